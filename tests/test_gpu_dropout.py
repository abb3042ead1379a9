"""L1: the dropout forwards (`forward_dropout`: Hopper's own and the sm80 one) and the sm80
backward (`backward_dropout`, fixed and varlen) against the
float64 reference under the same Philox mask (fa_gen.philox): the mask bit for bit, values within
the forward's and the backward's tolerances; same state, same bits; another seed or offset,
another mask; the keep rate binomial and the output unbiased.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_dropout.py
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen.check import _rounding_floor
from fa_gen.dropout import backward_dropout, forward_dropout
from fa_gen.philox import Dropout
from fa_gen.reference import attention_reference, attention_same_precision
from fa_gen.runtime import resolve_spec
from fa_gen.spec_load import load_spec
from tests.test_gpu_backward import _autograd, _max_abs, _rounded_o_effect, _rounding_floor as two_roundings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

SPECS = [resolve_spec("causal_bf16_d128"), resolve_spec("full_fp16_d64"), resolve_spec("sliding_window_bf16_d128"),
         resolve_spec("softcap"), resolve_spec("chunked_causal"),
         load_spec({"name": "drop_q80", "dtype": "bf16", "head_dim": 80, "mask": "causal"})]


def _inputs(spec, generator):
    if spec.name == "softcap":
        return {"softcap": 5.0 + 45.0 * float(torch.rand((), generator=generator, device="cuda"))}
    if spec.name == "chunked_causal":
        return {"chunk": int(torch.randint(1, 300, (), generator=generator, device="cuda"))}
    return None


def _draw(spec, generator, batch, seqlen_q, seqlen_k, heads_q, heads_kv):
    dtype = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
    q = torch.randn(batch, seqlen_q, heads_q, spec.head_dim_qk, generator=generator, device="cuda").to(dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, spec.head_dim_qk, generator=generator, device="cuda").to(dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, spec.head_dim_v, generator=generator, device="cuda").to(dtype)
    return q, k, v


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**40))
def test_dropout_forward_matches_reference(data, seed, offset):
    spec = data.draw(st.sampled_from(SPECS), label="spec")
    family = data.draw(st.sampled_from((None, "sm80")), label="family")
    p = data.draw(st.sampled_from((0.1, 0.5, 0.9)), label="p")
    batch, heads_kv = data.draw(st.integers(1, 2), label="batch"), data.draw(st.integers(1, 2), label="heads_kv")
    group = data.draw(st.sampled_from((1, 3)), label="group")
    seqlen_q, seqlen_k = data.draw(st.integers(1, 300), label="seqlen_q"), data.draw(st.integers(1, 300), label="seqlen_k")
    g = torch.Generator(device="cuda").manual_seed(seed % 2**31)
    q, k, v = _draw(spec, g, batch, seqlen_q, seqlen_k, heads_kv * group, heads_kv)
    inputs = _inputs(spec, g)
    out, lse = forward_dropout(spec, q, k, v, p, seed, offset, inputs=inputs, family=family)
    drop = Dropout(p, seed, offset)
    ref, ref_lse = attention_reference(q, k, v, spec, inputs=inputs, dropout=drop)
    same = attention_same_precision(q, k, v, spec, inputs=inputs, dropout=drop)
    tol = 2 * (same.double() - ref).abs().max().item() + _rounding_floor(ref, q.dtype)
    err = (out.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and err <= tol, f"{spec.name} p={p}: out err {err:.3e} > {tol:.3e}"
    visible = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), visible)
    assert (lse[visible].double() - ref_lse[visible]).abs().max().item() <= 1e-3 if visible.any() else True


def test_same_state_same_bits_other_state_other_mask():
    spec = SPECS[0]
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = _draw(spec, g, 2, 200, 300, 4, 2)
    first, _ = forward_dropout(spec, q, k, v, 0.3, 1234, 8)
    assert torch.equal(first, forward_dropout(spec, q, k, v, 0.3, 1234, 8)[0])
    for seed, offset in ((1235, 8), (1234, 12), (1234 + (1 << 40), 8)):
        assert not torch.equal(first, forward_dropout(spec, q, k, v, 0.3, seed, offset)[0])


def test_keep_rate_and_unbiased_output():
    """V = 1 everywhere: out = (kept probability mass) / (1 - p) per row, whose mean over rows is
    1 (unbiased) within the binomial spread of the kept count."""
    spec = resolve_spec("full_bf16_d128")
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.zeros(1, 512, 8, 128, device="cuda", dtype=torch.bfloat16)  # uniform probabilities
    k = torch.randn(1, 1024, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.ones(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    p = 0.25
    out, _ = forward_dropout(spec, q, k, v, p, 99, 0)
    kept_share = out[..., 0].double() * (1 - p)  # per row: kept keys / 1024
    n = kept_share.numel() * 1024
    assert abs(kept_share.mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    assert abs(out[..., 0].double().mean().item() - 1.0) < 5 * math.sqrt(p / (1 - p) / n)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**40))
def test_dropout_backward_matches_reference(data, seed, offset):
    """dq, dk, dv of forward_dropout through backward_dropout (the mask regenerated) against
    float64 autograd through the reference under the same mask; tolerance as the backward
    suite derives it (twice the same-precision autograd error, two roundings, and what D =
    rowsum(dO * O) moves by over O rounded to the input dtype: under dropout O = V / (1 - p)
    rounds even where one key is visible, which made dq 1.2e-2 off at sq = sk = 1 on the H100)."""
    spec = data.draw(st.sampled_from(SPECS), label="spec")
    p = data.draw(st.sampled_from((0.1, 0.5)), label="p")
    deterministic = data.draw(st.booleans(), label="deterministic")
    # The preferred family's backward (Hopper's where its narrow layout serves the spec) and the sm80 one.
    family = data.draw(st.sampled_from((None, "sm80")), label="backward family")
    seqlen_q, seqlen_k = data.draw(st.integers(1, 250), label="seqlen_q"), data.draw(st.integers(1, 250), label="seqlen_k")
    g = torch.Generator(device="cuda").manual_seed(seed % 2**31)
    q, k, v = _draw(spec, g, 2, seqlen_q, seqlen_k, 4, 2)
    dout = torch.randn(q.shape[:3] + (spec.head_dim_v,), generator=g, device="cuda").to(q.dtype)
    inputs = _inputs(spec, g)
    out, lse = forward_dropout(spec, q, k, v, p, seed, offset, inputs=inputs)
    got = backward_dropout(spec, dout, q, k, v, out, lse, p, seed, offset, deterministic=deterministic, inputs=inputs,
                           family=family)
    drop = Dropout(p, seed, offset)
    ref = _autograd(lambda *t: attention_reference(*t, spec, inputs=inputs, dropout=drop)[0],
                    (q.double(), k.double(), v.double()), dout.double())
    same = _autograd(lambda *t: attention_same_precision(*t, spec, inputs=inputs, dropout=drop), (q, k, v), dout)
    rounded_o = _rounded_o_effect(q, k, v, dout, spec, inputs, dropout=drop)
    for name, x, r, pt in zip(("dq", "dk", "dv"), got, ref, same):
        tol = 2 * _max_abs(pt.double() - r) + two_roundings(r, q.dtype) + rounded_o[name]
        err = _max_abs(x.double() - r)
        assert torch.isfinite(x).all() and err <= tol, f"{spec.name} p={p} {name}: {err:.3e} > {tol:.3e}"


# Each way a kernel applies the mask, pinned (the hypothesis draws above may miss one): the sm90
# forward's 16-bit pairs (d128, ping-pong) and its fp32 path with a last 16-key group that has
# no partner (d256: 80-key tiles, five groups), the sm80 forward; the sm90 backward's keep bits
# in registers (narrow layout, d128) and on P's way to shared memory (wide layout, d256, full
# and causal; keys on N, qk 192, S queries-major), and the sm80 backward's factors (d256 and d128
# forced onto sm80).
PATHS = [("full_bf16_d128", None, None), ("full_bf16_d256", None, None), ("causal_bf16_d128", "sm80", "sm80"),
         ("causal_fp16_d64", None, None), ("full_bf16_d256", None, "sm80"), ("drop_causal_d256", None, None),
         ("causal_bf16_qk192_v128", None, None), ("drop_full_d192", None, None)]
EXTRA_SPECS = {"drop_causal_d256": {"name": "drop_causal_d256", "dtype": "bf16", "head_dim": 256, "mask": "causal"},
               "drop_full_d192": {"name": "drop_full_d192", "dtype": "bf16", "head_dim": 192, "mask": "none"}}


@pytest.mark.parametrize("name,forward_family,backward_family", PATHS)
def test_every_mask_path_matches_reference(name, forward_family, backward_family):
    spec = load_spec(EXTRA_SPECS[name]) if name in EXTRA_SPECS else resolve_spec(name)
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = _draw(spec, g, 2, 77, 203, 6, 2)
    dout = torch.randn(q.shape[:3] + (spec.head_dim_v,), generator=g, device="cuda").to(q.dtype)
    seed, offset, p = 0x5EED5EED1234, 3 << 20, 0.3
    out, lse = forward_dropout(spec, q, k, v, p, seed, offset, family=forward_family)
    drop = Dropout(p, seed, offset)
    ref, _ = attention_reference(q, k, v, spec, dropout=drop)
    same = attention_same_precision(q, k, v, spec, dropout=drop)
    tol = 2 * (same.double() - ref).abs().max().item() + _rounding_floor(ref, q.dtype)
    err = (out.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and err <= tol, f"{name} out: {err:.3e} > {tol:.3e}"
    got = backward_dropout(spec, dout, q, k, v, out, lse, p, seed, offset, family=backward_family)
    ref_grads = _autograd(lambda *t: attention_reference(*t, spec, dropout=drop)[0],
                          (q.double(), k.double(), v.double()), dout.double())
    same_grads = _autograd(lambda *t: attention_same_precision(*t, spec, dropout=drop), (q, k, v), dout)
    rounded_o = _rounded_o_effect(q, k, v, dout, spec, None, dropout=drop)
    for grad, x, r, pt in zip(("dq", "dk", "dv"), got, ref_grads, same_grads):
        tol = 2 * _max_abs(pt.double() - r) + two_roundings(r, q.dtype) + rounded_o[grad]
        err = _max_abs(x.double() - r)
        assert torch.isfinite(x).all() and err <= tol, f"{name} {grad}: {err:.3e} > {tol:.3e}"


def test_varlen_dropout_per_sequence():
    """A packed batch (one sequence empty): every sequence's output and gradients against the
    reference of that sequence alone, its mask drawn as batch entry b."""
    from fa_gen.dropout import backward_varlen_dropout, forward_varlen_dropout

    lengths = [(37, 120), (0, 5), (200, 90), (64, 64)]
    starts_q = [0] + [sum(a for a, _ in lengths[:i + 1]) for i in range(len(lengths))]
    starts_k = [0] + [sum(b for _, b in lengths[:i + 1]) for i in range(len(lengths))]
    cu_q, cu_k = (torch.tensor(s, dtype=torch.int32, device="cuda") for s in (starts_q, starts_k))
    for spec, family in [(s, f) for s in SPECS[:3] + SPECS[5:] for f in (None, "sm80")]:
        g = torch.Generator(device="cuda").manual_seed(17)
        dtype = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
        q = torch.randn(starts_q[-1], 4, spec.head_dim_qk, generator=g, device="cuda").to(dtype)
        k = torch.randn(starts_k[-1], 2, spec.head_dim_qk, generator=g, device="cuda").to(dtype)
        v = torch.randn(starts_k[-1], 2, spec.head_dim_v, generator=g, device="cuda").to(dtype)
        dout = torch.randn(starts_q[-1], 4, spec.head_dim_v, generator=g, device="cuda").to(dtype)
        out, lse = forward_varlen_dropout(spec, q, k, v, cu_q, cu_k, 200, 120, 0.3, 4242, 16, family=family)
        grads = backward_varlen_dropout(spec, dout, q, k, v, out, lse, cu_q, cu_k, 200, 120, 0.3, 4242, 16)
        for b, (sq, sk) in enumerate(lengths):
            if sq == 0:
                continue
            rows, keys = slice(starts_q[b], starts_q[b] + sq), slice(starts_k[b], starts_k[b] + sk)
            drop = Dropout(0.3, 4242, 16, first_batch=b)
            parts = (q[rows][None], k[keys][None], v[keys][None])
            ref = attention_reference(*parts, spec, dropout=drop)[0]
            same = attention_same_precision(*parts, spec, dropout=drop)
            tol = 2 * (same.double() - ref).abs().max().item() + _rounding_floor(ref, dtype)
            assert (out[rows][None].double() - ref).abs().max().item() <= tol, f"{spec.name} sequence {b} out"
            exact = _autograd(lambda *t: attention_reference(*t, spec, dropout=drop)[0],
                              tuple(t.double() for t in parts), dout[rows][None].double())
            rounded = _autograd(lambda *t: attention_same_precision(*t, spec, dropout=drop), parts, dout[rows][None])
            rounded_o = _rounded_o_effect(*parts, dout[rows][None], spec, dropout=drop)
            for name, g_all, span, r, pt in zip(("dq", "dk", "dv"), grads, (rows, keys, keys), exact, rounded):
                tol = 2 * _max_abs(pt.double() - r) + two_roundings(r, dtype) + rounded_o[name]
                assert _max_abs(g_all[span][None].double() - r) <= tol, f"{spec.name} sequence {b} {name}"


def test_public_dropout_draws_from_the_torch_generator_and_differentiates():
    """fa_gen.attention(..., dropout_p=p): the mask of (torch's seed, its offset before the call),
    a fresh one on the next call, the same run after torch.manual_seed; gradients against the
    reference under that mask."""
    import fa_gen

    spec = SPECS[0]
    g = torch.Generator(device="cuda").manual_seed(23)
    q, k, v = (t.requires_grad_() for t in _draw(spec, g, 2, 150, 170, 4, 2))
    dout = torch.randn(q.shape[:3] + (spec.head_dim_v,), generator=g, device="cuda").to(q.dtype)
    torch.manual_seed(1234)
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    draw = Dropout(0.2, generator.initial_seed(), generator.get_offset())
    out, _ = fa_gen.attention(q, k, v, spec, dropout_p=0.2)
    out.backward(dout)
    ref = attention_reference(q.detach(), k.detach(), v.detach(), spec, dropout=draw)[0]
    same = attention_same_precision(q.detach(), k.detach(), v.detach(), spec, dropout=draw)
    tol = 2 * (same.double() - ref).abs().max().item() + _rounding_floor(ref, q.dtype)
    assert (out.detach().double() - ref).abs().max().item() <= tol
    exact = _autograd(lambda *t: attention_reference(*t, spec, dropout=draw)[0],
                      (q.detach().double(), k.detach().double(), v.detach().double()), dout.double())
    rounded = _autograd(lambda *t: attention_same_precision(*t, spec, dropout=draw),
                        (q.detach(), k.detach(), v.detach()), dout)
    rounded_o = _rounded_o_effect(q.detach(), k.detach(), v.detach(), dout, spec, dropout=draw)
    for name, x, r, pt in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), exact, rounded):
        tol = 2 * _max_abs(pt.double() - r) + two_roundings(r, q.dtype) + rounded_o[name]
        assert _max_abs(x.double() - r) <= tol, name
    again, _ = fa_gen.attention(q, k, v, spec, dropout_p=0.2)
    assert not torch.equal(again, out)  # the generator moved on
    torch.manual_seed(1234)
    assert torch.equal(fa_gen.attention(q, k, v, spec, dropout_p=0.2)[0], out)  # the same run again


def test_cuda_graph_replays_draw_new_masks_and_backward_regenerates_them():
    """fa_gen.attention(..., dropout_p) forward and backward captured in one CUDA graph: each
    replay reads the (seed, offset) the previous one left in fa_gen's graph state, so replays
    draw different masks, and each replay's output and gradients are the eager kernels' under
    that replay's (seed, offset)."""
    import fa_gen
    from fa_gen import dropout as kernels

    spec = SPECS[0]
    g = torch.Generator(device="cuda").manual_seed(31)
    q, k, v = (t.requires_grad_() for t in _draw(spec, g, 2, 130, 190, 4, 2))
    dout = torch.randn(q.shape[:3] + (spec.head_dim_v,), generator=g, device="cuda").to(q.dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compiles, and makes fa_gen's graph state
            out, _ = fa_gen.attention(q, k, v, spec, dropout_p=0.3)
            out.backward(dout)
    torch.cuda.current_stream().wait_stream(stream)
    q.grad = k.grad = v.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = fa_gen.attention(q, k, v, spec, dropout_p=0.3)
        out.backward(dout)
    state = kernels._GRAPH_STATES[torch.cuda.current_device()]
    outputs = []
    for _ in range(2):
        seed, offset = (int(x) % (1 << 64) for x in state.tolist())
        graph.replay()
        torch.cuda.synchronize()
        want, lse = forward_dropout(spec, q.detach(), k.detach(), v.detach(), 0.3, seed, offset)
        assert torch.equal(out, want)
        grads = backward_dropout(spec, dout, q.detach(), k.detach(), v.detach(), want, lse, 0.3, seed, offset)
        for got, expected in zip((q.grad, k.grad, v.grad), grads):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-2)
        outputs.append(out.clone())
    assert not torch.equal(outputs[0], outputs[1])
