"""Appending new keys and values to a KV cache: one kernel launch for K and V.

    append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, cache_batch_idx)

Token j of sequence b lands at position cache_seqlens[b] + j of that sequence's keys: through
the page table for paged caches, at cache row cache_batch_idx[b] (or b) for contiguous ones. The
CuTe DSL kernel (templates/common/append_kv.py.j2) is compiled once per (dtype, head dims, row
lookup, arch) and cached like every kernel; sizes, strides and the page size are runtime values.
It replaces eight PyTorch launches (index math, two index_put_) by one. Tensors whose rows are
not 16-byte aligned, head dims not a multiple of 8 elements, and CPU tensors take the PyTorch
path, which computes the same positions.
"""

from __future__ import annotations

import functools

import torch

from .helper_kernels import load_helper_kernel
from .render import environment
from .runtime import current_arch
from .version import __version__

TEMPLATE = "common/append_kv.py.j2"
_DTYPES = {torch.bfloat16: "BFloat16", torch.float16: "Float16"}


def render_append(dtype: torch.dtype, head_dim_k: int, head_dim_v: int, rows: str) -> str:
    """The append kernel's source; `rows`: "pages", "index" or "batch" (see the template)."""
    return environment().get_template(TEMPLATE).render(
        dtype_name=_DTYPES[dtype], head_dim_k=head_dim_k, head_dim_v=head_dim_v, rows=rows,
        fa_gen_version=__version__)


@functools.lru_cache(maxsize=None)
def append_kernel(dtype: torch.dtype, head_dim_k: int, head_dim_v: int, rows: str, arch: str):
    """The compiled append for (dtype, head dims, row lookup) on `arch`, from the cache or built."""
    source = render_append(dtype, head_dim_k, head_dim_v, rows)
    return load_helper_kernel(source, f"append_kv_{_DTYPES[dtype]}_k{head_dim_k}_v{head_dim_v}_{rows}", "append_kv",
                              arch)


def append_to_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    cache_seqlens: torch.Tensor, page_table: torch.Tensor | None = None,
                    cache_batch_idx: torch.Tensor | None = None) -> None:
    """Write k_new/v_new (batch, seqlen_new, heads_kv, d) into the caches in place at positions
    cache_seqlens[b] + j (cache_seqlens int32 (batch,) on the device). Shapes are the caller's
    to check (fa_gen.api.kvcache does)."""
    if k_new.shape[0] * k_new.shape[1] == 0:
        return
    if not _kernel_ready(k_cache, v_cache, k_new, v_new):
        _append_torch(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, cache_batch_idx)
        return
    if page_table is not None:
        rows, lookup = page_table, "pages"
    elif cache_batch_idx is not None:
        rows, lookup = cache_batch_idx.to(torch.int32), "index"
    else:
        rows, lookup = cache_seqlens, "batch"  # not read
    kernel = append_kernel(k_new.dtype, k_new.shape[-1], v_new.shape[-1], lookup, current_arch())
    kernel(k_new, v_new, k_cache, v_cache, cache_seqlens, rows)


def _kernel_ready(*tensors: torch.Tensor) -> bool:
    """CUDA tensors of a kernel dtype with unit column stride, 16-byte aligned rows and head
    dims a multiple of 16 bytes (what the kernel's 128-bit accesses assume)."""
    for t in tensors:
        step = 16 // t.element_size()
        if not t.is_cuda or t.dtype not in _DTYPES or t.stride(-1) != 1 or t.data_ptr() % 16 \
                or t.shape[-1] % step or any(s % step for s in t.stride()[:-1]):
            return False
    return True


def _append_torch(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, cache_batch_idx) -> None:
    """The same writes in PyTorch ops (index tensors computed on the device, no host sync)."""
    batch, seqlen_new = k_new.shape[:2]
    positions = cache_seqlens.to(torch.int64)[:, None] + torch.arange(seqlen_new, device=k_new.device)
    if page_table is not None:
        page_size = k_cache.shape[1]
        pages = torch.gather(page_table, 1, positions // page_size).to(torch.int64)
        index = (pages, positions % page_size)
    else:
        rows = cache_batch_idx.to(torch.int64) if cache_batch_idx is not None else \
            torch.arange(batch, device=k_new.device)
        index = (rows[:, None].expand(batch, seqlen_new), positions)
    k_cache.index_put_(index, k_new)
    v_cache.index_put_(index, v_new)
