"""Call plans of the backward kernel: a spec's inputs checked, and its mask classified, once.

The backward kernel takes the spec's inputs exactly as the forward does (declared order, after
its fixed arguments) and, under a mask expression, one more tensor: per key tile of each K/V
head, the (query head, query tile) pairs it visits, which of them take the element mask, and
each one's turn in deterministic mode (`fa_gen.variant.tiles.query_tile_lists`). The tiles are
classified as the forward's plan classifies them (`classify_tiles`, interval analysis over the
same expression, per-tile min/max of the tensors it reads), with the backward's tile sizes.

As with the forward, a plan made once serves every call with the same shapes and inputs:

    plan = bwd.plan(q, k, inputs={"q_doc": ids, "kv_doc": ids})
    dq, dk, dv = bwd(dout, q, k, v, out, lse, plan=plan)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError
from .plan import CallPlan, bind_arguments
from .spec import Spec


@dataclass(frozen=True)
class BackwardPlan(CallPlan):
    """What the backward kernel takes after its fixed arguments, for one set of shapes and inputs."""

    heads_kv: int = 0   # the K/V heads it was made for (its tile lists group query heads by them)

    def check_call(self, spec: Spec, tiles: tuple[int, int], q: torch.Tensor, k: torch.Tensor,
                   backward: bool = False) -> None:
        if not backward:
            raise InputError("this plan was made for the backward kernel (Backward.plan); "
                             "make the forward's with Kernel.plan")
        super().check_call(spec, tiles, q, k)
        if k.shape[2] != self.heads_kv:
            raise InputError(f"this plan was made for {self.heads_kv} K/V heads; this call has {k.shape[2]}")


def make_backward_plan(spec: Spec, tiles: tuple[int, int], q: torch.Tensor, k: torch.Tensor,
                       inputs) -> BackwardPlan:
    """Check `inputs` for q's and k's shapes; under a mask expression, list the query tiles of every
    key tile for the backward's (tile_m, tile_n)."""
    from .variant.tiles import classify_tiles, query_tile_lists

    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    bound, arguments = bind_arguments(spec, q, k, inputs)
    if spec.mask_tree is not None:
        tile_m, tile_n = tiles
        codes = classify_tiles(spec.mask_tree, spec.inputs, bound, batch=batch, heads_q=heads_q,
                               seqlen_q=seqlen_q, seqlen_k=seqlen_k, tile_m=tile_m, tile_n=tile_n,
                               device=q.device)
        arguments.append(query_tile_lists(codes, seqlen_k, tile_n, heads_q // heads_kv))
    return BackwardPlan(spec.canonical_json(), tiles, (batch, heads_q, seqlen_q, seqlen_k), q.device,
                        tuple(arguments), heads_kv)
