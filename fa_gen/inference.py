"""Inference-shaped forward calls: variable-length (packed) batches and split-KV.

    out, lse = forward_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out, lse = forward_split(spec, q, k, v)          # fixed lengths, keys split across CTAs
    out, lse = forward_paged(spec, q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q)

Varlen: q (total_q, heads_q, d), k/v (total_k, heads_kv, d), sequence b is rows
[cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and the same of k/v with cu_seqlens_k, of which
the first seqused_k[b] keys are used when seqused_k is given; out (total_q, heads_q, d_v), lse
(heads_q, total_q). Batch composition is a runtime value: one compiled kernel serves every set
of lengths, and nothing here reads a device tensor on the host (no sync on the call path);
`max_seqlen_q` (a host int, as FlashAttention takes it) sizes the grid.

Split-KV: when the query tiles cannot fill the GPU (decode: one query row against a long KV),
each tile's key range is divided among `num_splits` CTAs writing fp32 partial outputs and LSEs
(templates/common/splitkv.j2), merged by LSE in the combine kernel (fa_gen.combine). The merge
reads the splits in a fixed order: deterministic by construction.

Paged: the keys of packed query sequences live in caches (num_pages, page_size, heads_kv, d)
through a page table (batch, max_pages) int32 (templates/common/kv_source.j2); the page size is
a runtime value to the split kinds (one split writes the final output itself). Where the tiles
fill the GPU, a family with a whole-range paged kind takes the call instead (the sm90 family's:
key tiles in TMA boxes inside pages, the box height a compile-time value from the page size).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from .combine import combine_splits
from .errors import InputError, UnsupportedError
from . import fp8
from .plan import bind_arguments
from .runtime import _check_strides, _TORCH_DTYPES, build, current_arch, load_target
from .families.sm80 import GQA_PACKS
from .families.sm90 import SEQUSED_KIND
from .spec import Alignment, MaskKind, Spec
from .variant.tree import names_used
from .target import resolve_target

# Most splits one call uses (each writes rows * heads * d_v fp32 partials).
MAX_SPLITS = 128
# Tiles that fill this share of the GPU's CTA slots take no split (FlashAttention-2's rule).
FULL_GRID = 0.8
# A split count whose last wave is filled within this factor of the best count's is good enough.
# H200, decode b1 sk128k h32/8 (8 tiles, 264 slots): 29 splits (0.88 full) 151 us, 32 (0.97)
# 144 us, 33 (1.0) 143 us (bench/results/logs/2026-11-25-decode-splits-7d9101e.log).
WAVE_SLACK = 0.95
# Query rows of a split tile (fa_gen.families.sm80.split_tile_config): below it, pack GQA heads.
SPLIT_TILE_M = 64


@dataclass(frozen=True)
class InferenceKernel:
    """The compiled forward of one (spec, arch, family, kind), with that kind's tiles."""

    spec: Spec
    arch: str
    family: str
    kind: str
    function: object
    tile_m: int
    tile_n: int
    ctas_per_sm: int  # resident CTAs of this kernel per SM (what a split grid aims to fill)


@dataclass(frozen=True)
class KernelTiles:
    """What a kind's tiles tell the split-count choice, before anything is compiled."""

    spec: Spec
    tile_m: int
    tile_n: int
    ctas_per_sm: int


# Whole-range paged kinds: this prefix and the TMA box height (fa_gen.families.sm90.PAGED_KIND).
WHOLE_PAGED_PREFIX = "forward_varlen_paged_b"


@functools.lru_cache(maxsize=1024)
def kind_tiles(spec: Spec, arch: str, kind: str) -> KernelTiles | None:
    """The tiles of the `kind` forward (None where no family renders it): resolved, not compiled,
    so a call can choose its kind before anything is built. Cached: it runs on every call."""
    try:
        context = resolve_target(spec, arch, kind).context()
    except UnsupportedError:
        return None
    return KernelTiles(spec, context["tile"]["tile_m"], context["tile"]["tile_n"], context.get("ctas_per_sm", 1))


@functools.lru_cache(maxsize=1024)
def whole_paged_kind(spec: Spec, arch: str, page_size: int) -> tuple[str, KernelTiles] | None:
    """The whole-range paged kind for caches of `page_size` slots a page and its tiles: TMA boxes
    of gcd(page_size, tile_n) rows, so that every box lies inside one page; None where no family
    renders boxes of that height (the sm90 family's are whole 8-row swizzle atoms). Cached: it
    runs on every paged call."""
    whole = None if spec.is_fp8 else kind_tiles(spec, arch, "forward_varlen")
    if whole is None:
        return None
    kind = f"{WHOLE_PAGED_PREFIX}{math.gcd(page_size, whole.tile_n)}"
    tiles = kind_tiles(spec, arch, kind)
    return (kind, tiles) if tiles else None


@functools.lru_cache(maxsize=None)
def inference_kernel(spec: Spec, arch: str, kind: str) -> InferenceKernel:
    """Render, compile (or load) the `kind` forward of the first family that renders it."""
    target = resolve_target(spec, arch, kind)
    function, _ = load_target(target)
    context = target.context()
    return InferenceKernel(spec, arch, target.family.name, kind, function, context["tile"]["tile_m"],
                           context["tile"]["tile_n"], context.get("ctas_per_sm", 1))


@functools.lru_cache(maxsize=4096)
def num_splits_for(tiles: int, key_tiles: int, num_sms: int, ctas_per_sm: int = 1, saturating: int | None = None) -> int:
    """Splits of each query tile's keys: 1 when the tiles alone nearly fill the GPU and leave no
    mostly empty last wave; else the fewest splits whose grid fills its last wave of CTAs within
    WAVE_SLACK of the best fill, at least two key tiles per split, at most MAX_SPLITS. A wave is
    `ctas_per_sm` CTAs per SM, or `saturating` per SM (the CTAs that reach the memory bandwidth,
    _saturating_ctas) when the grid was smaller than a full wave. Cached: it runs on every call.
    H200, decode (seqlen_q 1, bf16, d 128, 64x64 tiles, 2 CTAs per SM): 5 splits of 64 tiles
    (1.2 waves) read 2.9 TB/s, 4 splits (0.97 of a wave) 4.3 TB/s. H100, d 64 (3 CTAs per SM):
    512 tiles (1.29 waves) unsplit read 2.39 TB/s, 3 splits 2.78; b1 sk128k (8 tiles): 16 splits
    (one CTA per SM) 2.87 TB/s, 32 splits 2.75 (bench/results/logs/2026-11-25-split-sweep-*-h100.json)."""
    slots = num_sms * ctas_per_sm
    if tiles == 0:
        return 1
    waves = tiles / slots
    if waves >= FULL_GRID and (waves >= 2 or waves % 1 == 0 or waves % 1 >= 0.5):
        return 1
    if waves < FULL_GRID and saturating:
        slots = num_sms * max(1, min(ctas_per_sm, saturating))
    most = max(1, min(key_tiles // 2, MAX_SPLITS))
    fill = [tiles * s / (math.ceil(tiles * s / slots) * slots) for s in range(1, most + 1)]
    return next(s for s, f in enumerate(fill, 1) if f >= WAVE_SLACK * max(fill))


# GB/s one split CTA streams from memory on its own (64x64 tiles, two stages): H200, decode
# b1 sk128k h32/8 at 16 splits (128 CTAs, one per SM), 3.52 TB/s = 27.5 GB/s a CTA.
CTA_STREAM_GBPS = 28.0


@functools.lru_cache(maxsize=8)
def _saturating_ctas(device_index: int) -> int | None:
    """Split CTAs per SM that together reach the device's peak memory bandwidth (from its memory
    clock and bus width: H100 SXM 3.35 TB/s / 132 SMs -> 1, H200 4.8 TB/s -> 2); None when the
    device does not say."""
    props = torch.cuda.get_device_properties(device_index)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        try:
            from cuda.bindings import runtime as cudart

            attr = cudart.cudaDeviceAttr
            clock_khz = cudart.cudaDeviceGetAttribute(attr.cudaDevAttrMemoryClockRate, device_index)[1]
            bus_bits = cudart.cudaDeviceGetAttribute(attr.cudaDevAttrGlobalMemoryBusWidth, device_index)[1]
        except Exception:  # no cuda-python or no answer: fill whole waves
            return None
    peak_gbps = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    return max(1, math.ceil(peak_gbps / props.multi_processor_count / CTA_STREAM_GBPS)) if peak_gbps else None


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def forward_split(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int | None = None,
                  inputs=None, arch: str | None = None, pack_gqa: bool | None = None):
    """(out, lse) of fixed-length q (b, sq, hq, d), k/v (b, sk, hkv, d) with the keys of each query
    tile split across `num_splits` CTAs (None: chosen from the shapes and the SM count), the query
    heads of a KV head packed into one tile's rows when `pack_gqa` (None: when seqlen_q is short).
    One query whose tiles fill the GPU unsplit (num_splits None) takes the fixed-length forward
    with the packed heads as query rows, where rows_spec finds one."""
    _check_fixed(spec, q, k, v)
    arch = arch or current_arch()
    batch, seqlen_q, heads_q, _ = q.shape
    group = gqa_pack(spec, arch, "forward_split", heads_q // k.shape[2], seqlen_q, pack_gqa)
    device = q.device.index or 0

    def count(kern: KernelTiles) -> int:
        tiles = -(-seqlen_q * group // kern.tile_m) * (heads_q // group) * batch
        return num_splits_for(tiles, -(-k.shape[1] // kern.tile_n), _num_sms(device), kern.ctas_per_sm,
                              _saturating_ctas(device))

    kind, splits = _split_kind(spec, arch, "forward_split", group, count)
    whole = _rows_route(spec, arch, q, k, splits, num_splits)
    if whole is not None:
        return _heads_as_rows(whole, arch, q, k, v, group, inputs)
    kern = inference_kernel(spec, arch, kind)
    splits = num_splits or splits
    _, extra = bind_arguments(spec, q, k, inputs)
    rows = batch * seqlen_q
    out = torch.empty((batch, seqlen_q, heads_q, spec.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if rows == 0:
        return out, lse
    # One split writes out and lse itself; more write partials that the combine merges.
    o_partial, lse_partial = _partials(splits, rows, heads_q, spec.head_dim_v, q.device)
    kern.function(q, k, v, out, lse, o_partial, lse_partial, splits, *extra)
    if splits == 1:
        return out, lse
    # lse (batch, heads, seqlen_q) is itself a (heads, rows) view when seqlen_q or batch is 1 (decode).
    direct = seqlen_q == 1 or batch == 1
    lse_rows = lse.permute(1, 0, 2).view(heads_q, rows) if direct else torch.empty((heads_q, rows), device=q.device)
    _combine()(o_partial, lse_partial, out.view(rows, heads_q, spec.head_dim_v), lse_rows)
    if not direct:
        lse.copy_(lse_rows.view(heads_q, batch, seqlen_q).permute(1, 0, 2))
    return out, lse


# Whether one-query calls that fill the GPU unsplit take the fixed-length forward with query heads
# as rows (rows_spec); GPU tests pin it off and on.
WHOLE_DECODE = True
# Keys from which they do. H200, d128 (bench/bench_decode.py, the split kinds alone in the same run,
# bench/results/logs/2026-11-27-s27/c6): b64 sk8k h32/8 bf16 4,551-4,602 GB/s against 4,516, fp16
# 4,540 against 4,523; b128 sk2k h64/8 4,401 against 4,443 (a CTA's fixed costs over 16 key tiles).
ROWS_MIN_SEQLEN_K = 8192


def _rows_route(spec: Spec, arch: str, q: torch.Tensor, k: torch.Tensor, splits: int, num_splits) -> Spec | None:
    """rows_spec for a fixed-length call that may take it: WHOLE_DECODE on, one query of a
    non-empty batch, tiles that fill the GPU unsplit (no num_splits asked), ROWS_MIN_SEQLEN_K keys."""
    one_query = q.shape[1] == 1 and q.shape[0] > 0 and k.shape[1] >= ROWS_MIN_SEQLEN_K
    return rows_spec(spec, arch) if WHOLE_DECODE and one_query and splits == 1 and not num_splits else None


@functools.lru_cache(maxsize=256)
def rows_spec(spec: Spec, arch: str) -> Spec | None:
    """The spec whose fixed-length forward serves a one-query call with each KV head's query heads
    as query rows (_heads_as_rows), where the sm90 family renders it: its TMA producer streams K/V
    faster than the split kinds' copying warps (H200, b64 sk8k, 8 / 8 heads, one query:
    bench/decode_stream_probe.py 4,489 GB/s against 4,426, FlashAttention-4 4,495). None unless no
    expression tells rows apart (reads h, q_idx or seqlen_q) and the one query sees every key (no
    mask, or a bottom-right right window: causal); the mask then becomes none. Head dim 128 only:
    at d64 the sm90 forward read 2,898 GB/s against the split kinds' 4,472 (b64 sk8k, H200, c6).
    Cached."""
    exprs = (spec.score_mod_tree, spec.mask_tree, spec.sink_tree)
    if any({"h", "q_idx", "seqlen_q"} & names_used(tree) for tree in exprs if tree is not None):
        return None
    sees_every_key = spec.mask_expr is None and spec.window_left is None and \
        (spec.window_right is None or spec.alignment is Alignment.BOTTOM_RIGHT)
    if spec.is_fp8 or (spec.head_dim_qk, spec.head_dim_v) != (128, 128) or not sees_every_key:
        return None
    rows = dataclasses.replace(spec, mask=MaskKind.NONE, window_left=None, window_right=None)
    try:
        return rows if resolve_target(rows, arch, "forward").family.name == "sm90" else None
    except UnsupportedError:
        return None


def _heads_as_rows(rows: Spec, arch: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, inputs):
    """(out, lse) of one query (b, 1, hq, d) through the fixed-length forward of `rows`, the
    `group` query heads of each KV head read as that head's query rows (_rows_views)."""
    out, lse, views = _rows_views(rows, q, group)
    build(rows, arch).forward(*views[:1], k, v, out=views[1], lse=views[2], inputs=inputs)
    return out, lse


def _rows_views(rows: Spec, q: torch.Tensor, group: int):
    """out (b, 1, hq, dv) and lse (b, hq, 1), new, and the views of q, out and lse with the
    `group` query heads of each KV head as its rows: (b, group, hkv, d), (b, group, hkv, dv) and
    (b, hkv, group); no copies (head h = kv * group + g is row g of head kv)."""
    batch, _, heads_q, head_dim = q.shape
    heads_kv, dv = heads_q // group, rows.head_dim_v
    out = q.new_empty((batch, 1, heads_q, dv))
    lse = torch.empty((batch, heads_q, 1), dtype=torch.float32, device=q.device)
    qv = q.as_strided((batch, group, heads_kv, head_dim), (q.stride(0), q.stride(2), group * q.stride(2), q.stride(3)),
                      q.storage_offset())
    ov = out.as_strided((batch, group, heads_kv, dv), (heads_q * dv, dv, group * dv, 1))
    return out, lse, (qv, ov, lse.view(batch, heads_kv, group))


def cache_rows_route(spec: Spec, arch: str, q: torch.Tensor, k_cache: torch.Tensor, pack_gqa) -> tuple | None:
    """(rows spec, group) where a contiguous KV-cache decode step (q (b, 1, hq, d), k_cache (b,
    capacity, hkv, d)) may take forward_cache_rows: what _rows_route asks of a fixed-length call,
    the capacity standing for the longest sequence (as the split counts take it), and a family
    rendering the rows spec's SEQUSED_KIND. None otherwise: the call keeps to forward_varlen."""
    batch, seqlen_q, heads_q, _ = q.shape
    one_row_each = seqlen_q == 1 and batch > 0 and k_cache.shape[0] == batch  # cache row b is sequence b
    rows = rows_spec(spec, arch) if WHOLE_DECODE and one_row_each and k_cache.shape[1] >= ROWS_MIN_SEQLEN_K else None
    if rows is None or kind_tiles(rows, arch, SEQUSED_KIND) is None:  # cached: no resolve per step
        return None
    group = gqa_pack(spec, arch, "forward_varlen_split", heads_q // k_cache.shape[2], 1, pack_gqa)
    tiles = kind_tiles(spec, arch, packed_kind("forward_varlen_split", group))
    if tiles is None or _varlen_splits(tiles, 1, k_cache.shape[1], heads_q, batch, group, q.device) != 1:
        return None
    return rows, group


def forward_cache_rows(rows: Spec, arch: str, group: int, q: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, seqused_k: torch.Tensor, inputs=None):
    """(out (b, 1, hq, dv), lse (b, hq, 1)) of one query per sequence against a contiguous cache
    (b, capacity, hkv, d) of which sequence b uses its first seqused_k[b] keys, through the
    SEQUSED_KIND forward of `rows` with the query heads of each KV head as its rows. Slots past a
    sequence's length may hold anything: their scores are masked and their V rows zeroed.
    The caller (fa_gen.api.kvcache) checked the shapes, dtypes and devices; the strides the
    kernel needs are checked here."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_strides(name, t)
    out, lse, (qv, ov, lv) = _rows_views(rows, q, group)
    _, extra = bind_arguments(rows, qv, k_cache, inputs)
    inference_kernel(rows, arch, SEQUSED_KIND).function(qv, k_cache, v_cache, ov, lv, seqused_k, *extra)
    return out, lse


def forward_varlen(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                   seqused_k: torch.Tensor | None = None, num_splits: int | None = None, inputs=None,
                   arch: str | None = None, pack_gqa: bool | None = None, checked: bool = False, descales=None):
    """(out (total_q, hq, d_v), lse (hq, total_q)) of a packed batch; see the module docstring.
    `checked`: the caller (fa_gen.api.kvcache) built the sequence vectors itself and checked the
    tensors' dtypes, shapes and devices; only the strides the kernels need are checked here.
    An fp8 spec (e4m3 q, k, v; the split kinds only): `descales` (q, k, v) as fa_gen.fp8.descale_tensors
    takes them, out in the spec's out_dtype."""
    if checked:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_strides(name, t)
    else:
        _check_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    arch, group, extra, out, lse = _varlen_call(spec, q, k.shape[1], "forward_varlen_split", max_seqlen_q, pack_gqa,
                                                inputs, arch)
    batch, heads_q = cu_seqlens_q.shape[0] - 1, q.shape[1]
    used = seqused_k if seqused_k is not None else cu_seqlens_k
    sequences = (cu_seqlens_q, cu_seqlens_k, used, int(seqused_k is not None), max(int(max_seqlen_q), 1))
    if q.shape[0] == 0 or batch == 0:
        return out, lse.fill_(-math.inf)
    shape = (max_seqlen_q, max_seqlen_k, heads_q, batch, group, q.device)
    # Key rows past seqused_k are slack a caller need not fill (NaN included): the split kinds
    # zero-fill them; the sm90 whole-range kernel masks their scores and zeroes their V rows in
    # shared memory before P @ V (forward_mainloop.j2, zero_tail_values). A KV-cache's decode step
    # (seqused_k, short queries) keeps to the split kinds, as it did before the sm90 kernel took
    # seqused_k: their 64-row tiles stream K/V with more CTAs an SM.
    decode_step = seqused_k is not None and max_seqlen_q < SPLIT_TILE_M and num_splits != 1
    if group == 1 and num_splits in (None, 0, 1) and not spec.is_fp8 and not decode_step:
        # The whole-key-range kernel (the sm90 family's on Hopper), unless its tiles leave the GPU idle.
        whole = kind_tiles(spec, arch, "forward_varlen")
        if whole is not None and (num_splits == 1 or _varlen_splits(whole, *shape) == 1):
            inference_kernel(spec, arch, "forward_varlen").function(q, k, v, out, lse, *sequences, *extra)
            return out, lse
    kind, splits = _split_kind(spec, arch, "forward_varlen_split", group, lambda kern: _varlen_splits(kern, *shape))
    return _run_split(inference_kernel(spec, arch, kind), (q, k, v), out, lse, sequences, num_splits or splits, extra,
                      _descales(spec, descales, batch, k.shape[1], q.device))


def forward_varlen_fp8(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, descales=None, inputs=None,
                       arch: str | None = None):
    """(out (total_q, hq, d_v) in the spec's out_dtype, lse (hq, total_q)) of a packed batch of e4m3
    q, k, v: the sm90 family's whole-range varlen forward over V^T regions (fa_gen.fp8.transpose_v_varlen);
    descales (q, k, v) each (batch, heads_kv), broadcastable, or None (fa_gen.fp8.descale_tensor)."""
    _check_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, max_seqlen_k)
    arch = arch or current_arch()
    batch, heads_q, heads_kv = cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1]
    extra = _varlen_extra_arguments(spec, q, heads_q, inputs)
    out = torch.empty((q.shape[0], heads_q, spec.head_dim_v), dtype=_TORCH_DTYPES[spec.output_dtype], device=q.device)
    lse = torch.empty((heads_q, q.shape[0]), dtype=torch.float32, device=q.device)
    if q.shape[0] == 0 or batch == 0:
        return out, lse.fill_(-math.inf)
    kern = inference_kernel(spec, arch, "forward_varlen")
    vt, offsets = fp8.transpose_v_varlen(v, cu_seqlens_k, kern.tile_n, arch)
    scales = fp8.descale_tensors(descales, batch, heads_kv, q.device)
    kern.function(q, k, vt, out, lse, *scales, offsets, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k, 0,
                  max(int(max_seqlen_q), 1), *extra)
    return out, lse


def forward_paged(spec: Spec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, max_seqlen_q: int,
                  num_splits: int | None = None, inputs=None, arch: str | None = None,
                  pack_gqa: bool | None = None, descales=None):
    """(out (total_q, hq, d_v), lse (hq, total_q)) of packed queries against a paged KV cache:
    k_cache/v_cache (num_pages, page_size, heads_kv, d), page_table (batch, max_pages) int32;
    sequence b attends its first seqused_k[b] keys, key r being slot r % page_size of page
    page_table[b, r // page_size]. The split count comes from shapes alone (the table's capacity
    max_pages * page_size stands for the longest sequence), so a captured CUDA graph replays
    with new lengths and page tables. Prefill-shaped calls whose tiles fill the GPU (or
    num_splits=1) take the whole-range paged kind where a family renders one for this page size
    (whole_paged_kind); the others, and every call with GQA packing, the split kinds."""
    _check_paged(spec, q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q)
    arch, group, extra, out, lse = _varlen_call(spec, q, k_cache.shape[2], "forward_varlen_split_paged", max_seqlen_q,
                                                pack_gqa, inputs, arch)
    batch, heads_q = cu_seqlens_q.shape[0] - 1, q.shape[1]
    if q.shape[0] == 0 or batch == 0:
        return out, lse.fill_(-math.inf)
    # cu_seqlens_k is not read (use_seqused_k is set): cu_seqlens_q stands in for it.
    sequences = (cu_seqlens_q, cu_seqlens_q, seqused_k, 1, max(int(max_seqlen_q), 1), page_table)
    capacity = page_table.shape[1] * k_cache.shape[1]
    # Decode steps (short queries) keep to the split kinds unless num_splits=1 pins the whole range.
    # (The whole-range kernel reads a table entry of every sequence: a table has at least one column.)
    prefill = (max_seqlen_q >= SPLIT_TILE_M or num_splits == 1) and page_table.shape[1] > 0
    whole = whole_paged_kind(spec, arch, k_cache.shape[1]) if group == 1 and num_splits in (None, 0, 1) and prefill \
        else None
    if whole is not None and (num_splits == 1 or _varlen_splits(whole[1], max_seqlen_q, capacity, heads_q, batch, 1,
                                                                   q.device) == 1):
        # One CTA per query tile over all of its keys, as the contiguous varlen forward.
        inference_kernel(spec, arch, whole[0]).function(q, k_cache, v_cache, out, lse, *sequences, *extra)
        return out, lse
    kern = inference_kernel(spec, arch, paged_kind(spec, arch, k_cache.shape[1], group))
    splits = num_splits or _varlen_splits(kern, max_seqlen_q, capacity, heads_q, batch, group, q.device,
                                          k_cache.shape[1] % (PAGE_RUN_TILES * kern.tile_n) == 0)
    return _run_split(kern, (q, k_cache, v_cache), out, lse, sequences, splits, extra,
                      _descales(spec, descales, batch, k_cache.shape[2], q.device))


@functools.lru_cache(maxsize=1024)
def paged_kind(spec: Spec, arch: str, page_size: int, group: int) -> str:
    """The paged split kind for this page size (a shape, so no host sync): a multiple of the key
    tile takes the whole-tile kind (one table entry a tile), a multiple of the rows one thread
    copies of a tile the row-group kind (one entry a thread a tile), any other size a page and
    slot found per copy row. Resolved, not compiled: only the kind chosen is built. Cached: it
    runs on every call."""
    rows = packed_kind("forward_varlen_split_paged", group)
    try:
        context = resolve_target(spec, arch, rows).context()
    except UnsupportedError:
        return rows
    if page_size % context["tile"]["tile_n"] == 0:
        return packed_kind("forward_varlen_split_paged_tiles", group)
    if page_size % context["page_group_rows"] == 0:
        return packed_kind("forward_varlen_split_paged_groups", group)
    return rows


# Whether split calls whose 64 x 64 grid is short of a wave take the wide kinds (_split_kind);
# GPU tests pin it off and on.
WIDE_SPLITS = True


def _split_kind(spec: Spec, arch: str, kind: str, group: int, count) -> tuple[str, int]:
    """(kind, splits) of a split call: `kind` packed by `group` and the splits `count(tiles)`
    picks for its tiles; where those are more than one (a grid short of a wave), the kind's wide
    twin (128-key tiles, one CTA an SM: sm80.split_tile_config) and its count, when a family
    renders it with wider tiles. Decided from resolved tiles: only the kind taken is compiled."""
    narrow = packed_kind(kind, group)
    tiles = kind_tiles(spec, arch, narrow)
    if tiles is None:
        resolve_target(spec, arch, narrow)  # raises UnsupportedError with each family's reasons
    splits = count(tiles)
    wide = kind_tiles(spec, arch, packed_kind(f"{kind}_wide", group)) if WIDE_SPLITS and splits > 1 else None
    if wide is None or wide.tile_n <= tiles.tile_n:
        return narrow, splits
    return packed_kind(f"{kind}_wide", group), count(wide)


def _varlen_call(spec: Spec, q: torch.Tensor, heads_kv: int, kind: str, max_seqlen_q: int, pack_gqa, inputs, arch):
    """What a varlen call of the split `kind` (packed q (total_q, hq, d)) sets up: (arch, GQA
    pack, the spec's inputs as kernel arguments, out (total_q, hq, d_v), lse (hq, total_q))."""
    arch = arch or current_arch()
    heads_q, total_q = q.shape[1], q.shape[0]
    group = gqa_pack(spec, arch, kind, heads_q // heads_kv, max_seqlen_q, pack_gqa)
    extra = _varlen_extra_arguments(spec, q, heads_q, inputs)
    out = torch.empty((total_q, heads_q, spec.head_dim_v), dtype=_TORCH_DTYPES[spec.output_dtype], device=q.device)
    lse = torch.empty((heads_q, total_q), dtype=torch.float32, device=q.device)
    return arch, group, extra, out, lse


# Pages of at least this many key tiles stream like contiguous K/V (split counts as for it).
PAGE_RUN_TILES = 4


def _varlen_splits(kern: InferenceKernel | KernelTiles, max_seqlen_q: int, max_seqlen_k: int, heads_q: int, batch: int,
                   group: int, device, streams_whole: bool = True) -> int:
    """Key splits of a varlen call's tiles, from the longest lengths and the GPU's SM count.
    `streams_whole`: K/V contiguous, or in pages of PAGE_RUN_TILES key tiles or more: a small
    grid then fills only the CTAs per SM that reach the memory bandwidth (_saturating_ctas), as
    the fixed-length kind does. Shorter pages fill whole waves of resident CTAs: a CTA that
    looks up a page every tile or every few rows streams slower alone. H100, decode b1 sk128k /
    b8 sk32k h32/8 (bench/kvcache_splits.py, 2026-11-27): contiguous 16 / 2 splits 3.01 / 3.10
    TB/s against 32 / 4 splits 2.91 / 2.99; pages of 256 2.94 / 3.02 against 2.88 / 2.97; pages
    of 64 2.83 / 2.92 against 2.86 / 2.96, of 16 2.48 / 2.54 against 2.87 / 2.99."""
    tiles = -(-max_seqlen_q * group // kern.tile_m) * (heads_q // group) * batch
    index = device.index or 0
    saturating = _saturating_ctas(index) if streams_whole else None
    if saturating and kern.spec.is_fp8:
        # e4m3 tiles carry half the bytes of 16-bit ones through the same pipeline.
        saturating *= 2
    return num_splits_for(tiles, -(-max_seqlen_k // kern.tile_n), _num_sms(index), kern.ctas_per_sm, saturating)


def _descales(spec: Spec, descales, batch: int, heads_kv: int, device) -> list:
    """The fp8 kinds' descale arguments (fa_gen.fp8.descale_tensors; None: every factor 1); none
    for a 16-bit spec, which takes no descales."""
    if not spec.is_fp8:
        if descales is not None and any(d is not None for d in descales):
            raise InputError(f"descales go with an fp8 spec; spec {spec.name!r} is {spec.dtype.value}")
        return []
    return fp8.descale_tensors(descales, batch, heads_kv, device)


def _run_split(kern: InferenceKernel, qkv: tuple, out: torch.Tensor, lse: torch.Tensor, sequences: tuple,
               splits: int, extra: list, descales: list = ()):
    """Launch a varlen split kind into out (total_q, hq, d_v) / lse (hq, total_q), then merge its
    partials (none with one split: the kernel writes out and lse itself)."""
    total_q, heads_q, head_dim_v = out.shape
    o_partial, lse_partial = _partials(splits, total_q, heads_q, head_dim_v, out.device)
    kern.function(*qkv, out, lse, *sequences, o_partial, lse_partial, splits, *descales, *extra)
    if splits > 1:
        _combine()(o_partial, lse_partial, out, lse, arch=kern.arch)
    return out, lse


def decode_shaped(spec: Spec, q: torch.Tensor) -> bool:
    """Whether fa_gen.attention should serve q through the split-KV forward: fewer query rows
    than a split tile holds (decode, speculative decoding), on a GPU whose family renders it.
    H200, seqlen_q 1 (bench/bench_decode.py): 0.86-1.02x the best of FA4, cuDNN and FA2, where
    the fixed-length forward read 0.14-0.38x."""
    if not (isinstance(q, torch.Tensor) and q.dim() == 4 and q.is_cuda and q.shape[1] < SPLIT_TILE_M):
        return False
    if spec.mask_expr is not None:
        # The fixed-length forward visits only the key tiles a mask expression leaves visible
        # (per-call lists); the split kinds would visit all of them.
        return False
    return supports(spec, current_arch(), "forward_split")


def packed_kind(kind: str, group: int) -> str:
    """The kind whose tiles pack `group` query heads per KV head (the kind itself for 1)."""
    return kind if group == 1 else f"{kind}_pack{group}"


def gqa_pack(spec: Spec, arch: str, kind: str, group: int, seqlen_q: int, wanted: bool | None) -> int:
    """Query heads per tile row group: the GQA ratio when packing is on, else 1. None packs when
    one head's rows leave a split tile (64 rows) mostly empty: then K/V are read once per group."""
    possible = group > 1 and supports(spec, arch, packed_kind(kind, group))
    if wanted is None:
        wanted = possible and seqlen_q < SPLIT_TILE_M
    if wanted and not possible:
        raise UnsupportedError(f"pack_gqa=True for spec {spec.name!r}", [
            f"{group} query heads per KV head: packing needs a ratio among {', '.join(map(str, GQA_PACKS))} "
            "and a spec whose expressions (score mod, mask, sink) read neither h nor q_idx"])
    return group if wanted else 1


def _combine():
    """The combine of split partials (a seam: ad hoc checks swap in a torch stand-in)."""
    return combine_splits


def _partials(splits: int, rows: int, heads_q: int, head_dim_v: int, device):
    if splits == 1:  # the kernel writes the final output: no partials (one-element placeholders)
        return (torch.empty((1, 1, heads_q, head_dim_v), dtype=torch.float32, device=device),
                torch.empty((1, heads_q, 1), dtype=torch.float32, device=device))
    o_partial = torch.empty((splits, rows, heads_q, head_dim_v), dtype=torch.float32, device=device)
    lse_partial = torch.empty((splits, heads_q, rows), dtype=torch.float32, device=device)
    return o_partial, lse_partial


def _varlen_extra_arguments(spec: Spec, q: torch.Tensor, heads_q: int, inputs) -> list:
    """The spec's inputs as kernel arguments; a varlen batch has no (batch, seqlen) grid, so
    tensors shaped by batch or sequence lengths are refused."""
    for decl in spec.inputs:
        if not decl.is_scalar and {"batch", "seqlen_q", "seqlen_k"} & set(map(str, decl.shape)):
            raise UnsupportedError(f"input {decl.name!r} of spec {spec.name!r} in a varlen call", [
                f"its shape {list(decl.shape)} is indexed by batch or sequence lengths, which a packed batch "
                "does not have; varlen takes tensors shaped by heads_q or constants"])
    if not spec.inputs and inputs is None:  # nothing to bind (the common case: no view made)
        return []
    view = q.new_empty((1, 1, heads_q, q.shape[-1])) if q.shape[0] == 0 else q[:1].unsqueeze(0)
    return bind_arguments(spec, view, view, inputs)[1]


def _check_tensor(spec: Spec, name: str, t, dims: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != _TORCH_DTYPES[spec.dtype]:
        raise InputError(f"{name} has dtype {t.dtype}; spec {spec.name!r} was built for {_TORCH_DTYPES[spec.dtype]}")
    if t.dim() != dims:
        raise InputError(f"{name} must be {dims}-D {layout}; got shape {tuple(t.shape)}")
    _check_strides(name, t)


def _check_heads(spec: Spec, q, k, v, head_axis: int) -> None:
    hq, hk, hv = q.shape[head_axis], k.shape[head_axis], v.shape[head_axis]
    if q.shape[-1] != spec.head_dim_qk or k.shape[-1] != spec.head_dim_qk or v.shape[-1] != spec.head_dim_v:
        raise InputError(f"head dims must be q/k {spec.head_dim_qk}, v {spec.head_dim_v} (spec {spec.name!r}); "
                         f"got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if hk != hv or hk == 0 or hq % hk:
        raise InputError(f"heads of q ({hq}) must be a multiple of heads of k/v ({hk}, {hv}) (GQA/MQA)")


def _check_device(**tensors) -> None:
    for name, t in tensors.items():
        if not t.is_cuda:
            raise InputError(f"{name} is on {t.device}; fa_gen kernels need CUDA tensors")
    if len({t.device for t in tensors.values()}) > 1:
        raise InputError("every tensor must be on one device; got " +
                         ", ".join(f"{n} {t.device}" for n, t in tensors.items()))


def _check_fixed(spec: Spec, q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(spec, name, t, 4, "(batch, seqlen, heads, head_dim)")
    _check_heads(spec, q, k, v, 2)
    if not q.shape[0] == k.shape[0] == v.shape[0] or k.shape[1] != v.shape[1]:
        raise InputError(f"q, k, v must agree in batch (and k, v in seqlen): {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    _check_device(q=q, k=k, v=v)


def _check_varlen(spec: Spec, q, k, v, cu_q, cu_k, used_k, max_seqlen_q, max_seqlen_k) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(spec, name, t, 3, "(total_tokens, heads, head_dim)")
    _check_heads(spec, q, k, v, 1)
    if k.shape[0] != v.shape[0]:
        raise InputError(f"k and v must have the same number of tokens; got {k.shape[0]} and {v.shape[0]}")
    cu = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, **({"seqused_k": used_k} if used_k is not None else {})}
    _check_int32_vectors(**cu)
    if cu_q.shape[0] < 1 or cu_k.shape[0] != cu_q.shape[0]:
        raise InputError(f"cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 1 entries; got "
                         f"{cu_q.shape[0]} and {cu_k.shape[0]}")
    if used_k is not None and used_k.shape[0] != cu_q.shape[0] - 1:
        raise InputError(f"seqused_k must have one entry per sequence ({cu_q.shape[0] - 1}); got {used_k.shape[0]}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{name} must be an int >= 0 (the longest sequence); got {value!r}")
    _check_device(q=q, k=k, v=v, **cu)


def _check_paged(spec: Spec, q, k_cache, v_cache, page_table, cu_q, used_k, max_seqlen_q) -> None:
    _check_tensor(spec, "q", q, 3, "(total_q, heads, head_dim)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(spec, name, t, 4, "(num_pages, page_size, heads_kv, head_dim)")
    _check_heads(spec, q, k_cache, v_cache, -2)
    if k_cache.shape[:2] != v_cache.shape[:2] or k_cache.shape[1] == 0:
        raise InputError(f"k_cache and v_cache must agree in pages and page size (>= 1); got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if max(t.stride()[:3]) >= 2**31:
            raise InputError(f"{name}'s page, slot and head strides must each be below 2**31 elements (the kernel "
                             f"multiplies them as 32-bit values); got {tuple(t.stride()[:3])}")
    _check_int32_vectors(cu_seqlens_q=cu_q, seqused_k=used_k)
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2 \
            or page_table.stride(-1) != 1:
        raise InputError("page_table must be a 2-D int32 tensor (batch, max_pages) with a contiguous last dimension")
    if page_table.shape[0] != cu_q.shape[0] - 1 or used_k.shape[0] != cu_q.shape[0] - 1:
        raise InputError(f"page_table ({page_table.shape[0]} rows) and seqused_k ({used_k.shape[0]}) must have one "
                         f"entry per sequence ({cu_q.shape[0] - 1})")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise InputError(f"max_seqlen_q must be an int >= 0 (the longest sequence); got {max_seqlen_q!r}")
    _check_device(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, cu_seqlens_q=cu_q, seqused_k=used_k)


def _check_int32_vectors(**vectors) -> None:
    for name, t in vectors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            raise InputError(f"{name} must be a contiguous 1-D int32 tensor; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                             f"{' ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")


@functools.lru_cache(maxsize=None)
def supports(spec: Spec, arch: str, kind: str) -> bool:
    """Whether some family renders the `kind` forward of `spec` on `arch`."""
    try:
        resolve_target(spec, arch, kind)
    except UnsupportedError:
        return False
    return True
