"""`fa_gen.attention_with_kvcache`: append new keys and values to a KV cache, then attend over it.

    out, lse = fa_gen.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, spec="causal_bf16_d128",
                                             k_new=k, v_new=v, page_table=page_table)

The call packs the batch's queries as a varlen batch (cu_seqlens built on the device) and runs
the varlen split-KV forwards of fa_gen.inference: contiguous caches as packed keys located by
offsets, paged caches through their page table. Every size the call uses (grid, split count,
partial buffers) comes from tensor shapes, never from tensor values, and nothing reads the
device on the host: a decode step captured once in a CUDA graph replays with new cache_seqlens
and page-table contents. A spec of MLA's head dims (576, 512) goes to fa_gen.mla_decode, with
v_cache the latent cache's first 512 columns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..append import Rotary, append_to_cache
from ..autograd import spec_from_key, spec_key
from ..errors import InputError, UnsupportedError
from ..inference import cache_rows_route, forward_cache_rows, forward_paged, forward_varlen
from ..mla import mla_decode
from ..runtime import _TORCH_DTYPES, current_arch
from ..spec import MLA_HEAD_DIMS, MaskKind, Spec


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens,
                           spec: Spec | str | os.PathLike, k_new: torch.Tensor | None = None,
                           v_new: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
                           cache_batch_idx: torch.Tensor | None = None, num_splits: int = 0,
                           pack_gqa: bool | None = None, inputs=None, rotary_cos: torch.Tensor | None = None,
                           rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = True,
                           cache_leftpad: torch.Tensor | None = None, q_descale=None, k_descale=None,
                           v_descale=None):
    """Attention of q against a KV cache, after writing k_new/v_new into it: `out, lse` (or
    `out` when the spec has return_lse false). Forward only (inference): no autograd graph is
    recorded (torch.no_grad semantics) and no gradient flows to any argument.

    q: (batch, seqlen_q, heads_q, d).
    k_cache, v_cache: contiguous (batch_cache, seqlen_cache, heads_kv, d), or paged
        (num_pages, page_size, heads_kv, d) with `page_table`; any page size >= 1.
    cache_seqlens: keys already in the cache per sequence, an int32 (batch,) tensor on the
        device, or an int for every sequence.
    k_new, v_new: (batch, seqlen_new, heads_kv, d) written in place at positions
        cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence b (through the page
        table when paged); sequence b then attends its cache_seqlens[b] + seqlen_new keys. The
        positions must lie inside the cache (seqlen_cache, or max_pages * page_size): nothing
        checks the lengths on the host, which would synchronise with the device.
    page_table: (batch, max_pages) int32: key r of sequence b is slot r % page_size of page
        page_table[b, r // page_size].
    cache_batch_idx: (batch,) int32/int64, the cache row of each sequence (contiguous caches only;
        default: row b).
    num_splits: key splits per query tile (0: chosen from the shapes and the SM count; 1: each
        query tile over all its keys in one CTA; on Hopper without GQA packing, the sm90 forward's).
    pack_gqa: the query heads of a KV head on one tile's rows (None: when seqlen_q is short).
    inputs: the spec's declared inputs (scalars, or tensors shaped by heads / constants).
    rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) tables of q's dtype, rotary_dim a multiple
        of 16 up to the head dim (FlashAttention's kvcache convention; needs k_new/v_new). The
        first rotary_dim columns of each new key are rotated by row cache_seqlens[b] + j on their
        way into the cache, and query i by row cache_seqlens[b] + i, or cache_seqlens[b] for
        every query where the spec has no mask (q itself is left as it is). Pairs are columns
        (2m, 2m + 1) with rotary_interleaved, else (m, m + rotary_dim / 2) (GPT-NeoX). Rows past
        the tables' end take their last row: keep positions inside them. Fused into the append's
        one launch.
    cache_leftpad: (batch,) int32, where each sequence's keys start in a contiguous cache (slots
        before it are not attended; default 0). cache_seqlens and positions stay cache slots:
        sequence b attends slots cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1, masks
        and ALiBi count from cache_leftpad[b]. Not with page_table (as in FlashAttention).
    q_descale, k_descale, v_descale: an fp8 spec's factors (FlashAttention-3's): q, the caches and
        k_new / v_new are then float8_e4m3fn, each value standing for value * its descale; each a
        float or a (batch, heads_kv) float32 tensor (default 1). out is in the spec's out_dtype.
        Not with rotary tables.

    Queries align with the end of their sequence's keys as the spec's mask says (bottom-right by
    default: query i of seqlen_q sees keys up to cache_seqlens + seqlen_new - seqlen_q + i), so
    chunked prefill and speculative decoding (seqlen_q > 1) take every mask. lse is
    (batch, heads_q, seqlen_q) float32, a view of the kernel's (heads_q, batch * seqlen_q).
    """
    # A name or path is parsed once per process (spec_key memoises it), not once per decode step.
    spec = spec if isinstance(spec, Spec) else spec_from_key(spec_key(spec))
    with torch.no_grad():
        extras = _Extras(rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad, (q_descale, k_descale, v_descale))
        out, lse = _attend(spec, q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, cache_batch_idx,
                           int(num_splits), pack_gqa, inputs, extras)
    return (out, lse) if spec.return_lse else out


@dataclass(frozen=True)
class _Extras:
    """The kvcache call's FlashAttention extras: rotary embedding tables and left padding."""

    rotary_cos: torch.Tensor | None = None
    rotary_sin: torch.Tensor | None = None
    rotary_interleaved: bool = True
    cache_leftpad: torch.Tensor | None = None
    descales: tuple = (None, None, None)   # an fp8 spec's (q, k, v) descales


def _attend(spec, q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, cache_batch_idx, num_splits,
            pack_gqa, inputs, extras=_Extras()):
    _check_call(spec, q, k_cache, v_cache, k_new, v_new, page_table, cache_batch_idx)
    mla = (spec.head_dim_qk, spec.head_dim_v) == MLA_HEAD_DIMS
    if mla:
        _check_mla(spec, k_cache, v_cache, k_new, v_new, cache_batch_idx, extras)
    _check_extras(spec, q, k_new, page_table, extras)
    batch, seqlen_q, heads_q, _ = q.shape
    lengths = _cache_lengths(cache_seqlens, batch, q.device)
    _check_devices(q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new, page_table=page_table,
                   cache_batch_idx=cache_batch_idx, cache_seqlens=lengths, rotary_cos=extras.rotary_cos,
                   rotary_sin=extras.rotary_sin, cache_leftpad=extras.cache_leftpad)
    # Once a call: the append, the forward and the combine take it (MLA decode finds its own).
    arch = None if mla else current_arch()
    seqlen_new = 0
    if k_new is not None:
        seqlen_new = k_new.shape[1]
        rotary = None
        if extras.rotary_cos is not None:
            # FlashAttention's rule: queries at their own positions under a causal or local mask.
            own = spec.mask != MaskKind.NONE or spec.mask_expr is not None
            rotary = Rotary(extras.rotary_cos, extras.rotary_sin, bool(extras.rotary_interleaved), q, own)
        rotated = append_to_cache(k_cache, v_cache, k_new, v_new, lengths, page_table, cache_batch_idx, rotary, arch)
        q = rotated if rotary is not None else q
    seqused = lengths + seqlen_new if seqlen_new else lengths
    if mla:
        return _attend_mla(spec, q, k_cache, seqused, page_table, num_splits)
    # A contiguous cache's decode step that fills the GPU: Hopper's TMA forward, heads as rows.
    plain = page_table is None and cache_batch_idx is None and extras.cache_leftpad is None and not num_splits
    rows = cache_rows_route(spec, arch, q, k_cache, pack_gqa) if plain else None
    if rows is not None:
        return forward_cache_rows(rows[0], arch, rows[1], q, k_cache, v_cache, seqused, inputs)
    # [0, seqlen_q, 2 seqlen_q, ...], kept per shape: no launch per step.
    cu_q = uniform_offsets(batch, seqlen_q, q.device)
    packed_q = q.reshape(batch * seqlen_q, heads_q, q.shape[-1])
    if page_table is not None:
        out, lse = forward_paged(spec, packed_q, k_cache, v_cache, page_table, cu_q, seqused, seqlen_q,
                                 num_splits or None, inputs, arch, pack_gqa=pack_gqa, descales=extras.descales)
    else:
        out, lse = _attend_contiguous(spec, packed_q, k_cache, v_cache, cu_q, seqused, seqlen_q, cache_batch_idx,
                                      num_splits, inputs, pack_gqa, extras.cache_leftpad, arch, extras.descales)
    return out.view(batch, seqlen_q, heads_q, -1), lse.view(heads_q, batch, seqlen_q).permute(1, 0, 2)


def _attend_contiguous(spec, packed_q, k_cache, v_cache, cu_q, seqused, seqlen_q, cache_batch_idx, num_splits,
                       inputs, pack_gqa, leftpad=None, arch=None, descales=None):
    """A contiguous cache as one packed key tensor: sequence b's keys start at row
    cache_batch_idx[b] * seqlen_cache (cu_seqlens_k's last entry is never read: seqused_k is set),
    plus cache_leftpad[b] (`leftpad`), its length then seqused[b] - cache_leftpad[b].
    A cache's unused slots may hold anything, NaN included: every kind forward_varlen picks keeps
    key rows past a sequence's length out of the result (zero-filled, or masked and zeroed)."""
    batch_cache, seqlen_cache, heads_kv, _ = k_cache.shape
    batch = cu_q.shape[0] - 1
    if cache_batch_idx is None:  # row b at b * seqlen_cache: the offsets of uniform lengths
        cu_k = uniform_offsets(batch, seqlen_cache, packed_q.device)
    else:
        rows = cache_batch_idx.to(torch.int32)
        cu_k = torch.cat([rows * seqlen_cache, rows.new_zeros(1)])
    if leftpad is not None:  # device ops (no sync): the offsets stay device values
        cu_k = cu_k + torch.nn.functional.pad(leftpad, (0, 1))
        seqused = (seqused - leftpad).clamp_(min=0)
    k = k_cache.view(batch_cache * seqlen_cache, heads_kv, k_cache.shape[-1])
    v = v_cache.view(batch_cache * seqlen_cache, heads_kv, v_cache.shape[-1])
    # Checked above (_check_call, _check_devices) and the sequence vectors made here: forward_varlen
    # checks only the strides.
    return forward_varlen(spec, packed_q, k, v, cu_q, cu_k, seqlen_q, seqlen_cache, seqused, num_splits or None,
                          inputs, arch, pack_gqa=pack_gqa, checked=True, descales=descales)


def uniform_offsets(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """int32 (batch + 1,) offsets 0, length, 2 * length, ... on `device`: the cu_seqlens of a batch
    whose sequences all have `length` rows. Made once per (batch, length, device) and kept, so a
    decode step launches no kernel to build them (a tiny kernel costs a few percent of a 0.15 ms
    decode); made afresh while a CUDA graph is being captured (memory from the graph's pool must
    not outlive it in a cache). Callers only read it."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return _offsets(batch, length, device)
    key = (batch, length, str(device))
    found = _OFFSETS.get(key)
    if found is None:
        if len(_OFFSETS) >= _OFFSETS_KEPT:
            _OFFSETS.pop(next(iter(_OFFSETS)))
        found = _OFFSETS[key] = _offsets(batch, length, device)
    return found


def _offsets(batch: int, length: int, device) -> torch.Tensor:
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * length


# uniform_offsets' tensors by (batch, length, device), oldest first; a serving loop meets a few shapes.
_OFFSETS: dict[tuple, torch.Tensor] = {}
_OFFSETS_KEPT = 64


def _check_mla(spec, k_cache, v_cache, k_new, v_new, cache_batch_idx, extras=_Extras()) -> None:
    """An MLA spec (qk 576, v 512) reads V from the latent cache itself: v_cache (and v_new)
    must be the first 512 columns of k_cache (and k_new)."""
    for name, v, k in (("v_cache", v_cache, k_cache), ("v_new", v_new, k_new)):
        if k is not None and not (v.data_ptr() == k.data_ptr() and v.shape[:3] == k.shape[:3]
                                  and v.stride() == k.stride()):
            raise UnsupportedError(f"{name} of MLA spec {spec.name!r}", [
                f"MLA decode reads V from the latent cache itself: pass {name} = "
                f"{'k_cache' if name == 'v_cache' else 'k_new'}[..., :512]"])
    if cache_batch_idx is not None:
        raise UnsupportedError("cache_batch_idx with an MLA spec", ["MLA decode reads sequence b from cache row b "
                                                                   "(or through page_table)"])
    if extras.rotary_cos is not None or extras.rotary_sin is not None or extras.cache_leftpad is not None:
        raise UnsupportedError("rotary_cos / rotary_sin / cache_leftpad with an MLA spec", [
            "MLA decode takes its rotary part already applied (the 64 rope columns of the latent cache) and "
            "sequences from slot 0"])


def _attend_mla(spec, q, k_cache, seqused, page_table, num_splits):
    """fa_gen.mla_decode over the latent cache (k_new was appended already)."""
    return mla_decode(q, k_cache, seqused, spec, block_table=page_table, num_splits=num_splits or None)


def _cache_lengths(cache_seqlens, batch: int, device) -> torch.Tensor:
    """cache_seqlens as an int32 (batch,) tensor (an int fills one on `device`)."""
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            raise InputError(f"cache_seqlens must be >= 0; got {cache_seqlens}")
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 \
            or tuple(cache_seqlens.shape) != (batch,):
        got = (f"{tuple(cache_seqlens.shape)} {cache_seqlens.dtype}" if isinstance(cache_seqlens, torch.Tensor)
               else type(cache_seqlens).__name__)
        raise InputError(f"cache_seqlens must be an int or an int32 tensor of shape ({batch},); got {got}")
    return cache_seqlens.contiguous()


def _check_extras(spec: Spec, q, k_new, page_table, extras: _Extras) -> None:
    """The rotary tables (both or neither, with k_new; (seqlen_ro, rotary_dim / 2) of q's dtype,
    rotary_dim a multiple of 16 up to the head dim) and cache_leftpad ((batch,) int32, not paged)."""
    cos, sin = extras.rotary_cos, extras.rotary_sin
    if cos is not None and spec.is_fp8:  # refused before the append: the cache is left as it was
        raise UnsupportedError(f"rotary tables with fp8 spec {spec.name!r}", [
            "the append kernel rotates 16-bit keys; rotate before quantizing to e4m3"])
    if not spec.is_fp8 and any(d is not None for d in extras.descales):
        raise InputError(f"q_descale / k_descale / v_descale go with an fp8 spec; spec {spec.name!r} is "
                         f"{spec.dtype.value}")
    if (cos is None) != (sin is None):
        raise InputError("rotary_cos and rotary_sin go together: pass both or neither")
    if cos is not None:
        if k_new is None:
            raise InputError("rotary_cos / rotary_sin need k_new and v_new: the new keys are what gets rotated "
                             "(as in FlashAttention's kvcache call)")
        for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise InputError(f"{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2)")
            if t.dtype != q.dtype:
                raise InputError(f"{name} has dtype {t.dtype}; it must be q's ({q.dtype})")
        if cos.shape != sin.shape or cos.shape[0] == 0:
            raise InputError(f"rotary_cos {tuple(cos.shape)} and rotary_sin {tuple(sin.shape)} must have one shape "
                             "(seqlen_ro >= 1, rotary_dim / 2)")
        dim = 2 * cos.shape[1]
        if dim == 0 or dim % 16 or dim > spec.head_dim_qk:
            raise InputError(f"rotary_dim (2 * rotary_cos.shape[1] = {dim}) must be a multiple of 16 from 16 to the "
                             f"head dim {spec.head_dim_qk}")
    pad = extras.cache_leftpad
    if pad is not None:
        if page_table is not None:
            raise UnsupportedError("cache_leftpad with page_table", [
                "left padding is for contiguous caches (FlashAttention refuses the pair too): a paged cache "
                "starts each sequence at its first page"])
        if not isinstance(pad, torch.Tensor) or pad.dtype != torch.int32 or tuple(pad.shape) != (q.shape[0],):
            raise InputError(f"cache_leftpad must be an int32 tensor of shape ({q.shape[0]},)")


def _check_call(spec: Spec, q, k_cache, v_cache, k_new, v_new, page_table, cache_batch_idx) -> None:
    """Shapes, dtypes and devices of the call's tensors (the kernels' own checks follow)."""
    if (k_new is None) != (v_new is None):
        raise InputError("k_new and v_new go together: pass both or neither")
    dtype = _TORCH_DTYPES[spec.dtype]
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if k_new is not None:
        named.update(k_new=k_new, v_new=v_new)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name} must be 4-D; got shape {tuple(t.shape)}")
        if t.dtype != dtype:
            raise InputError(f"{name} has dtype {t.dtype}; spec {spec.name!r} was built for {dtype}")
    _check_heads(spec, q, k_cache, v_cache)
    if k_new is not None:
        _check_new(k_cache, v_cache, k_new, v_new, q.shape[0])
    if page_table is not None:
        _check_page_table(page_table, q, cache_batch_idx)
        return
    if cache_batch_idx is not None:
        _check_batch_idx(cache_batch_idx, q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):  # viewed as (rows, heads_kv, d)
        if t.stride(0) != t.shape[1] * t.stride(1):
            raise InputError(f"{name}: the batch and sequence dimensions must be contiguous with each other "
                             f"(stride(0) == seqlen_cache * stride(1)); got strides {t.stride()}")


def _check_devices(**tensors) -> None:
    """Every tensor given (None: absent) on q's CUDA device; checked last, so that every other
    check runs on a machine without a GPU too."""
    device = tensors["q"].device
    for name, t in tensors.items():
        if t is None:
            continue
        if not t.is_cuda:
            raise InputError(f"{name} is on {t.device}; fa_gen kernels need CUDA tensors")
        if t.device != device:
            raise InputError(f"{name} is on {t.device}; q is on {device}")


def _check_heads(spec: Spec, q, k_cache, v_cache) -> None:
    if (q.shape[-1], k_cache.shape[-1], v_cache.shape[-1]) != (spec.head_dim_qk, spec.head_dim_qk, spec.head_dim_v):
        raise InputError(f"head dims must be q/k {spec.head_dim_qk}, v {spec.head_dim_v} (spec {spec.name!r}); got "
                         f"{q.shape[-1]}, {k_cache.shape[-1]}, {v_cache.shape[-1]}")
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[1] == 0:
        raise InputError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in every "
                         "dimension but the head dim, with at least one slot per page (or sequence)")
    if k_cache.shape[2] == 0 or q.shape[2] % k_cache.shape[2]:
        raise InputError(f"heads of q ({q.shape[2]}) must be a multiple of the caches' heads ({k_cache.shape[2]})")


def _check_new(k_cache, v_cache, k_new, v_new, batch: int) -> None:
    if k_new.shape[0] != batch or v_new.shape[0] != batch or k_new.shape[1] != v_new.shape[1]:
        raise InputError(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} must be (batch={batch}, "
                         "seqlen_new, heads_kv, d) with one seqlen_new")
    if k_new.shape[2:] != k_cache.shape[2:] or v_new.shape[2:] != v_cache.shape[2:]:
        raise InputError(f"k_new/v_new heads and head dims {tuple(k_new.shape[2:])}, {tuple(v_new.shape[2:])} must "
                         f"match the caches' {tuple(k_cache.shape[2:])}, {tuple(v_cache.shape[2:])}")


def _check_page_table(page_table, q, cache_batch_idx) -> None:
    if cache_batch_idx is not None:
        raise InputError("cache_batch_idx is for contiguous caches; a paged cache maps sequences by page_table")
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2:
        got = (f"{tuple(page_table.shape)} {page_table.dtype}" if isinstance(page_table, torch.Tensor)
               else type(page_table).__name__)
        raise InputError(f"page_table must be a 2-D int32 tensor (batch, max_pages); got {got}")
    if page_table.shape[0] != q.shape[0] or page_table.shape[1] == 0:
        raise InputError(f"page_table must have one row per sequence ({q.shape[0]}) and >= 1 page; "
                         f"got {tuple(page_table.shape)}")


def _check_batch_idx(cache_batch_idx, q) -> None:
    if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype not in (torch.int32, torch.int64) \
            or tuple(cache_batch_idx.shape) != (q.shape[0],):
        raise InputError(f"cache_batch_idx must be an int32/int64 tensor of shape ({q.shape[0]},)")
