"""Context-parallel (ring) attention: a sequence sharded over the ranks of a process group, K/V
shards passed around the ring, partial results merged by their LSE (fa_gen.distributed.ring).

    out, lse = fa_gen.distributed.ring_attention(q, k, v, spec, group=None, layout="zigzag")

q, k, v are this rank's shards, (batch, seqlen / world, heads, dim), cut from the whole sequence
by `layout` (fa_gen.distributed.layout: "contiguous", or "zigzag", which balances causal work);
`shard` / `unshard` make and undo them. Masks and expressions see positions in the whole
sequence. Differentiable: the backward sends dK/dV around the ring with their shards. out is
this rank's rows (q's dtype), lse (batch, heads, seqlen / world) fp32.

    out, lse = fa_gen.distributed.simulate_ring_attention(q, k, v, spec, world=4, layout="zigzag")

runs the same rank programs for `world` ranks in one process, on whole-sequence tensors (a
single GPU, or the CPU with blocks="reference"): the test of the ring's logic without a second
GPU. blocks: "kernels" (fa_gen's compiled kernels; the default on CUDA tensors) or "reference"
(float64 torch at global positions; out and lse float64).

Served now: on the kernels, masks none / causal / sliding window (either alignment) and score
mods that read no position (the shifted kinds move the window's diagonal per block); on the
reference blocks, every mask, mask expression and score mod. Sink logits are refused on both.
"""

from __future__ import annotations

import torch

from ..errors import InputError, UnsupportedError
from ..runtime import resolve_spec
from ..spec import Spec
from .blocks import KernelBlocks, ReferenceBlocks
from .layout import LAYOUTS, Chunk, Layout
from .ring import backward_program, forward_program, run_distributed, run_simulated

__all__ = ["LAYOUTS", "Chunk", "Layout", "ring_attention", "shard", "simulate_ring_attention", "unshard"]


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "contiguous") -> torch.Tensor:
    """Rank `rank`'s shard of a whole-sequence tensor (batch, seqlen, ...)."""
    return Layout(layout, world, x.shape[1]).shard(x, rank)


def unshard(shards: list[torch.Tensor], layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard, the sequence on `dim`."""
    return Layout(layout, len(shards), sum(s.shape[dim] for s in shards)).unshard(shards, dim)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Spec | str, group=None,
                   layout: str = "contiguous", deterministic: bool | None = None, inputs=None):
    """This rank's (out, lse) of attention over the whole sequence the group's shards make up."""
    import torch.distributed as dist

    spec = _checked(spec, q, k, v)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shape = Layout(layout, world, q.shape[1] * world)
    blocks = _blocks(spec, q, "kernels" if q.is_cuda else "reference", _deterministic(deterministic), inputs,
                     shape.seqlen)
    run = lambda programs: [run_distributed(programs[0], group)]  # noqa: E731
    return _RingFunction.apply(q, k, v, (shape, [rank], blocks, run, False))


def simulate_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Spec | str, world: int,
                            layout: str = "contiguous", blocks: str | None = None,
                            deterministic: bool | None = None, inputs=None):
    """ring_attention's rank programs for `world` simulated ranks over whole-sequence q, k, v:
    (out, lse) of the whole sequence."""
    spec = _checked(spec, q, k, v)
    shape = Layout(layout, world, q.shape[1])
    kind = blocks or ("kernels" if q.is_cuda else "reference")
    chosen = _blocks(spec, q, kind, _deterministic(deterministic), inputs, shape.seqlen)
    return _RingFunction.apply(q, k, v, (shape, list(range(world)), chosen, run_simulated, True))


class _RingFunction(torch.autograd.Function):
    """The ring's forward and backward for the ranks this process runs: one (ring_attention)
    or all of them (the simulation, which shards and unshards around them)."""

    @staticmethod
    def forward(ctx, q, k, v, setup):
        layout, ranks, blocks, run, whole = setup
        parts = [tuple(layout.shard(t, r) if whole else t for t in (q, k, v)) for r in ranks]
        accumulate = torch.float64 if isinstance(blocks, ReferenceBlocks) else torch.float32
        programs = [forward_program(r, layout, blocks, *p, accumulate=accumulate) for r, p in zip(ranks, parts)]
        results = run(programs)
        out_dtype = torch.float64 if accumulate == torch.float64 else q.dtype
        outs = [o.to(out_dtype) for o, _ in results]
        lses = [lse.to(accumulate if accumulate == torch.float64 else torch.float32) for _, lse in results]
        ctx.setup, ctx.whole = setup, whole
        ctx.save_for_backward(q, k, v)
        ctx.parts_out = (outs, lses)
        out = layout.unshard(outs) if whole else outs[0]
        lse = layout.unshard(lses, dim=2) if whole else lses[0]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        layout, ranks, blocks, run, _ = ctx.setup
        q, k, v = ctx.saved_tensors
        outs, lses = ctx.parts_out
        parts = [tuple(layout.shard(t, r) if ctx.whole else t for t in (q, k, v, dout)) for r in ranks]
        accumulate = torch.float64 if isinstance(blocks, ReferenceBlocks) else torch.float32
        programs = [backward_program(r, layout, blocks, *p[:3], out, lse, p[3].to(out.dtype), accumulate=accumulate)
                    for r, p, out, lse in zip(ranks, parts, outs, lses)]
        results = run(programs)
        grads = []
        for i, t in enumerate((q, k, v)):
            pieces = [r[i].to(t.dtype) for r in results]
            grads.append(layout.unshard(pieces) if ctx.whole else pieces[0])
        return (*grads, None)


def _checked(spec, q, k, v) -> Spec:
    spec = resolve_spec(spec)
    if spec.sink_expr is not None:
        raise UnsupportedError(f"ring attention of spec {spec.name!r}",
                               ["a sink logit enters each row's softmax once; the ring's merge does not add it yet"])
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InputError(f"{name} must be a 4-D tensor (batch, seqlen, heads, dim); got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if q.shape[1] != k.shape[1] or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
        raise InputError(f"ring attention is self-attention over one sharded sequence: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch and seqlen")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise InputError(f"heads of q ({q.shape[2]}) must be a multiple of heads of k/v ({k.shape[2]})")
    return spec


def _blocks(spec: Spec, q: torch.Tensor, kind: str, deterministic: bool, inputs, seqlen: int):
    if kind == "reference":
        return ReferenceBlocks(spec, seqlen, inputs)
    if kind == "kernels":
        if not q.is_cuda:
            raise InputError("blocks='kernels' needs CUDA tensors; use blocks='reference' on the CPU")
        return KernelBlocks(spec, inputs, deterministic)
    raise InputError(f"blocks must be 'kernels' or 'reference'; got {kind!r}")


def _deterministic(value: bool | None) -> bool:
    return torch.are_deterministic_algorithms_enabled() if value is None else bool(value)
