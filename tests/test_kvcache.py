"""L0 (CPU): the KV-cache call's argument checks, its in-place append (torch index ops, run here
on CPU tensors), and the paged kinds' render and compile. The GPU suite is test_gpu_kvcache.py."""

from __future__ import annotations

import pytest
import torch

import fa_gen
from fa_gen.api.kvcache import append_to_cache
from fa_gen.errors import InputError
from fa_gen.families.sm80 import GQA_PACKS, INFERENCE_KINDS
from fa_gen.inference import forward_paged, forward_varlen, packed_kind
from fa_gen.reference import rotary_reference
from fa_gen.render import render
from fa_gen.runtime import resolve_spec

SPEC = "causal_bf16_d128"
BF16 = torch.bfloat16


def _call(q=None, k_cache=None, v_cache=None, cache_seqlens=0, **options):
    q = torch.zeros(2, 1, 8, 128, dtype=BF16) if q is None else q
    k_cache = torch.zeros(2, 64, 2, 128, dtype=BF16) if k_cache is None else k_cache
    v_cache = torch.zeros_like(k_cache) if v_cache is None else v_cache
    return fa_gen.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, SPEC, **options)


@pytest.mark.parametrize("options,message", [
    ({"q": torch.zeros(2, 1, 8, 128, dtype=torch.float16)}, "dtype"),
    ({"q": torch.zeros(2, 8, 128, dtype=BF16)}, "4-D"),
    ({"q": torch.zeros(2, 1, 8, 64, dtype=BF16)}, "head dims"),
    ({"q": torch.zeros(2, 1, 7, 128, dtype=BF16)}, "multiple"),
    ({"v_cache": torch.zeros(2, 32, 2, 128, dtype=BF16)}, "must agree"),
    ({"k_new": torch.zeros(2, 1, 2, 128, dtype=BF16)}, "go together"),
    ({"k_new": torch.zeros(3, 1, 2, 128, dtype=BF16), "v_new": torch.zeros(3, 1, 2, 128, dtype=BF16)}, "batch=2"),
    ({"k_new": torch.zeros(2, 1, 1, 128, dtype=BF16), "v_new": torch.zeros(2, 1, 1, 128, dtype=BF16)}, "heads"),
    ({"page_table": torch.zeros(2, 4, dtype=torch.int64)}, "int32"),
    ({"page_table": torch.zeros(3, 4, dtype=torch.int32)}, "one row per sequence"),
    ({"page_table": torch.zeros(2, 4, dtype=torch.int32), "cache_batch_idx": torch.zeros(2, dtype=torch.int32)},
     "contiguous caches"),
    ({"cache_batch_idx": torch.zeros(3, dtype=torch.int32)}, "cache_batch_idx"),
    ({"k_cache": torch.zeros(64, 2, 2, 128, dtype=BF16).transpose(0, 1)}, "contiguous with each other"),
    ({"cache_seqlens": torch.zeros(2, dtype=torch.int64)}, "int32"),
    ({"cache_seqlens": torch.zeros(3, dtype=torch.int32)}, "shape \\(2,\\)"),
    ({"cache_seqlens": -1}, ">= 0"),
    ({}, "CUDA"),
])
def test_argument_errors(options, message):
    with pytest.raises(InputError, match=message):
        _call(**options)


def test_paged_forward_checks():
    spec = resolve_spec(SPEC)
    q = torch.zeros(3, 8, 128, dtype=BF16)
    cache = torch.zeros(10, 16, 2, 128, dtype=BF16)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    used = torch.ones(3, dtype=torch.int32)
    table = torch.zeros(3, 4, dtype=torch.int32)
    with pytest.raises(InputError, match="4-D"):
        forward_paged(spec, q, cache[0], cache[0], table, cu, used, 1)
    with pytest.raises(InputError, match="page_table"):
        forward_paged(spec, q, cache, cache, table.t(), cu, used, 1)
    with pytest.raises(InputError, match="one entry per sequence"):
        forward_paged(spec, q, cache, cache, table[:2], cu, used, 1)
    with pytest.raises(InputError, match="max_seqlen_q"):
        forward_paged(spec, q, cache, cache, table, cu, used, -1)
    # A page stride past 32 bits (a meta tensor: no memory behind it).
    huge = torch.empty_strided(cache.shape, (2**31, *cache.stride()[1:]), dtype=BF16, device="meta")
    with pytest.raises(InputError, match="below 2\\*\\*31"):
        forward_paged(spec, q, huge, cache, table, cu, used, 1)
    with pytest.raises(InputError, match="CUDA"):
        forward_paged(spec, q, cache, cache, table, cu, used, 1)


def test_paged_append_writes_through_the_page_table():
    page_size, heads, dim = 3, 2, 8
    k_cache = torch.full((6, page_size, heads, dim), float("nan"))
    v_cache = k_cache.clone()
    # Sequence 0 on pages 4, 1, 5; sequence 1 on pages 0, 3 (page 2 unused).
    table = torch.tensor([[4, 1, 5], [0, 3, 2]], dtype=torch.int32)
    lengths = torch.tensor([2, 0], dtype=torch.int32)
    k_new = torch.randn(2, 4, heads, dim)
    v_new = torch.randn(2, 4, heads, dim)
    append_to_cache(k_cache, v_cache, k_new, v_new, lengths, page_table=table)
    for b, length in enumerate(lengths.tolist()):
        for j in range(4):
            position = length + j
            page, slot = int(table[b, position // page_size]), position % page_size
            assert torch.equal(k_cache[page, slot], k_new[b, j]) and torch.equal(v_cache[page, slot], v_new[b, j])
    # Exactly 8 rows written, the rest untouched (still NaN).
    written = ~torch.isnan(k_cache[..., 0, 0])
    assert int(written.sum()) == 8 and bool(torch.isnan(k_cache[2]).all())


def test_contiguous_append_follows_cache_batch_idx():
    k_cache = torch.zeros(4, 10, 1, 8)
    v_cache = torch.zeros(4, 10, 1, 8)
    k_new, v_new = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
    append_to_cache(k_cache, v_cache, k_new, v_new, torch.tensor([0, 7], dtype=torch.int32),
                    cache_batch_idx=torch.tensor([3, 1]))
    assert torch.equal(k_cache[3, 0:3], k_new[0]) and torch.equal(k_cache[1, 7:10], k_new[1])
    assert torch.equal(v_cache[3, 0:3], v_new[0]) and torch.equal(v_cache[1, 7:10], v_new[1])
    assert int((k_cache != 0).any(-1).sum()) == 6


def test_paged_kinds_are_registered():
    assert INFERENCE_KINDS["forward_varlen_split_paged"].paged
    assert all(INFERENCE_KINDS[packed_kind("forward_varlen_split_paged", g)].paged for g in GQA_PACKS)
    assert not any(call.paged for kind, call in INFERENCE_KINDS.items() if "paged" not in kind)


def test_page_lookup_follows_the_page_size():
    """Page sizes that are multiples of the key tile get the whole-tile kind (one table entry a
    tile, rows copied as contiguous ones), multiples of a thread's copy rows the row-group kind
    (one entry a thread), any other size a page per copy row. Picked from the shape."""
    from fa_gen.inference import paged_kind

    lookups = (("forward_varlen_split_paged", "row"), ("forward_varlen_split_paged_tiles", "tile"),
               ("forward_varlen_split_paged_groups", "group"))
    for g in (1, *GQA_PACKS):
        for base, lookup in lookups:
            call = INFERENCE_KINDS[packed_kind(base, g)]
            assert call.paged and call.page_lookup == lookup and call.pack == g
    spec = resolve_spec(SPEC)
    texts = {lookup: render(spec, "sm_90a", "sm80", kind=f"forward_varlen_split_paged{lookup}_pack4").text
             for lookup in ("", "_tiles", "_groups")}
    assert "def tile(self)" in texts["_tiles"] and "def row(self" not in texts["_tiles"]
    assert "def row(self" in texts[""] and "def tile(self)" not in texts[""]
    assert "grouped_rows(rows)" in texts["_groups"] and "def row(self" not in texts["_groups"]
    assert "grouped_rows" not in texts["_tiles"] + texts[""]
    tile_n = 64  # fa_gen.families.sm80.split_tile_config at d128: 4 warps, 8 threads a 64-column row
    group_rows = 4
    for page_size in (tile_n, 2 * tile_n, 4 * tile_n):
        assert paged_kind(spec, "sm_90a", page_size, 4) == "forward_varlen_split_paged_tiles_pack4"
        assert paged_kind(spec, "sm_90a", page_size, 1) == "forward_varlen_split_paged_tiles"
    for page_size in (group_rows, 16, 32, 48, tile_n + 16, 3 * tile_n // 2, 100):
        assert paged_kind(spec, "sm_90a", page_size, 4) == "forward_varlen_split_paged_groups_pack4"
    for page_size in (1, 2, 3, 6, 18, tile_n + 2):
        assert paged_kind(spec, "sm_90a", page_size, 4) == "forward_varlen_split_paged_pack4"


def test_whole_range_paged_kind_follows_the_page_size():
    """On Hopper, a page size whose gcd with the key tile (128 at d128) is whole 8-row swizzle
    atoms takes the sm90 whole-range paged kind, its TMA boxes that gcd's rows; other sizes, fp8
    specs, specs without a varlen forward there and other archs have none (the split kinds)."""
    from fa_gen.inference import whole_paged_kind

    spec = resolve_spec(SPEC)
    for page_size, box in ((8, 8), (16, 16), (24, 8), (48, 16), (64, 64), (128, 128), (256, 128), (1024, 128)):
        kind, tiles = whole_paged_kind(spec, "sm_90a", page_size)
        assert kind == f"forward_varlen_paged_b{box}" and tiles.tile_n == 128
    for page_size in (1, 2, 4, 12, 100):
        assert whole_paged_kind(spec, "sm_90a", page_size) is None
    assert whole_paged_kind(spec, "sm_80", 64) is None
    assert whole_paged_kind(resolve_spec("fp8_e4m3_d128"), "sm_90a", 64) is None
    assert whole_paged_kind(resolve_spec("chunked_causal"), "sm_90a", 64) is None  # a mask expression
    # d256: key tiles of 80 rows, boxes of 16 for pages of 16 / 64 / 256.
    assert whole_paged_kind(resolve_spec("full_bf16_d256"), "sm_90a", 64)[0] == "forward_varlen_paged_b16"


def test_whole_range_paged_render_loads_boxes_from_pages():
    text = render(resolve_spec(SPEC), "sm_90a", "sm90", kind="forward_varlen_paged_b16").text
    assert "PAGE_BOX = 16" in text and "mPageTable: cute.Tensor" in text and "page_row[page_index]" in text
    plain = render(resolve_spec(SPEC), "sm_90a", "sm90", kind="forward_varlen").text
    assert "PAGE_BOX" not in plain and "mPageTable" not in plain


@pytest.mark.parametrize("name, kind", [(SPEC, "forward_varlen_paged_b16"), (SPEC, "forward_varlen_paged_b128"),
                                        ("softcap", "forward_varlen_paged_b8"),
                                        ("full_bf16_d256", "forward_varlen_paged_b40")])
def test_whole_range_paged_kinds_compile(tmp_path, monkeypatch, name, kind):
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    text = render(resolve_spec(name), "sm_90a", "sm90", kind=kind).text
    compile_to_object(text, "sm_90a", tmp_path / f"{kind}.o", label=f"{name} {kind}")


def test_seqused_kind_reads_each_sequences_key_count():
    """forward_seqused: the fixed-length forward with seqused_k (a contiguous cache's used slots);
    its tail tile's V rows are zeroed; the plain forward renders neither."""
    text = render(resolve_spec("full_bf16_d128"), "sm_90a", "sm90", kind="forward_seqused").text
    assert "mSeqUsedK: cute.Tensor" in text and "seqlen_k = mSeqUsedK[batch]" in text
    assert "seqlen_k[batch]" in text and "def zero_tail_values" in text
    plain = render(resolve_spec("full_bf16_d128"), "sm_90a", "sm90", kind="forward").text
    assert "mSeqUsedK" not in plain and "zero_tail_values" not in plain


@pytest.mark.parametrize("name", ["full_bf16_d128", "softcap"])
def test_seqused_kind_compiles(tmp_path, monkeypatch, name):
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    text = render(resolve_spec(name), "sm_90a", "sm90", kind="forward_seqused").text
    compile_to_object(text, "sm_90a", tmp_path / "forward_seqused.o", label=f"{name} forward_seqused")


def test_cache_rows_route_conditions(monkeypatch):
    """A contiguous cache's one-query step that fills the GPU (H200-sized: 132 SMs, two saturating
    CTAs) at d128 with >= 8k slots takes the rows route; short caches, small batches (the grid
    needs splits), more queries, a cache of more rows than sequences, d64 and WHOLE_DECODE off
    keep to forward_varlen."""
    import fa_gen.inference as inference

    monkeypatch.setattr(inference, "_num_sms", lambda index: 132)
    monkeypatch.setattr(inference, "_saturating_ctas", lambda index: 2)
    spec = resolve_spec("causal_bf16_d128")
    q, cache = torch.empty(64, 1, 32, 128, device="meta"), torch.empty(64, 8192, 8, 128, device="meta")
    rows, group = inference.cache_rows_route(spec, "sm_90a", q, cache, None)
    assert group == 4 and not rows.is_masked and rows.head_dim_qk == 128
    assert inference.cache_rows_route(spec, "sm_90a", q, cache[:, :4096], None) is None
    assert inference.cache_rows_route(spec, "sm_90a", q[:8], cache[:8], None) is None
    assert inference.cache_rows_route(spec, "sm_90a", q.expand(64, 2, 32, 128), cache, None) is None
    more_rows = torch.empty(65, 8192, 8, 128, device="meta")
    assert inference.cache_rows_route(spec, "sm_90a", q, more_rows, None) is None
    d64 = resolve_spec("causal_fp16_d64")
    assert inference.cache_rows_route(d64, "sm_90a", q[..., :64], cache[..., :64], None) is None
    monkeypatch.setattr(inference, "WHOLE_DECODE", False)
    assert inference.cache_rows_route(spec, "sm_90a", q, cache, None) is None


def test_cache_rows_checks_strides_before_any_kernel(monkeypatch):
    """forward_cache_rows (reached after the API's shape, dtype and device checks) refuses a cache
    whose last dimension is not contiguous, or a broadcast q, before it builds anything."""
    import fa_gen.inference as inference

    monkeypatch.setattr(inference, "inference_kernel", lambda *args: pytest.fail("built a kernel"))
    spec = resolve_spec("full_bf16_d128")
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    cache = torch.randn(2, 64, 2, 128, dtype=torch.bfloat16)
    strided = torch.randn(2, 64, 2, 256, dtype=torch.bfloat16)[..., ::2]
    lengths = torch.tensor([3, 64], dtype=torch.int32)
    with pytest.raises(InputError, match="k_cache must have a contiguous last dimension"):
        inference.forward_cache_rows(spec, "sm_90a", 4, q, strided, cache, lengths)
    with pytest.raises(InputError, match="q is a broadcast view"):
        inference.forward_cache_rows(spec, "sm_90a", 4, q[:1].expand(2, 1, 8, 128), cache, cache, lengths)


def test_paged_render_reads_pages():
    text = render(resolve_spec(SPEC), "sm_90a", "sm80", kind="forward_varlen_split_paged_pack4").text
    assert "class PagedKV" in text and "mPageTable: cute.Tensor" in text
    plain = render(resolve_spec(SPEC), "sm_90a", "sm80", kind="forward_varlen_split_pack4").text
    assert "PagedKV" not in plain and "mPageTable" not in plain


# The paged kinds compile for sm_80 and sm_90a: tests/test_inference.py::test_inference_kinds_compile.


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("rows", ["pages", "index", "batch"])
def test_append_kernel_compiles(tmp_path, monkeypatch, arch, rows):
    from fa_gen.append import render_append
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    for dtype, dk, dv in ((torch.bfloat16, 128, 128), (torch.float16, 192, 128)):
        source = render_append(dtype, dk, dv, rows)
        object_path = tmp_path / f"append_{dk}_{dv}.o"
        compile_to_object(source, arch, object_path, label="append_kv")
        assert object_path.stat().st_size > 0


def test_append_takes_the_torch_path_where_the_kernel_cannot_go():
    from fa_gen.append import _kernel_ready

    cache = torch.randn(2, 8, 2, 64, dtype=torch.bfloat16)
    assert not _kernel_ready(cache)  # on the CPU
    assert not _kernel_ready(torch.randn(2, 8, 2, 64))  # fp32


def test_uniform_offsets_are_made_once_per_shape(monkeypatch):
    """The cu_seqlens of a decode step's uniform lengths are built once per (batch, length, device)
    and kept (no kernel per call); the cache stays bounded; under capture they are made afresh."""
    from fa_gen.api import kvcache

    monkeypatch.setattr(kvcache, "_OFFSETS", {})
    first = kvcache.uniform_offsets(3, 5, torch.device("cpu"))
    assert first.dtype == torch.int32 and first.tolist() == [0, 5, 10, 15]
    assert kvcache.uniform_offsets(3, 5, torch.device("cpu")) is first
    assert kvcache.uniform_offsets(3, 0, torch.device("cpu")).tolist() == [0, 0, 0, 0]
    assert kvcache.uniform_offsets(2, 5, torch.device("cpu")).tolist() == [0, 5, 10]
    for n in range(kvcache._OFFSETS_KEPT + 5):
        kvcache.uniform_offsets(1, n, torch.device("cpu"))
    assert len(kvcache._OFFSETS) == kvcache._OFFSETS_KEPT
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fresh = kvcache.uniform_offsets(1, 1000, torch.device("cpu"))
    assert fresh.tolist() == [0, 1000] and (1, 1000, "cpu") not in kvcache._OFFSETS


# --- rotary embedding fused into the append ------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 64])
def test_rotate_matches_complex_rotation(interleaved, rotary_dim):
    from fa_gen.append import rotate

    generator = torch.Generator().manual_seed(rotary_dim + interleaved)
    x = torch.randn(3, 5, 2, 64, generator=generator)
    angles = torch.rand(40, rotary_dim // 2, generator=generator) * 6.3
    cos, sin = torch.cos(angles), torch.sin(angles)
    positions = torch.randint(0, 40, (3, 5), generator=generator)
    got = rotate(x, cos, sin, positions, interleaved)
    want = rotary_reference(x, cos, sin, positions, interleaved)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
    # The other pairing rotates different columns: the test can tell them apart.
    other = rotary_reference(x, cos, sin, positions, not interleaved)
    assert not torch.allclose(got.double(), other, atol=1e-3)


@pytest.mark.parametrize("own_positions", [True, False])
def test_append_with_rotary_rotates_keys_and_returns_rotated_queries(own_positions):
    from fa_gen.append import Rotary

    generator = torch.Generator().manual_seed(7)
    heads, dim = 2, 32
    k_cache = torch.full((2, 12, heads, dim), float("nan"))
    v_cache = k_cache.clone()
    lengths = torch.tensor([3, 6], dtype=torch.int32)
    k_new, v_new = torch.randn(2, 2, heads, dim, generator=generator), torch.randn(2, 2, heads, dim, generator=generator)
    q = torch.randn(2, 2, 4, dim, generator=generator)
    angles = torch.rand(12, 8, generator=generator) * 6.3
    cos, sin = torch.cos(angles), torch.sin(angles)
    q_out = append_to_cache(k_cache, v_cache, k_new, v_new, lengths,
                            rotary=Rotary(cos, sin, False, q, own_positions))
    key_positions = lengths.long()[:, None] + torch.arange(2)
    keys = rotary_reference(k_new, cos, sin, key_positions, False)
    query_positions = key_positions if own_positions else lengths.long()[:, None].expand(2, 2)
    queries = rotary_reference(q, cos, sin, query_positions, False)
    for b, n in enumerate(lengths.tolist()):
        assert torch.allclose(k_cache[b, n:n + 2].double(), keys[b], atol=1e-5)
        assert torch.equal(v_cache[b, n:n + 2], v_new[b])
    assert torch.allclose(q_out.double(), queries, atol=1e-5)
    assert int((~torch.isnan(k_cache[..., 0, 0])).sum()) == 4


def test_rotary_and_leftpad_arguments_are_checked():
    q = torch.zeros(2, 1, 8, 128, dtype=BF16)
    new = torch.zeros(2, 1, 2, 128, dtype=BF16)
    table = torch.zeros(40, 32, dtype=BF16)
    with pytest.raises(InputError, match="need k_new"):
        _call(rotary_cos=table, rotary_sin=table)
    with pytest.raises(InputError, match="go together"):
        _call(k_new=new, v_new=new, rotary_cos=table)
    with pytest.raises(InputError, match="multiple of 16"):
        _call(k_new=new, v_new=new, rotary_cos=table[:, :4], rotary_sin=table[:, :4])
    with pytest.raises(InputError, match="multiple of 16"):
        wide = torch.zeros(40, 72, dtype=BF16)
        _call(k_new=new, v_new=new, rotary_cos=wide, rotary_sin=wide)
    with pytest.raises(InputError, match="one shape"):
        _call(k_new=new, v_new=new, rotary_cos=table, rotary_sin=table[:20])
    with pytest.raises(InputError, match="must be q's"):
        _call(k_new=new, v_new=new, rotary_cos=table.float(), rotary_sin=table.float())
    with pytest.raises(InputError, match="cache_leftpad must be"):
        _call(q=q, cache_leftpad=torch.zeros(2, dtype=torch.int64))
    from fa_gen.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="cache_leftpad with page_table"):
        _call(k_cache=torch.zeros(4, 16, 2, 128, dtype=BF16), page_table=torch.zeros(2, 2, dtype=torch.int32),
              cache_leftpad=torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("style", ["interleaved", "halves"])
def test_rotary_append_kernel_compiles(tmp_path, monkeypatch, arch, style):
    from fa_gen.append import render_append
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    for dtype, dk, dv, rows, rotary_dim in ((torch.bfloat16, 128, 128, "pages", 128),
                                            (torch.float16, 64, 64, "index", 32)):
        source = render_append(dtype, dk, dv, rows, style, rotary_dim)
        assert f"ROTARY = \"{style}\"" in source and f"ROTARY_DIM = {rotary_dim}" in source
        object_path = tmp_path / f"append_{style}_{dk}.o"
        compile_to_object(source, arch, object_path, label="append_kv")
        assert object_path.stat().st_size > 0
    assert "def rotate_lane" not in render_append(torch.bfloat16, 128, 128, "batch")


def test_the_kvcache_path_checks_strides_only_once_its_own_checks_ran(monkeypatch):
    """attention_with_kvcache checks dtypes, shapes and devices itself and builds the sequence
    vectors, so forward_varlen(checked=True) checks only what the kernels need of the strides:
    a broadcast key view still fails there, and _check_varlen is not called."""
    from fa_gen import inference

    def refuse(*args):
        raise AssertionError("_check_varlen ran")

    monkeypatch.setattr(inference, "_check_varlen", refuse)
    q = torch.zeros(3, 8, 128, dtype=BF16)
    k = torch.zeros(1, 2, 128, dtype=BF16).expand(40, 2, 128)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(InputError, match="broadcast view"):
        forward_varlen(resolve_spec(SPEC), q, k, k, cu, cu, 1, 40, cu[1:], checked=True, arch="sm_90a")
    with pytest.raises(AssertionError, match="_check_varlen ran"):
        forward_varlen(resolve_spec(SPEC), q, k, k, cu, cu, 1, 40, cu[1:], arch="sm_90a")


def test_fp8_refuses_rotary_before_the_append():
    """The append rotates 16-bit keys only: an fp8 call with rotary tables leaves the cache as it was."""
    from fa_gen.errors import UnsupportedError

    fp8 = torch.float8_e4m3fn
    q, cache = torch.zeros(2, 1, 8, 128).to(fp8), torch.zeros(2, 64, 2, 128).to(fp8)
    new = torch.ones(2, 1, 2, 128).to(fp8)
    table = torch.ones(64, 16)
    with pytest.raises(UnsupportedError, match="rotary tables with fp8 spec 'fp8_e4m3_d128'"):
        fa_gen.attention_with_kvcache(q, cache, cache, 3, "fp8_e4m3_d128", k_new=new, v_new=new,
                                      rotary_cos=table, rotary_sin=table)
    assert not cache.float().any()


def test_descales_need_an_fp8_spec():
    q, cache = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16), torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="go with an fp8 spec"):
        fa_gen.attention_with_kvcache(q, cache, cache, 3, "full_bf16_d128", k_descale=0.5)


def test_fp8_appends_move_bytes():
    """The append's PyTorch path writes e4m3 values (as bytes) at each sequence's position."""
    from fa_gen.append import _append_torch

    fp8 = torch.float8_e4m3fn
    cache = torch.zeros(2, 8, 2, 16).to(fp8)
    new = (torch.arange(2 * 3 * 2 * 16, dtype=torch.float32).view(2, 3, 2, 16) / 64 - 1).to(fp8)
    _append_torch(cache, cache, new, new, torch.tensor([1, 4], dtype=torch.int32), None, None)
    assert torch.equal(cache[0, 1:4].view(torch.uint8), new[0].view(torch.uint8))
    assert torch.equal(cache[1, 4:7].view(torch.uint8), new[1].view(torch.uint8))
    assert not cache[0, 4:].float().any() and not cache[1, :4].float().any()
