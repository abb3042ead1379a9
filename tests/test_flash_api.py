"""L0 (CPU): the FlashAttention-compatible functions without a GPU: argument mapping, the Spec each
configuration builds (name, caching, semantics against an independent FlashAttention-2-style
reference), errors, return conventions, flash_attn_with_kvcache's mapping onto a fake
fa_gen.attention_with_kvcache, and torch.compile(fullgraph=True) tracing on meta tensors."""

from __future__ import annotations

import math

import pytest
import torch

import fa_gen
from fa_gen import autograd
from fa_gen.api import flash_attn
from fa_gen.api.flash_specs import FlashConfig, flash_spec, spec_mapping
from fa_gen.errors import InputError, UnsupportedError
from fa_gen.reference import attention_reference
from fa_gen.spec import _BY_KEY


def _meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape, dtype=dtype, device="meta", requires_grad=grad)


def _spec_of(q, v, **options):
    """The Spec flash_attn_func builds for these arguments (through its own mapping)."""
    sink = options.pop("learnable_sink", None)
    key, _ = flash_attn._spec_and_inputs(q, v, options.get("softmax_scale"), options.get("causal", False),
                                         options.get("window_size", (-1, -1)), options.get("softcap", 0.0),
                                         options.get("alibi_slopes"), sink, heads=q.shape[-2],
                                         batch=q.shape[0] if q.dim() == 4 else None)
    return autograd.spec_from_key(key)


@pytest.mark.parametrize("options, name", [
    ({}, "fa_bf16_d128_full"),
    ({"causal": True}, "fa_bf16_d128_causal"),
    ({"causal": True, "window_size": (-1, -1)}, "fa_bf16_d128_causal"),
    ({"causal": True, "window_size": (255, 7)}, "fa_bf16_d128_win255_0"),   # causal folds right to 0
    ({"window_size": (255, 7)}, "fa_bf16_d128_win255_7"),
    ({"causal": True, "softcap": 30.0}, "fa_bf16_d128_causal_softcap"),
    ({"softmax_scale": 0.125}, "fa_bf16_d128_full_scale0p125"),
    ({"softmax_scale": 128 ** -0.5}, "fa_bf16_d128_full"),                 # the default, given
    ({"causal": True, "alibi_slopes": torch.ones(4)}, "fa_bf16_d128_causal_alibi"),
    ({"alibi_slopes": torch.ones(2, 4), "softcap": 5.0}, "fa_bf16_d128_full_softcap_alibi_bh"),
    ({"causal": True, "learnable_sink": torch.zeros(4)}, "fa_bf16_d128_causal_sink"),
])
def test_spec_names(options, name):
    q = _meta(2, 9, 4, 128)
    spec = _spec_of(q, q, **options)
    assert spec.name == name
    assert spec.alignment.value == "bottom_right"


def test_qk_and_v_head_dims_in_the_name():
    q, v = _meta(1, 5, 2, 192), _meta(1, 5, 2, 128)
    assert _spec_of(q, v, causal=True).name == "fa_bf16_qk192_v128_causal"
    assert _spec_of(q.half(), v.half()).name == "fa_fp16_qk192_v128_full"


def test_a_repeated_call_builds_no_spec_and_compiles_nothing():
    q, k = _meta(2, 33, 4, 64), _meta(2, 40, 2, 64)
    fa_gen.flash_attn_func(q, k, k, causal=True, softcap=20.0)
    misses, specs = flash_spec.cache_info().misses, len(_BY_KEY)
    for softcap in (20.0, 3.5, 50.0):  # the value is a runtime input: the same spec
        out = fa_gen.flash_attn_func(q, k, k, causal=True, softcap=softcap)
    assert out.shape == q.shape
    assert flash_spec.cache_info().misses == misses and len(_BY_KEY) == specs


def test_runtime_values_travel_as_inputs():
    q = _meta(2, 9, 4, 64)
    slopes, sink = torch.ones(4, device="meta"), torch.zeros(4, device="meta", dtype=torch.bfloat16)
    key, inputs = flash_attn._spec_and_inputs(q, q, None, True, (-1, -1), 7.5, slopes, sink, heads=4, batch=2)
    spec = autograd.spec_from_key(key)
    assert {d.name for d in spec.inputs} == {"softcap", "slopes", "sinks"}
    assert inputs["softcap"] == 7.5 and inputs["slopes"] is slopes
    assert inputs["sinks"].dtype == torch.float32  # a bf16 sink parameter is cast (differentiably)
    assert "softcap" not in spec.canonical_json().split('"inputs"')[0]  # no value compiled in
    assert "7.5" not in spec.canonical_json()


def _fa2_reference(q, k, v, causal, window, scale, softcap, slopes, sink):
    """FlashAttention-2's documented semantics, written from its docstring, float64, no fa_gen code:
    scaled scores, soft-capped, minus slope * |i + sk - sq - j|, window (left, right) bottom-right,
    causal right = 0, a sink logit in the denominator."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kx, vx = (x.double().repeat_interleave(hq // hk, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kx) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq).view(-1, 1) + sk - sq
    j = torch.arange(sk).view(1, -1)
    if slopes is not None:
        per = slopes.double().view(-1, hq, 1, 1)  # (heads,) or (batch, heads)
        s = s - per * (i - j).abs()
    left, right = window
    right = 0 if causal else right
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    s = s.masked_fill(~visible, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if sink is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, vx)


@pytest.mark.parametrize("options", [
    {"causal": True},
    {"causal": True, "window_size": (5, 3)},
    {"window_size": (4, 2)},
    {"window_size": (0, 0)},
    {"causal": True, "softcap": 2.0, "softmax_scale": 0.4},
    {"causal": True, "alibi": (4,)},
    {"alibi": (3, 4), "softcap": 3.0},
    {"causal": True, "sink": True, "window_size": (6, -1)},
], ids=str)
@pytest.mark.parametrize("lengths", [(11, 11), (7, 13), (13, 7)], ids=str)
def test_spec_semantics_match_flash_attention(options, lengths):
    """The spec each configuration builds means what FlashAttention-2 computes (float64 reference)."""
    options = dict(options)
    g = torch.Generator().manual_seed(0)
    sq, sk = lengths
    q, k, v = (torch.randn(3, n, h, 64, generator=g) for n, h in ((sq, 4), (sk, 2), (sk, 2)))
    alibi = options.pop("alibi", None)
    slopes = torch.rand(*alibi, generator=g) if alibi else None
    sink = torch.randn(4, generator=g) if options.pop("sink", False) else None
    key, inputs = flash_attn._spec_and_inputs(q.bfloat16(), v, options.get("softmax_scale"),
                                              options.get("causal", False), options.get("window_size", (-1, -1)),
                                              options.get("softcap", 0.0), slopes, sink, heads=4, batch=3)
    spec = autograd.spec_from_key(key)
    got, _ = attention_reference(q, k, v, spec, inputs=inputs)
    want = _fa2_reference(q, k, v, options.get("causal", False), options.get("window_size", (-1, -1)),
                          options.get("softmax_scale") or 64 ** -0.5, options.get("softcap", 0.0), slopes, sink)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_return_conventions():
    q = _meta(2, 9, 4, 64)
    assert isinstance(fa_gen.flash_attn_func(q, q, q), torch.Tensor)
    out, lse = fa_gen.flash_attn_func(q, q, q, return_lse=True)
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    out, lse, probs = fa_gen.flash_attn_func(q, q, q, return_attn_probs=True)
    assert probs is None and out.shape == q.shape


def test_varlen_shapes_and_int64_cu_seqlens():
    q, k = _meta(20, 4, 64), _meta(30, 2, 64)
    cu_q = torch.tensor([0, 5, 20], device="meta")                  # int64, as some callers build them
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32, device="meta")
    out, lse = fa_gen.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 15, 20, causal=True, softcap=4.0,
                                             alibi_slopes=torch.ones(4, device="meta"), return_lse=True)
    assert out.shape == (20, 4, 64) and lse.shape == (4, 20)


@pytest.mark.parametrize("call, argument", [
    (lambda q: fa_gen.flash_attn_func(q, q, q, window_size=(-1, 5)), "window_size=(-1, 5)"),
    (lambda q: fa_gen.flash_attn_func(q, q, q, window_size=(3,)), "window_size=(3,)"),
    (lambda q: fa_gen.flash_attn_func(q, q, q, window_size=(-2, 0)), "window_size=(-2, 0)"),
    (lambda q: fa_gen.flash_attn_func(q.float(), q.float(), q.float()), "q.dtype torch.float32"),
    (lambda q: fa_gen.flash_attn_func(q[..., :44], q[..., :44], q[..., :44]), "the head dims"),
    (lambda q: fa_gen.flash_attn_varlen_func(q[0], q, q, None, None, 9, 9, dropout_p=0.5, block_table=q),
     "dropout_p=0.5 with block_table"),
    (lambda q: fa_gen.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 9, 9,
                                             alibi_slopes=torch.ones(2, 4)), "alibi_slopes"),
    (lambda q: fa_gen.flash_attn_with_kvcache(q, q, q, cache_leftpad=torch.zeros(2, dtype=torch.int32),
                                              block_table=torch.zeros(2, 1, dtype=torch.int32)),
     "cache_leftpad with page_table"),
])
def test_unsupported_arguments_are_named(call, argument):
    q = _meta(2, 9, 4, 64)
    with pytest.raises(UnsupportedError) as info:
        call(q)
    assert str(info.value).startswith(argument), str(info.value)
    assert info.value.reasons and all(info.value.reasons)


@pytest.mark.parametrize("call, message", [
    (lambda q: fa_gen.flash_attn_func(q, q, q, softcap=-1.0), "softcap must be"),
    (lambda q: fa_gen.flash_attn_func(q, q, q, softmax_scale=0.0), "softmax_scale must be"),
    (lambda q: fa_gen.flash_attn_func(q, q, q, alibi_slopes=torch.ones(4, dtype=torch.float16)), "float32"),
    (lambda q: fa_gen.flash_attn_func(q, q, q, alibi_slopes=torch.ones(3)), r"shape \(heads,\)"),
    (lambda q: fa_gen.flash_attn_func(q, q, q, learnable_sink=torch.zeros(2, 4)), "learnable_sink must"),
    (lambda q: fa_gen.flash_attn_func(q, q[0], q), "k must be a 4-D"),
    (lambda q: fa_gen.flash_attn_func(q, q.half(), q), "share a dtype"),
    (lambda q: fa_gen.flash_attn_with_kvcache(q, q, q, k=q), "k and v together"),
    (lambda q: fa_gen.flash_attn_with_kvcache(q, q, q, rotary_cos=q[0, :, 0], rotary_sin=q[0, :, 0]),
     "need k_new and v_new"),
    (lambda q: fa_gen.flash_attn_with_kvcache(q, q, q, k=q[:, :1], v=q[:, :1], cache_seqlens=1,
                                              rotary_cos=q[0, :, 0, :4], rotary_sin=q[0, :, 0, :4]),
     "multiple of 16"),
    (lambda q: fa_gen.flash_attn_with_kvcache(q, q, q, k=q[:, :1], v=q[:, :1], cache_seqlens=1,
                                              rotary_cos=q[0, :, 0].float(), rotary_sin=q[0, :, 0].float()),
     "must be q's"),
    (lambda q: fa_gen.flash_attn_with_kvcache(q, q, q, k=q[:, :1], v=q[:, :1], cache_seqlens=1,
                                              rotary_cos=q[0, :, 0]), "go together"),
    (lambda q: fa_gen.flash_attn_with_kvcache(q, q, q, cache_leftpad=torch.zeros(3, dtype=torch.int32)),
     "cache_leftpad must be"),
])
def test_bad_values_are_input_errors(call, message):
    with pytest.raises(InputError, match=message):
        call(_meta(2, 9, 4, 64))


def test_autograd_reaches_q_k_v_and_the_sink():
    q, k = _meta(2, 33, 4, 64, grad=True), _meta(2, 40, 2, 64, grad=True)
    sink = torch.zeros(4, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = fa_gen.flash_attn_func(q, k, k, causal=True, learnable_sink=sink, window_size=(16, 0))
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and sink.grad.shape == sink.shape


def test_varlen_takes_a_learnable_sink_and_its_gradient_on_meta():
    q, k = _meta(20, 4, 64, grad=True), _meta(30, 2, 64, grad=True)
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32, device="meta")
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32, device="meta")
    sink = torch.zeros(4, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = fa_gen.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 15, 20, causal=True, learnable_sink=sink)
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and sink.grad.shape == sink.shape
    assert _spec_of(q, k, causal=True, learnable_sink=torch.zeros(4)).name == "fa_bf16_d64_causal_sink"


def test_packed_forms_take_views_and_give_one_gradient():
    """flash_attn_(varlen_)qkvpacked_func and flash_attn_(varlen_)kvpacked_func: the packed tensor's
    views go through the unpacked functions, and its gradient comes back in the packed shape."""
    def packed(*shape):
        return torch.zeros(*shape, device="meta", dtype=torch.bfloat16, requires_grad=True)

    qkv = packed(2, 33, 3, 4, 64)
    out = fa_gen.flash_attn_qkvpacked_func(qkv, causal=True)
    out.float().sum().backward()
    assert out.shape == (2, 33, 4, 64) and qkv.grad.shape == qkv.shape
    q, kv = _meta(2, 33, 4, 64, grad=True), packed(2, 40, 2, 2, 64)
    out, lse, _ = fa_gen.flash_attn_kvpacked_func(q, kv, causal=True, window_size=(16, 0), return_attn_probs=True)
    out.float().sum().backward()
    assert lse.shape == (2, 4, 33) and q.grad.shape == q.shape and kv.grad.shape == kv.shape
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32, device="meta")
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32, device="meta")
    qkv = packed(20, 3, 4, 64)
    out = fa_gen.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 15, causal=True)
    out.float().sum().backward()
    assert out.shape == (20, 4, 64) and qkv.grad.shape == qkv.shape
    q, kv = _meta(20, 4, 64, grad=True), packed(30, 2, 2, 64)
    out = fa_gen.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 15, 20, softcap=10.0)
    out.float().sum().backward()
    assert out.shape == (20, 4, 64) and kv.grad.shape == kv.shape
    with pytest.raises(InputError, match=r"qkv must be a 5-D tensor \(batch, seqlen, 3, heads, head_dim\)"):
        fa_gen.flash_attn_qkvpacked_func(packed(2, 33, 2, 4, 64))
    with pytest.raises(InputError, match="kv must be a 4-D tensor"):
        fa_gen.flash_attn_varlen_kvpacked_func(q, packed(2, 30, 2, 2, 64), cu_q, cu_k, 15, 20)


def test_torch_compile_fullgraph_traces_varlen_with_a_sink():
    def loss(q, k, v, cu_q, cu_k, sink):
        return fa_gen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 15, 20, causal=True, learnable_sink=sink)

    torch._dynamo.reset()
    q, k = _meta(20, 4, 64, grad=True), _meta(30, 2, 64, grad=True)
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32, device="meta")
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32, device="meta")
    sink = torch.zeros(4, device="meta", requires_grad=True)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")  # any graph break is an error
    compiled(q, k, k, cu_q, cu_k, sink).float().sum().backward()
    assert q.grad.shape == q.shape and sink.grad.shape == sink.shape


def _reference_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, spec, inputs=None, **_):
    """attention_varlen's stand-in: each sequence's float64 reference, as the kernel gives it (no
    gradient: the kernel's is checked on the GPU); the sink gradient is what is tested."""
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        o, lse = attention_reference(q[None, cq[b]:cq[b + 1]].detach(), k[None, ck[b]:ck[b + 1]].detach(),
                                     v[None, ck[b]:ck[b + 1]].detach(), spec, inputs=inputs)
        outs.append(o[0].to(q.dtype))
        lses.append(lse[0].float())
    rest = q.shape[0] - cq[-1]  # rows past the batch: what a kernel leaves there is undefined
    outs.append(torch.full((rest, *q.shape[1:-1], v.shape[-1]), 1e4, dtype=q.dtype))
    lses.append(torch.full((q.shape[1], rest), float("nan")))
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("padded_rows", [0, 3])
def test_varlen_sink_gradient_matches_autograd_through_the_reference(monkeypatch, padded_rows):
    """The sink's gradient in a packed batch (taken beside the varlen backward, fa_gen.api.flash_attn)
    against autograd through the float64 reference of every sequence alone; rows past cu_seqlens_q[-1]
    (a caller's padding) take no part."""
    monkeypatch.setattr(flash_attn, "attention_varlen", _reference_varlen_forward)
    g = torch.Generator().manual_seed(3)
    lengths_q, lengths_k = [5, 1, 9], [7, 12, 9]
    q = torch.randn(sum(lengths_q) + padded_rows, 4, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    sink = torch.randn(4, generator=g, requires_grad=True)  # float32, as the spec declares
    dout = torch.randn(q.shape[0], 4, 64, generator=g, dtype=torch.float64)
    out = fa_gen.flash_attn_varlen_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, 9, 12, causal=True,
                                        window_size=(4, 0), learnable_sink=sink)
    (out.double() * dout).sum().backward()
    got, sink.grad = sink.grad, None
    spec = _spec_of(q.bfloat16(), v, causal=True, window_size=(4, 0), learnable_sink=sink)
    total = 0
    for b in range(3):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        o, _ = attention_reference(q[None, rows].bfloat16().double(), k[None, keys].bfloat16().double(),
                                   v[None, keys].bfloat16().double(), spec, inputs={"sinks": sink})
        total = total + (o[0] * dout[rows]).sum()
    total.backward()
    torch.testing.assert_close(got, sink.grad, rtol=2e-2, atol=2e-2)
    assert float(sink.grad.abs().max()) > 0.1  # a gradient worth checking


def test_torch_compile_fullgraph_traces_flash_attn_func():
    def loss(q, k, v, slopes, sink, softcap):
        a = fa_gen.flash_attn_func(q, k, v, causal=True, softcap=softcap, learnable_sink=sink, window_size=(31, 0))
        b, lse = fa_gen.flash_attn_func(q, k, v, alibi_slopes=slopes, return_lse=True)
        return (a.float() + b.float()).sum() + lse.sum()

    torch._dynamo.reset()
    q, k = _meta(2, 33, 4, 64, grad=True), _meta(2, 40, 2, 64, grad=True)
    sink = torch.zeros(4, device="meta", requires_grad=True)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")  # any graph break is an error
    compiled(q, k, k, torch.ones(4, device="meta"), sink, 20.0).backward()
    assert q.grad.shape == q.shape and sink.grad.shape == sink.shape
    misses = flash_spec.cache_info().misses
    compiled(q, k, k, torch.ones(4, device="meta"), sink, 20.0)
    compiled(q, k, k, torch.ones(4, device="meta"), sink, 3.5)  # another softcap: a SymFloat, the same spec
    assert flash_spec.cache_info().misses == misses


def test_torch_compile_with_changing_compile_time_arguments():
    """A softmax_scale, window or head dim that changes between calls arrives symbolic once
    torch.compile marks it dynamic (found on the H100 for softcap): made a constant again, never
    a graph break; a changing softcap stays one spec."""
    def call(q, softcap, scale, left):
        return fa_gen.flash_attn_func(q, q, q, causal=True, softcap=softcap, softmax_scale=scale,
                                      window_size=(left, 0))

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    names = set()
    for dim in (64, 128):
        q = _meta(2, 33, 4, dim)
        for softcap, scale, left in ((7.5, 0.1, 10), (3.0, 0.2, 11), (5.0, 0.3, 12), (6.0, 0.3, 12)):
            assert compiled(q, softcap, scale, left).shape == q.shape
            names.add(_spec_of(q, q, causal=True, softcap=softcap, softmax_scale=scale, window_size=(left, 0)).name)
    assert len(names) == 6 and "fa_bf16_d128_win12_0_scale0p3_softcap" in names


class _FakeKvcache:
    def __init__(self):
        self.calls = []

    def __call__(self, q, k_cache, v_cache, cache_seqlens, spec, k_new=None, v_new=None, page_table=None,
                 cache_batch_idx=None, num_splits=0, pack_gqa=None, inputs=None, rotary_cos=None, rotary_sin=None,
                 rotary_interleaved=True, cache_leftpad=None, q_descale=None, k_descale=None, v_descale=None):
        self.calls.append(dict(cache_seqlens=cache_seqlens, spec=spec, k_new=k_new, v_new=v_new,
                               page_table=page_table, cache_batch_idx=cache_batch_idx, num_splits=num_splits,
                               pack_gqa=pack_gqa, inputs=inputs, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                               rotary_interleaved=rotary_interleaved, cache_leftpad=cache_leftpad,
                               descales=(q_descale, k_descale, v_descale)))
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])


@pytest.fixture
def fake_kvcache(monkeypatch):
    fake = _FakeKvcache()
    monkeypatch.setattr(fa_gen, "attention_with_kvcache", fake, raising=False)
    return fake


def test_kvcache_arguments_map_onto_attention_with_kvcache(fake_kvcache):
    q = torch.randn(3, 1, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(3, 100, 2, 128, dtype=torch.bfloat16)
    new = torch.randn(3, 1, 2, 128, dtype=torch.bfloat16)
    lengths = torch.tensor([5, 0, 99], dtype=torch.int32)
    out, lse = fa_gen.flash_attn_with_kvcache(q, cache, cache, k=new, v=new, cache_seqlens=lengths, causal=True,
                                              softcap=15.0, num_splits=3, return_softmax_lse=True,
                                              cache_batch_idx=torch.tensor([2, 0, 1], dtype=torch.int32))
    call = fake_kvcache.calls[-1]
    assert out.shape == q.shape and lse.shape == (3, 8, 1)
    assert call["spec"].name == "fa_bf16_d128_causal_softcap" and call["inputs"] == {"softcap": 15.0}
    assert call["k_new"] is new and call["v_new"] is new and call["cache_seqlens"] is lengths
    assert call["num_splits"] == 3 and call["page_table"] is None and call["cache_batch_idx"].tolist() == [2, 0, 1]
    assert call["rotary_cos"] is None and call["cache_leftpad"] is None
    cos, sin = torch.randn(200, 32, dtype=torch.bfloat16), torch.randn(200, 32, dtype=torch.bfloat16)
    fa_gen.flash_attn_with_kvcache(q, cache, cache, k=new, v=new, cache_seqlens=lengths, rotary_cos=cos,
                                   rotary_sin=sin, rotary_interleaved=False, cache_leftpad=torch.tensor([1, 0, 2]))
    call = fake_kvcache.calls[-1]
    assert call["rotary_cos"] is cos and call["rotary_sin"] is sin and call["rotary_interleaved"] is False
    assert call["cache_leftpad"].dtype == torch.int32 and call["cache_leftpad"].tolist() == [1, 0, 2]


def test_kvcache_fp8_takes_descales(fake_kvcache):
    fp8 = torch.float8_e4m3fn
    q, cache = torch.randn(2, 1, 8, 128).to(fp8), torch.zeros(2, 64, 2, 128).to(fp8)
    scale = torch.full((2, 2), 0.5)
    fa_gen.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, k_descale=scale, v_descale=0.25)
    call = fake_kvcache.calls[-1]
    assert call["spec"].is_fp8 and call["descales"][0] is None
    assert call["descales"][1] is scale and call["descales"][2] == 0.25


def test_kvcache_int_and_missing_lengths_and_block_table(fake_kvcache):
    q = torch.randn(2, 4, 8, 64, dtype=torch.float16)
    pages = torch.zeros(10, 16, 2, 64, dtype=torch.float16)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    out = fa_gen.flash_attn_with_kvcache(q, pages, pages, block_table=table, window_size=(8, 0))
    call = fake_kvcache.calls[-1]
    assert isinstance(out, torch.Tensor) and call["page_table"] is table
    assert call["cache_seqlens"].tolist() == [48, 48] and call["cache_seqlens"].dtype == torch.int32
    assert call["spec"].name == "fa_fp16_d64_win8_0" and call["inputs"] is None
    fa_gen.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=7, k=q[:, :, :2], v=q[:, :, :2])
    assert fake_kvcache.calls[-1]["cache_seqlens"].tolist() == [7, 7]
    with pytest.raises(InputError, match="cache_seqlens is required"):
        fa_gen.flash_attn_with_kvcache(q, pages, pages, k=q[:, :, :2], v=q[:, :, :2])


def test_varlen_block_table_maps_onto_forward_paged(monkeypatch):
    """flash_attn_varlen_func(..., block_table=...) is FlashAttention-2's paged prefill: packed
    queries against paged caches, each sequence's keys its cu_seqlens_k span or seqused_k."""
    import fa_gen.api.flash_attn as flash

    calls = []

    def fake(spec, q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, inputs=None,
             descales=None):
        calls.append(dict(spec=spec, page_table=page_table, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                          max_seqlen_q=max_seqlen_q, inputs=inputs, k_cache=k_cache, descales=descales))
        return torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1]), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(flash, "forward_paged", fake)
    q = torch.randn(11, 8, 64, dtype=torch.bfloat16)
    pages = torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, 3, 11]), torch.tensor([0, 20, 29], dtype=torch.int32)
    out, lse = fa_gen.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 8, 20, causal=True, softcap=30.0,
                                             block_table=table, return_lse=True)
    call = calls[-1]
    assert out.shape == (11, 8, 64) and lse.shape == (8, 11)
    assert call["spec"].name == "fa_bf16_d64_causal_softcap" and call["inputs"] == {"softcap": 30.0}
    assert call["page_table"] is table and call["k_cache"] is pages and call["max_seqlen_q"] == 8
    assert call["cu_seqlens_q"].dtype == torch.int32 and call["cu_seqlens_q"].tolist() == [0, 3, 11]
    assert call["seqused_k"].dtype == torch.int32 and call["seqused_k"].tolist() == [20, 9]
    assert call["descales"] is None
    used = torch.tensor([17, 2], dtype=torch.int32)
    fa_gen.flash_attn_varlen_func(q, pages, pages, cu_q, None, 8, 20, block_table=table, seqused_k=used)
    assert calls[-1]["seqused_k"].tolist() == [17, 2]
    with pytest.raises(InputError, match="k must be a 4-D tensor"):
        fa_gen.flash_attn_varlen_func(q, q, q, cu_q, cu_k, 8, 20, block_table=table)
    with pytest.raises(UnsupportedError, match="gradients through block_table"):
        fa_gen.flash_attn_varlen_func(q.requires_grad_(), pages, pages, cu_q, cu_k, 8, 20, block_table=table)
    with torch.no_grad():
        fa_gen.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 8, 20, block_table=table)


def test_varlen_fp8_maps_onto_the_fp8_forwards(monkeypatch):
    """float8_e4m3fn q, k, v with FlashAttention-3's descales: contiguous ones go to
    attention_fp8_varlen, paged ones (an fp8 KV cache) to forward_paged with the descales; what
    fp8 has no kernel for is refused by name, and descales on 16-bit inputs too."""
    import fa_gen.api.flash_attn as flash

    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, spec, q_descale, k_descale, v_descale, inputs=None):
        calls.append(dict(kind="varlen", spec=spec, cu_q=cu_q, max_k=max_k, descales=(q_descale, k_descale, v_descale)))
        return torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.bfloat16), torch.zeros(q.shape[1], q.shape[0])

    def fake_paged(spec, q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, inputs=None,
                   descales=None):
        calls.append(dict(kind="paged", spec=spec, seqused_k=seqused_k, descales=descales))
        return torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=torch.bfloat16), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(flash, "attention_fp8_varlen", fake_varlen)
    monkeypatch.setattr(flash, "forward_paged", fake_paged)
    fp8 = torch.float8_e4m3fn
    q, k = torch.randn(11, 8, 128).to(fp8), torch.randn(29, 2, 128).to(fp8)
    cu_q, cu_k = torch.tensor([0, 3, 11]), torch.tensor([0, 20, 29], dtype=torch.int32)
    qd, kd = torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5
    out, lse = fa_gen.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 8, 20, causal=True, q_descale=qd, k_descale=kd,
                                             v_descale=0.25, return_lse=True)
    call = calls[-1]
    assert call["kind"] == "varlen" and call["spec"].is_fp8 and call["spec"].mask.value == "causal"
    assert call["descales"][0] is qd and call["descales"][1] is kd and call["descales"][2] == 0.25
    assert call["cu_q"].dtype == torch.int32 and call["max_k"] == 20
    assert out.dtype == torch.bfloat16 and out.shape == (11, 8, 128) and lse.shape == (8, 11)
    pages = torch.randn(6, 16, 2, 128).to(fp8)
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    fa_gen.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 8, 20, block_table=table, k_descale=kd)
    call = calls[-1]
    assert call["kind"] == "paged" and call["spec"].is_fp8 and call["seqused_k"].tolist() == [20, 9]
    assert call["descales"][0] is None and call["descales"][1] is kd and call["descales"][2] is None
    with pytest.raises(UnsupportedError, match="seqused_k with float8_e4m3fn"):
        fa_gen.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 8, 20, seqused_k=torch.tensor([3, 9], dtype=torch.int32))
    with pytest.raises(UnsupportedError, match="dropout_p=0.1 with float8_e4m3fn"):
        fa_gen.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 8, 20, dropout_p=0.1)
    bf16 = torch.randn(11, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="q_descale"):
        fa_gen.flash_attn_varlen_func(bf16, bf16, bf16, cu_q, cu_q, 8, 8, q_descale=qd)
    with pytest.raises(UnsupportedError, match="q_descale"):
        fa_gen.flash_attn_varlen_func(bf16, pages.bfloat16(), pages.bfloat16(), cu_q, cu_k, 8, 20, block_table=table,
                                      v_descale=0.5)
    assert len(calls) == 2


def test_kvcache_without_the_kv_cache_forward_is_unsupported(monkeypatch):
    monkeypatch.delattr(fa_gen, "attention_with_kvcache", raising=False)
    q = _meta(2, 1, 4, 64)
    with pytest.raises(UnsupportedError, match="attention_with_kvcache"):
        fa_gen.flash_attn_with_kvcache(q, q, q)


def test_spec_mapping_is_a_valid_yaml_shape():
    config = FlashConfig("fp16", 64, 64, True, (10, 0), 0.2, softcap=True, alibi="heads", sink=True)
    fields = spec_mapping(config)
    assert fields["mask"] == {"kind": "sliding_window", "left": 10, "right": 0}
    assert fields["score_mod"]["expr"].startswith("softcap * tanh(score / softcap) - slopes[h]")
    assert flash_spec(config) is flash_spec(config)


def test_dropout_p_reaches_the_dropout_attention(monkeypatch):
    """flash_attn_func / flash_attn_varlen_func hand dropout_p to fa_gen.api.dropout (which draws
    the mask on the GPU; tests/test_gpu_dropout.py runs it)."""
    import sys

    # fa_gen.api exports functions of these names: reach the modules themselves.
    api_attention, api_varlen = sys.modules["fa_gen.api.attention"], sys.modules["fa_gen.api.varlen"]

    seen = []
    monkeypatch.setattr(api_attention, "attention_dropout",
                        lambda q, k, v, spec, p, deterministic, inputs: seen.append(("fixed", p)) or (q, q[..., 0]))
    monkeypatch.setattr(api_varlen, "attention_varlen_dropout",
                        lambda q, k, v, cq, ck, mq, mk, spec, p, det, inputs: seen.append(("varlen", p)) or (q, q[..., 0]))
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    fa_gen.flash_attn_func(q, q, q, dropout_p=0.1, causal=True)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    fa_gen.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, dropout_p=0.25)
    assert seen == [("fixed", 0.1), ("varlen", 0.25)]


@pytest.mark.parametrize("p", [-0.1, 1.0, "0.1", True])
def test_dropout_p_out_of_range_is_an_input_error(p):
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="dropout_p"):
        fa_gen.flash_attn_func(q, q, q, dropout_p=p)
