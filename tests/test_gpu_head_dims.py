"""L1: the forward at (qk, v) head dims off the measured set: any multiples of 8 up to 256, held in
shared memory rounded up to whole swizzle atoms (fa_gen.families.warp_tiles.padded_head_dim).

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_head_dims.py
Fixed-length (fa_gen.attention, prefill and decode), varlen (split kinds, GQA packed or not) and
paged KV-cache calls, every sequence against the float64 reference of that sequence alone; the
backward (fixed-length and varlen) against float64 autograd.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from concurrent import futures

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fa_gen
from fa_gen.check import compare
from fa_gen.reference import attention_reference, attention_same_precision
from fa_gen.spec_load import load_spec
from tests.test_gpu_backward import _autograd, _max_abs, _rounding_floor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

# The FlashAttention-2 test suite's head dims that are multiples of 8 (32, 40, 80, 160, 224),
# the smallest (8), pairs whose qk and v pad differently (72/136, 256/200, 40/72), qk < v and
# qk > v (FlashAttention-3/4's hdimv tests: 64/128 and 128/64), and 184/120, whose padded pair
# (192/128) takes Hopper's own backward.
PAIRS = ((8, 8), (32, 32), (40, 40), (80, 80), (160, 160), (224, 224), (72, 136), (256, 200), (40, 72), (64, 128),
         (128, 64), (184, 120))
MASKS = ("none", "causal", {"kind": "sliding_window", "left": 90, "right": 3})
KINDS = ("forward", "backward", "backward_varlen", "forward_split", "forward_split_pack4", "forward_varlen_split", "forward_varlen_split_pack4",
         "forward_varlen_split_paged", "forward_varlen_split_paged_pack4", "forward_varlen_split_paged_groups",
         "forward_varlen_split_paged_groups_pack4")


def _spec(qk, v, mask_index, dtype):
    dims = qk if qk == v else {"qk": qk, "v": v}
    return load_spec({"name": f"hd_{dtype}_q{qk}_v{v}_m{mask_index}", "dtype": dtype, "head_dim": dims,
                      "mask": MASKS[mask_index]})


SPECS = [_spec(qk, v, i % len(MASKS), "bf16" if i % 2 == 0 else "fp16") for i, (qk, v) in enumerate(PAIRS)]


def _build(spec, arch, kind):
    from fa_gen.inference import inference_kernel
    from fa_gen.target import resolve_target
    from fa_gen.runtime import load_target

    if not kind.startswith("forward_"):
        load_target(resolve_target(spec, arch, kind))
    else:
        inference_kernel(spec, arch, kind)
    return spec.name, kind


@pytest.fixture(scope="module")
def arch():
    """Every kind the tests call, compiled up front (in parallel with FA_GEN_PRECOMPILE_JOBS)."""
    from fa_gen.runtime import current_arch

    arch = current_arch()
    work = [(spec, arch, kind) for spec in SPECS for kind in KINDS]
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    if jobs > 1:
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_build, *zip(*work)))
    return arch


def _dtype(spec):
    return torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16


def _draw(generator, spec, *shape_and_dim):
    return torch.randn(*shape_and_dim, generator=generator, device="cuda").to(_dtype(spec))


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_fixed_length_forward(arch, data, seed):
    spec = data.draw(st.sampled_from(SPECS), label="spec")
    batch = data.draw(st.integers(1, 3), label="batch")
    seqlen_q = data.draw(st.one_of(st.just(1), st.integers(1, 300)), label="seqlen_q")
    seqlen_k = data.draw(st.integers(1, 700), label="seqlen_k")
    heads_kv, group = data.draw(st.integers(1, 2), label="heads_kv"), data.draw(st.sampled_from((1, 4)), label="group")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = _draw(g, spec, batch, seqlen_q, heads_kv * group, spec.head_dim_qk)
    k = _draw(g, spec, batch, seqlen_k, heads_kv, spec.head_dim_qk)
    v = _draw(g, spec, batch, seqlen_k, heads_kv, spec.head_dim_v)
    out, lse = fa_gen.attention(q, k, v, spec)
    assert out.shape == (batch, seqlen_q, heads_kv * group, spec.head_dim_v)
    result = compare(spec, q, k, v, out, lse)
    assert result.ok, f"{spec.name} b{batch} sq{seqlen_q} sk{seqlen_k} {heads_kv}x{group}: {result}"


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**31 - 1),
       lengths=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 900)), min_size=1, max_size=5))
def test_varlen_forward_per_sequence(arch, data, seed, lengths):
    spec = data.draw(st.sampled_from(SPECS), label="spec")
    group = data.draw(st.sampled_from((1, 4)), label="group")
    num_splits = data.draw(st.sampled_from((0, 1, 3)), label="num_splits")
    g = torch.Generator(device="cuda").manual_seed(seed)
    total_q, total_k = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    q = _draw(g, spec, total_q, 2 * group, spec.head_dim_qk)
    k = _draw(g, spec, total_k, 2, spec.head_dim_qk)
    v = _draw(g, spec, total_k, 2, spec.head_dim_v)
    starts_q = [0] + [sum(a for a, _ in lengths[:i + 1]) for i in range(len(lengths))]
    starts_k = [0] + [sum(b for _, b in lengths[:i + 1]) for i in range(len(lengths))]
    cu_q, cu_k = (torch.tensor(s, dtype=torch.int32, device="cuda") for s in (starts_q, starts_k))
    max_q, max_k = max(a for a, _ in lengths), max(b for _, b in lengths)
    out, lse = fa_gen.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, spec, num_splits=num_splits)
    failures = []
    for b, (sq, sk) in enumerate(lengths):
        if sq == 0:
            continue
        rows, keys = slice(starts_q[b], starts_q[b] + sq), slice(starts_k[b], starts_k[b] + sk)
        result = compare(spec, q[rows][None], k[keys][None], v[keys][None], out[rows][None], lse[:, rows][None])
        if not result.ok:
            failures.append(f"sequence {b} ({sq}, {sk}): {result}")
    assert not failures, f"{spec.name} group {group} splits {num_splits}: " + "; ".join(failures)


@pytest.mark.parametrize("page_size", [1, 16, 48])
@pytest.mark.parametrize("index", range(len(SPECS)))
def test_paged_decode_with_append(arch, index, page_size):
    """One new token appended through a shuffled page table, then attended (GQA 4)."""
    spec = SPECS[index]
    g = torch.Generator(device="cuda").manual_seed(index * 7 + page_size)
    lengths = [0, 5, 333, 70]
    batch, heads_kv, group = len(lengths), 2, 4
    keys = [_draw(g, spec, n + 1, heads_kv, spec.head_dim_qk) for n in lengths]
    values = [_draw(g, spec, n + 1, heads_kv, spec.head_dim_v) for n in lengths]
    pages = [math.ceil((n + 1) / page_size) for n in lengths]
    order = torch.randperm(sum(pages) + 1, generator=g, device="cuda")
    table = torch.full((batch, max(pages)), int(order[-1]), dtype=torch.int32, device="cuda")
    k_cache = torch.full((sum(pages) + 1, page_size, heads_kv, spec.head_dim_qk), math.nan, dtype=_dtype(spec),
                         device="cuda")
    v_cache = torch.full((sum(pages) + 1, page_size, heads_kv, spec.head_dim_v), math.nan, dtype=_dtype(spec),
                         device="cuda")
    first = 0
    for b, n in enumerate(lengths):
        table[b, :pages[b]] = order[first:first + pages[b]].to(torch.int32)
        first += pages[b]
        rows = torch.arange(n, device="cuda")
        k_cache[table[b].long()[rows // page_size], rows % page_size] = keys[b][:n]
        v_cache[table[b].long()[rows // page_size], rows % page_size] = values[b][:n]
    q = _draw(g, spec, batch, 1, heads_kv * group, spec.head_dim_qk)
    k_new = torch.stack([kk[-1:] for kk in keys])
    v_new = torch.stack([vv[-1:] for vv in values])
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = fa_gen.attention_with_kvcache(q, k_cache, v_cache, seqlens, spec, k_new=k_new, v_new=v_new,
                                             page_table=table)
    for b, n in enumerate(lengths):
        slot = table[b, n // page_size].long(), n % page_size
        assert torch.equal(k_cache[slot], keys[b][-1]) and torch.equal(v_cache[slot], values[b][-1])
        result = compare(spec, q[b:b + 1], keys[b][None], values[b][None], out[b:b + 1], lse[b:b + 1])
        assert result.ok, f"{spec.name} page {page_size} sequence {b} ({n} cached): {result}"


GRADS = ("dq", "dk", "dv")


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_backward_matches_reference(arch, data, seed):
    """fa_gen.attention then autograd: dq, dk, dv within twice the error of PyTorch autograd at
    the input dtype, plus two roundings (tests/test_gpu_backward.py's rule), for the padded pairs."""
    spec = data.draw(st.sampled_from(SPECS), label="spec")
    batch = data.draw(st.integers(1, 2), label="batch")
    seqlen_q, seqlen_k = data.draw(st.integers(1, 400), label="seqlen_q"), data.draw(st.integers(1, 400), label="seqlen_k")
    group = data.draw(st.sampled_from((1, 3)), label="group")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = _draw(g, spec, batch, seqlen_q, 2 * group, spec.head_dim_qk)
    k = _draw(g, spec, batch, seqlen_k, 2, spec.head_dim_qk)
    v = _draw(g, spec, batch, seqlen_k, 2, spec.head_dim_v)
    dout = _draw(g, spec, batch, seqlen_q, 2 * group, spec.head_dim_v)
    got = _autograd(lambda *t: fa_gen.attention(*t, spec=spec)[0], (q, k, v), dout)
    ref = _autograd(lambda *t: attention_reference(*t, spec)[0], (q.double(), k.double(), v.double()), dout.double())
    same = _autograd(lambda *t: attention_same_precision(*t, spec), (q, k, v), dout)
    for name, x, r, pt in zip(GRADS, got, ref, same):
        tol = 2 * _max_abs(pt.double() - r) + _rounding_floor(r, q.dtype)
        err = _max_abs(x.double() - r)
        assert torch.isfinite(x).all() and err <= tol, f"{spec.name} {name}: {err:.2e} > {tol:.2e} " \
            f"(b{batch} sq{seqlen_q} sk{seqlen_k} group {group})"


def test_varlen_backward_per_sequence(arch):
    """attention_varlen then autograd on a packed batch of three sequences (one empty), each
    sequence's dq, dk, dv judged by test_gpu_varlen_backward's rule against its own reference."""
    from tests.test_gpu_varlen_backward import _sequence_failures

    lengths = [(37, 120), (0, 5), (200, 90)]
    for spec in SPECS:
        g = torch.Generator(device="cuda").manual_seed(11)
        total_q, total_k = sum(a for a, _ in lengths), sum(b for _, b in lengths)
        q = _draw(g, spec, total_q, 4, spec.head_dim_qk).requires_grad_()
        k = _draw(g, spec, total_k, 2, spec.head_dim_qk).requires_grad_()
        v = _draw(g, spec, total_k, 2, spec.head_dim_v).requires_grad_()
        dout = _draw(g, spec, total_q, 4, spec.head_dim_v)
        cu_q = torch.tensor([0, 37, 37, 237], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 120, 125, 215], dtype=torch.int32, device="cuda")
        out, _ = fa_gen.attention_varlen(q, k, v, cu_q, cu_k, 200, 120, spec)
        out.backward(dout)
        data = (q.detach(), k.detach(), v.detach(), dout, cu_q, cu_k, None)
        failures = _sequence_failures(spec, data, (q.grad, k.grad, v.grad), lengths, [0] * len(lengths))
        assert not failures, f"{spec.name}: " + "; ".join(failures)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_DRAWN_PAIRS", "4")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(qk=st.integers(1, 32).map(lambda i: 8 * i), v=st.integers(1, 32).map(lambda i: 8 * i),
       causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_drawn_pairs_forward_and_backward(arch, qk, v, causal, seed):
    """Pairs drawn from every multiple of 8 (compiled on the fly): forward and gradients."""
    spec = load_spec({"name": f"hd_drawn_q{qk}_v{v}_{int(causal)}", "dtype": "bf16",
                      "head_dim": qk if qk == v else {"qk": qk, "v": v}, "mask": "causal" if causal else "none"})
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = _draw(g, spec, 2, 97, 4, qk)
    k = _draw(g, spec, 2, 130, 2, qk)
    vv = _draw(g, spec, 2, 130, 2, v)
    dout = _draw(g, spec, 2, 97, 4, v)
    out, lse = fa_gen.attention(q, k, vv, spec)
    assert compare(spec, q, k, vv, out, lse).ok
    got = _autograd(lambda *t: fa_gen.attention(*t, spec=spec)[0], (q, k, vv), dout)
    ref = _autograd(lambda *t: attention_reference(*t, spec)[0], (q.double(), k.double(), vv.double()), dout.double())
    same = _autograd(lambda *t: attention_same_precision(*t, spec), (q, k, vv), dout)
    for name, x, r, pt in zip(GRADS, got, ref, same):
        tol = 2 * _max_abs(pt.double() - r) + _rounding_floor(r, q.dtype)
        assert torch.isfinite(x).all() and _max_abs(x.double() - r) <= tol, f"{spec.name} {name}"
