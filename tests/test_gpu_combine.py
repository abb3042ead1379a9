"""L1: the combine kernel and fa_gen.merge_attention_states against the float64 oracle.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_combine.py
Tolerance: the output dtype's rounding of the merged value (one step at its magnitude) plus
float32 accumulation over the parts; LSEs within a few float32 steps. NaN never passes.
"""

from __future__ import annotations

import math

import pytest
import torch

from fa_gen.combine import combine_splits, merge_attention_states, merge_reference, slices_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]


def _states(parts, rows, heads, head_dim, seed, empty_share=0.2):
    """Fresh random partial outputs and LSEs; some (part, row, head) entries empty (-inf), and
    every entry of the first row empty in all parts."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    outs = torch.randn(parts, rows, heads, head_dim, generator=g, device="cuda")
    lses = 4 * torch.randn(parts, rows, heads, generator=g, device="cuda")
    lses[torch.rand(lses.shape, generator=g, device="cuda") < empty_share] = -math.inf
    lses[:, 0] = -math.inf
    return outs, lses


def _tolerance(ref: torch.Tensor, dtype: torch.dtype, parts: int) -> float:
    magnitude = ref.abs().max().item() if ref.numel() else 0.0
    return magnitude * (torch.finfo(dtype).eps + 4 * parts * torch.finfo(torch.float32).eps)


def _assert_close(out, lse, ref_out, ref_lse, parts):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err = (out.double() - ref_out).abs().max().item()
    assert err <= _tolerance(ref_out, out.dtype, parts), f"out err {err:.3e}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows with no key must (only) have lse -inf"
    assert bool((out[empty] == 0).all()), "rows with no key must be 0"
    finite = ~empty
    if finite.any():
        lse_err = (lse[finite].double() - ref_lse[finite]).abs().max().item()
        assert lse_err <= 8 * torch.finfo(torch.float32).eps * (1 + ref_lse[finite].abs().max().item()), lse_err


@pytest.mark.parametrize("variant", ["auto", "one group per pair", "sliced"])
@pytest.mark.parametrize("parts", [1, 2, 3, 17, 128])
@pytest.mark.parametrize("rows,heads", [(1, 1), (7, 5), (333, 32)])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_combine_splits_matches_reference(parts, rows, heads, head_dim, dtype, variant):
    """The split forward's layouts: fp32 parts (S, rows, heads, d), LSEs (S, heads, rows); both
    kernel variants pinned (a sliced CTA with fewer parts than slices leaves some slices empty)."""
    outs, lses = _states(parts, rows, heads, head_dim, seed=parts * 1000 + rows + head_dim)
    out = torch.full((rows, heads, head_dim), math.nan, dtype=dtype, device="cuda")
    lse = torch.full((heads, rows), math.nan, device="cuda")
    slices = {"auto": None, "one group per pair": 1, "sliced": slices_for(1, 128, head_dim, torch.float32)}[variant]
    combine_splits(outs, lses.permute(0, 2, 1).contiguous(), out, lse, slices=slices)
    ref_out, ref_lse = merge_reference(outs, lses)
    _assert_close(out, lse.t(), ref_out, ref_lse, parts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("parts", [1, 5])
def test_merge_attention_states_matches_reference(dtype, parts):
    outs, lses = _states(parts, 41, 6, 128, seed=parts)
    outs = outs.to(dtype)
    out, lse = merge_attention_states(outs, lses)
    assert out.dtype == dtype and out.shape == (41, 6, 128) and lse.shape == (41, 6)
    ref_out, ref_lse = merge_reference(outs, lses)
    _assert_close(out, lse, ref_out, ref_lse, parts)


def test_merge_of_low_precision_parts_and_extra_row_dims():
    outs, lses = _states(4, 6 * 5, 3, 128, seed=11)
    outs = outs.view(4, 6, 5, 3, 128).to(torch.bfloat16)
    lses = lses.view(4, 6, 5, 3)
    out, lse = merge_attention_states(outs, lses)
    assert out.shape == (6, 5, 3, 128) and out.dtype == torch.bfloat16 and lse.shape == (6, 5, 3)
    ref_out, ref_lse = merge_reference(outs, lses)
    _assert_close(out, lse, ref_out, ref_lse, 4)


def test_deterministic():
    outs, lses = _states(37, 100, 8, 128, seed=5)
    first = merge_attention_states(outs, lses)
    for _ in range(3):
        again = merge_attention_states(outs, lses)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("parts", [2, 9])
def test_merge_reads_strided_parts_in_place(dtype, parts):
    """Parts that are views (every other head of a wider tensor; LSEs with heads outermost) are
    merged without a copy and match the oracle."""
    wide, wide_lses = _states(parts, 19, 14, 64, seed=40 + parts)
    outs = wide.to(dtype)[:, :, ::2]
    lses = wide_lses.permute(0, 2, 1).contiguous().permute(0, 2, 1)[:, :, ::2]
    out, lse = merge_attention_states(outs, lses)
    ref_out, ref_lse = merge_reference(outs, lses)
    _assert_close(out, lse, ref_out, ref_lse, parts)


def test_no_host_sync():
    """The combine launches without synchronising with the device (after its first build)."""
    outs, lses = _states(16, 9, 4, 128, seed=3)
    lse_parts = lses.permute(0, 2, 1).contiguous()
    out = torch.empty(9, 4, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(4, 9, device="cuda")
    combine_splits(outs, lse_parts, out, lse)
    merge_attention_states(outs, lses)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        combine_splits(outs, lse_parts, out, lse)
        merge_attention_states(outs, lses)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("seqlen_q", [1, 37])
@pytest.mark.parametrize("name", ["causal_bf16_d128", "causal_fp16_d64"])
def test_split_forward_matches_reference(name, seqlen_q, num_splits):
    """The combine inside the real split-KV forward: (out, lse) of fa_gen.inference.forward_split
    against the float64 reference attention (fa_gen.check.compare's tolerances)."""
    from fa_gen.check import compare
    from fa_gen.inference import forward_split
    from fa_gen.runtime import resolve_spec

    spec = resolve_spec(name)
    dtype = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(seqlen_q * 100 + num_splits)
    batch, seqlen_k, heads_kv, group = 2, 1003, 2, 3
    q = torch.randn(batch, seqlen_q, heads_kv * group, spec.head_dim_qk, generator=g, device="cuda").to(dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, spec.head_dim_qk, generator=g, device="cuda").to(dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, spec.head_dim_v, generator=g, device="cuda").to(dtype)
    out, lse = forward_split(spec, q, k, v, num_splits=num_splits)
    result = compare(spec, q, k, v, out, lse)
    assert result.ok, f"{name} sq={seqlen_q} splits={num_splits}: {result}"
