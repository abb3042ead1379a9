"""Attention with dropout, differentiable: what `fa_gen.attention(..., dropout_p=p)` and
`fa_gen.attention_varlen(..., dropout_p=p)` run when p > 0.

Each call draws (seed, offset) from PyTorch's CUDA generator (fa_gen.dropout.draw_rng_state:
`torch.manual_seed` reproduces a run, and every call draws a fresh mask), runs the dropout
forward, and keeps the draw for the backward, which regenerates the same mask
(fa_gen.dropout.backward_dropout): nothing of size seqlen_q x seqlen_k is stored. Eager only:
under torch.compile the generator draw would be traced once, so p > 0 is refused there.
Gradients flow to q, k and v; a spec input that requires grad is refused with dropout.

CUDA graphs: under stream capture the draw is fa_gen's per-device graph state instead
(fa_gen.dropout.graph_rng_state), read and advanced on the device, so every replay of the
graph draws a new mask and its backward regenerates the forward's; eager calls make that state
(seeded from PyTorch's generator), so the warm-up steps before a capture prepare it.
"""

from __future__ import annotations

import torch

from ..dropout import (backward_dropout, backward_varlen_dropout, draw_rng_state, forward_dropout,
                       forward_varlen_dropout, graph_rng_state, prepare_graph_rng)
from ..errors import InputError, UnsupportedError
from ..spec import Spec


def check_dropout_p(dropout_p) -> float:
    """dropout_p as a float in [0, 1); 0 means no dropout."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise InputError(f"dropout_p must be a number in [0, 1); got {dropout_p!r}")
    return float(dropout_p)


def attention_dropout(q, k, v, spec: Spec, dropout_p: float, deterministic: bool, inputs):
    """(out, lse) of fixed-length attention with dropout, differentiable in q, k, v."""
    _refuse_traced_and_input_gradients(spec, inputs)
    return _Dropout.apply(q, k, v, spec, dropout_p, deterministic, inputs)


def attention_varlen_dropout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, spec: Spec,
                             dropout_p: float, deterministic: bool, inputs):
    """(out, lse) of a packed batch with dropout, differentiable in q, k, v."""
    _refuse_traced_and_input_gradients(spec, inputs)
    return _VarlenDropout.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, spec, dropout_p,
                                deterministic, inputs)


def _refuse_traced_and_input_gradients(spec: Spec, inputs) -> None:
    if torch.compiler.is_compiling():
        raise UnsupportedError("dropout_p > 0 under torch.compile", [
            "the dropout mask is drawn from PyTorch's generator at each call, which a traced graph would "
            "draw once; call the attention eagerly (torch.compiler.disable) or with dropout_p=0"])
    for name, value in (inputs or {}).items():
        if isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled():
            raise UnsupportedError(f"gradient of spec {spec.name!r}'s input {name!r} with dropout", [
                "with dropout the backward gives dq, dk and dv only; detach the input"])


def draw(device: torch.device):
    """(seed, offset) for one call: ints from PyTorch's generator when eager, a device tensor
    (seed, offset) with offset None under CUDA-graph capture."""
    if torch.cuda.is_current_stream_capturing():
        return graph_rng_state(device), None
    prepare_graph_rng(device)
    return draw_rng_state(device)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec, dropout_p, deterministic, inputs):
        seed, offset = draw(q.device)
        out, lse = forward_dropout(spec, q, k, v, dropout_p, seed, offset, inputs=inputs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.draw = (spec, dropout_p, seed, offset, deterministic, inputs)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        spec, dropout_p, seed, offset, deterministic, inputs = ctx.draw
        dq, dk, dv = backward_dropout(spec, dout.contiguous(), q, k, v, out, lse, dropout_p, seed, offset,
                                      deterministic=deterministic, inputs=inputs)
        return dq, dk, dv, None, None, None, None


class _VarlenDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, spec, dropout_p, deterministic,
                inputs):
        seed, offset = draw(q.device)
        out, lse = forward_varlen_dropout(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          dropout_p, seed, offset, inputs=inputs)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.draw = (spec, max_seqlen_q, max_seqlen_k, dropout_p, seed, offset, deterministic, inputs)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        spec, max_seqlen_q, max_seqlen_k, dropout_p, seed, offset, deterministic, inputs = ctx.draw
        dq, dk, dv = backward_varlen_dropout(spec, dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, dropout_p, seed, offset,
                                             deterministic=deterministic, inputs=inputs)
        return dq, dk, dv, None, None, None, None, None, None, None, None
