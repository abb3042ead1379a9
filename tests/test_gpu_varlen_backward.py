"""L1: fa_gen.varlen_backward.backward_varlen (the preferred family's `backward_varlen` kernel:
Hopper's own on sm_90a where it serves the spec, the sm80 family's elsewhere) called
directly after fa_gen.inference.forward_varlen, every sequence judged alone.

Run on a GPU machine:  FA_GEN_PRECOMPILE_JOBS=14 python -m pytest -m gpu tests/test_gpu_varlen_backward.py
dq, dk, dv of each sequence are compared with float64 autograd through fa_gen.reference of that
sequence alone (its q rows, its first seqused_k[b] keys); the tolerance is twice a same-precision
PyTorch autograd's own error plus one rounding step at the sequence's gradient magnitude. Keys
past seqused_k[b] are not attended: their dk and dv must be exactly 0. Deterministic mode must
give bitwise-equal gradients on a second run. (tests/test_gpu_varlen.py also reaches this kernel
through fa_gen.attention_varlen's autograd, without seqused_k.)
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent import futures

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen.runtime import resolve_spec
from tests.test_gpu_varlen import _inputs, _packed, _sequence_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

# Causal, a left + right window, a score mod with a runtime scalar, one reading h and q_idx, the
# 128-row tile of d64, d256, and unequal head dims; a mask expression (applied to every tile:
# no per-call lists in varlen) and a sink logit (in the forward's LSE).
NAMES = ["causal_bf16_d128", "sliding_window_bf16_d128", "softcap", "alibi", "causal_fp16_d64",
         "full_bf16_d256", "causal_bf16_qk192_v128", "chunked_causal", "sink_logit"]
SPECS = {name: resolve_spec(name) for name in NAMES}

# (seqlen_q, seqlen_k) per sequence: empty sequences and single rows, keys fewer than queries,
# one long sequence among short ones (its key tiles run far past the others' grids).
BATCHES = {
    "edges": [(0, 5), (1, 1), (1, 300), (77, 0), (64, 64), (0, 0), (3, 2)],
    "short_keys": [(300, 17), (129, 128), (257, 1), (65, 63)],
    "long_among_short": [(3, 7), (1500, 1700), (1, 2), (130, 40), (5, 5)],
}
# (heads_q, heads_kv): GQA groups 1, 2, 4.
HEADS = [(2, 2), (4, 2), (4, 1)]


def _compile(spec, arch, kind):
    """Compile (or load) one kind of one spec: forward_varlen or backward_varlen."""
    from fa_gen.inference import inference_kernel
    from fa_gen.runtime import load_kernel_function

    if kind == "backward_varlen":
        load_kernel_function(spec, arch, None, kind=kind)
    else:
        inference_kernel(spec, arch, kind)


@pytest.fixture(scope="module")
def arch():
    """The forward and backward kinds of every spec, compiled before the first test (in
    FA_GEN_PRECOMPILE_JOBS parallel processes where set, filling the disk cache first)."""
    from fa_gen.runtime import current_arch

    arch = current_arch()
    work = [(spec, arch, kind) for spec in SPECS.values() for kind in ("forward_varlen", "backward_varlen")]
    _compile_in_processes(work, int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0")))
    for item in work:
        _compile(*item)
    return arch


def _compile_in_processes(work, jobs):
    """With jobs > 1: compile `work` in that many spawned processes (no CUDA state inherited);
    the disk cache they fill is where this process then loads from."""
    if jobs <= 1:
        return
    pool = futures.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
    with pool:
        for done in [pool.submit(_compile, *item) for item in work]:
            done.result()


def _run(spec, lengths, heads, seed, used=False, deterministic=False, runs=1):
    """Packed inputs, forward_varlen (one kind pinned), then `runs` backward_varlen calls.
    Returns (inputs, grads of each run, slack key rows per sequence)."""
    from fa_gen.inference import forward_varlen
    from fa_gen.varlen_backward import backward_varlen

    generator = torch.Generator(device="cuda").manual_seed(seed)
    slack = [int(x) for x in torch.randint(0, 40, (len(lengths),), generator=torch.Generator().manual_seed(seed))] \
        if used else [0] * len(lengths)
    q, k, v, cu_q, cu_k = _packed(spec, lengths, heads, generator, slack if used else ())
    seqused = torch.tensor([sk for _, sk in lengths], dtype=torch.int32, device="cuda") if used else None
    inputs = _inputs(spec, generator, q.shape[1])
    max_q, max_k = max(sq for sq, _ in lengths), max(sk + x for (_, sk), x in zip(lengths, slack))
    out, lse = forward_varlen(spec, q, k, v, cu_q, cu_k, max_q, max_k, seqused, num_splits=1, inputs=inputs,
                              pack_gqa=False)
    dout = torch.randn(out.shape, generator=generator, device="cuda").to(out.dtype)
    grads = [backward_varlen(spec, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, seqused,
                             deterministic=deterministic, inputs=inputs) for _ in range(runs)]
    return (q, k, v, dout, cu_q, cu_k, inputs), grads, slack


def _judge(what, got, want, same, floor):
    """None if `got` is finite and within the tolerance of the float64 `want`, else why not."""
    tol = 2 * (same.double() - want).abs().max().item() + floor if want.numel() else 0.0
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    if bool(torch.isfinite(got).all()) and err <= tol:
        return None
    return f"{what}: err {err:.3e} tol {tol:.3e}"


def _expected(spec, parts, d_out, inputs):
    """(float64 gradients, same-precision gradients, one rounding step at their magnitude) of one
    sequence's (q, k, v) parts for the upstream `d_out`."""
    from fa_gen.reference import attention_reference, attention_same_precision

    exact = _sequence_grads(lambda *x: attention_reference(*x, spec, inputs=inputs)[0],
                            [t.double() for t in parts], d_out.double())
    rounded = _sequence_grads(lambda *x: attention_same_precision(*x, spec, inputs=inputs), parts, d_out)
    magnitude = max((g.abs().max().item() if g.numel() else 0.0) for g in exact)
    return exact, rounded, torch.finfo(parts[0].dtype).eps * magnitude


def _sequence_failures(spec, data, grads, lengths, slack):
    """Every sequence's dq, dk, dv against its own reference; its slack keys' dk, dv exactly 0."""
    q, k, v, dout, cu_q, cu_k, inputs = data
    failures = []
    for b, ((sq, sk), start_q, start_k) in enumerate(zip(lengths, cu_q.tolist(), cu_k.tolist())):
        spans = (slice(start_q, start_q + sq), slice(start_k, start_k + sk), slice(start_k, start_k + sk))
        exact, rounded, floor = _expected(spec, [t[s].unsqueeze(0) for t, s in zip((q, k, v), spans)],
                                          dout[spans[0]].unsqueeze(0), inputs)
        for name, g, span, want, same in zip("qkv", grads, spans, exact, rounded):
            failures.append(_judge(f"sequence {b} ({sq}, {sk}) d{name}", g[span], want[0], same[0], floor))
        unused = slice(start_k + sk, start_k + sk + slack[b])
        if any(bool(g[unused].any()) for g in grads[1:]):
            failures.append(f"sequence {b}: dk / dv of the {slack[b]} keys past seqused_k are not 0")
    return [f for f in failures if f]


@pytest.mark.parametrize("used", [False, True], ids=["all_keys", "seqused_k"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", NAMES)
def test_backward_varlen_per_sequence(arch, name, batch, heads, used):
    spec, lengths = SPECS[name], BATCHES[batch]
    data, (grads,), slack = _run(spec, lengths, heads, seed=len(name) * 31 + len(batch), used=used)
    failures = _sequence_failures(spec, data, grads, lengths, slack)
    assert not failures, f"{name} {batch} heads={heads} seqused_k={used}: " + "; ".join(failures)


@pytest.mark.parametrize("used", [False, True], ids=["all_keys", "seqused_k"])
@pytest.mark.parametrize("name", ["causal_bf16_d128", "sliding_window_bf16_d128", "causal_fp16_d64", "full_bf16_d256"])
def test_deterministic_is_bitwise_reproducible(arch, name, used):
    """Many key tiles per query tile and GQA 4 (many CTAs adding into one dQ tile): two
    deterministic runs agree bit for bit, and both are exact."""
    spec, lengths = SPECS[name], [(700, 1900), (33, 2500), (1200, 300), (0, 9)]
    data, runs, slack = _run(spec, lengths, (8, 2), seed=11, used=used, deterministic=True, runs=2)
    unequal = [n for n, a, b in zip("qkv", *runs) if not torch.equal(a, b)]
    assert not unequal, f"{name}: deterministic d{', d'.join(unequal)} differ between two runs"
    failures = _sequence_failures(spec, data, runs[0], lengths, slack)
    assert not failures, f"{name} deterministic: " + "; ".join(failures)


lengths_strategy = st.lists(st.tuples(st.one_of(st.integers(0, 3), st.integers(1, 400)),
                                      st.one_of(st.integers(0, 3), st.integers(1, 700))), min_size=1, max_size=6)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "150")) // 3 + 1, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), lengths=lengths_strategy, seed=st.integers(0, 2**31 - 1))
def test_backward_varlen_drawn_batches(arch, data, lengths, seed):
    name = data.draw(st.sampled_from(NAMES), label="spec")
    heads = data.draw(st.sampled_from(HEADS + [(3, 3), (8, 2)]), label="heads")
    used, deterministic = data.draw(st.booleans(), label="seqused_k"), data.draw(st.booleans(), label="det")
    packed, (grads,), slack = _run(SPECS[name], lengths, heads, seed, used, deterministic)
    failures = _sequence_failures(SPECS[name], packed, grads, lengths, slack)
    assert not failures, f"{name} heads={heads} seqused_k={used} det={deterministic}: " + "; ".join(failures)


@pytest.mark.parametrize("deterministic", [False, True], ids=["any_order", "deterministic"])
def test_workspace_contents_are_never_read(arch, deterministic, monkeypatch):
    """The varlen workspaces full of NaN (what a reused allocation may hold): every sequence still
    exact, including query tiles no key tile sees, the padding rows between the sequences'
    workspace regions, and a sequence past CLEAR_IN_MAIN_ROWS (its accumulator zeroed by the
    pre-pass, the others' by the main kernel) (tests/test_gpu_backward.py has the fixed-length twin)."""
    import fa_gen.varlen_backward
    from tests.test_gpu_backward import _poisoned_workspace

    monkeypatch.setattr(fa_gen.varlen_backward, "_workspace", _poisoned_workspace(fa_gen.varlen_backward._workspace))
    spec, lengths = SPECS["causal_bf16_d128"], [(700, 1900), (400, 90), (1, 0), (300, 17), (4200, 350), (129, 600)]
    data, (grads,), slack = _run(spec, lengths, (8, 2), seed=13, deterministic=deterministic)
    failures = _sequence_failures(spec, data, grads, lengths, slack)
    assert not failures, f"deterministic={deterministic}: " + "; ".join(failures)


def test_empty_batches_give_zero_gradients(arch):
    """No sequence, or sequences with no query rows: zeros, shaped like q, k, v."""
    spec = SPECS["causal_bf16_d128"]
    for lengths in ([(0, 0)], [(0, 17), (0, 4)]):
        data, (grads,), slack = _run(spec, lengths, (4, 2), seed=5)
        q, k, v = data[:3]
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        assert not any(bool(g.any()) for g in grads), lengths
    from fa_gen.varlen_backward import backward_varlen

    q = torch.randn(0, 4, 128, device="cuda").to(torch.bfloat16)
    none = torch.zeros(1, dtype=torch.int32, device="cuda")
    dq, dk, dv = backward_varlen(spec, q, q, q[:, :2], q[:, :2], q, torch.empty(4, 0, device="cuda"), none, none, 0, 0)
    assert dq.shape == q.shape and dk.shape == (0, 2, 128)


@pytest.mark.parametrize("name", ["causal_bf16_d128", "full_bf16_d256"])
def test_rows_outside_every_sequence_get_zero_gradients(arch, name):
    """The tensors hold rows before cu_seqlens[0] and past cu_seqlens[-1]: their dq, dk and dv
    are exactly 0 though the gradients start as uninitialised memory (the allocator's last
    block, filled with NaN), and every sequence is still exact."""
    from fa_gen.inference import forward_varlen
    from fa_gen.varlen_backward import backward_varlen

    spec, lengths = SPECS[name], [(70, 90), (129, 40), (1, 300)]
    generator = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, cu_q, cu_k = _packed(spec, lengths, (4, 2), generator)
    (before_q, after_q), (before_k, after_k) = (5, 11), (3, 17)

    def pad(t, before, after):
        rows = torch.randn(before + t.shape[0] + after, *t.shape[1:], generator=generator, device="cuda")
        rows = rows.to(t.dtype)
        rows[before:before + t.shape[0]] = t
        return rows

    q, k, v = pad(q, before_q, after_q), pad(k, before_k, after_k), pad(v, before_k, after_k)
    cu_q, cu_k = cu_q + before_q, cu_k + before_k
    sizes = (max(a for a, _ in lengths), max(b for _, b in lengths))
    out, lse = forward_varlen(spec, q, k, v, cu_q, cu_k, *sizes, num_splits=1, pack_gqa=False)
    dout = torch.randn(out.shape, generator=generator, device="cuda").to(out.dtype)
    poison = torch.full((3 * (q.numel() + k.numel()),), float("nan"), dtype=q.dtype, device="cuda")
    del poison
    grads = backward_varlen(spec, dout, q, k, v, out, lse, cu_q, cu_k, *sizes)
    for name_, g, before, after in zip("qkv", grads, (before_q, before_k, before_k), (after_q, after_k, after_k)):
        outside = torch.cat([g[:before], g[g.shape[0] - after:]])
        assert torch.equal(outside, torch.zeros_like(outside)), f"d{name_} outside the sequences is not 0"
    failures = _sequence_failures(spec, (q, k, v, dout, cu_q, cu_k, None), grads, lengths, [0] * len(lengths))
    assert not failures, "; ".join(failures)


def test_no_host_sync_and_no_recompile(arch):
    """New batch compositions reuse the one compiled backward and never synchronise the host."""
    from fa_gen.cache import default_cache
    from fa_gen.inference import forward_varlen
    from fa_gen.varlen_backward import backward_varlen

    spec = SPECS["causal_bf16_d128"]
    generator = torch.Generator(device="cuda").manual_seed(9)
    calls = []
    for lengths in ([(5, 9), (300, 17)], [(1, 4000)] * 3, [(0, 0), (128, 64), (2, 2)]):
        q, k, v, cu_q, cu_k = _packed(spec, lengths, (8, 2), generator)
        sizes = (max(a for a, _ in lengths), max(b for _, b in lengths))
        out, lse = forward_varlen(spec, q, k, v, cu_q, cu_k, *sizes, num_splits=1, pack_gqa=False)
        calls.append((torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, *sizes))
    builds = default_cache().stats.builds
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            backward_varlen(spec, *call, deterministic=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert default_cache().stats.builds == builds
