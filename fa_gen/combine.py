"""Merging attention results by their log-sum-exp: split-KV's combine and `merge_attention_states`.

    out, lse = fa_gen.merge_attention_states(outs, lses)

Attention over a key set split into parts A and B is recoverable from each part's normalised
output and LSE: out = (e^L_A out_A + e^L_B out_B) / (e^L_A + e^L_B), lse = log(e^L_A + e^L_B).
The split-KV forward (fa_gen.inference) writes fp32 partials and merges them with
`combine_splits`; context-parallel attention merges the results of several devices the same
way. One CuTe DSL template (templates/common/combine.py.j2) serves both, compiled once per (head
dim, parts dtype, output dtype, variant, arch) and cached like every kernel; sizes and strides
are runtime values. Two variants: one lane group per (row, head) pair when there are many
pairs, one CTA per pair sharing its parts among lane groups when there are few (decode).
"""

from __future__ import annotations

import functools
import math

import torch

from .arch_table import programmatic_launch
from .errors import InputError
from .helper_kernels import load_helper_kernel
from .render import environment
from .runtime import current_arch
from .version import __version__

TEMPLATE = "common/combine.py.j2"
# Every multiple of 8 up to 512 (16-byte rows of bf16/fp16 parts; the forwards' head dims and MLA's 512).
HEAD_DIMS = tuple(range(8, 513, 8))
_DTYPES = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32"}
# Threads a CTA aims for: whole lane groups (head_dim / columns-per-lane threads each).
_THREADS = 128
# Threads a sliced CTA (one pair) aims for.
_SLICED_THREADS = 256
# One lane group per pair once there are this many threads: 4 unrolled 128-bit loads each keep
# ~4 MB in flight, more than an H200's bandwidth-latency product (~4.8 TB/s * 1 us). Fewer
# pairs (decode) share each pair's parts among slices of lanes.
_ENOUGH_THREADS = 1 << 16


def _lanes(head_dim: int, in_dtype: torch.dtype) -> int:
    """Threads per pair group: each lane loads 16 bytes of a part's row."""
    return head_dim // (16 // in_dtype.itemsize)


def render_combine(head_dim: int, dtype: torch.dtype, in_dtype: torch.dtype = torch.float32, slices: int = 1,
                   pdl: bool = False) -> str:
    """The combine kernel's source: parts of `in_dtype`, outputs of `dtype`, `head_dim` columns,
    each pair's parts shared by `slices` lane groups; `pdl`: launched as a programmatic dependent
    of the kernel before it (sm_90 on), overlapping its launch with that kernel's tail."""
    lanes = _lanes(head_dim, in_dtype)
    pairs = 1 if slices > 1 else max(1, _THREADS // lanes)
    return environment().get_template(TEMPLATE).render(
        head_dim=head_dim, dtype_name=_DTYPES[dtype], in_dtype_name=_DTYPES[in_dtype], pairs=pairs, slices=slices, pdl=pdl,
        fa_gen_version=__version__)


def slices_for(pairs: int, parts: int, head_dim: int, in_dtype: torch.dtype) -> int:
    """Lane groups per pair: 1 when the pairs alone give enough threads or there are few parts,
    else as many as fill _SLICED_THREADS (one sliced variant per head dim and dtypes, not one
    per split count: slices left without a part only cost a barrier)."""
    lanes = _lanes(head_dim, in_dtype)
    if pairs * lanes >= _ENOUGH_THREADS or parts < 4:
        return 1
    return max(1, _SLICED_THREADS // lanes)


@functools.lru_cache(maxsize=None)
def combine_kernel(head_dim: int, dtype: torch.dtype, arch: str, in_dtype: torch.dtype = torch.float32,
                   slices: int = 1):
    """The compiled combine for (head_dim, dtype, in_dtype, slices) on `arch`, from the cache or built."""
    source = render_combine(head_dim, dtype, in_dtype, slices, pdl=programmatic_launch(arch))
    return load_helper_kernel(source, f"combine_d{head_dim}_{_DTYPES[in_dtype]}_{_DTYPES[dtype]}_s{slices}",
                              "combine", arch)


def combine_splits(o_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   slices: int | None = None, arch: str | None = None) -> None:
    """Merge o_partial (S, rows, heads, d) fp32 (or out's dtype) and lse_partial (S, heads, rows)
    into `out` (rows, heads, d) and `lse` (heads, rows), in place. The split forward's internal
    contract: shapes and alignment are not re-checked here. `slices` pins the kernel variant
    (tests); None picks it from the shapes. `arch`: the caller's, when it has it (else the current device's)."""
    parts, rows, heads, head_dim = o_partial.shape
    slices = slices or slices_for(rows * heads, parts, head_dim, o_partial.dtype)
    kernel = combine_kernel(head_dim, out.dtype, arch or current_arch(), o_partial.dtype, slices)
    kernel(o_partial, lse_partial, out, lse)


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (*rows, heads, d) in outs' dtype, lse (*rows, heads) fp32) of S partial results:
    outs (S, *rows, heads, d) fp32/bf16/fp16, each normalised over its own keys; lses
    (S, *rows, heads) fp32, natural log, -inf where a part saw no key (its output is weighted by
    0, so it must be finite, e.g. 0: a branch-free sum keeps the loads batched). Rows every part
    leaves empty get out 0 and lse -inf. Deterministic: parts are summed in a fixed order."""
    _check_states(outs, lses)
    parts, heads, head_dim = outs.shape[0], outs.shape[-2], outs.shape[-1]
    rows_shape = outs.shape[1:-2]
    rows = math.prod(rows_shape)
    out = torch.empty((*rows_shape, heads, head_dim), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((*rows_shape, heads), dtype=torch.float32, device=outs.device)
    if rows * heads == 0:
        return out, lse
    # reshape is a view whenever the row dims merge; the kernel reads any strides but 16-byte rows.
    o_parts = _aligned(outs.reshape(parts, rows, heads, head_dim))
    lse_parts = lses.reshape(parts, rows, heads).transpose(1, 2)
    combine_splits(o_parts, lse_parts, out.view(rows, heads, head_dim), lse.view(rows, heads).t())
    return out, lse


def _aligned(parts: torch.Tensor) -> torch.Tensor:
    """`parts` itself when its rows start on 16-byte boundaries with unit column stride (what
    the kernel's 128-bit loads assume), else a fresh contiguous (hence aligned) copy."""
    step = 16 // parts.element_size()
    strides_ok = parts.stride(-1) == 1 and all(s % step == 0 for s in parts.stride()[:-1])
    return parts if strides_ok and parts.data_ptr() % 16 == 0 else parts.clone(memory_format=torch.contiguous_format)


def merge_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_attention_states in float64 torch ops, written from the definition: the oracle of
    the tests (out (*rows, heads, d) float64, lse (*rows, heads) float64)."""
    lses = lses.double()
    top = lses.max(dim=0).values
    ref = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lses - ref)
    total = weights.sum(dim=0)
    out = (weights.unsqueeze(-1) * outs.double()).sum(dim=0) / torch.where(total > 0, total, 1).unsqueeze(-1)
    lse = torch.where(total > 0, ref + torch.log(total), torch.full_like(total, -math.inf))
    return out, lse


def _check_states(outs, lses) -> None:
    if not isinstance(outs, torch.Tensor) or not isinstance(lses, torch.Tensor):
        raise InputError("outs and lses must be torch.Tensors")
    if outs.dtype not in _DTYPES:
        raise InputError(f"outs must be float32, bfloat16 or float16; got {outs.dtype}")
    if lses.dtype != torch.float32:
        raise InputError(f"lses must be float32 (natural-log LSEs); got {lses.dtype}")
    if outs.dim() < 3 or tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise InputError(f"outs must be (parts, *rows, heads, head_dim) and lses (parts, *rows, heads); got "
                         f"{tuple(outs.shape)} and {tuple(lses.shape)}")
    if outs.shape[0] < 1:
        raise InputError("there must be at least one part to merge")
    if outs.shape[-1] not in HEAD_DIMS:
        raise InputError(f"head_dim must be a multiple of 8 from 8 to 512; got {outs.shape[-1]}")
    if not outs.is_cuda or lses.device != outs.device:
        raise InputError(f"outs and lses must be CUDA tensors on one device; got {outs.device} and {lses.device}")
