"""Attention of one query chunk against one key chunk at their global positions, forward and
backward: what each ring step computes, by two backends.

ReferenceBlocks (float64 torch, any device): the spec's masks, score mods and mask expressions
evaluated at global positions (q_idx, kv_idx in the whole sequence; seqlen_q = seqlen_k = its
length), from the spec's definition as fa_gen.reference has it: the oracle of the ring's logic.

KernelBlocks (fa_gen's compiled kernels): each (query chunk, key chunk) pair is classified at
global positions: hidden (skipped), full (the spec with no mask), or diagonal (the same positions
on both sides: the spec's own mask, whose alignment offset is then 0). A partial block off the
diagonal (a sliding window reaching into the previous chunk) and expressions that read
positions would need the kernels to take a runtime diagonal shift; they are refused with the
reason.

Every backward takes the ring's merged output and LSE of the query rows: a block's gradients
are then exactly its share of the whole attention's (dS = P (dP - D), D = rowsum(dO O), P from
the global LSE).
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import UnsupportedError
from ..spec import MaskKind, Spec
from ..variant.bind import bind_inputs
from ..variant.emit_torch import emit_torch
from ..variant.tree import names_used
from .layout import Chunk

POSITION_NAMES = frozenset({"q_idx", "kv_idx", "seqlen_q", "seqlen_k"})
HIDDEN, FULL, DIAGONAL, PARTIAL = "hidden", "full", "diagonal", "partial"


def classify(spec: Spec, q: Chunk, k: Chunk) -> str:
    """How the spec's window mask (any kind but an expression) relates query chunk q to key
    chunk k of one sequence: hidden, full, diagonal (same positions) or partial."""
    if spec.mask is MaskKind.EXPR:
        return DIAGONAL if (q.start, q.length) == (k.start, k.length) else PARTIAL
    low, high = spec.window_left, spec.window_right          # key j visible iff i - low <= j <= i + high
    first_q, last_q, first_k, last_k = q.start, q.stop - 1, k.start, k.stop - 1
    if (low is not None and last_k < first_q - low) or (high is not None and first_k > last_q + high):
        return HIDDEN
    if (low is None or first_k >= last_q - low) and (high is None or last_k <= first_q + high):
        return FULL
    return DIAGONAL if (q.start, q.length) == (k.start, k.length) else PARTIAL


class ReferenceBlocks:
    """float64 blocks at global positions (fa_gen.reference's semantics)."""

    def __init__(self, spec: Spec, seqlen: int, inputs=None):
        self.spec, self.seqlen, self.inputs = spec, seqlen, inputs

    def _logits(self, q: torch.Tensor, k: torch.Tensor, qc: Chunk, kc: Chunk) -> torch.Tensor:
        spec = self.spec
        batch, _, heads_q, _ = q.shape
        kx = k.repeat_interleave(heads_q // k.shape[2], dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * spec.softmax_scale
        i = torch.arange(qc.start, qc.stop, device=q.device)
        j = torch.arange(kc.start, kc.stop, device=q.device)
        env = {}
        if spec.uses_expressions:
            sizes = {"batch": batch, "heads_q": heads_q, "seqlen_q": self.seqlen, "seqlen_k": self.seqlen}
            env = bind_inputs(spec.inputs, self.inputs, sizes)
            env.update(b=torch.arange(batch, device=q.device).view(-1, 1, 1, 1),
                       h=torch.arange(heads_q, device=q.device).view(1, -1, 1, 1),
                       q_idx=i.view(1, 1, -1, 1), kv_idx=j.view(1, 1, 1, -1),
                       seqlen_q=self.seqlen, seqlen_k=self.seqlen, heads_q=heads_q)
        if spec.score_mod_expr is not None:
            scores = emit_torch(spec.score_mod_tree, scores.dtype)({**env, "score": scores}).expand_as(scores)
        if spec.mask_expr is not None:
            visible = emit_torch(spec.mask_tree)(env)
        else:
            row, col = i.view(-1, 1) + spec.key_offset(self.seqlen, self.seqlen), j.view(1, -1)
            visible = torch.ones(len(i), len(j), dtype=torch.bool, device=q.device)
            if spec.window_left is not None:
                visible &= col >= row - spec.window_left
            if spec.window_right is not None:
                visible &= col <= row + spec.window_right
        return scores.masked_fill(~visible, float("-inf"))

    def forward(self, q, k, v, qc: Chunk, kc: Chunk):
        """(out (b, Lq, hq, dv), lse (b, hq, Lq)) of the block, float64; rows that see no key of
        it: out 0, lse -inf."""
        logits = self._logits(q.double(), k.double(), qc, kc)
        lse = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        vx = v.double().repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        return torch.einsum("bhqk,bkhd->bqhd", probs, vx), lse

    def backward(self, dout, q, k, v, out, lse, qc: Chunk, kc: Chunk):
        """(dq, dk, dv) of the whole attention's loss through this block (float64)."""
        qd, kd = q.double().requires_grad_(), k.double().requires_grad_()
        group = q.shape[2] // k.shape[2]
        with torch.enable_grad():
            logits = self._logits(qd, kd, qc, kc)
        lse_ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).double().unsqueeze(-1)
        probs = torch.exp(logits.detach() - lse_ref)
        vx = v.double().repeat_interleave(group, dim=2)
        do = dout.double()
        dprobs = torch.einsum("bqhd,bkhd->bhqk", do, vx)
        row_dot = (do * out.double()).sum(-1).transpose(1, 2).unsqueeze(-1)      # D: (b, h, Lq, 1)
        dlogits = torch.where(probs > 0, probs * (dprobs - row_dot), torch.zeros_like(probs))
        grads = torch.autograd.grad(logits, (qd, kd), dlogits, allow_unused=True)
        dq, dk = (torch.zeros_like(t) if g is None else g for g, t in zip(grads, (qd, kd)))
        dv = torch.einsum("bhqk,bqhd->bkhd", probs, do).unflatten(2, (v.shape[2], group)).sum(3)
        return dq, dk, dv


class KernelBlocks:
    """Blocks through fa_gen's compiled forward and backward kernels (one GPU)."""

    def __init__(self, spec: Spec, inputs=None, deterministic: bool = False):
        reasons = kernel_reasons(spec)
        if reasons:
            raise UnsupportedError(f"ring attention of spec {spec.name!r} on fa_gen's kernels", reasons)
        self.spec, self.inputs, self.deterministic = spec, inputs, deterministic
        self.full = dataclasses.replace(spec, name=f"{spec.name}_ring_full", mask=MaskKind.NONE, window_left=None,
                                        window_right=None)

    def _spec_for(self, qc: Chunk, kc: Chunk) -> Spec | None:
        kind = classify(self.spec, qc, kc)
        if kind == PARTIAL:
            raise UnsupportedError(f"ring attention of spec {self.spec.name!r} on fa_gen's kernels", [
                f"query chunk at {qc.start} and key chunk at {kc.start} are partly visible off the diagonal; the "
                "kernels align masks within a call and take no runtime position shift yet (use chunks at least "
                "as long as the window reaches, or ReferenceBlocks)"])
        return None if kind == HIDDEN else self.full if kind == FULL else self.spec

    def forward(self, q, k, v, qc: Chunk, kc: Chunk):
        from ..runtime import build

        spec = self._spec_for(qc, kc)
        if spec is None:
            return None
        return build(spec).forward(q.contiguous(), k.contiguous(), v.contiguous(), inputs=self.inputs)

    def backward(self, dout, q, k, v, out, lse, qc: Chunk, kc: Chunk):
        from ..backward import build_backward

        spec = self._spec_for(qc, kc)
        if spec is None:
            return None
        parts = (t.contiguous() for t in (dout, q, k, v, out, lse))
        return build_backward(spec)(*parts, deterministic=self.deterministic, inputs=self.inputs)


def kernel_reasons(spec: Spec) -> list[str]:
    """Why the kernel blocks cannot serve `spec` whatever the layout (empty: they can)."""
    reasons = []
    if spec.mask is MaskKind.EXPR:
        reasons.append("a mask expression is evaluated at the positions of one call; the kernels take no runtime "
                       "position shift yet (ReferenceBlocks evaluates it at global positions)")
    if spec.score_mod_expr is not None and names_used(spec.score_mod_tree) & POSITION_NAMES:
        reasons.append("the score mod reads positions, which the kernels see per call, not in the whole sequence")
    if spec.sink_expr is not None:
        reasons.append("a sink logit enters each row's softmax once; the ring's merge does not add it yet")
    return reasons
