"""Attention of one query chunk against one key chunk at their global positions, forward and
backward: what each ring step computes, by two backends.

ReferenceBlocks (float64 torch, any device): the spec's masks, score mods and mask expressions
evaluated at global positions (q_idx, kv_idx in the whole sequence; seqlen_q = seqlen_k = its
length), from the spec's definition as fa_gen.reference has it: the oracle of the ring's logic.

KernelBlocks (fa_gen's compiled kernels): the `forward_shifted` and `backward_shifted` kinds of
the sm90 / sm80 families, whose window mask takes its diagonal offset as a runtime value: a block
of queries at q0 against keys at k0 is the spec's mask shifted by q0 - k0. Hidden blocks are
skipped. Mask expressions and score mods or sinks that read positions are refused with the
reason (the shift moves the window only).

Every backward takes the ring's merged output and LSE of the query rows: a block's gradients
are then exactly its share of the whole attention's (dS = P (dP - D), D = rowsum(dO O), P from
the global LSE).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..spec import MaskKind, Spec
from ..variant.bind import bind_inputs
from ..variant.emit_torch import emit_torch
from ..families.base import position_reasons
from .layout import Chunk

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


class _WithShift:
    """A shifted kind's compiled function with the call's diagonal offset appended (the kernels
    take it as their last parameter), so that Kernel and Backward call it as they call any."""

    def __init__(self, function):
        self.function, self.shift = function, 0

    def __call__(self, *args):
        return self.function(*args, self.shift)


class KernelBlocks:
    """Blocks through fa_gen's compiled `forward_shifted` / `backward_shifted` kinds (one GPU):
    the spec's window mask with its diagonal moved by (query chunk start - key chunk start), a
    runtime value, so one kernel of each serves every block of the ring."""

    def __init__(self, spec: Spec, inputs=None, deterministic: bool = False, arch: str | None = None):
        from ..backward import Backward
        from ..runtime import Kernel, current_arch, load_target
        from ..target import resolve_target

        reasons = kernel_reasons(spec)
        if reasons:
            raise UnsupportedError(f"ring attention of spec {spec.name!r} on fa_gen's kernels", reasons)
        self.spec, self.inputs, self.deterministic = spec, inputs, deterministic
        arch = arch or current_arch()
        function, info = load_target(resolve_target(spec, arch, "forward_shifted"))
        self._forward_shift = _WithShift(function)
        self._forward = Kernel(spec, arch, self._forward_shift, info)
        self._forward._variants = []          # the shifted kind serves every length
        function, info = load_target(resolve_target(spec, arch, "backward_shifted"))
        self._backward_shift = _WithShift(function)
        self._backward = Backward(spec, arch, self._backward_shift, info)

    def forward(self, q, k, v, qc: Chunk, kc: Chunk):
        if classify(self.spec, qc, kc) == HIDDEN:
            return None
        self._forward_shift.shift = qc.start - kc.start
        return self._forward.forward(q.contiguous(), k.contiguous(), v.contiguous(), inputs=self.inputs)

    def backward(self, dout, q, k, v, out, lse, qc: Chunk, kc: Chunk):
        if classify(self.spec, qc, kc) == HIDDEN:
            return None
        self._backward_shift.shift = qc.start - kc.start
        parts = (t.contiguous() for t in (dout, q, k, v, out, lse))
        return self._backward(*parts, deterministic=self.deterministic, inputs=self.inputs)


def kernel_reasons(spec: Spec) -> list[str]:
    """Why the kernel blocks cannot serve `spec` (empty: they can): the shifted kinds move the
    window's diagonal and nothing else (fa_gen.families.base.position_reasons), and the ring's
    merge adds no sink."""
    reasons = position_reasons(spec)
    if spec.sink_expr is not None:
        reasons.append("a sink logit enters each row's softmax once; the ring's merge does not add it yet")
    return reasons
