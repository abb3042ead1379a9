"""Appending new keys and values to a KV cache: one kernel launch for K and V.

    append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, cache_batch_idx)
    q_rotated = append_to_cache(..., rotary=Rotary(cos, sin, interleaved, q, own_positions))

Token j of sequence b lands at position cache_seqlens[b] + j of that sequence's keys: through
the page table for paged caches, at cache row cache_batch_idx[b] (or b) for contiguous ones. The
CuTe DSL kernel (templates/common/append_kv.py.j2) is compiled once per (dtype, head dims, row
lookup, arch) and cached like every kernel; sizes, strides and the page size are runtime values.
It replaces eight PyTorch launches (index math, two index_put_) by one. Tensors whose rows are
not 16-byte aligned, head dims not a multiple of 8 elements, and CPU tensors take the PyTorch
path, which computes the same positions.

With `rotary` (FlashAttention's `rotary_cos` / `rotary_sin` of its kvcache call) the same launch
rotates the first rotary_dim columns of every new key on its way into the cache (at its cache
position) and writes the rotated queries to a new tensor, which the call returns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .helper_kernels import load_helper_kernel
from .render import environment
from .runtime import current_arch
from .version import __version__

TEMPLATE = "common/append_kv.py.j2"
_DTYPES = {torch.bfloat16: "BFloat16", torch.float16: "Float16"}
ROTARY_STYLES = ("none", "interleaved", "halves")


@dataclass(frozen=True)
class Rotary:
    """A rotary embedding applied by the append: tables cos / sin (seqlen_ro, rotary_dim / 2) of
    q's dtype; `interleaved` pairs columns (2m, 2m + 1), else (m, m + rotary_dim / 2) (GPT-NeoX);
    the queries q (batch, seqlen_q, heads_q, d) sit at positions cache_seqlens[b] + i
    (`own_positions`) or all at cache_seqlens[b]."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool
    q: torch.Tensor
    own_positions: bool

    @property
    def dim(self) -> int:
        return 2 * self.cos.shape[1]

    @property
    def style(self) -> str:
        return "interleaved" if self.interleaved else "halves"


def render_append(dtype: torch.dtype, head_dim_k: int, head_dim_v: int, rows: str, rotary: str = "none",
                  rotary_dim: int = 0) -> str:
    """The append kernel's source; `rows`: "pages", "index" or "batch"; `rotary`: one of
    ROTARY_STYLES over the first `rotary_dim` columns (see the template)."""
    assert rotary in ROTARY_STYLES, rotary
    return environment().get_template(TEMPLATE).render(
        dtype_name=_DTYPES[dtype], head_dim_k=head_dim_k, head_dim_v=head_dim_v, rows=rows, rotary=rotary,
        rotary_dim=rotary_dim if rotary != "none" else 0, fa_gen_version=__version__)


@functools.lru_cache(maxsize=None)
def append_kernel(dtype: torch.dtype, head_dim_k: int, head_dim_v: int, rows: str, arch: str, rotary: str = "none",
                  rotary_dim: int = 0):
    """The compiled append for (dtype, head dims, row lookup, rotary) on `arch`, from the cache or built."""
    source = render_append(dtype, head_dim_k, head_dim_v, rows, rotary, rotary_dim)
    suffix = f"_rot{rotary[0]}{rotary_dim}" if rotary != "none" else ""
    return load_helper_kernel(source, f"append_kv_{_DTYPES[dtype]}_k{head_dim_k}_v{head_dim_v}_{rows}{suffix}",
                              "append_kv", arch)


def append_to_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    cache_seqlens: torch.Tensor, page_table: torch.Tensor | None = None,
                    cache_batch_idx: torch.Tensor | None = None, rotary: Rotary | None = None,
                    arch: str | None = None):
    """Write k_new/v_new (batch, seqlen_new, heads_kv, d) into the caches in place at positions
    cache_seqlens[b] + j (cache_seqlens int32 (batch,) on the device). With `rotary`, the keys go
    in rotated and the rotated queries are returned (a new tensor); else None. Shapes are the
    caller's to check (fa_gen.api.kvcache does); `arch`: the caller's, else the current device's."""
    if rotary is not None and not k_new.shape[0] * (k_new.shape[1] + rotary.q.shape[1]):
        return torch.empty_like(rotary.q)
    if rotary is None and k_new.shape[0] * k_new.shape[1] == 0:
        return None
    tables = () if rotary is None else (rotary.q, rotary.cos, rotary.sin)
    if not _kernel_ready(k_cache, v_cache, k_new, v_new, *tables):
        return _append_torch(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, cache_batch_idx, rotary)
    if page_table is not None:
        rows, lookup = page_table, "pages"
    elif cache_batch_idx is not None:
        rows, lookup = cache_batch_idx.to(torch.int32), "index"
    else:
        rows, lookup = cache_seqlens, "batch"  # not read
    style, dim = (rotary.style, rotary.dim) if rotary is not None else ("none", 0)
    kernel = append_kernel(k_new.dtype, k_new.shape[-1], v_new.shape[-1], lookup, arch or current_arch(), style, dim)
    if rotary is None:
        kernel(k_new, v_new, k_cache, v_cache, cache_seqlens, rows)
        return None
    q_out = torch.empty_like(rotary.q)
    kernel(k_new, v_new, k_cache, v_cache, cache_seqlens, rows, rotary.q, q_out, rotary.cos, rotary.sin,
           int(rotary.own_positions))
    return q_out


def _kernel_ready(*tensors: torch.Tensor) -> bool:
    """CUDA tensors of a kernel dtype with unit column stride, 16-byte aligned rows and head
    dims a multiple of 16 bytes (what the kernel's 128-bit accesses assume)."""
    for t in tensors:
        step = 16 // t.element_size()
        if not t.is_cuda or t.dtype not in _DTYPES or t.stride(-1) != 1 or t.data_ptr() % 16 \
                or t.shape[-1] % step or any(s % step for s in t.stride()[:-1]):
            return False
    return True


def _append_torch(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, cache_batch_idx, rotary=None):
    """The same writes in PyTorch ops (index tensors computed on the device, no host sync);
    with `rotary`, the rotated queries are returned."""
    batch, seqlen_new = k_new.shape[:2]
    positions = cache_seqlens.to(torch.int64)[:, None] + torch.arange(seqlen_new, device=k_new.device)
    q_out = None
    if rotary is not None:
        k_new = rotate(k_new, rotary.cos, rotary.sin, positions, rotary.interleaved)
        seqlen_q = rotary.q.shape[1]
        steps = torch.arange(seqlen_q, device=k_new.device) * int(rotary.own_positions)
        q_out = rotate(rotary.q, rotary.cos, rotary.sin, cache_seqlens.to(torch.int64)[:, None] + steps,
                       rotary.interleaved)
    if batch * seqlen_new == 0:
        return q_out
    if page_table is not None:
        page_size = k_cache.shape[1]
        pages = torch.gather(page_table, 1, positions // page_size).to(torch.int64)
        index = (pages, positions % page_size)
    else:
        rows = cache_batch_idx.to(torch.int64) if cache_batch_idx is not None else \
            torch.arange(batch, device=k_new.device)
        index = (rows[:, None].expand(batch, seqlen_new), positions)
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        if cache.dtype == torch.float8_e4m3fn:  # e4m3 values moved as their bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.index_put_(index, new)
    return q_out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool):
    """x (batch, s, heads, d) with its first 2 * cos.shape[1] columns rotated by the angles of
    rows positions (batch, s) of the tables (clamped to them, as the kernel does), in float32,
    returned in x's dtype: the append kernel's arithmetic in PyTorch ops."""
    half = cos.shape[1]
    rows = positions.clamp(0, cos.shape[0] - 1)
    c, s = cos[rows].float()[:, :, None, :], sin[rows].float()[:, :, None, :]  # (batch, s, 1, half)
    head, tail = x[..., :2 * half].float(), x[..., 2 * half:]
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = head[..., :half], head[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((turned.to(x.dtype), tail), dim=-1)
