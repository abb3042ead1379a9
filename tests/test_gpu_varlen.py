"""L1: packed (varlen) batches and split-KV / GQA-packed forwards against the float64 reference.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_varlen.py
Every sequence of a packed batch is judged against the reference of that sequence alone
(fa_gen.check.compare on its slice), so a kernel that reads across sequence boundaries fails.
"""

from __future__ import annotations

import os
from concurrent import futures
import multiprocessing

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen.check import compare
from fa_gen.runtime import resolve_spec
from fa_gen.spec_load import load_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

_MASKS = ("none", "causal", {"kind": "causal", "alignment": "top_left"},
          {"kind": "sliding_window", "left": 100, "right": 7})


def _specs():
    specs = []
    for dtype, dim in (("bf16", 128), ("fp16", 64)):
        for i, mask in enumerate(_MASKS):
            specs.append(load_spec({"name": f"vl_{dtype}_d{dim}_{i}", "dtype": dtype, "head_dim": dim, "mask": mask}))
    specs.append(load_spec({"name": "vl_bf16_d256_causal", "dtype": "bf16", "head_dim": 256, "mask": "causal"}))
    specs.append(load_spec({"name": "vl_fp16_qk192_v128_window", "dtype": "fp16",
                            "head_dim": {"qk": 192, "v": 128}, "mask": _MASKS[3]}))
    specs.append(resolve_spec("softcap"))  # a score mod with a runtime scalar (packable)
    specs.append(resolve_spec("alibi"))    # a score mod reading h and q_idx (never packed)
    specs.append(resolve_spec("causal_topleft_fp16_d96"))  # 12 O vectors per row (sm90 varlen store)
    # Expressions without per-call tile lists: a mask expression on every tile, a sink logit
    # counted in split 0 only.
    specs.append(resolve_spec("chunked_causal"))
    specs.append(resolve_spec("sink_logit"))
    return specs


SPECS = _specs()
KINDS = ("forward_varlen", "forward_varlen_split", "forward_split")
GROUPS = (2, 4, 8)


def _kinds(spec):
    from fa_gen.families.sm80 import gqa_packable
    from fa_gen.inference import packed_kind

    from fa_gen.inference import supports
    from fa_gen.runtime import current_arch

    kinds = list(KINDS)
    if gqa_packable(spec):
        kinds += [packed_kind(k, g) for k in ("forward_varlen_split", "forward_split") for g in GROUPS]
    # The wide twins (64 x 128 tiles) that split calls short of a wave take, where the spec has them.
    wide = [kind.replace("_split", "_split_wide") for kind in kinds if "_split" in kind]
    return kinds + [kind for kind in wide if supports(spec, current_arch(), kind)]


def _build(spec, arch, kind):
    from fa_gen.inference import inference_kernel

    inference_kernel(spec, arch, kind)
    return spec.name, kind


@pytest.fixture(scope="module")
def arch():
    """Every kind the tests call, compiled up front (in parallel with FA_GEN_PRECOMPILE_JOBS)."""
    from fa_gen.runtime import current_arch

    arch = current_arch()
    work = [(spec, arch, kind) for spec in SPECS for kind in _kinds(spec)]
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    if jobs > 1:
        context = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            list(pool.map(_build, *zip(*work)))
    for item in work:
        _build(*item)
    return arch


def _inputs(spec, generator, heads_q):
    """Fresh values of the spec's inputs (runtime scalars drawn, tensors random)."""
    if spec.name == "softcap":
        return {"softcap": 5.0 + 45.0 * float(torch.rand((), generator=generator, device="cuda"))}
    if spec.name == "sink_logit":
        return {"sinks": 2.0 * torch.randn(heads_q, generator=generator, device="cuda")}
    if spec.name == "chunked_causal":
        return {"chunk": int(torch.randint(1, 400, (), generator=generator, device="cuda"))}
    return None


def _packed(spec, lengths, heads, generator, extra_k=()):
    """Fresh random q, k, v of the sequences `lengths` [(seqlen_q, seqlen_k)], one after the other;
    `extra_k[b]` more key rows after sequence b (cache slack that seqused_k leaves out)."""
    dtype = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
    heads_q, heads_kv = heads
    total_q = sum(sq for sq, _ in lengths)
    total_k = sum(sk for _, sk in lengths) + sum(extra_k)

    def draw(rows, h, d):
        return torch.randn(rows, h, d, generator=generator, device="cuda").to(dtype)

    q, k, v = draw(total_q, heads_q, spec.head_dim_qk), draw(total_k, heads_kv, spec.head_dim_qk), \
        draw(total_k, heads_kv, spec.head_dim_v)
    cu_q = torch.tensor([0] + [sum(sq for sq, _ in lengths[:i + 1]) for i in range(len(lengths))],
                        dtype=torch.int32, device="cuda")
    stored = [sk + (extra_k[i] if extra_k else 0) for i, (_, sk) in enumerate(lengths)]
    cu_k = torch.tensor([0] + [sum(stored[:i + 1]) for i in range(len(stored))], dtype=torch.int32, device="cuda")
    # The slack past each sequence's used keys is NaN: no kernel may let it into a result.
    start = 0
    for (_, sk), rows in zip(lengths, stored):
        k[start + sk:start + rows] = float("nan")
        v[start + sk:start + rows] = float("nan")
        start += rows
    return q, k, v, cu_q, cu_k


def _check_sequences(spec, q, k, v, out, lse, lengths, cu_q, cu_k, inputs):
    """compare() per sequence, against the reference of that sequence alone."""
    failures = []
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b, (sq, sk) in enumerate(lengths):
        if sq == 0:
            continue
        rows = slice(starts_q[b], starts_q[b] + sq)
        keys = slice(starts_k[b], starts_k[b] + sk)
        result = compare(spec, q[rows].unsqueeze(0), k[keys].unsqueeze(0), v[keys].unsqueeze(0),
                         out[rows].unsqueeze(0), lse[:, rows].unsqueeze(0), inputs)
        if not result.ok:
            failures.append(f"sequence {b} {result}")
    return failures


lengths_strategy = st.lists(
    st.tuples(st.one_of(st.integers(0, 3), st.integers(1, 300), st.integers(1, 2500)),
              st.one_of(st.integers(0, 3), st.integers(1, 300), st.integers(1, 5000))),
    min_size=1, max_size=7)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), lengths=lengths_strategy, seed=st.integers(0, 2**31 - 1))
def test_varlen_matches_reference_per_sequence(arch, data, lengths, seed):
    from fa_gen.api import attention_varlen

    spec = data.draw(st.sampled_from(SPECS), label="spec")
    heads_kv = data.draw(st.integers(1, 3), label="heads_kv")
    group = data.draw(st.sampled_from((1, 2, 4, 8)), label="group")
    num_splits = data.draw(st.sampled_from((0, 1, 3)), label="num_splits")
    pack = data.draw(st.sampled_from((None, False, True)), label="pack_gqa")
    used = data.draw(st.booleans(), label="seqused_k")
    wide = data.draw(st.booleans(), label="wide_splits")
    from fa_gen.families.sm80 import gqa_packable
    if pack and (group == 1 or not gqa_packable(spec)):
        pack = None
    generator = torch.Generator(device="cuda").manual_seed(seed)
    extra = [data.draw(st.integers(0, 40)) for _ in lengths] if used else ()
    q, k, v, cu_q, cu_k = _packed(spec, lengths, (heads_kv * group, heads_kv), generator, extra)
    seqused = torch.tensor([sk for _, sk in lengths], dtype=torch.int32, device="cuda") if used else None
    inputs = _inputs(spec, generator, q.shape[1])
    max_q, max_k = max(sq for sq, _ in lengths), max(sk for _, sk in lengths) + max(extra, default=0)
    import fa_gen.inference as inference
    try:
        inference.WIDE_SPLITS = wide
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, spec, seqused_k=seqused, inputs=inputs,
                                    num_splits=num_splits, pack_gqa=pack)
    finally:
        inference.WIDE_SPLITS = True
    failures = _check_sequences(spec, q, k, v, out, lse, lengths, cu_q, cu_k, inputs)
    assert not failures, f"{spec.name} splits={num_splits} pack={pack} wide={wide} heads={heads_kv}x{group}: " + \
        "; ".join(failures)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("num_splits", [1, 2, 5, 0])
@pytest.mark.parametrize("name", ["vl_bf16_d128_1", "vl_fp16_d64_3", "softcap", "vl_bf16_d256_causal"])
def test_fixed_length_split(arch, monkeypatch, name, num_splits, pack, wide):
    """forward_split (decode-shaped and short prefill) with splits, GQA packing and the wide
    kinds (where the spec has them: these small grids take them unless WIDE_SPLITS is off) pinned."""
    import fa_gen.inference as inference
    from fa_gen.inference import forward_split

    monkeypatch.setattr(inference, "WIDE_SPLITS", wide)

    spec = next(s for s in SPECS if s.name == name)
    generator = torch.Generator(device="cuda").manual_seed(num_splits * 2 + pack)
    dtype = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
    for batch, sq, sk, heads_kv, group in ((3, 1, 1000, 2, 4), (2, 37, 777, 1, 8), (1, 5, 3, 3, 2)):
        q = torch.randn(batch, sq, heads_kv * group, spec.head_dim_qk, generator=generator, device="cuda").to(dtype)
        k = torch.randn(batch, sk, heads_kv, spec.head_dim_qk, generator=generator, device="cuda").to(dtype)
        v = torch.randn(batch, sk, heads_kv, spec.head_dim_v, generator=generator, device="cuda").to(dtype)
        inputs = _inputs(spec, generator, q.shape[2])
        out, lse = forward_split(spec, q, k, v, num_splits=num_splits or None, inputs=inputs, pack_gqa=pack)
        result = compare(spec, q, k, v, out, lse, inputs)
        assert result.ok, f"{name} b={batch} sq={sq} sk={sk} {heads_kv}x{group}: {result}"


ROWS_SPECS = ("causal_bf16_d128", "softcap", "full_bf16_d128")


@pytest.fixture(scope="module")
def rows_specs(arch):
    """The mask-free twins (fa_gen.inference.rows_spec) of ROWS_SPECS, compiled up front."""
    from fa_gen.inference import rows_spec
    from fa_gen.precompile import precompile

    specs = {name: resolve_spec(name) for name in ROWS_SPECS}
    if any(rows_spec(spec, arch) is None for spec in specs.values()):
        pytest.skip(f"no family on {arch} serves one query with heads as rows")
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    if jobs > 1:
        precompile([(rows_spec(spec, arch), arch) for spec in specs.values()], jobs=jobs, log=lambda *a: None)
    return specs


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("name", ROWS_SPECS)
def test_one_query_with_heads_as_rows(arch, rows_specs, monkeypatch, name, whole):
    """A decode step whose tiles fill the GPU unsplit: with WHOLE_DECODE the fixed-length forward of
    the spec's mask-free twin serves it, the query heads of each KV head as its query rows (views of
    q, out and lse); judged against the reference of the spec itself (causal included: one query sees
    every key). GQA 4 packed, GQA 2 unpacked (the kernel's own GQA), MHA; q a strided view into a
    fused qkv tensor (its storage offset and head stride carried into the view). Keys from 77 (the
    length bound lowered) to 8,200 (the bound as shipped)."""
    import fa_gen.inference as inference

    monkeypatch.setattr(inference, "WHOLE_DECODE", whole)
    # full_bf16_d128 under the shipped bound (its longest shape alone takes the route), the others under 64.
    monkeypatch.setattr(inference, "ROWS_MIN_SEQLEN_K", 8192 if name == "full_bf16_d128" else 64)
    taken, heads_as_rows = [], inference._heads_as_rows
    monkeypatch.setattr(inference, "_heads_as_rows", lambda *args: taken.append(args[0]) or heads_as_rows(*args))
    spec = rows_specs[name]
    dtype = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
    generator = torch.Generator(device="cuda").manual_seed(len(name) + whole)
    shapes = ((96, 301, 8, 4, None), (64, 1000, 4, 2, False), (130, 77, 8, 1, None), (70, 8200, 8, 4, None))
    for batch, sk, heads_kv, group, pack in shapes:
        heads_q = heads_kv * group
        qkv = torch.randn(batch, 1, heads_q + 3, spec.head_dim_qk, generator=generator, device="cuda").to(dtype)
        q = qkv[:, :, 3:]
        k = torch.randn(batch, sk, heads_kv, spec.head_dim_qk, generator=generator, device="cuda").to(dtype)
        v = torch.randn(batch, sk, heads_kv, spec.head_dim_v, generator=generator, device="cuda").to(dtype)
        inputs = _inputs(spec, generator, heads_q)
        out, lse = inference.forward_split(spec, q, k, v, inputs=inputs, pack_gqa=pack)
        result = compare(spec, q, k, v, out, lse, inputs)
        assert result.ok, f"{name} whole={whole} b={batch} sk={sk} {heads_kv}x{group}: {result}"
    routed = sum(sk >= inference.ROWS_MIN_SEQLEN_K for _, sk, *_ in shapes) if whole else 0
    assert len(taken) == routed and all(not s.is_masked for s in taken)


@pytest.mark.parametrize("name", ["vl_bf16_d128_0", "vl_bf16_d128_1", "vl_bf16_d128_3", "vl_fp16_d64_2",
                                  "vl_bf16_d256_causal", "softcap"])
def test_whole_range_kernel_long_among_short(arch, name):
    """The whole-key-range varlen kernel (the sm90 family's on Hopper) on one sequence past 8k
    queries (a causal grid then takes one CTA per tile) among short and empty ones: the rows of
    each sequence stay its own, and the query tiles past a sequence's end store nothing."""
    from fa_gen.api import attention_varlen

    spec = next(s for s in SPECS if s.name == name)
    generator = torch.Generator(device="cuda").manual_seed(11)
    lengths = [(3, 5), (8300, 8300), (0, 9), (1, 1), (130, 7), (257, 1000), (64, 0)]
    q, k, v, cu_q, cu_k = _packed(spec, lengths, (4, 2), generator)
    inputs = _inputs(spec, generator, q.shape[1])
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, 8300, 8300, spec, inputs=inputs, num_splits=1,
                                pack_gqa=False)
    failures = _check_sequences(spec, q, k, v, out, lse, lengths, cu_q, cu_k, inputs)
    assert not failures, f"{name}: " + "; ".join(failures)


@pytest.mark.parametrize("name", ["vl_bf16_d128_0", "vl_bf16_d128_1", "vl_fp16_d64_2", "softcap"])
@pytest.mark.parametrize("persistent", [True, False])
def test_whole_range_kernel_many_sequences(arch, name, persistent):
    """More sequences than a warp's 32 lanes (the sm90 scheduler finds a tile's sequence 32
    at a time), empty ones among them, in both schedules (persistent; one CTA per tile past
    PERSIST_M_BLOCKS query tiles): every sequence's rows are its own."""
    from fa_gen.api import attention_varlen

    spec = next(s for s in SPECS if s.name == name)
    generator = torch.Generator(device="cuda").manual_seed(5 + persistent)
    draw = lambda hi: int(torch.randint(0, hi, (), generator=generator, device="cuda"))  # noqa: E731
    lengths = [(0 if i % 9 == 4 else draw(400), draw(600)) for i in range(75)]
    lengths[40] = (1000, 1000)
    # max_seqlen_q only bounds the sequences: a large one takes the one-CTA-per-tile grid.
    max_q = 1000 if persistent else 13000
    q, k, v, cu_q, cu_k = _packed(spec, lengths, (4, 2), generator)
    inputs = _inputs(spec, generator, q.shape[1])
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, max_q, 1000, spec, inputs=inputs, num_splits=1, pack_gqa=False)
    failures = _check_sequences(spec, q, k, v, out, lse, lengths, cu_q, cu_k, inputs)
    assert not failures, f"{name}: " + "; ".join(failures)


def test_one_kernel_for_every_batch_composition_and_no_host_sync(arch):
    """New lengths neither compile anything nor synchronise with the device."""
    from fa_gen.cache import default_cache
    from fa_gen.api import attention_varlen

    spec = SPECS[1]
    generator = torch.Generator(device="cuda").manual_seed(7)
    calls = []
    for lengths in ([(5, 9), (300, 17)], [(1, 4000)] * 3, [(0, 0), (128, 64), (2, 2)]):
        q, k, v, cu_q, cu_k = _packed(spec, lengths, (8, 2), generator)
        calls.append((q, k, v, cu_q, cu_k, max(a for a, _ in lengths), max(b for _, b in lengths)))
    attention_varlen(*calls[0], spec)  # warm: the kinds this spec needs are loaded
    builds = default_cache().stats.builds
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls[1:]:
            with torch.no_grad():
                attention_varlen(*call, spec, num_splits=1, pack_gqa=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert default_cache().stats.builds == builds


def test_varlen_autograd_matches_reference(arch):
    """Gradients through fa_gen.attention_varlen on a fixed batch (lengths 1, 0, sk < sq)."""
    failures = _check_gradients(SPECS[1], [(1, 1), (77, 300), (0, 5), (513, 129), (64, 64)], (4, 2), seed=3)
    assert not failures, "; ".join(failures)


@settings(max_examples=max(10, int(os.environ.get("FA_GEN_L1_EXAMPLES", "150")) // 4), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), lengths=lengths_strategy, seed=st.integers(0, 2**31 - 1))
def test_varlen_backward_per_sequence(arch, data, lengths, seed):
    spec = data.draw(st.sampled_from(SPECS), label="spec")
    heads = data.draw(st.sampled_from(((1, 1), (4, 2), (8, 2), (3, 3))), label="heads_q, heads_kv")
    deterministic = data.draw(st.booleans(), label="deterministic")
    failures = _check_gradients(spec, lengths, heads, seed, deterministic)
    assert not failures, f"{spec.name} heads={heads} det={deterministic}: " + "; ".join(failures)


def _check_gradients(spec, lengths, heads, seed, deterministic=False):
    """dq, dk, dv of every sequence against float64 autograd of that sequence alone; the tolerance
    is twice a same-precision PyTorch autograd's own error plus one rounding step at the magnitude
    of the sequence's gradients. Deterministic mode: a second run must be bitwise equal."""
    from fa_gen.reference import attention_reference, attention_same_precision
    from fa_gen.api import attention_varlen

    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, cu_q, cu_k = _packed(spec, lengths, heads, generator)
    inputs = _inputs(spec, generator, q.shape[1])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    max_q, max_k = max(a for a, _ in lengths), max(b for _, b in lengths)

    def grads_of(dout=None):
        out, _ = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, spec, inputs=inputs, deterministic=deterministic)
        if dout is None:
            dout = torch.randn(out.shape, generator=generator, device="cuda").to(out.dtype)
        return torch.autograd.grad(out, (q, k, v), dout), dout

    grads, dout = grads_of()
    failures = []
    if deterministic and not all(torch.equal(a, b) for a, b in zip(grads, grads_of(dout)[0])):
        failures.append("deterministic backward differs between two runs")
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b, (sq, sk) in enumerate(lengths):
        rows, keys = slice(starts_q[b], starts_q[b] + sq), slice(starts_k[b], starts_k[b] + sk)
        parts = [t[s].detach().unsqueeze(0) for t, s in ((q, rows), (k, keys), (v, keys))]
        d_out = dout[rows].unsqueeze(0)
        want = _sequence_grads(lambda *x: attention_reference(*x, spec, inputs=inputs)[0],
                               [t.double() for t in parts], d_out.double())
        same = _sequence_grads(lambda *x: attention_same_precision(*x, spec, inputs=inputs), parts, d_out)
        # One rounding step at the magnitude of this sequence's gradients (dq of a single key is 0).
        floor = torch.finfo(q.dtype).eps * max((w.abs().max().item() if w.numel() else 0.0) for w in want)
        for name, got, w, s in zip("qkv", (g[sl] for g, sl in zip(grads, (rows, keys, keys))), want, same):
            tol = 2 * (s.double() - w).abs().max().item() + floor if w.numel() else 0.0
            err = (got.double() - w[0]).abs().max().item() if got.numel() else 0.0
            if not (bool(torch.isfinite(got).all()) and err <= tol):
                failures.append(f"sequence {b} ({sq}, {sk}) d{name}: err {err:.3e} tol {tol:.3e}")
    return failures


def _sequence_grads(fn, leaves, dout):
    """d(fn(*leaves)) / d(leaves) for the upstream `dout`; zeros where the sequence has no rows or keys."""
    leaves = [t.clone().requires_grad_() for t in leaves]
    if not all(t.shape[1] for t in leaves):
        return [torch.zeros_like(t) for t in leaves]
    grads = torch.autograd.grad(fn(*leaves), leaves, dout, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
