"""`fa_gen.attention_varlen`: differentiable attention over a packed (varlen) batch."""

from __future__ import annotations

import os

import torch

from .. import autograd
from ..autograd import _inputs_as_lists, refuse_missing_backward, spec_from_key
from ..errors import UnsupportedError
from ..spec import Spec
from .dropout import attention_varlen_dropout, check_dropout_p
from ..varlen import attention_varlen_forward


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     spec: Spec | str | os.PathLike, seqused_k: torch.Tensor | None = None,
                     deterministic: bool | None = None, inputs=None, num_splits: int = 0,
                     pack_gqa: bool | None = None, dropout_p: float = 0.0):
    """Differentiable attention over a packed batch: `out, lse` (or `out` when the spec has
    return_lse false); the layouts are FlashAttention's varlen ones (see fa_gen.varlen).

    max_seqlen_q / max_seqlen_k: host ints, at least the longest sequence (they size the grid).
    num_splits: key splits per query tile (0: chosen from the shapes and the SM count).
    pack_gqa: put the query heads of one KV head on a tile's rows (None: when seqlen_q is short).
    deterministic: a bitwise-reproducible backward; None follows torch's deterministic flag.
    dropout_p: attention dropout, as fa_gen.attention takes it (sequence b draws its mask as
    batch entry b); the split and packing options do not apply then.
    """
    key = spec.canonical if isinstance(spec, Spec) else autograd.spec_key(spec)
    declared = spec_from_key(key)
    if check_dropout_p(dropout_p) > 0:
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        out, lse = attention_varlen_dropout(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                            declared, float(dropout_p), bool(deterministic), inputs)
        return (out, lse) if declared.return_lse else out
    tensors, scalars = _inputs_as_lists(declared, inputs) if inputs or declared.inputs else ([], [])
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise UnsupportedError(f"gradient of spec {declared.name!r}'s tensor inputs in attention_varlen", [
            "the varlen backward gives dq, dk and dv only; detach the input (or pass it with requires_grad=False)"])
    refuse_missing_backward(key, "backward_varlen", q, k, v)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    out, lse = attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q),
                                        int(max_seqlen_k), key, bool(deterministic), int(num_splits),
                                        -1 if pack_gqa is None else int(bool(pack_gqa)), tensors, scalars)
    return (out, lse) if declared.return_lse else out
