"""The backward pass of a packed (varlen) batch: the `backward_varlen` kernel of the preferred
family that renders it (Hopper's own on sm_90a where its backward serves the spec's head dims and
its varlen forward the spec, templates/sm90/backward.py.j2; the sm80 family's elsewhere).

    dq, dk, dv = backward_varlen(spec, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k)

Layouts as fa_gen.inference.forward_varlen takes and returns them: q/out/dout (total_q, hq, d),
k/v (total_k, hkv, d), lse (hq, total_q) fp32. Sequence b's workspace rows (fp32 dQ accumulator,
LSE in base 2, D, per-tile counters) start at 128 * ((cu_seqlens_q[b] + 128 * b) // 128)
(templates/common/seqlen.j2, workspace_offset), so the workspaces are sized from total_q and the
batch alone: nothing on the call path reads the device. Keys past seqused_k[b] (or outside every
sequence) are not attended and get dK = dV = 0: the sm90 kernel zeroes the rows outside every
sequence itself, and dq, dk, dv start zeroed where it does not (the sm80 kernel; dk and dv past
seqused_k). Both families' kernels take the same arguments and workspaces.
"""

from __future__ import annotations

import functools

import torch

from .errors import InputError
from .families.warp_tiles import padded_head_dim
from .inference import _check_tensor, _check_varlen, _varlen_extra_arguments
from .runtime import current_arch, load_target
from .spec import Spec
from .target import resolve_target

KIND = "backward_varlen"
# Rows every sequence's workspace start is rounded to (every backward tile_m divides it).
ROW_ALIGN = 128
# The smallest backward tile_m: per-query-tile counters are sized for it.
MIN_TILE_M = 32


def backward_varlen(spec: Spec, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                    max_seqlen_q: int, max_seqlen_k: int, seqused_k: torch.Tensor | None = None,
                    deterministic: bool = False, inputs=None, arch: str | None = None,
                    family: str | None = None):
    """(dq, dk, dv) of a packed batch for the upstream gradient `dout` of `out` (see the module
    docstring); `deterministic` makes them bitwise reproducible. `family` pins the kernel's
    family (else the preferred one that renders the kind)."""
    _check_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    _check_outputs(spec, q, out, dout, lse)
    family_name, function = kernel_function(spec, arch or current_arch(), KIND, family)
    batch = cu_seqlens_q.shape[0] - 1
    if q.shape[0] == 0 or k.shape[0] == 0 or batch == 0:
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dq, dk, dv = _gradients(family_name, q, k, v, seqused_k is not None)
    extra = _varlen_extra_arguments(spec, q, q.shape[1], inputs)
    used = seqused_k if seqused_k is not None else cu_seqlens_k
    sequences = (cu_seqlens_q, cu_seqlens_k, used, int(seqused_k is not None), max(int(max_seqlen_q), 1),
                 max(int(max_seqlen_k), 1))
    function(q, k, v, out, dout, lse, dq, dk, dv, *_workspace(q, batch, padded_head_dim(spec.head_dim_qk)), int(bool(deterministic)),
             *sequences, *extra)
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def kernel_function(spec: Spec, arch: str, kind: str, family: str | None):
    """(family name, compiled function) of the `kind` varlen backward, resolved and loaded once
    per (spec, arch, kind, family): the call path then does no lookup."""
    target = resolve_target(spec, arch, kind, family)
    return target.family.name, load_target(target)[0]


def _gradients(family: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: bool):
    """dq, dk, dv as the kernel writes them: the sm90 kernel writes every row of every sequence
    and zeroes those outside them (but not the keys past seqused_k), the sm80 one only the rows
    of the sequences' attended keys and queries (the rest must start at 0)."""
    def make(t: torch.Tensor, written: bool) -> torch.Tensor:
        return (torch.empty if written else torch.zeros)(t.shape, dtype=t.dtype, device=t.device)

    own = family == "sm90"
    return make(q, own), make(k, own and not used), make(v, own and not used)


def _workspace(q: torch.Tensor, batch: int, head_dim_qk: int):
    """(dq_accum, lse_log2, dpsum, semaphore), each (1, heads_q, padded rows [* head_dim_qk]): room
    for every sequence's padded region (see the module docstring). The kernels write every word
    before reading it (the pre-pass; Hopper's main kernel zeroes the accumulator of sequences up
    to 4,096 rows)."""
    heads_q = q.shape[1]
    rows = -(-(q.shape[0] + ROW_ALIGN * (batch + 1)) // ROW_ALIGN) * ROW_ALIGN
    sizes = (rows * head_dim_qk, rows, rows)
    buffer = torch.empty(heads_q * sum(sizes), dtype=torch.float32, device=q.device)
    parts, offset = [], 0
    for size in sizes:
        parts.append(buffer[offset:offset + heads_q * size].view(1, heads_q, size))
        offset += heads_q * size
    semaphore = torch.empty((1, heads_q, rows // MIN_TILE_M), dtype=torch.int32, device=q.device)
    return (*parts, semaphore)


def _check_outputs(spec: Spec, q, out, dout, lse) -> None:
    for name, t in (("out", out), ("dout", dout)):
        _check_tensor(spec, name, t, 3, "(total_q, heads_q, head_dim_v)")
        if tuple(t.shape) != (*q.shape[:2], spec.head_dim_v):
            raise InputError(f"{name} must have shape {(*q.shape[:2], spec.head_dim_v)} (q's with v's head_dim); "
                             f"got {tuple(t.shape)}")
    expected = (q.shape[1], q.shape[0])
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or tuple(lse.shape) != expected \
            or not lse.is_contiguous():
        got = f"{tuple(lse.shape)} {lse.dtype}" if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise InputError(f"lse must be contiguous float32 of shape {expected} (heads_q, total_q), as the forward "
                         f"returns it; got {got}")
    for name, t in (("out", out), ("dout", dout), ("lse", lse)):
        if t.device != q.device:
            raise InputError(f"{name} is on {t.device}; q is on {q.device}")
