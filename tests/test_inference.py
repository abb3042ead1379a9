"""L0 (CPU): the inference kinds (varlen, split-KV, GQA packing) render and compile, and the
host-side choices (split count, packing) follow their rules. The GPU suite is test_gpu_varlen.py."""

from __future__ import annotations

import math

import pytest
import torch

from fa_gen.errors import InputError, UnsupportedError
from fa_gen.families.sm80 import GQA_PACKS, INFERENCE_KINDS, gqa_packable
from fa_gen.inference import (MAX_SPLITS, WAVE_SLACK, forward_split, forward_varlen, gqa_pack, num_splits_for,
                              packed_kind)
from fa_gen.render import render
from fa_gen.runtime import resolve_spec



@pytest.mark.parametrize("tiles,key_tiles", [(64, 512), (8, 2048), (32, 256), (3, 16), (1, 1), (200, 40)])
def test_split_count_fills_the_last_wave(tiles, key_tiles):
    slots = 132 * 2
    splits = num_splits_for(tiles, key_tiles, 132, 2)
    assert 1 <= splits <= max(1, min(MAX_SPLITS, key_tiles // 2))

    def fill(s):
        return tiles * s / (math.ceil(tiles * s / slots) * slots)

    best = max(fill(s) for s in range(1, max(1, min(MAX_SPLITS, key_tiles // 2)) + 1))
    assert fill(splits) >= WAVE_SLACK * best
    assert all(fill(s) < WAVE_SLACK * best for s in range(1, splits))


def test_empty_grids_take_no_split():
    assert num_splits_for(0, 100, 132, 2) == 1


def test_full_grids_take_no_split():
    assert num_splits_for(512, 128, 132, 2) == 1  # 1.94 waves
    assert num_splits_for(240, 4096, 132, 2) == 1  # 0.91 of a wave
    assert num_splits_for(1024, 32, 132, 3) == 1  # 2.6 waves


def test_a_mostly_empty_last_wave_is_split():
    # 512 tiles on 396 slots: 1.29 waves; 3 splits fill 0.97 of four waves.
    assert num_splits_for(512, 128, 132, 3) == 3


def test_a_small_grid_fills_the_ctas_that_saturate_memory():
    # 8 tiles (decode b1, 8 KV heads): one CTA per SM saturates an H100 (16 splits), two an H200 (32).
    assert num_splits_for(8, 2048, 132, 2, saturating=1) == 16
    assert num_splits_for(8, 2048, 132, 2, saturating=2) == 32
    assert num_splits_for(8, 2048, 132, 2, saturating=5) == 32  # never past the resident CTAs
    # A full grid keeps its own rule.
    assert num_splits_for(512, 128, 132, 3, saturating=1) == 3


def test_varlen_splits_saturate_where_keys_stream_whole(monkeypatch):
    import fa_gen.inference as inference

    monkeypatch.setattr(inference, "_num_sms", lambda index: 132)
    monkeypatch.setattr(inference, "_saturating_ctas", lambda index: 1)
    kern = inference.InferenceKernel(resolve_spec("full_bf16_d128"), "sm_90a", "sm80", "forward_varlen_split_pack4",
                                     None, 64, 64, 2)
    device = torch.device("cpu")
    # Decode b1 sk128k, 32 query heads on 8 KV heads, packed by 4: 8 tiles.
    assert inference._varlen_splits(kern, 1, 131072, 32, 1, 4, device) == 16
    # e4m3 tiles carry half the bytes: twice the saturating CTAs (within the resident ones).
    fp8 = inference.InferenceKernel(resolve_spec("fp8_e4m3_d128"), "sm_90a", "sm80", "forward_varlen_split_pack4",
                                    None, 16, 64, 3)
    assert inference._varlen_splits(fp8, 1, 131072, 32, 1, 4, device) == 32
    assert inference._varlen_splits(kern, 1, 131072, 32, 1, 4, device, streams_whole=False) == 32


def test_split_kinds_count_their_registers():
    from fa_gen.families.sm80 import split_tile_config
    d64, d128 = resolve_spec("full_fp16_d64"), resolve_spec("full_bf16_d128")
    smem = 227 * 1024
    narrow = split_tile_config(d64, "sm_90a")  # 32 rows over 2 warps at d <= 64
    assert (narrow.tile_m, narrow.num_warps) == (32, 2)
    assert narrow.blocks_per_sm(64, 64, smem, 168) == 6  # by registers and by shared memory
    assert narrow.blocks_per_sm(64, 64, smem) == 4  # at the 255 cap
    assert split_tile_config(d128, "sm_90a").blocks_per_sm(128, 128, smem, 168) == 2  # by shared memory


def test_fp8_split_tiles_take_32_rows():
    """e4m3 K/V: 32-row tiles on two warps (the 16-bit tiles' idle rows of MMA and conversion
    work bound the step); 16-bit tiles stay 64 rows on four."""
    from fa_gen.families.sm80 import Sm80Family, split_tile_config
    fp8, bf16 = resolve_spec("fp8_e4m3_d128"), resolve_spec("full_bf16_d128")
    assert (split_tile_config(fp8, "sm_90a").tile_m, split_tile_config(fp8, "sm_90a").num_warps) == (32, 2)
    assert split_tile_config(bf16, "sm_90a").tile_m == 64
    context = Sm80Family().kind_context(fp8, "sm_90a", "forward_varlen_split_paged_groups_pack4")
    assert (context["tile"]["tile_m"], context["page_group_rows"]) == (32, 8)


def test_packing_rules():
    causal = resolve_spec("causal_bf16_d128")
    assert gqa_packable(causal) and gqa_packable(resolve_spec("softcap"))
    assert not gqa_packable(resolve_spec("alibi"))  # reads h and q_idx
    assert gqa_pack(causal, "sm_90a", "forward_split", 4, 1, None) == 4
    assert gqa_pack(causal, "sm_90a", "forward_split", 4, 64, None) == 1  # a full tile of one head
    assert gqa_pack(causal, "sm_90a", "forward_split", 4, 1, False) == 1
    assert gqa_pack(causal, "sm_90a", "forward_split", 1, 1, None) == 1
    assert gqa_pack(causal, "sm_90a", "forward_split", 3, 1, None) == 1  # 3 does not divide 64 rows
    with pytest.raises(UnsupportedError, match="pack_gqa"):
        gqa_pack(causal, "sm_90a", "forward_split", 3, 1, True)
    with pytest.raises(UnsupportedError, match="pack_gqa"):
        gqa_pack(resolve_spec("alibi"), "sm_90a", "forward_split", 4, 1, True)
    assert packed_kind("forward_split", 1) == "forward_split"
    assert packed_kind("forward_varlen_split", 8) == "forward_varlen_split_pack8"
    assert all(packed_kind("forward_split", g) in INFERENCE_KINDS for g in GQA_PACKS)


def test_packed_renders_differ_only_where_packing_acts():
    spec = resolve_spec("sliding_window_bf16_d128")
    plain = render(spec, "sm_90a", "sm80", kind="forward_split").text
    packed = render(spec, "sm_90a", "sm80", kind="forward_split_pack4").text
    assert "PACK = 4" in packed and "PACK" not in plain
    assert "pack_heads(" in packed and "// 4" in packed  # rows -> positions in the window mask


def test_input_errors_before_any_device_work():
    spec = resolve_spec("causal_bf16_d128")
    q = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 100, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="dtype"):
        forward_split(spec, q.half(), k, k)
    with pytest.raises(InputError, match="multiple of heads"):
        forward_split(spec, q[:, :, :7], k, k)
    packed_q, packed_k = q[0], k[0]
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(InputError, match="int32"):
        forward_varlen(spec, packed_q, packed_k, packed_k, cu.long(), cu, 1, 100)
    with pytest.raises(InputError, match="batch \\+ 1"):
        forward_varlen(spec, packed_q, packed_k, packed_k, cu, torch.tensor([0, 1, 2], dtype=torch.int32), 1, 100)
    with pytest.raises(InputError, match="max_seqlen_q"):
        forward_varlen(spec, packed_q, packed_k, packed_k, cu, cu, -1, 100)
    with pytest.raises(InputError, match="CUDA"):
        forward_varlen(spec, packed_q, packed_k, packed_k, cu, cu, 1, 100)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name,kind", [("causal_bf16_d128", "forward_varlen_split_pack8"),
                                       ("softcap", "forward_split_pack4"),
                                       ("full_fp16_d64", "forward_split"),
                                       ("sliding_window_bf16_d128", "backward_varlen"),
                                       ("softcap", "backward_varlen"),
                                       ("alibi", "backward_varlen"),
                                       ("full_bf16_d256", "backward_varlen"),
                                       # Expressions without per-call tile lists.
                                       ("chunked_causal", "forward_varlen_split"),
                                       ("sink_logit", "forward_split"),
                                       ("chunked_causal", "backward_varlen"),
                                       # Paged K/V (templates/common/kv_source.j2).
                                       ("causal_bf16_d128", "forward_varlen_split_paged"),
                                       ("softcap", "forward_varlen_split_paged_pack8"),
                                       ("causal_topleft_fp16_d96", "forward_varlen_split_paged"),
                                       # Whole-tile pages (one table entry a key tile).
                                       ("causal_bf16_d128", "forward_varlen_split_paged_tiles_pack4"),
                                       ("causal_topleft_fp16_d96", "forward_varlen_split_paged_tiles"),
                                       # Row groups (one table entry a thread a key tile).
                                       ("causal_bf16_d128", "forward_varlen_split_paged_groups_pack4"),
                                       ("causal_topleft_fp16_d96", "forward_varlen_split_paged_groups"),
                                       # Wide key tiles (64 x 128) for grids a split fills.
                                       ("causal_bf16_d128", "forward_split_wide_pack4"),
                                       ("causal_topleft_fp16_d96", "forward_varlen_split_wide"),
                                       ("softcap", "forward_varlen_split_wide_pack8")])
def test_inference_kinds_compile(tmp_path, monkeypatch, arch, name, kind):
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    text = render(resolve_spec(name), arch, "sm80", kind=kind).text
    compile_to_object(text, arch, tmp_path / f"{kind}.o", label=f"{name} {kind}")


def test_wide_split_kinds_take_128_key_tiles_where_they_fit():
    """16-bit specs of head dims 65-128 have wide split kinds: 64 x 128 tiles, one CTA an SM on
    Hopper; where those do not fit shared memory (sm_86: 99 KB a block) the 64 x 64 tiles."""
    from fa_gen.families.sm80 import Sm80Family

    family = Sm80Family()
    d128 = resolve_spec("causal_bf16_d128")
    kinds = family.call_kinds(d128)
    assert "forward_split_wide_pack4" in kinds and "forward_varlen_split_wide" in kinds
    for name in ("full_fp16_d64", "full_bf16_d256", "fp8_e4m3_d128"):
        assert not [k for k in family.call_kinds(resolve_spec(name)) if "wide" in k], name
    wide = family.kind_context(d128, "sm_90a", "forward_split_wide_pack4")
    assert (wide["tile"]["tile_m"], wide["tile"]["tile_n"], wide["ctas_per_sm"]) == (64, 128, 1)
    assert family.kind_context(d128, "sm_90a", "forward_split_pack4")["tile"]["tile_n"] == 64
    assert family.kind_context(d128, "sm_86", "forward_split_wide_pack4")["tile"]["tile_n"] == 64


def test_split_calls_short_of_a_wave_take_the_wide_kind(monkeypatch):
    """H200-sized GPU (132 SMs, two CTAs saturate): decode b8 sk32k h32/8 (64 packed tiles) splits
    the 64 x 64 grid, so it takes the wide kind at its own count; b64 sk8k (512 tiles) fills the
    GPU unsplit and keeps the 64 x 64 kind; WIDE_SPLITS off keeps every call on it; specs without
    wide kinds (d64) keep theirs."""
    import fa_gen.inference as inference

    def count(seqlen_k, heads_kv, batch):
        return lambda t: inference.num_splits_for(-(-4 // t.tile_m) * heads_kv * batch, -(-seqlen_k // t.tile_n),
                                                  132, t.ctas_per_sm, 2)

    d128, d64 = resolve_spec("causal_bf16_d128"), resolve_spec("full_fp16_d64")
    assert inference._split_kind(d128, "sm_90a", "forward_split", 4, count(32768, 8, 8)) == \
        ("forward_split_wide_pack4", 2)
    assert inference._split_kind(d128, "sm_90a", "forward_varlen_split", 4, count(32768, 8, 8)) == \
        ("forward_varlen_split_wide_pack4", 2)
    assert inference._split_kind(d128, "sm_90a", "forward_split", 4, count(8192, 8, 64)) == ("forward_split_pack4", 1)
    assert inference._split_kind(d64, "sm_90a", "forward_split", 4, count(32768, 8, 8))[0] == "forward_split_pack4"
    monkeypatch.setattr(inference, "WIDE_SPLITS", False)
    assert inference._split_kind(d128, "sm_90a", "forward_split", 4, count(32768, 8, 8)) == ("forward_split_pack4", 4)


def test_rows_spec_keeps_what_one_query_with_heads_as_rows_computes():
    """A one-query call may read each KV head's query heads as query rows of a mask-free twin only
    where that changes nothing: no mask (or a bottom-right causal one, under which the query sees
    every key) and no expression reading h, q_idx or seqlen_q; head dim 128 only (where it was
    measured faster); fp8 and Ampere keep the split kinds."""
    from fa_gen.inference import rows_spec

    twin = rows_spec(resolve_spec("causal_bf16_d128"), "sm_90a")
    assert twin.mask.value == "none" and not twin.is_masked and twin.head_dim_qk == 128
    assert rows_spec(resolve_spec("full_bf16_d128"), "sm_90a") == resolve_spec("full_bf16_d128")
    assert rows_spec(resolve_spec("softcap"), "sm_90a").score_mod_expr is not None
    for name in ("sliding_window_bf16_d128", "alibi", "causal_topleft_fp16_d96", "sink_logit", "document",
                 "fp8_e4m3_d128", "causal_fp16_d64", "full_bf16_d256"):
        assert rows_spec(resolve_spec(name), "sm_90a") is None, name
    assert rows_spec(resolve_spec("causal_bf16_d128"), "sm_80") is None


def test_rows_route_only_for_one_query_unsplit_long_calls(monkeypatch):
    import fa_gen.inference as inference

    spec = resolve_spec("causal_bf16_d128")
    q, k = torch.empty(4, 1, 32, 128, device="meta"), torch.empty(4, 8192, 8, 128, device="meta")
    assert inference._rows_route(spec, "sm_90a", q, k, 1, None) == inference.rows_spec(spec, "sm_90a") is not None
    assert inference._rows_route(spec, "sm_90a", q, k, 2, None) is None  # the grid needs splits
    assert inference._rows_route(spec, "sm_90a", q, k, 1, 1) is None  # num_splits asked for
    assert inference._rows_route(spec, "sm_90a", q.expand(4, 2, 32, 128), k, 1, None) is None  # two queries
    assert inference._rows_route(spec, "sm_90a", q[:0], k[:0], 1, None) is None  # empty batch
    assert inference._rows_route(spec, "sm_90a", q, k[:, :8191], 1, None) is None
    monkeypatch.setattr(inference, "WHOLE_DECODE", False)
    assert inference._rows_route(spec, "sm_90a", q, k, 1, None) is None


def test_idle_warps_skip_the_mmas_in_split_kinds_only(monkeypatch):
    """A split kind of several warps renders the idle-warp check around its MMAs (a decode tile
    fills one warp's rows); one-warp tiles and the training forwards render none (their branch
    cost speed, and spilled the 128-row forward on Blackwell)."""
    import fa_gen.families.sm80 as sm80

    def guarded(name, kind, arch="sm_90a"):
        text = render(resolve_spec(name), arch, "sm80", kind=kind).text
        return text.count("        if ops.computes:\n"), text.count("        if const_expr(True):\n")

    assert guarded("full_bf16_d128", "forward_varlen_split_pack4") == (2, 0)
    assert guarded("fp8_e4m3_d128", "forward_varlen_split_paged_pack8") == (2, 0)  # two warps
    assert guarded("full_bf16_d128", "forward", "sm_80") == (0, 2)
    assert guarded("document", "forward", "sm_80") == (0, 2)
    monkeypatch.setattr(sm80, "split_tile_config", lambda spec, arch, wide=False: sm80.TileConfig(16, 64, 1, 2))
    assert guarded("full_bf16_d128", "forward_varlen_split_pack4") == (0, 2)


@pytest.mark.parametrize("kind", ["forward_varlen_split_pack4", "forward_varlen_split_paged_tiles_pack4",
                                  "forward_varlen_split_paged_groups_pack4", "forward_varlen_split_paged_pack8",
                                  "forward_varlen_split", "forward_varlen_split_paged_groups_pack32"])
def test_fp8_kvcache_kinds_compile(tmp_path, monkeypatch, kind):
    """e4m3 inputs staged and converted to fp16 in shared memory (templates/common/fp8_staging.j2)."""
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    text = render(resolve_spec("fp8_e4m3_d128"), "sm_90a", "sm80", kind=kind).text
    assert "IN_DTYPE = cutlass.Float8E4M3FN" in text and "OUT_DTYPE = cutlass.BFloat16" in text
    assert "read_staged(ops.tKsK8[None, None, None, 2 * stage])" in text
    compile_to_object(text, "sm_90a", tmp_path / f"{kind}.o", label=f"fp8 {kind}")


def test_fp8_specs_take_the_kvcache_kinds_only():
    from fa_gen.families.sm80 import FP8_KINDS
    from fa_gen.target import resolve_target

    spec = resolve_spec("fp8_e4m3_d128")
    assert resolve_target(spec, "sm_90a", "forward").family.name == "sm90"
    assert resolve_target(spec, "sm_90a", "forward_varlen_split_pack4").family.name == "sm80"
    for kind in ("forward", "forward_split_pack4", "backward_varlen", "forward_dropout"):
        with pytest.raises(UnsupportedError):
            resolve_target(spec, "sm_90a", kind, family="sm80")
    assert resolve_target(spec, "sm_90a", "forward_varlen_split_paged_groups_pack4").family.name == "sm80"
    with pytest.raises(UnsupportedError, match="dtype fp8_e4m3"):
        resolve_target(spec, "sm_89", "forward_varlen_split_pack4", family="sm80")
    assert "forward_varlen_split_paged_tiles_pack8" in FP8_KINDS and "forward_split" not in FP8_KINDS


def test_varlen_backward_input_errors():
    from fa_gen.varlen_backward import backward_varlen

    spec = resolve_spec("causal_bf16_d128")
    q = torch.zeros(5, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(7, 2, 128, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    lse = torch.zeros(4, 5)
    with pytest.raises(InputError, match="CUDA"):
        backward_varlen(spec, q, q, k, k, q, lse, cu_q, cu_k, 5, 7)
    with pytest.raises(InputError, match="int32"):
        backward_varlen(spec, q, q, k, k, q, lse, cu_q.float(), cu_k, 5, 7)


def test_kinds_without_tile_lists_mask_every_tile_and_sink_once():
    # Fixed-length kinds take a mask expression's per-call tile lists; varlen and split kinds
    # take none and apply the expression to every tile they visit.
    document = resolve_spec("document")
    assert "mTileList" in render(document, "sm_90a", "sm80", kind="backward").text
    for kind in ("backward_varlen", "forward_varlen", "forward_split", "forward_varlen_split"):
        text = render(document, "sm_90a", "sm80", kind=kind).text
        assert "mTileList" not in text and "mTileOrder" not in text, kind
        assert "q_doc" in text, kind
    assert "m_block_free_hi = m_block_free_lo" in render(document, "sm_90a", "sm80", kind="backward_varlen").text
    # A sink logit enters split 0's partial only; the unsplit varlen kind adds it to every row.
    sink = resolve_spec("sink_logit")
    assert "split == 0 else Float32(NO_SINK)" in render(sink, "sm_90a", "sm80", kind="forward_varlen_split").text
    assert "NO_SINK" not in render(sink, "sm_90a", "sm80", kind="forward_varlen").text
    # An expression reading h or q_idx cannot share a tile's rows among query heads.
    with pytest.raises(UnsupportedError):
        render(sink, "sm_90a", "sm80", kind="forward_split_pack4")
