"""`fa_gen.attention_fp8`: attention over e4m3 inputs with FlashAttention-3's descale factors (forward only)."""

from __future__ import annotations

import os

import torch

from ..errors import InputError
from ..runtime import build, resolve_spec
from ..spec import Spec


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Spec | str | os.PathLike,
                  q_descale=None, k_descale=None, v_descale=None, inputs=None):
    """`out, lse = attention_fp8(q8, k8, v8, spec, q_descale, k_descale, v_descale)` (or `out` when
    the spec has return_lse false) for an fp8 spec (`dtype: fp8_e4m3`) on Hopper.

    q, k, v: (batch, seqlen, heads, d) torch.float8_e4m3fn (GQA/MQA as elsewhere); the inputs they
    stand for are q * q_descale etc., each descale (batch, heads_kv) float32 (FlashAttention-3's
    shape; a query head takes its kv head's factor), anything broadcasting to it, or None for 1.
    fa_gen.fp8.quantize makes (x8, descale) from a 16-bit tensor (for q under GQA,
    quantize(q, heads_kv=...)). out is in the spec's out_dtype.
    v may also come as fa_gen.fp8.transpose_v(v), the layout the kernel reads (keys contiguous): then
    no transpose runs per call (V reused across calls, as a cache is).
    Scores are exact fp32 sums of e4m3 products; P goes to the second GEMM in e4m3 (scaled by
    2^8, which the normalisation removes). Not differentiable.
    """
    declared = resolve_spec(spec)
    if not declared.is_fp8:
        raise InputError(f"attention_fp8 takes an fp8 spec (dtype: fp8_e4m3); {declared.name!r} is "
                         f"{declared.dtype.value}: call fa_gen.attention")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q_descale, k_descale, v_descale)):
        raise InputError("attention_fp8 has no backward: descale factors that require grad are not supported")
    kernel = build(declared)
    out, lse = kernel.forward(q, k, v, inputs=inputs, descales=(q_descale, k_descale, v_descale))
    return (out, lse) if declared.return_lse else out


def attention_fp8_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                         spec: Spec | str | os.PathLike, q_descale=None, k_descale=None, v_descale=None, inputs=None):
    """attention_fp8 over a packed batch: q (total_q, heads, d), k/v (total_k, heads_kv, d) e4m3,
    cu_seqlens_* (batch + 1) int32 on the device, descales per (sequence, kv head). Returns
    (out (total_q, heads, d_v) in the spec's out_dtype, lse (heads, total_q)), or out alone when
    the spec has return_lse false. Not differentiable."""
    from ..inference import forward_varlen_fp8

    declared = resolve_spec(spec)
    if not declared.is_fp8:
        raise InputError(f"attention_fp8_varlen takes an fp8 spec (dtype: fp8_e4m3); {declared.name!r} is "
                         f"{declared.dtype.value}: call fa_gen.attention_varlen")
    out, lse = forward_varlen_fp8(declared, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  (q_descale, k_descale, v_descale), inputs)
    return (out, lse) if declared.return_lse else out
