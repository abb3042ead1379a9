"""The spec's semantics in plain PyTorch: the float64 oracle every kernel is tested against.

`attention_reference` is deliberately naive (materialises the score matrix) and
shares no code with the kernels: it is written from the spec's definition of
visibility, not from any kernel's tiling.
"""

from __future__ import annotations

import torch

from .spec import Spec


def visibility(spec: Spec, seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k): may query i attend to key j under `spec`'s mask."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1) + spec.key_offset(seqlen_q, seqlen_k)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if spec.window_left is not None:
        visible &= j >= i - spec.window_left
    if spec.window_right is not None:
        visible &= j <= i + spec.window_right
    return visible


def _expand_kv_heads(x: torch.Tensor, heads_q: int) -> torch.Tensor:
    # (b, s, h_kv, d) -> (b, s, h_q, d): query head h reads kv head h // group.
    group = heads_q // x.shape[2]
    return x.repeat_interleave(group, dim=2)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Spec,
                        compute_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for (batch, seqlen, heads, dim) inputs, computed in `compute_dtype`.

    out has q's layout with v's head dim, in `compute_dtype`; lse is (batch, heads_q,
    seqlen_q), natural log. Rows that see no key get out 0 and lse -inf.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    qc = q.to(compute_dtype)
    kc = _expand_kv_heads(k.to(compute_dtype), heads_q)
    vc = _expand_kv_heads(v.to(compute_dtype), heads_q)
    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * spec.softmax_scale
    visible = visibility(spec, seqlen_q, seqlen_k, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - -inf) is NaN: rows with no visible key take probability 0 everywhere.
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse.unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vc)
    return out, lse


def attention_same_precision(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Spec) -> torch.Tensor:
    """What a straightforward PyTorch program computes in the inputs' own dtype.

    Its error against the float64 reference is the yardstick for a kernel's
    tolerance: scores and the P·V product are rounded to q.dtype, softmax runs
    in float32 (as PyTorch users write it and as FlashAttention's tests do).
    """
    heads_q = q.shape[2]
    kx = _expand_kv_heads(k, heads_q)
    vx = _expand_kv_heads(v, heads_q)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx).float() * spec.softmax_scale
    visible = visibility(spec, q.shape[1], k.shape[1], device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vx)
