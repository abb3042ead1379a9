"""L1: adversarial shapes and layouts through the public API (issue 24, item 4). Each case gets
either the right answer (every sequence against the float64 reference of its own tensors) or a
clear fa_gen error that names the problem; never a crash, a CUDA error or a silent wrong value.

    python -m pytest -m gpu tests/test_gpu_adversarial.py

The cases: one query against 2^20 keys and 2^20 queries against one key; tensors of more than
2^31 elements (forward and backward, judged on the first and last batch entries, whose offsets
cross 2^31); a batch of 1,024 sequences of length one, fixed-length and packed; heads that are
not contiguous; K/V broadcast over the query heads with stride 0 (MQA written as an expand);
tensors on a second GPU (skipped with one). CPU tensors: tests/test_public_api.py.
"""

from __future__ import annotations

import pytest
import torch

import fa_gen
from fa_gen.check import _rounding_floor
from fa_gen.errors import FaGenError
from fa_gen.reference import attention_reference, attention_same_precision
from fa_gen.runtime import resolve_spec

from .test_gpu_backward import _autograd, _rounded_o_effect
from .test_gpu_backward import _rounding_floor as _grad_floor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

FULL = resolve_spec("full_bf16_d128")
CAUSAL = resolve_spec("causal_bf16_d128")


def _randn(*shape, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)


def _out(result):
    return result[0] if isinstance(result, tuple) else result


def _assert_close(out, q, k, v, spec, what):
    """out (b, sq, hq, d) against the float64 reference; the tolerance is twice a same-precision
    PyTorch computation's own error plus one rounding step."""
    ref, _ = attention_reference(q, k, v, spec)
    same = attention_same_precision(q, k, v, spec)
    tol = 2 * (same.double() - ref).abs().max().item() + _rounding_floor(ref, q.dtype)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"{what}: error {err:.3g} > tolerance {tol:.3g}"


def _answer_or_clear_error(call, judge, what):
    """Run `call`; a fa_gen error passes when it says what is wrong, any other exception fails,
    and a result must satisfy `judge`."""
    try:
        result = call()
        torch.cuda.synchronize()
    except FaGenError as exc:
        assert len(str(exc)) > 20, f"{what}: an error that explains nothing: {exc!r}"
        return exc
    judge(result)
    return None


def test_one_query_against_a_million_keys():
    """Decode against 2^20 keys (GQA 8/2): the split-KV path, one row per head."""
    n = 1 << 20
    q, k, v = _randn(1, 1, 8, 128, seed=1), _randn(1, n, 2, 128, seed=2), _randn(1, n, 2, 128, seed=3)
    out = _out(fa_gen.attention(q, k, v, FULL))
    _assert_close(out, q, k, v, FULL, "1 query x 2^20 keys")


def test_a_million_queries_against_one_key():
    """Every row sees one key: its probability is exactly 1, so every output row is that value
    row, bit for bit, and the LSE is the scaled score."""
    n = 1 << 20
    q, k, v = _randn(1, n, 4, 128, seed=4), _randn(1, 1, 4, 128, seed=5), _randn(1, 1, 4, 128, seed=6)
    out, lse = fa_gen.attention(q, k, v, FULL)
    assert torch.equal(out, v.expand_as(out)), "2^20 queries x 1 key: rows differ from the one value row"
    scores = (q.double() * k.double()).sum(-1) * FULL.softmax_scale           # (1, n, 4)
    err = (lse.double() - scores.transpose(1, 2)).abs().max().item()
    assert err <= 1e-3 * (1 + scores.abs().max().item()), f"LSE off by {err}"


def test_tensors_past_two_to_the_31_elements():
    """q, k, v and out of 4,100 x 512 x 16 x 64 = 2^31 + 2^23 elements each: any 32-bit offset
    wraps before the last entries. Forward and backward; the first and last batch entries
    (their tensors cross 2^31) against the reference of their own tensors."""
    b, s, h, d = 4100, 512, 16, 64
    spec = resolve_spec("causal_fp16_d64")
    free, _ = torch.cuda.mem_get_info()
    if free < 48 << 30:
        pytest.skip(f"needs 48 GiB of free GPU memory, {free >> 30} free")
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16).requires_grad_() for _ in range(3))
    out = _out(fa_gen.attention(q, k, v, spec))
    dout = torch.randn_like(out)
    out.backward(dout)
    for i in (0, b - 1):
        parts = [t.detach()[i:i + 1] for t in (q, k, v)]
        _assert_close(out.detach()[i:i + 1], *parts, spec, f"batch entry {i} of {b}")
        # The tolerance of tests/test_gpu_backward.py: twice the same-precision error, two
        # rounding steps, and the effect of D computed from the rounded output.
        grad_out = dout[i:i + 1]
        ref = _autograd(lambda *t: attention_reference(*t, spec)[0], [t.double() for t in parts], grad_out.double())
        same = _autograd(lambda *t: attention_same_precision(*t, spec), parts, grad_out)
        rounded_o = _rounded_o_effect(*parts, grad_out, spec)
        for name, got, want, yard in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref, same):
            got = got[i:i + 1].double()
            tol = 2 * (yard.double() - want).abs().max().item() + _grad_floor(want, torch.float16) + rounded_o[name]
            err = (got - want).abs().max().item()
            assert torch.isfinite(got).all() and err <= tol, f"{name} of entry {i}: {err:.3g} > {tol:.3g}"


def test_a_batch_of_1024_sequences_of_length_one():
    """1,024 sequences of one query and one key, fixed-length and packed: each output row is its
    own value row, bit for bit (its one probability is 1)."""
    q, k, v = _randn(1024, 1, 4, 128, seed=7), _randn(1024, 1, 2, 128, seed=8), _randn(1024, 1, 2, 128, seed=9)
    out = _out(fa_gen.attention(q, k, v, CAUSAL))
    assert torch.equal(out, v.repeat_interleave(2, dim=2)), "fixed-length: a row is not its value row"
    cu = torch.arange(1025, dtype=torch.int32, device="cuda")
    packed = _out(fa_gen.attention_varlen(q[:, 0], k[:, 0], v[:, 0], cu, cu, 1, 1, CAUSAL))
    assert torch.equal(packed, v[:, 0].repeat_interleave(2, dim=1)), "packed: a row is not its value row"


def test_heads_not_contiguous():
    """q, k, v made (batch, heads, seqlen, dim) and transposed: legal strides, heads not contiguous."""
    q = _randn(2, 8, 300, 128, seed=10).transpose(1, 2)
    k, v = _randn(2, 2, 257, 128, seed=11).transpose(1, 2), _randn(2, 2, 257, 128, seed=12).transpose(1, 2)
    _answer_or_clear_error(lambda: _out(fa_gen.attention(q, k, v, CAUSAL)),
                           lambda out: _assert_close(out, q, k, v, CAUSAL, "transposed heads"), "transposed heads")


def test_kv_broadcast_over_heads_with_stride_zero():
    """MQA written as an expand: K/V (b, s, 8, d) whose head stride is 0."""
    q = _randn(2, 200, 8, 128, seed=13)
    k = _randn(2, 333, 1, 128, seed=14).expand(2, 333, 8, 128)
    v = _randn(2, 333, 1, 128, seed=15).expand(2, 333, 8, 128)
    _answer_or_clear_error(lambda: _out(fa_gen.attention(q, k, v, CAUSAL)),
                           lambda out: _assert_close(out, q, k.contiguous(), v.contiguous(), CAUSAL, "stride-0 heads"),
                           "stride-0 heads")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_tensors_on_a_second_gpu():
    """Everything on cuda:1 while cuda:0 is current: the kernel runs there (or says why not)."""
    q = _randn(2, 300, 8, 128, seed=16, device="cuda:1")
    k, v = _randn(2, 257, 2, 128, seed=17, device="cuda:1"), _randn(2, 257, 2, 128, seed=18, device="cuda:1")
    torch.cuda.set_device(0)

    def judge(out):
        assert out.device == q.device, f"output on {out.device}"
        _assert_close(out, q, k, v, CAUSAL, "cuda:1")

    _answer_or_clear_error(lambda: _out(fa_gen.attention(q, k, v, CAUSAL)), judge, "cuda:1")
