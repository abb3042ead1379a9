"""The backward pass on torch tensors: a compiled backward kernel behind input checks.

`build_backward(spec)` renders and compiles (or loads from the cache) the `backward` kernel of
the family serving (spec, arch). The returned `Backward` validates its inputs as `Kernel` does,
allocates the fp32 workspaces and calls the compiled host function once; that function
launches the pre-pass, the main kernel and the dQ post-pass on PyTorch's current stream.

    bwd = fa_gen.backward.build_backward("causal_bf16_d128")
    dq, dk, dv = bwd(dout, q, k, v, out, lse)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, inputs={...})   # a spec with inputs: the forward's
"""

from __future__ import annotations

import functools
import os

import torch

from .backward_plan import BackwardPlan, make_backward_plan
from .errors import InputError
from .families.warp_tiles import padded_head_dim
from .plan import memoised_plan
from .runtime import CompiledKernel, _check_shapes, _check_strides, current_arch, load_target, resolve_spec
from .spec import Spec
from .target import resolve_target

# Workspace rows are padded to a multiple of this (every backward tile_m divides it), and the
# per-query-tile semaphores are sized for the smallest tile_m any family uses.
ROW_ALIGN = 128
MIN_TILE_M = 32
KIND = "backward"


class Backward(CompiledKernel):
    """A compiled backward kernel for one spec on one arch: `dq, dk, dv = bwd(dout, q, k, v, out, lse)`."""

    def __init__(self, spec: Spec, arch: str, function, info):
        super().__init__(spec, arch, function, info)
        # Plans of masks that read no tensor, by shapes, device and scalars (fa_gen.backward_plan).
        self._plans: dict[tuple, BackwardPlan] = {}

    def __call__(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, deterministic: bool = False, inputs=None,
                 plan: BackwardPlan | None = None, *, checked: bool = False):
        """Gradients of the attention output `out` (with its `lse`, both from the forward) for
        the upstream gradient `dout`. With `deterministic`, results are bitwise reproducible.
        `inputs`: the spec's declared inputs, as the forward took them; or `plan`: those inputs
        checked and the mask classified once by `self.plan` (fa_gen.backward_plan).
        `checked` (fa_gen.autograd's eager backward): q, k, v passed the forward's checks, out
        and lse are its results and dout is a contiguous gradient of out (autograd gives it
        out's shape, dtype and device): only dout's alignment is checked (the rest is 20-30 us
        of host time a call, which a short backward's GPU waits for)."""
        if checked:
            _check_strides("dout", dout)
        else:
            self._check(dout, q, k, v, out, lse)
        extra = self._extra_arguments(q, k, inputs, plan)
        # empty_like with the format spelled out: a third of torch.empty(shape, dtype=, device=)'s host time.
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        if q.numel() == 0 or k.numel() == 0:
            return dq.zero_(), dk.zero_(), dv.zero_()
        workspace = _workspace(q, padded_head_dim(self.spec.head_dim_qk))
        self._function(q, k, v, out, dout, lse, dq, dk, dv, *workspace, int(bool(deterministic)), *extra)
        return dq, dk, dv

    def plan(self, q: torch.Tensor, k: torch.Tensor, inputs=None) -> BackwardPlan:
        """The spec's inputs checked, and its mask expression classified for this kernel's tiles,
        for calls with q's and k's shapes: pass it as `bwd(..., plan=...)`."""
        for name, t in (("q", q), ("k", k)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise InputError(f"{name} must be a 4-D torch.Tensor (batch, seqlen, heads, head_dim)")
        if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
            raise InputError(f"heads of q ({q.shape[2]}) must be a multiple of heads of k ({k.shape[2]}) (GQA/MQA)")
        return make_backward_plan(self.spec, self._tiles, q, k, inputs)

    def _extra_arguments(self, q, k, inputs, plan) -> tuple:
        """What the kernel takes after `deterministic`: the spec's inputs and mask schedule, if any."""
        if plan is not None:
            if inputs is not None:
                raise InputError("pass inputs or a plan (which holds its inputs), not both")
            if not isinstance(plan, BackwardPlan):
                raise InputError("this plan was made for the forward kernel; make the backward's with Backward.plan")
            plan.check_call(self.spec, self._tiles, q, k, backward=True)
            return plan.arguments
        if not (self.spec.inputs or inputs or self.spec.mask_expr):
            return ()
        return memoised_plan(self._plans, self.spec, q, k, inputs, self.plan).arguments

    @functools.cached_property
    def _tiles(self) -> tuple[int, int]:
        """(tile_m, tile_n) of this backward kernel (its render context): what a mask is classified for."""
        if self.spec.mask_expr is None:
            return (0, 0)
        tiles = self.family.kind_context(self.spec, self.arch, KIND)["bwd"]
        return tiles["tile_m"], tiles["tile_n"]

    def _check(self, dout, q, k, v, out, lse) -> None:
        spec = self.spec
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self._dtype:
                raise InputError(f"{name} has dtype {t.dtype}; spec {spec.name!r} was built for {self._dtype}")
            if t.dim() != 4:
                raise InputError(f"{name} must be 4-D (batch, seqlen, heads, head_dim); got shape {tuple(t.shape)}")
            _check_strides(name, t)
        _check_shapes(spec, q, k, v)
        expected_out = (*q.shape[:3], spec.head_dim_v)
        for name, t in (("out", out), ("dout", dout)):
            if tuple(t.shape) != expected_out:
                raise InputError(f"{name} must have shape {expected_out} (q's with v's head_dim); got {tuple(t.shape)}")
        expected_lse = (q.shape[0], q.shape[2], q.shape[1])
        if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or tuple(lse.shape) != expected_lse:
            got = f"{tuple(lse.shape)} {lse.dtype}" if isinstance(lse, torch.Tensor) else type(lse).__name__
            raise InputError(f"lse must be float32 of shape {expected_lse} (batch, heads_q, seqlen_q); got {got}")
        if not lse.is_contiguous():
            raise InputError("lse must be contiguous (as the forward returns it)")
        # Device last: every other check above can then be tested without a GPU.
        tensors = (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse))
        for name, t in tensors:
            if not t.is_cuda:
                raise InputError(f"{name} is on {t.device}; fa_gen kernels need CUDA tensors")
        if len({t.device for _, t in tensors}) > 1:
            raise InputError("q, k, v, out, dout, lse must be on one device; got "
                             + ", ".join(f"{n} {t.device}" for n, t in tensors))


def _workspace(q: torch.Tensor, head_dim_qk: int):
    """(dq_accum, lse_log2, dpsum, semaphore): fp32 dQ accumulator (b, heads_q, rows * head_dim_qk),
    per-row LSE * log2(e) and D (b, heads_q, rows), int32 per-query-tile counters. One
    allocation serves all four; the kernels write every word before reading it (the pre-pass;
    Hopper's main kernel zeroes the accumulator of sequences up to 4,096 query rows)."""
    batch, seqlen_q, heads_q, _ = q.shape
    rows = -(-seqlen_q // ROW_ALIGN) * ROW_ALIGN
    # A counter per tile of the padded rows: Hopper's pre-pass zeroes those of its whole 128-row
    # blocks (two tiles of 64 rows each even where seqlen_q <= 32), not only the tiles of seqlen_q.
    tiles = rows // MIN_TILE_M
    sizes = (rows * head_dim_qk, rows, rows, tiles)
    # One allocation for all four (the counters as int32 words of the same 4-byte elements), cut
    # by as_strided: one view each (a slice then a view cost twice the host time).
    buffer = torch.empty(batch * heads_q * sum(sizes), dtype=torch.float32, device=q.device)
    parts, offset = [], 0
    for size in sizes:
        parts.append(buffer.as_strided((batch, heads_q, size), (heads_q * size, size, 1), offset))
        offset += batch * heads_q * size
    parts[-1] = parts[-1].view(torch.int32)
    return tuple(parts)


def backward_family(spec: Spec, arch: str) -> str:
    """The first family, in the registry's preference order, that serves (spec, arch) and renders
    a backward kernel for it: a family without one, or whose backward refuses the spec (Hopper's
    above head dim 128), leaves the backward to the next."""
    return resolve_target(spec, arch, KIND).family.name


_BACKWARDS: dict[tuple[object, str, str | None], Backward] = {}


def build_backward(spec: Spec | str | os.PathLike, arch: str | None = None, family: str | None = None) -> Backward:
    """Load `spec` (a Spec, a YAML path, or a shipped spec's name), then compile or load its
    backward kernel, rendered by `family` or else by `backward_family(spec, arch)`."""
    arch = arch or current_arch()
    memo_key = (spec if isinstance(spec, Spec) else os.fspath(spec), arch, family)
    backward = _BACKWARDS.get(memo_key)
    if backward is None:
        resolved = resolve_spec(spec)
        function, info = load_target(resolve_target(resolved, arch, KIND, family))
        backward = _BACKWARDS[memo_key] = Backward(resolved, arch, function, info)
    return backward
