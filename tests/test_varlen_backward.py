"""L0 (CPU): the varlen backward (kind `backward_varlen`, fa_gen/varlen_backward.py): the sm80
family's and Hopper's own (templates/sm90/backward.py.j2 with `varlen`).

Compiles them (other shipped specs compile in tests/test_inference.py), checks that the host's
workspace sizing and the templates' per-sequence row offsets agree for random batches (a tile of
one sequence must never reach another's rows; every block of the Hopper pre-pass finds its
sequence), which gradients start zeroed, and the input errors.
The GPU exactness tests are in tests/test_gpu_varlen_backward.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from fa_gen import varlen_backward
from fa_gen.errors import InputError
from fa_gen.families.sm80 import BACKWARD_ROW_ALIGN, backward_tile_config
from fa_gen.render import environment, render
from fa_gen.runtime import resolve_spec
from fa_gen.varlen_backward import backward_varlen

# (spec, why): a causal mask, a left + right window, a score mod with a runtime scalar, d64 (the
# 128-row backward tile), d256 (one Q/dO stage on sm_80), qk 192 / v 128 (unequal head dims).
COMPILED = ["causal_bf16_d128", "causal_fp16_d64", "causal_bf16_qk192_v128"]
RENDERED = COMPILED + ["sliding_window_bf16_d128", "softcap", "alibi", "full_bf16_d256"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name", COMPILED)
def test_backward_varlen_compiles(tmp_path, monkeypatch, arch, name):
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    text = render(resolve_spec(name), arch, "sm80", kind="backward_varlen").text
    compile_to_object(text, arch, tmp_path / "backward_varlen.o", label=f"{name} backward_varlen")


@pytest.mark.parametrize("name", RENDERED)
def test_varlen_render_finds_sequences_and_fixed_render_does_not(name):
    """The varlen kind reads cu_seqlens in all three kernels (pre-pass, main, dQ post-pass) and
    offsets the workspaces per sequence; the fixed kind has none of it."""
    spec = resolve_spec(name)
    varlen = render(spec, "sm_90a", "sm80", kind="backward_varlen").text
    fixed = render(spec, "sm_90a", "sm80", kind="backward").text
    assert varlen.count("offset_q = mCuSeqlensQ[batch]") == 3
    assert varlen.count("ws_offset = ((offset_q + batch * 128) // 128) * 128") == 3
    assert "mSeqUsedK[batch]" in varlen
    assert "mCuSeqlens" not in fixed and "ws_offset" not in fixed


def test_backward_tiles_divide_the_row_alignment():
    """Per-sequence workspace starts are multiples of ROW_ALIGN: every tile_m must divide it."""
    assert varlen_backward.ROW_ALIGN == BACKWARD_ROW_ALIGN
    for name in RENDERED:
        for arch in ("sm_80", "sm_86", "sm_90a"):
            tile_m = backward_tile_config(resolve_spec(name), arch).tile_m
            assert BACKWARD_ROW_ALIGN % tile_m == 0 and tile_m >= varlen_backward.MIN_TILE_M, (name, arch)


def _template_offset(offset_q: int, batch: int) -> int:
    """The workspace row offset of sequence `batch` as the template computes it (its macro's
    statement run as Python on ints)."""
    module = environment().get_template("common/seqlen.j2").module
    scope = {"offset_q": offset_q, "batch": batch}
    exec(module.workspace_offset("start", "offset_q", "batch"), {}, scope)
    return scope["start"]


@pytest.mark.parametrize("seed", range(20))
def test_sequence_workspaces_are_disjoint_and_inside_the_buffers(seed):
    """Every sequence's padded rows (its length rounded up to whole 128-row tiles) lie inside
    the workspace the host allocates and overlap no other sequence's; same for its semaphores."""
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 127, 128, 129, rng.randint(0, 3000)]) for _ in range(rng.randint(1, 9))]
    q = torch.empty(sum(lengths), 3, 64)
    dq_accum, lse_log2, dpsum, semaphore = varlen_backward._workspace(q, len(lengths), 64)
    rows = lse_log2.shape[-1]
    assert dq_accum.shape[-1] == rows * 64 and dpsum.shape[-1] == rows
    taken, start = [], 0
    for b, length in enumerate(lengths):
        first = _template_offset(start, b)
        last = first + -(-length // 128) * 128
        assert first % 128 == 0 and last <= rows, (lengths, b)
        assert last // varlen_backward.MIN_TILE_M <= semaphore.shape[-1]
        assert all(last <= lo or first >= hi for lo, hi in taken if length), (lengths, b)
        taken.append((first, last))
        start += length


def test_workspace_is_one_allocation_with_aligned_parts():
    dq_accum, lse_log2, dpsum, _ = varlen_backward._workspace(torch.empty(300, 4, 128), 5, 128)
    base = dq_accum.data_ptr()
    for part in (lse_log2, dpsum):
        # 512-byte aligned slices of one buffer (the kernels assume at least 16 of dq_accum).
        assert (part.data_ptr() - base) % 512 == 0


def _cpu_call(**changes):
    spec = resolve_spec("causal_bf16_d128")
    q = torch.randn(5, 4, 128).to(torch.bfloat16)
    k = torch.randn(7, 2, 128).to(torch.bfloat16)
    args = dict(spec=spec, dout=q.clone(), q=q, k=k, v=k.clone(), out=q.clone(), lse=torch.randn(4, 5),
                cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32),
                max_seqlen_q=5, max_seqlen_k=7)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,message", [
    ({}, "CUDA"),
    ({"cu_seqlens_q": torch.tensor([0, 5], dtype=torch.int64)}, "int32"),
    ({"cu_seqlens_k": torch.tensor([0, 3, 7], dtype=torch.int32)}, "batch \\+ 1"),
    ({"seqused_k": torch.tensor([1, 2], dtype=torch.int32)}, "one entry per sequence"),
    ({"max_seqlen_k": -1}, "max_seqlen_k"),
    ({"q": torch.randn(5, 3, 128).to(torch.bfloat16)}, "multiple of heads"),
])
def test_input_errors(changes, message):
    with pytest.raises(InputError, match=message):
        backward_varlen(**_cpu_call(**changes))


@pytest.mark.parametrize("name,value,message", [
    ("out", torch.zeros(5, 4, 64, dtype=torch.bfloat16), "out must have shape"),
    ("dout", torch.zeros(5, 4, 128, dtype=torch.float16), "dout has dtype"),
    ("dout", torch.zeros(4, 4, 128, dtype=torch.bfloat16), "dout must have shape"),
    ("lse", torch.zeros(4, 5, dtype=torch.float64), "lse must be contiguous float32"),
    ("lse", torch.zeros(5, 4), "lse must be contiguous float32 of shape \\(4, 5\\)"),
    ("lse", torch.zeros(5, 4).t(), "lse must be contiguous"),
    ("lse", torch.zeros(4, 5, device="meta"), "lse is on meta"),
])
def test_output_errors(name, value, message):
    """out, dout and lse as the forward returned them (the checks after the device check)."""
    args = _cpu_call(**{name: value})
    with pytest.raises(InputError, match=message):
        varlen_backward._check_outputs(args["spec"], args["q"], args["out"], args["dout"], args["lse"])


def test_mask_and_sink_expressions_render_without_tile_lists():
    """The varlen backward takes no per-call query-tile lists: a mask expression applies to every
    query tile it visits; a sink logit needs no code (the forward's LSE holds it)."""
    for name in ("document", "prefix_lm", "sink_logit", "attention_sinks"):
        text = render(resolve_spec(name), "sm_80", "sm80", kind="backward_varlen").text
        assert "mTileList" not in text, name
        fixed = render(resolve_spec(name), "sm_80", "sm80", kind="backward").text
        assert ("mTileList" in fixed) == (resolve_spec(name).mask_expr is not None), name


# ---- Hopper's own varlen backward (templates/sm90/backward.py.j2 with `varlen`) -------------

# The narrow layout (d128), the lean schedule (d64), keys on N (qk 192) and the wide layout (d256).
SM90_COMPILED = ["causal_bf16_d128", "causal_fp16_d64", "causal_bf16_qk192_v128", "full_bf16_d256"]


@pytest.mark.parametrize("name", SM90_COMPILED)
def test_sm90_backward_varlen_compiles(tmp_path, monkeypatch, name):
    from fa_gen.backends.cute_dsl import compile_to_object
    from fa_gen.target import resolve_target

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    target = resolve_target(resolve_spec(name), "sm_90a", "backward_varlen")
    assert target.family.name == "sm90"
    text = render(target.spec, "sm_90a", "sm90", kind="backward_varlen").text
    compile_to_object(text, "sm_90a", tmp_path / "backward_varlen.o", label=f"{name} sm90 backward_varlen")


def test_sm90_varlen_render_guards_every_sequence_end_and_the_fixed_render_does_not():
    """Where a tile reaches past its sequence: K / V and Q / dO rows zeroed in shared memory, the
    last dK / dV / dQ tiles stored row by row, rows outside every sequence zeroed by a fourth
    kernel. The fixed-length render (generated/) has none of it."""
    spec = resolve_spec("causal_bf16_d128")
    varlen = render(spec, "sm_90a", "sm90", kind="backward_varlen").text
    fixed = render(spec, "sm_90a", "sm90", kind="backward").text
    assert varlen.count("clear_rows(ops.tidx, smem.s") == 2 and varlen.count("clear_rows(ops.tidx, ops.smem.s") == 2
    assert varlen.count("store_rows(ops.tidx, smem.s") == 2 and "store_rows(tidx, sdQ, gdQ, query_rows" in varlen
    assert "self.clear_outside(mdQ, mdK, mdV, mCuSeqlensQ, mCuSeqlensK)" in varlen
    assert "if work.live:" in varlen
    for name in ("clear_rows", "store_rows", "clear_outside", "mCuSeqlens"):
        assert name not in fixed, name
    # The fixed causal render's only skipped CTAs: the empty slots of its last L2 group of heads.
    assert [line.strip() for line in fixed.splitlines() if "work.live =" in line] == ["work.live = batch < mQ.shape[3]"]


@pytest.mark.parametrize("kind", ["backward", "backward_varlen", "backward_dropout"])
def test_sm90_backward_kernels_chain_by_programmatic_launch(kind):
    """Every kernel of the Hopper backward's chain is launched as a programmatic dependent and
    waits at its head (griddepcontrol.wait) before it touches global memory: one launch, one
    wait and one trigger per kernel, the wait before the kernel's first global-memory read."""
    text = render(resolve_spec("causal_bf16_d128"), "sm_90a", "sm90", kind=kind).text
    kernels = text.count("@cute.kernel")
    assert kernels == (4 if kind == "backward_varlen" else 3)
    assert text.count(".launch(") == text.count("use_pdl=True") == kernels
    assert text.count("cute.arch.griddepcontrol_wait()") == text.count("griddepcontrol_launch_dependents()") == kernels
    for body in text.split("@cute.kernel")[1:]:
        head = body[:body.index("cute.arch.griddepcontrol_wait()")]
        # Before the wait: the signature, docstring, shared-memory and barrier set-up only.
        assert "mCuSeqlens" not in head.split('):', 1)[1] and "copy(" not in head and "[batch" not in head


class _Cu:
    """cu_seqlens as the template's expressions index it, on host ints."""

    def __init__(self, values):
        self.values, self.shape = values, (len(values),)

    def __getitem__(self, i):
        return self.values[i]


def _slot_owner(cu: list[int], slot: int, unit: int) -> tuple[int, int]:
    """(sequence, its first slot) as common/seqlen.j2's sequence_of_slot computes them, run as
    Python on ints."""
    module = environment().get_template("common/seqlen.j2").module
    scope = {"cu": _Cu(cu), "slot": slot, "Int32": int}
    exec(module.sequence_of_slot("owner", "first", "cu", "slot", str(unit)), {}, scope)
    return scope["owner"], scope["first"]


@pytest.mark.parametrize("seed", range(20))
def test_prepass_blocks_cover_every_sequence_region_once(seed):
    """The varlen pre-pass's CTA r (workspace rows [128 r, 128 r + 128)) finds the sequence whose
    region holds them: every sequence's padded rows are its blocks, and every block of the
    workspace belongs to the sequence whose region starts at or before it."""
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 127, 128, 129, rng.randint(0, 3000)]) for _ in range(rng.randint(1, 9))]
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    rows = varlen_backward._workspace(torch.empty(cu[-1], 1, 64), len(lengths), 64)[1].shape[-1]
    starts = [_template_offset(cu[b], b) for b in range(len(lengths))]
    for block in range(rows // 128):
        owner, first = _slot_owner(cu, block, 128)
        assert first * 128 == starts[owner] <= block * 128, (lengths, block)
        assert owner == len(lengths) - 1 or block * 128 < starts[owner + 1], (lengths, block)
    for b, length in enumerate(lengths):
        for block in range(starts[b] // 128, starts[b] // 128 + -(-length // 128)):
            assert _slot_owner(cu, block, 128)[0] == b, (lengths, b, block)


@pytest.mark.parametrize("family,used,zeroed", [("sm90", False, ""), ("sm90", True, "kv"), ("sm80", False, "qkv"),
                                                ("sm80", True, "qkv")])
def test_gradients_start_zeroed_only_where_the_kernel_writes_no_zeros(family, used, zeroed):
    """The sm90 kernel writes every row of dq, dk and dv (zeros outside every sequence) except dk
    and dv past seqused_k; the sm80 kernel only the rows it attends."""
    q, k, v = torch.randn(6, 2, 8), torch.randn(9, 1, 8), torch.randn(9, 1, 8)
    for name, t in zip("qkv", varlen_backward._gradients(family, q, k, v, used)):
        assert t.shape == {"q": q, "k": k, "v": v}[name].shape
        if name in zeroed:
            assert not t.any(), (family, used, name)
