"""Call plans: a spec's inputs checked, and its mask expression classified, once for many calls.

A kernel whose spec declares inputs or a mask expression takes, after its fixed arguments,
the inputs' values (in declared order) and, under a mask expression, two per-call tensors:
the key tiles each query tile visits (`fa_gen.variant.tiles.key_tile_lists`) and the order in
which the scheduler hands out query tiles (head by head, within a head the ones with the most
key tiles first, so that the long ones do not finish last). Making them costs about a hundred small PyTorch operations (about a millisecond
of host time) when the mask reads a tensor (document ids, prefix lengths): as much as the
attention itself at short sequences. So, as FlexAttention's BlockMask or FlashAttention's
cu_seqlens, it can be made once and reused by every call with the same shapes and inputs
(every layer of a model, say):

    plan = kernel.plan(q, k, inputs={"q_doc": ids, "kv_doc": ids})
    out, lse = kernel.forward(q, k, v, plan=plan)

A plan holds its inputs; changing a tensor it holds after making it leaves the plan stale (the
caller's contract, as with a BlockMask). Calls without one make a plan per call, memoised when
the mask reads no tensor (a pure function of the shapes and scalars).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError
from .spec import Spec
from .variant.bind import bind_inputs


@dataclass(frozen=True)
class CallPlan:
    """What a kernel takes after its fixed arguments, for one set of shapes and inputs."""

    spec_key: str                 # the spec it was made for (canonical JSON)
    tiles: tuple[int, int]        # (tile_m, tile_n) of the kernel it was made for
    sizes: tuple[int, int, int, int]   # (batch, heads_q, seqlen_q, seqlen_k)
    device: torch.device
    arguments: tuple              # the kernel's extra arguments, in order

    def check_call(self, spec: Spec, tiles: tuple[int, int], q: torch.Tensor, k: torch.Tensor) -> None:
        if self.spec_key != spec.canonical_json() or self.tiles != tiles:
            raise InputError(f"this plan was made for another kernel (spec or tiles differ from {spec.name!r}'s)")
        sizes = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        if sizes != self.sizes:
            raise InputError(f"this plan was made for (batch, heads_q, seqlen_q, seqlen_k) = {self.sizes}; "
                             f"this call has {sizes}")
        if q.device != self.device:
            raise InputError(f"this plan lives on {self.device}; q is on {q.device}")


def make_plan(spec: Spec, tiles: tuple[int, int], q: torch.Tensor, k: torch.Tensor, inputs) -> CallPlan:
    """Check `inputs` against the spec for q's and k's shapes and classify the mask's key tiles."""
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    bound, arguments = bind_arguments(spec, q, k, inputs)
    if spec.mask_tree is not None:
        arguments.extend(_tile_schedule(spec, tiles, bound, batch, heads_q, seqlen_q, seqlen_k, q.device))
    return CallPlan(spec.canonical_json(), tiles, (batch, heads_q, seqlen_q, seqlen_k), q.device, tuple(arguments))


def bind_arguments(spec: Spec, q: torch.Tensor, k: torch.Tensor, inputs) -> tuple[dict, list]:
    """`inputs` checked against the spec for q's and k's shapes: (name -> value, scalars' defaults
    filled in; the kernel arguments they make, in declared order, tensors contiguous on q's device)."""
    batch, seqlen_q, heads_q, _ = q.shape
    sizes = {"batch": batch, "heads_q": heads_q, "seqlen_q": seqlen_q, "seqlen_k": k.shape[1]}
    bound = bind_inputs(spec.inputs, inputs, sizes)
    arguments = []
    for decl in spec.inputs:
        value = bound[decl.name]
        if isinstance(value, torch.Tensor):
            if value.device != q.device:
                raise InputError(f"input {decl.name!r} is on {value.device}; q is on {q.device}")
            value = value.contiguous()
        arguments.append(value)
    return bound, arguments


def _tile_schedule(spec: Spec, tiles, bound, batch, heads_q, seqlen_q, seqlen_k, device):
    from .variant.tiles import classify_tiles, key_tile_lists, visit_order

    tile_m, tile_n = tiles
    codes = classify_tiles(spec.mask_tree, spec.inputs, bound, batch=batch, heads_q=heads_q, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, tile_m=tile_m, tile_n=tile_n, device=device)
    lists = key_tile_lists(codes, seqlen_k, tile_n)
    return lists, visit_order(lists, batch, heads_q), uneven_rows(lists)


def uneven_rows(lists: torch.Tensor) -> int:
    """1 when the query tiles' key-tile counts spread widely (standard deviation above a quarter
    of the mean: causal-like masks, documents, prefixes), else 0 (windows: every row alike).

    Long uneven rows balance better one CTA per query tile, handed out by the hardware in the
    plan's order; even ones better on a persistent grid. H200, sm90, bf16, d128, s=16k, b=1:
    documents / chunks of 2048 351 -> 418 TFLOP/s and prefix-LM 510 -> 641 one CTA per tile,
    a sliding window of 1024 431 -> 394 (.scratch A/B). One host sync, once per plan.
    """
    visits = lists[..., 1].to(torch.float32)
    mean = visits.mean()
    return int(bool((visits.std(correction=0) > 0.25 * mean).item())) if visits.numel() > 1 else 0


def memoised_plan(plans: dict, spec: Spec, q: torch.Tensor, k: torch.Tensor, inputs, make):
    """`make(q, k, inputs)`, remembered in `plans` by shapes, device and scalars when the mask
    reads no tensor (the plan is then a pure function of them); made afresh otherwise."""
    if reads_tensors(spec):
        return make(q, k, inputs)
    key = (*q.shape[:3], *k.shape[1:3], q.device, tuple(sorted((inputs or {}).items())))
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = make(q, k, inputs)
    return plan


def reads_tensors(spec: Spec) -> bool:
    """Whether a plan depends on tensor values (else on shapes, device and scalars alone)."""
    return any(not d.is_scalar for d in spec.inputs)
