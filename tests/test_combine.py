"""L0 (CPU): the LSE merge's float64 oracle, its input checks, and the combine kernel compiling
for every head dim and output dtype. The GPU suite is test_gpu_combine.py."""

from __future__ import annotations

import math

import pytest
import torch

from fa_gen.arch_table import programmatic_launch
from fa_gen.combine import HEAD_DIMS, _aligned, merge_attention_states, merge_reference, render_combine, slices_for
from fa_gen.errors import InputError


def _attention(q, k, v):
    """(out, lse) of one query block against keys k (float64): the definition."""
    scores = q @ k.T
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def test_merging_parts_of_the_keys_gives_the_whole():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (5, 40, 40))
    whole, whole_lse = _attention(q, k, v)
    cuts = [0, 3, 4, 25, 40]
    parts = [_attention(q, k[a:b], v[a:b]) for a, b in zip(cuts, cuts[1:])]
    outs = torch.stack([o for o, _ in parts]).unsqueeze(2)   # (S, rows, heads=1, d)
    lses = torch.stack([l for _, l in parts]).unsqueeze(2)
    out, lse = merge_reference(outs, lses)
    torch.testing.assert_close(out[:, 0], whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[:, 0], whole_lse, rtol=1e-12, atol=1e-12)


def test_one_part_is_the_identity_and_empty_parts_count_nothing():
    g = torch.Generator().manual_seed(1)
    outs = torch.randn(1, 7, 3, 64, generator=g)
    lses = torch.randn(1, 7, 3, generator=g)
    out, lse = merge_reference(outs, lses)
    torch.testing.assert_close(out, outs[0].double())
    torch.testing.assert_close(lse, lses[0].double())
    empty_out = torch.randn(1, 7, 3, 64, generator=g)  # whatever an empty part holds is ignored
    out2, lse2 = merge_reference(torch.cat([outs, empty_out]), torch.cat([lses, torch.full_like(lses, -math.inf)]))
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(lse2, lse)


def test_rows_no_part_saw_are_zero_and_minus_infinity():
    outs = torch.randn(3, 2, 4, 64)
    lses = torch.full((3, 2, 4), -math.inf)
    out, lse = merge_reference(outs, lses)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("outs,lses,match", [
    (torch.zeros(2, 3, 4, 64, dtype=torch.int32), torch.zeros(2, 3, 4), "float32, bfloat16 or float16"),
    (torch.zeros(2, 3, 4, 64), torch.zeros(2, 3, 4, dtype=torch.float16), "lses must be float32"),
    (torch.zeros(2, 3, 4, 64), torch.zeros(2, 3, 5), "parts, \\*rows, heads"),
    (torch.zeros(0, 3, 4, 64), torch.zeros(0, 3, 4), "at least one part"),
    (torch.zeros(2, 3, 4, 84), torch.zeros(2, 3, 4), "head_dim must be a multiple of 8"),
    (torch.zeros(2, 3, 4, 64), torch.zeros(2, 3, 4), "CUDA"),
])
def test_input_errors(outs, lses, match):
    with pytest.raises(InputError, match=match):
        merge_attention_states(outs, lses)


def test_parts_are_read_in_place_when_their_rows_are_aligned():
    """merge_attention_states hands the kernel the caller's parts (any dtype, any 16-byte
    aligned strides) and copies only what its 128-bit loads cannot read."""
    for dtype in (torch.float32, torch.bfloat16):
        parts = torch.randn(3, 5, 4, 128).to(dtype)
        assert _aligned(parts) is parts
        strided = torch.randn(3, 5, 8, 128).to(dtype)[:, :, ::2]
        assert _aligned(strided) is strided
    shifted = torch.randn(3 * 5 * 4 * 64 + 1)[1:].view(3, 5, 4, 64)  # rows start 4 bytes off
    copy = _aligned(shifted)
    assert copy is not shifted and copy.data_ptr() % 16 == 0 and torch.equal(copy, shifted)
    odd_stride = torch.randn(3, 5, 4, 66)[..., :64]  # 264-byte rows
    assert _aligned(odd_stride).is_contiguous() and torch.equal(_aligned(odd_stride), odd_stride)


def test_few_pairs_share_their_parts_among_slices():
    """Decode shapes (few pairs, many parts) spread each pair over a 256-thread CTA; many pairs
    or few parts keep one lane group per pair."""
    assert slices_for(32, 64, 128, torch.float32) == 8       # 32 lanes of 4 fp32 columns
    assert slices_for(32, 64, 64, torch.bfloat16) == 32      # 8 lanes of 8 bf16 columns
    assert slices_for(32, 3, 128, torch.float32) == 1
    assert slices_for(8192, 64, 128, torch.float32) == 1
    assert slices_for(1, 128, 512, torch.float32) == 2


def _variants(head_dim):
    """(output dtype, parts dtype, slices) of the split forward's combine (fp32 parts) and of
    merge_attention_states (parts in the output dtype), one lane group per pair and sliced."""
    sliced = slices_for(1, 128, head_dim, torch.float32)
    return [(torch.bfloat16, torch.float32, 1), (torch.float16, torch.float32, 1), (torch.float32, torch.float32, 1),
            (torch.bfloat16, torch.float32, sliced), (torch.bfloat16, torch.bfloat16, 1),
            (torch.float16, torch.float16, slices_for(1, 128, head_dim, torch.float16))]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("head_dim", [8, 72, 96, 128, 200, 256, 512])
def test_combine_compiles(tmp_path, monkeypatch, arch, head_dim):
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    for i, (dtype, in_dtype, slices) in enumerate(_variants(head_dim)):
        object_path = tmp_path / f"c{head_dim}_{i}.o"
        source = render_combine(head_dim, dtype, in_dtype, slices, pdl=programmatic_launch(arch))
        assert ("griddepcontrol_wait" in source) == (arch == "sm_90a")
        compile_to_object(source, arch, object_path, label="combine")
        assert object_path.stat().st_size > 0


def test_programmatic_launch_from_sm90_on():
    """The combine launches as a programmatic dependent of the split forward where the arch has
    griddepcontrol (compute capability 9.0 on), and only there."""
    from fa_gen.arch_table import ARCHS

    assert [a for a in ("sm_75", "sm_80", "sm_86", "sm_89") if programmatic_launch(a)] == []
    assert all(programmatic_launch(a) for a in ARCHS if ARCHS[a].compute_capability >= (9, 0))
    assert not programmatic_launch("sm_91x")
    for arch in ("sm_80", "sm_90a"):
        source = render_combine(128, torch.bfloat16, pdl=programmatic_launch(arch))
        assert ("use_pdl=True" in source) == (arch == "sm_90a") == ("griddepcontrol_wait()" in source)
