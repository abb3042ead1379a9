"""Multi-head latent attention (MLA) decode: DeepSeek-style attention over a latent KV cache.

    out, lse = fa_gen.mla_decode(q, kv_cache, cache_seqlens, spec)                 # contiguous cache
    out, lse = fa_gen.mla_decode(q, kv_cache, cache_seqlens, spec, block_table=bt)  # paged cache

q (batch, seqlen_q, heads_q, 576): per head, the query's 512 latent columns (q_nope already
multiplied by the key up-projection) and its 64 rope columns. kv_cache holds one latent KV head:
(batch, capacity, 1, 576) contiguous, or (num_pages, page_size, 1, 576) paged through
block_table (batch, max_pages) int32, page_size a multiple of 64. V is the first 512 columns of
the same cache (nothing is copied). Sequence b attends its first cache_seqlens[b] keys; with a
causal spec, query s of seqlen_q (speculative / multi-token decode) sees keys up to
cache_seqlens[b] - seqlen_q + s. out (batch, seqlen_q, heads_q, 512) in q's dtype, lse
(batch, heads_q, seqlen_q) fp32 (natural log).

The spec fixes what changes code: dtype (bf16 or fp16), head_dim {qk: 576, v: 512}, mask none
or causal, softmax_scale (MLA models use 1/sqrt(192), not 1/sqrt(576)). Lengths, page tables
and the split count are runtime values: one compiled kernel per (spec, contiguous or paged),
no host sync on the call path (a CUDA graph replays with new lengths and tables).

Kernel: templates/sm90_mla/mla_decode.py.j2 (Hopper). The query heads are packed into 64-row
tiles, so 128 heads read each key once per two tiles; split-KV partials are merged by the
combine kernel (fa_gen.combine).
"""

from __future__ import annotations

import functools
import math

import torch

from .combine import combine_splits
from .errors import InputError, UnsupportedError
from .families.sm90_mla import TILE_M, TILE_N
from .inference import _num_sms, num_splits_for
from .runtime import _TORCH_DTYPES, current_arch, load_target, resolve_spec
from .spec import MLA_HEAD_DIMS, Spec
from .target import resolve_target

LATENT, ROPE = MLA_HEAD_DIMS[1], MLA_HEAD_DIMS[0] - MLA_HEAD_DIMS[1]


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, cache_seqlens, spec, block_table: torch.Tensor | None = None,
               num_splits: int | None = None, arch: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, seqlen_q, heads_q, 512), lse (b, heads_q, seqlen_q)); see the module docstring.
    cache_seqlens: (b,) int32 on q's device, or an int for every sequence. num_splits: the key
    splits (None: from the shapes and the GPU's SM count)."""
    spec = resolve_spec(spec)
    _check_spec(spec)
    seqlens = _check(spec, q, kv_cache, cache_seqlens, block_table)
    paged = block_table is not None
    kernel = _kernel(spec, arch or current_arch(), "mla_decode_paged" if paged else "mla_decode")
    batch, seqlen_q, heads_q, _ = q.shape
    rows = seqlen_q * heads_q
    out = torch.empty((batch, seqlen_q, heads_q, LATENT), dtype=q.dtype, device=q.device)
    lse = torch.empty((heads_q, batch * seqlen_q), dtype=torch.float32, device=q.device)
    if batch == 0 or rows == 0:
        return out, lse.view(heads_q, batch, seqlen_q).permute(1, 0, 2)
    capacity = block_table.shape[1] * kv_cache.shape[1] if paged else kv_cache.shape[1]
    splits = num_splits if num_splits is not None else splits_for(batch, rows, capacity, q.device)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise InputError(f"num_splits must be an int >= 1; got {splits!r}")
    q3 = _rows(q.reshape(batch, rows, spec.head_dim_qk))
    kv3 = kv_cache.select(2, 0)
    if splits == 1:  # the kernel writes out and lse itself: stand-ins of the partials' shapes, no storage
        o_partial = torch.empty((1, 1, 1, LATENT), dtype=torch.float32, device=q.device).expand(1, batch, rows, LATENT)
        lse_partial = torch.empty((1, 1, batch * seqlen_q), dtype=torch.float32,
                                  device=q.device).expand(1, heads_q, batch * seqlen_q)
    else:
        o_partial = torch.empty((splits, batch, rows, LATENT), dtype=torch.float32, device=q.device)
        lse_partial = torch.empty((splits, heads_q, batch * seqlen_q), dtype=torch.float32, device=q.device)
    tables = (block_table,) if paged else ()
    kernel(q3[..., :LATENT], q3[..., LATENT:], kv3[..., :LATENT], kv3[..., LATENT:], out.view(batch, rows, LATENT), lse,
           seqlens, *tables, o_partial, lse_partial, splits, seqlen_q)
    if splits > 1:
        combine_splits(o_partial.view(splits, batch * seqlen_q, heads_q, LATENT), lse_partial,
                       out.view(batch * seqlen_q, heads_q, LATENT), lse)
    return out, lse.view(heads_q, batch, seqlen_q).permute(1, 0, 2)


def splits_for(batch: int, rows: int, capacity: int, device) -> int:
    """Key splits from the shapes alone: the (row tile, batch) CTAs, one per SM (224 KB of
    shared memory each), topped up to whole waves with at least two key tiles per split."""
    tiles = -(-rows // TILE_M) * batch
    return num_splits_for(tiles, -(-capacity // TILE_N), _num_sms(device.index or 0), 1)


def _check_spec(spec: Spec) -> None:
    if (spec.head_dim_qk, spec.head_dim_v) != MLA_HEAD_DIMS:
        raise UnsupportedError(f"mla_decode with spec {spec.name!r}", [
            f"MLA decode takes head_dim {{qk: {MLA_HEAD_DIMS[0]}, v: {MLA_HEAD_DIMS[1]}}}; the spec has "
            f"qk {spec.head_dim_qk}, v {spec.head_dim_v}"])


@functools.lru_cache(maxsize=None)
def _kernel(spec: Spec, arch: str, kind: str):
    """The compiled (or cached) kernel of `kind` (Target resolved once: render, cache, load)."""
    function, _ = load_target(resolve_target(spec, arch, kind))
    return function


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with 16-byte-aligned rows and a contiguous last dimension (TMA's terms), copied only if needed."""
    ok = t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0
    return t if ok else t.contiguous()


def _check(spec: Spec, q, kv_cache, cache_seqlens, block_table) -> torch.Tensor:
    """Refuse what the kernel cannot take, with the reason; returns cache_seqlens as (b,) int32."""
    dtype = _TORCH_DTYPES[spec.dtype]
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise InputError(f"{name} has dtype {t.dtype}; spec {spec.name!r} was built for {dtype}")
        if t.dim() != 4 or t.shape[-1] != spec.head_dim_qk:
            layout = "(batch, seqlen_q, heads_q, 576)" if name == "q" else \
                "(batch, capacity, 1, 576) or, paged, (num_pages, page_size, 1, 576)"
            raise InputError(f"{name} must be 4-D {layout}; got shape {tuple(t.shape)}")
    if kv_cache.shape[2] != 1:
        raise InputError(f"kv_cache must hold one latent KV head (axis 2 of size 1); got {kv_cache.shape[2]}")
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) % 8 or kv_cache.stride(1) % 8 or kv_cache.data_ptr() % 16:
        raise InputError(f"kv_cache needs a contiguous last dimension, strides of multiples of 8 elements and a "
                         f"16-byte-aligned start (TMA); got strides {kv_cache.stride()}")
    batch = q.shape[0]
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.stride(-1) != 1 or block_table.device != q.device:
            raise InputError("block_table must be a 2-D int32 tensor (batch, max_pages) on q's device with a "
                             "contiguous last dimension")
        if block_table.shape[0] != batch:
            raise InputError(f"block_table has {block_table.shape[0]} rows; q has batch {batch}")
        if kv_cache.shape[1] % TILE_N:
            raise InputError(f"page_size must be a multiple of {TILE_N} for MLA decode; got {kv_cache.shape[1]}")
    elif kv_cache.shape[0] != batch:
        raise InputError(f"kv_cache has batch {kv_cache.shape[0]}; q has {batch} (pass block_table for a paged cache)")
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        capacity = kv_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        if not 0 <= cache_seqlens <= capacity:
            raise InputError(f"cache_seqlens {cache_seqlens} is outside 0..{capacity} (the cache's capacity)")
    elif not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1 \
            or cache_seqlens.shape[0] != batch or not cache_seqlens.is_contiguous() or cache_seqlens.device != q.device:
        raise InputError(f"cache_seqlens must be an int or a contiguous (batch,) = ({batch},) int32 tensor on q's "
                         f"device; got {_describe(cache_seqlens)}")
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if not t.is_cuda:
            raise InputError(f"{name} is on {t.device}; fa_gen kernels need CUDA tensors")
    if kv_cache.device != q.device:
        raise InputError(f"q is on {q.device} and kv_cache on {kv_cache.device}; both must be on one device")
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    return cache_seqlens


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)} {x.dtype} on {x.device}"
    return type(x).__name__


def mla_reference(q: torch.Tensor, kv_cache: torch.Tensor, cache_seqlens: list[int], spec: Spec,
                  block_table: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence b, (out (seqlen_q, heads_q, 512), lse (heads_q, seqlen_q)) of fa_gen's float64
    reference over that sequence's keys alone (tests and checks; host lists, any device)."""
    from .reference import attention_reference

    results = []
    for b, length in enumerate(cache_seqlens):
        if block_table is None:
            keys = kv_cache[b, :length]
        else:
            page = kv_cache.shape[1]
            pages = block_table[b, :math.ceil(length / page)].long()
            keys = kv_cache[pages].reshape(-1, 1, kv_cache.shape[-1])[:length]
        k = keys.unsqueeze(0)
        out, lse = attention_reference(q[b:b + 1], k, k[..., :LATENT], spec)
        results.append((out[0], lse[0]))
    return results
