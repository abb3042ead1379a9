"""Gradients of the tensor inputs a sink expression reads (gpt-oss's learnable sink logits).

A sink is one more logit per query row in the softmax denominator, carrying no value. Its
probability is exp(sink - LSE) (the forward's LSE includes it), and as no value makes its dP
0, the softmax Jacobian gives it the gradient
    dsink = P_sink * (0 - D) = -exp(sink - LSE) * D,      D = rowsum(dO * O),
the D the backward kernel computes for every row. Each row's dsink then flows into the input
elements its sink expression reads, through d(sink)/d(read) (fa_gen.variant.derivative): for
`sinks[h]`, d sinks[h] = -(sum over batch entries and query rows of exp(sinks[h] - LSE) * D).

Plain PyTorch on (batch, heads_q, seqlen_q) tensors: one pass over O and dO, nothing per key.
The sums go through index_put_(accumulate=True): bitwise reproducible where PyTorch's
deterministic algorithms are enabled, as that op documents.

Score-mod inputs (slopes, biases) would need a reduction over every (query, key) pair of dS in
the kernel: their gradients are refused (`differentiable_inputs` leaves them out).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..spec import Spec
from .derivative import derivative, reads_of
from .emit_torch import emit_torch
from .tree import names_used


def differentiable_inputs(spec: Spec) -> frozenset[str]:
    """Tensor inputs whose gradient the backward gives: float tensors read by the sink expression
    and by no other expression."""
    if spec.sink_tree is None:
        return frozenset()
    others = set()
    for tree in (spec.score_mod_tree, spec.mask_tree):
        if tree is not None:
            others |= names_used(tree)
    return frozenset(d.name for d in spec.inputs
                     if not d.is_scalar and d.dtype != "int32" and d.name in names_used(spec.sink_tree)
                     and d.name not in others)


def sink_input_gradients(spec: Spec, values: Mapping[str, object], names: set[str], out: torch.Tensor,
                         dout: torch.Tensor, lse: torch.Tensor, seqlen_k: int) -> dict[str, torch.Tensor]:
    """name -> gradient (the input's shape and dtype) for each of `names` (all in
    `differentiable_inputs(spec)`), from the forward's `out` (b, seqlen_q, heads_q, d_v), its
    `lse` (b, heads_q, seqlen_q), the upstream `dout`, and the inputs' `values`."""
    batch, heads_q, seqlen_q = lse.shape
    env = _row_env(values, batch, heads_q, seqlen_q, seqlen_k, lse.device)
    rows = (batch, heads_q, seqlen_q)
    sink = emit_torch(spec.sink_tree, torch.float32)(env).expand(rows)
    row_dot = (dout.float() * out.float()).sum(-1).permute(0, 2, 1)   # D: (b, heads_q, seqlen_q)
    dsink = -torch.exp(sink - lse.float()) * row_dot
    grads = {}
    for name in sorted(names):
        tensor = values[name]
        grad = torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device)
        for read in reads_of(spec.sink_tree, name):
            slope = emit_torch(derivative(spec.sink_tree, read), torch.float32)(env).expand(rows)
            indices = tuple(emit_torch(i)(env).expand(rows) for i in read.indices)
            grad.index_put_(indices, (dsink * slope).float(), accumulate=True)
        grads[name] = grad.to(tensor.dtype)
    return grads


def _row_env(values: Mapping[str, object], batch: int, heads_q: int, seqlen_q: int, seqlen_k: int,
             device) -> dict:
    """Names a sink expression may read, as index tensors broadcasting to (batch, heads_q, seqlen_q)."""
    env = dict(values)
    env.update(seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q)
    for name, length, axis in (("b", batch, 0), ("h", heads_q, 1), ("q_idx", seqlen_q, 2)):
        shape = [1, 1, 1]
        shape[axis] = length
        env[name] = torch.arange(length, device=device).view(shape)
    return env
