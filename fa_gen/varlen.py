"""Variable-length (packed) attention as a differentiable PyTorch op, behind `fa_gen.attention_varlen`
(fa_gen.api.varlen); the ops layer, as fa_gen.autograd is.

    out, lse = fa_gen.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       spec="causal_bf16_d128")

q (total_q, heads_q, d), k/v (total_k, heads_kv, d): the sequences of a batch one after the other;
sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and the same of k/v with
cu_seqlens_k (int32, batch + 1 entries, on the device), of which its first seqused_k[b] keys are
attended when `seqused_k` is given. out (total_q, heads_q, d_v), lse (heads_q, total_q), as
FlashAttention's varlen functions return them. Masks align per sequence, and expressions see that
sequence's index `b`, positions and lengths. The batch composition is a runtime value: one compiled
kernel serves every set of lengths and nothing on the call path reads the device.

Two custom ops, joined by `register_autograd` as fa_gen::attention_forward/backward are:

    fa_gen::attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
        max_seqlen_k, spec_key, deterministic, num_splits, pack_gqa, tensors, scalars) -> (out, lse)
    fa_gen::attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
        max_seqlen_q, max_seqlen_k, spec_key, deterministic, tensors, scalars) -> (dq, dk, dv)

`num_splits` 0 and `pack_gqa` -1 mean "chosen from the shapes" (fa_gen.inference).
"""

from __future__ import annotations

from typing import Optional

import torch

from .autograd import _inputs_by_name, _plain_eager, no_gradient, refuse_other_devices, spec_from_key
from .inference import forward_varlen
from .varlen_backward import backward_varlen


@torch.library.custom_op("fa_gen::attention_varlen_forward", mutates_args=(), device_types="cuda")
def attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
                             max_seqlen_k: int, spec_key: str, deterministic: bool, num_splits: int,
                             pack_gqa: int, tensors: list[torch.Tensor],
                             scalars: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a packed batch; `deterministic` is only carried to the backward."""
    spec = spec_from_key(spec_key)
    return forward_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                          num_splits or None, _inputs_by_name(spec, tensors, scalars),
                          pack_gqa=None if pack_gqa < 0 else bool(pack_gqa))


@attention_varlen_forward.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, spec_key,
                  deterministic, num_splits, pack_gqa, tensors, scalars):
    spec = spec_from_key(spec_key)
    total_q, heads_q, _ = q.shape
    return q.new_empty((total_q, heads_q, spec.head_dim_v)), q.new_empty((heads_q, total_q), dtype=torch.float32)


@torch.library.custom_op("fa_gen::attention_varlen_backward", mutates_args=(), device_types="cuda")
def attention_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor, seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
                              max_seqlen_k: int, spec_key: str, deterministic: bool, tensors: list[torch.Tensor],
                              scalars: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a packed batch for the upstream gradient `dout` of `out`."""
    return _run_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                         max_seqlen_k, spec_key, deterministic, tensors, scalars)


def _run_backward(dout, q, k, v, out, lse, cu_q, cu_k, used_k, max_q, max_k, key, deterministic, tensors, scalars):
    spec = spec_from_key(key)
    return backward_varlen(spec, dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, used_k,
                           deterministic, _inputs_by_name(spec, tensors, scalars))


refuse_other_devices(attention_varlen_forward)
refuse_other_devices(attention_varlen_backward)


@attention_varlen_backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                   spec_key, deterministic, tensors, scalars):
    spec_from_key(spec_key)  # a missing spec fails while tracing, not at run time
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, used_k, max_q, max_k, key, deterministic, _, _, tensors, scalars = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_k, *tensors)
    ctx.lengths = (max_q, max_k)
    ctx.scalars = list(scalars)
    ctx.spec_key = key
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, used_k, *tensors = ctx.saved_tensors
    if dout is None:  # only lse was used, which carries no gradient
        dout = torch.zeros_like(out)
    dout = dout.contiguous()
    args = (dout, q, k, v, out, lse, cu_q, cu_k, used_k, *ctx.lengths, ctx.spec_key, ctx.deterministic, tensors,
            ctx.scalars)
    if _plain_eager(dout, q, k, v, out, lse, *tensors):
        dq, dk, dv = _run_backward(*args)  # the op's body, without the dispatcher's round trip
    else:
        dq, dk, dv = torch.ops.fa_gen.attention_varlen_backward.default(*args)
    return (dq, dk, dv, None, None, None, None, None, None, None, None, None, no_gradient(tensors),
            no_gradient(ctx.scalars))


attention_varlen_forward.register_autograd(_backward, setup_context=_setup_context)
