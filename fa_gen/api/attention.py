"""`fa_gen.attention`: differentiable attention of one spec on (batch, seqlen, heads, dim) tensors."""

from __future__ import annotations

import os

import torch

from .. import autograd
from ..autograd import _inputs_as_lists, _refuse_gradients, attention_op, differentiable_input_names
from ..autograd import refuse_missing_backward, returns_lse, spec_from_key
from ..spec import Spec
from ..errors import UnsupportedError
from .dropout import attention_dropout, check_dropout_p
from .fp8 import attention_fp8


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Spec | str | os.PathLike,
              deterministic: bool | None = None, inputs=None, dropout_p: float = 0.0):
    """Differentiable attention: `out, lse = fa_gen.attention(q, k, v, spec="causal_bf16_d128")`
    (or `out` when the spec has return_lse false). Traceable by torch.compile(fullgraph=True):
    it goes through the `fa_gen::attention_forward` custom op (fa_gen.autograd); decode-shaped
    calls take the split-KV forward. `fa_gen.build(spec)(q, k, v)` stays the raw path, with the
    least per-call overhead.

    deterministic: a backward with no order-dependent atomics (bitwise reproducible);
    None follows `torch.are_deterministic_algorithms_enabled()`.
    inputs: name -> tensor or number for the spec's declared inputs. Float tensors read by the
    sink expression alone may require grad (they get one); any other that does is an error.
    dropout_p: attention dropout (fa_gen.api.dropout): each probability dropped with probability
    p' (p rounded to a multiple of 1/256: the mask draws a byte a probability), the kept ones
    scaled by 1 / (1 - p'), the mask drawn from PyTorch's CUDA generator; eager calls only,
    gradients to q, k and v.
    """
    # A Spec's key is a field read (a constant under torch.compile); passing the Spec object to
    # spec_key would make torch.compile reconstruct it, which torch 2.11 cannot do.
    key = spec.canonical if isinstance(spec, Spec) else autograd.spec_key(spec)
    # A broadcast view (K/V expanded over heads with stride 0) is copied: its gradient then
    # flows back through the expand, summed as autograd sums it.
    q, k, v = (_materialized(t) for t in (q, k, v))
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    declared = spec_from_key(key)
    if declared.is_fp8:
        # e4m3 inputs, descale factors 1 (attention_fp8 takes them): forward only.
        if check_dropout_p(dropout_p) > 0:
            raise UnsupportedError(f"dropout with spec {declared.name!r}", ["fp8 inputs have no dropout kernel"])
        return attention_fp8(q, k, v, declared, inputs=inputs)
    if check_dropout_p(dropout_p) > 0:
        out, lse = attention_dropout(q, k, v, declared, float(dropout_p), bool(deterministic), inputs)
        return (out, lse) if declared.return_lse else out
    tensors, scalars = _inputs_as_lists(declared, inputs) if inputs or declared.inputs else ([], [])
    if torch.is_grad_enabled():
        decls = [d for d in declared.inputs if not d.is_scalar]
        wanted = [d.name for d, t in zip(decls, tensors) if t.requires_grad]
        if wanted:
            _refuse_gradients(declared, wanted, differentiable_input_names(key))
    refuse_missing_backward(key, "backward", q, k, v)
    out, lse = attention_op(q, k, v, key, bool(deterministic), tensors, scalars)
    return (out, lse) if returns_lse(key) else out


def _materialized(t):
    """`t`, or a contiguous copy where a stride of 0 repeats rows (an expanded view)."""
    if isinstance(t, torch.Tensor) and any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t
