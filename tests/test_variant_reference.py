"""The reference for every library spec against a naive per-row implementation written by hand (L0, CPU).

Each naive variant states its mask, score mod and sink in plain Python, from the
definition of the variant (e.g. softcap is c * tanh(s / c)), not from the spec's
expression: the reference must agree with it to float64 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from fa_gen.errors import InputError
from fa_gen.paths import specs_dir
from fa_gen.reference import attention_reference, attention_same_precision, visibility
from fa_gen.spec import Alignment, DType, MaskKind, Spec
from fa_gen.spec_load import load_spec
from tests.variants import variant_library_paths

LIBRARY = variant_library_paths()
B, HQ, HKV, D = 2, 4, 2, 16


def library_spec(name: str) -> Spec:
    # Head dim 16 keeps the naive loops fast; the library's head dims do not enter the semantics.
    import dataclasses

    spec = load_spec(LIBRARY[name], check_archs=False)
    return dataclasses.replace(spec, head_dim_qk=D, head_dim_v=D, softmax_scale=D ** -0.5)


@dataclass
class Naive:
    """A variant by hand: visible(b, h, i, j), mod(s, b, h, i, j) and sink(b, h, i), given offset = sk - sq."""
    visible: callable
    mod: callable = lambda s, b, h, i, j: s
    sink: callable = None
    inputs: callable = field(default=lambda sq, sk, gen: {})


def causal(off):
    return lambda b, h, i, j: j <= i + off


def _ids(gen, sq, sk):
    return {"q_doc": torch.randint(0, 3, (B, sq), generator=gen, dtype=torch.int32).sort(dim=1).values,
            "kv_doc": torch.randint(0, 3, (B, sk), generator=gen, dtype=torch.int32).sort(dim=1).values}


def naive_variants(sq: int, sk: int, gen: torch.Generator) -> dict[str, tuple[Naive, dict]]:
    """name -> (hand-written variant, values for its inputs)."""
    off = sk - sq
    ids = _ids(gen, sq, sk)
    slopes = torch.rand(HQ, generator=gen)
    sinks = torch.randn(HQ, generator=gen)
    rel = torch.randn(HQ, 257, generator=gen)
    prefix = torch.tensor([2, 0], dtype=torch.int32)
    return {
        "sliding_window_causal": (Naive(lambda b, h, i, j: i + off - 3 < j <= i + off), {"window": 3}),
        "attention_sinks": (Naive(lambda b, h, i, j: j <= i + off and (j < 2 or j > i + off - 3)),
                            {"window": 3, "sink_tokens": 2}),
        "sink_logit": (Naive(causal(off), sink=lambda b, h, i: sinks[h].item()), {"sinks": sinks}),
        "softcap": (Naive(causal(off), mod=lambda s, b, h, i, j: 1.5 * math.tanh(s / 1.5)), {"softcap": 1.5}),
        "alibi": (Naive(causal(off), mod=lambda s, b, h, i, j: s - 2 ** (-8 * (h + 1) / HQ) * abs(i + off - j)), {}),
        "alibi_supplied": (Naive(causal(off), mod=lambda s, b, h, i, j: s - slopes[h].item() * abs(i + off - j)),
                           {"slopes": slopes}),
        "relative_bias": (Naive(lambda b, h, i, j: True,
                                mod=lambda s, b, h, i, j: s + rel[h, min(max(j - i, -128), 128) + 128].item()),
                          {"rel_bias": rel}),
        "prefix_lm": (Naive(lambda b, h, i, j: j < prefix[b] or j <= i + off), {"prefix_len": prefix}),
        "document": (Naive(lambda b, h, i, j: ids["q_doc"][b, i] == ids["kv_doc"][b, j] and j <= i + off), ids),
        "chunked_causal": (Naive(lambda b, h, i, j: i // 3 == j // 3 and j <= i), {"chunk": 3}),
    }


def naive_attention(q, k, v, scale, variant: Naive):
    batch, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.zeros(batch, sq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(hq):
            kvh = h // (hq // hkv)
            for i in range(sq):
                keys = [j for j in range(sk) if variant.visible(b, h, i, j)]
                logits = [variant.mod((q[b, i, h].double() @ k[b, j, kvh].double()).item() * scale, b, h, i, j)
                          for j in keys]
                every = logits + ([variant.sink(b, h, i)] if variant.sink else [])
                if not every:
                    continue
                top = max(every)
                lse[b, h, i] = top + math.log(sum(math.exp(x - top) for x in every))
                for x, j in zip(logits, keys):
                    out[b, i, h] += math.exp(x - lse[b, h, i].item()) * v[b, j, kvh].double()
    return out, lse


def _qkv(sq, sk, gen):
    return (torch.randn(B, sq, HQ, D, generator=gen), torch.randn(B, sk, HKV, D, generator=gen),
            torch.randn(B, sk, HKV, D, generator=gen))


NAMES = sorted(LIBRARY)
SHAPES = [(5, 9), (9, 5), (7, 7)]


def test_every_library_spec_has_a_naive_variant():
    assert sorted(naive_variants(2, 2, torch.Generator())) == NAMES


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sq, sk", SHAPES)
def test_reference_matches_naive(name, sq, sk):
    gen = torch.Generator().manual_seed(sq * 31 + sk)
    q, k, v = _qkv(sq, sk, gen)
    variant, values = naive_variants(sq, sk, gen)[name]
    spec = library_spec(name)
    out, lse = attention_reference(q, k, v, spec, inputs=values)
    want_out, want_lse = naive_attention(q, k, v, spec.softmax_scale, variant)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)


def test_relative_bias_clips_far_distances():
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(3, 300, gen)
    variant, values = naive_variants(3, 300, gen)["relative_bias"]
    spec = library_spec("relative_bias")
    out, _ = attention_reference(q, k, v, spec, inputs=values)
    torch.testing.assert_close(out, naive_attention(q, k, v, spec.softmax_scale, variant)[0], rtol=1e-12, atol=1e-12)


def test_sink_takes_the_whole_row_when_no_key_is_visible():
    spec = library_spec("sink_logit")
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(6, 2, gen)  # bottom-right causal: rows 0..3 see no key
    sinks = torch.randn(HQ, generator=gen)
    out, lse = attention_reference(q, k, v, spec, inputs={"sinks": sinks})
    assert (out[:, :4] == 0).all()
    assert torch.equal(lse[..., :4], sinks.double().view(1, HQ, 1).expand(B, HQ, 4))
    assert torch.isfinite(lse).all()


def test_expression_window_equals_the_window_kind():
    window = 5
    kind = Spec(name="w", dtype=DType.BF16, head_dim_qk=D, head_dim_v=D, mask=MaskKind.SLIDING_WINDOW,
                window_left=window - 1, window_right=0, alignment=Alignment.BOTTOM_RIGHT, softmax_scale=D ** -0.5,
                archs=())
    expr = library_spec("sliding_window_causal")
    gen = torch.Generator().manual_seed(1)
    for sq, sk in SHAPES:
        q, k, v = _qkv(sq, sk, gen)
        assert torch.equal(visibility(kind, sq, sk).expand(B, HQ, sq, sk),
                           visibility(expr, sq, sk, batch=B, heads_q=HQ, inputs={"window": window}))
        for got, want in zip(attention_reference(q, k, v, expr, inputs={"window": window}),
                             attention_reference(q, k, v, kind)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", NAMES)
def test_same_precision_stays_near_the_reference(name):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (x.to(torch.bfloat16) for x in _qkv(7, 9, gen))
    _, values = naive_variants(7, 9, gen)[name]
    spec = library_spec(name)
    ref, _ = attention_reference(q, k, v, spec, inputs=values)
    same = attention_same_precision(q, k, v, spec, inputs=values)
    error = (same.double() - ref).abs().max().item()
    assert 0 < error < 0.05  # bf16 rounding: present, and small


def test_visibility_of_a_mask_expression_is_per_batch_and_head():
    spec = library_spec("prefix_lm")
    seen = visibility(spec, 4, 4, batch=2, heads_q=3, inputs={"prefix_len": torch.tensor([4, 0], dtype=torch.int32)})
    assert seen.shape == (2, 3, 4, 4)
    assert seen[0].all() and torch.equal(seen[1, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(TypeError, match="needs batch= and heads_q="):
        visibility(spec, 4, 4)


@pytest.mark.parametrize("values, message", [
    ({}, "tensor input 'prefix_len' is missing; expected shape [batch]"),
    ({"prefix_len": torch.zeros(3, dtype=torch.int32)}, "has shape (3,); expected (2,) ([batch])"),
    ({"prefix_len": torch.zeros(2)}, "has dtype torch.float32; the spec declares int32"),
    ({"prefix_len": torch.tensor([1, -1], dtype=torch.int32)}, "holds -1, below its declared min 0"),
    ({"prefix_len": torch.zeros(2, dtype=torch.int32), "extra": 1}, "unknown input(s) extra"),
    ({"prefix_len": [1, 2]}, "must be a torch.Tensor, got list"),
])
def test_reference_checks_input_values(values, message):
    q, k, v = _qkv(4, 4, torch.Generator().manual_seed(0))
    with pytest.raises(InputError) as caught:
        attention_reference(q, k, v, library_spec("prefix_lm"), inputs=values)
    assert message in str(caught.value)


def test_scalars_take_their_default_and_are_checked():
    q, k, v = _qkv(4, 6, torch.Generator().manual_seed(0))
    spec = library_spec("softcap")
    default, _ = attention_reference(q, k, v, spec)
    explicit, _ = attention_reference(q, k, v, spec, inputs={"softcap": 30.0})
    assert torch.equal(default, explicit)
    with pytest.raises(InputError, match="below its declared min 1.0"):
        attention_reference(q, k, v, spec, inputs={"softcap": 0.5})
    with pytest.raises(InputError, match="must be a finite int"):
        attention_reference(q, k, v, library_spec("sliding_window_causal"), inputs={"window": 2.5})
