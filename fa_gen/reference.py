"""The spec's semantics in plain PyTorch: the float64 oracle every kernel is tested against.

`attention_reference` is deliberately naive (materialises the score matrix) and
shares no code with the kernels: it is written from the spec's definition of
visibility, not from any kernel's tiling.

A spec's expressions (fa_gen/variant) enter through the torch emitter, over index
tensors shaped to broadcast as (batch, heads_q, seqlen_q, seqlen_k):
  score_mod  replaces each scaled score (score = softmax_scale * q.k) before masking;
  mask       keeps the keys it is true for (kind masks keep their window definition);
  sink       one extra logit per row in the softmax denominator: it takes probability
             mass and contributes no value, so a row that sees no key gets out 0 and
             lse = the sink (not -inf).
Values for the spec's declared inputs are passed as `inputs={name: tensor or number}`.
"""

from __future__ import annotations

import math

import torch

from .spec import Spec
from .variant.bind import bind_inputs
from .variant.emit_torch import emit_torch


def visibility(spec: Spec, seqlen_q: int, seqlen_k: int, device=None, *, batch: int | None = None,
               heads_q: int | None = None, inputs=None) -> torch.Tensor:
    """Boolean: may query i attend to key j under `spec`'s mask.

    (seqlen_q, seqlen_k) for the kind masks; for a mask expression, which may depend on the
    batch entry, the head and the inputs, (batch, heads_q, seqlen_q, seqlen_k).
    """
    if spec.mask_expr is not None:
        if batch is None or heads_q is None:
            raise TypeError("visibility of a mask expression needs batch= and heads_q=")
        env = _env(spec, batch, heads_q, seqlen_q, seqlen_k, device, inputs)
        visible = emit_torch(spec.mask_tree)(env)
        return visible.expand(batch, heads_q, seqlen_q, seqlen_k)
    i = torch.arange(seqlen_q, device=device).unsqueeze(1) + spec.key_offset(seqlen_q, seqlen_k)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if spec.window_left is not None:
        visible &= j >= i - spec.window_left
    if spec.window_right is not None:
        visible &= j <= i + spec.window_right
    return visible


def _env(spec: Spec, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, device, inputs) -> dict:
    """Names for the torch emitter: indices as broadcastable aranges, sizes, checked inputs."""
    sizes = {"batch": batch, "heads_q": heads_q, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    env = bind_inputs(spec.inputs, inputs, sizes)
    for name, length, axis in (("b", batch, 0), ("h", heads_q, 1), ("q_idx", seqlen_q, 2), ("kv_idx", seqlen_k, 3)):
        shape = [1, 1, 1, 1]
        shape[axis] = length
        env[name] = torch.arange(length, device=device).view(shape)
    env.update(seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q)
    return env


def _expand_kv_heads(x: torch.Tensor, heads_q: int) -> torch.Tensor:
    # (b, s, h_kv, d) -> (b, s, h_q, d): query head h reads kv head h // group.
    group = heads_q // x.shape[2]
    return x.repeat_interleave(group, dim=2)


def _logits(scores: torch.Tensor, spec: Spec, inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(masked logits (b, h, sq, sk), sink logits (b, h, sq) or None), in scores' dtype."""
    batch, heads_q, seqlen_q, seqlen_k = scores.shape
    needs_env = spec.uses_expressions
    env = _env(spec, batch, heads_q, seqlen_q, seqlen_k, scores.device, inputs) if needs_env else {}
    if spec.score_mod_expr is not None:
        scores = emit_torch(spec.score_mod_tree, scores.dtype)({**env, "score": scores}).expand_as(scores)
    if spec.mask_expr is not None:
        visible = emit_torch(spec.mask_tree)(env)
    else:
        visible = visibility(spec, seqlen_q, seqlen_k, device=scores.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = None
    if spec.sink_expr is not None:
        sink = emit_torch(spec.sink_tree, scores.dtype)(env).expand(batch, heads_q, seqlen_q, 1)[..., 0]
    return scores, sink


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Spec,
                        compute_dtype: torch.dtype = torch.float64, *,
                        inputs=None, dropout=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for (batch, seqlen, heads, dim) inputs, computed in `compute_dtype`.

    out has q's layout with v's head dim, in `compute_dtype`; lse is (batch, heads_q,
    seqlen_q), natural log. Rows that see no key get out 0 and lse -inf (the sink, with one).
    dropout: a fa_gen.philox.Dropout: the probabilities are multiplied by its keep mask / (1 - p)
    before P @ V, bit for bit the mask a kernel regenerates; the LSE is unaffected.
    """
    heads_q = q.shape[2]
    qc = q.to(compute_dtype)
    kc = _expand_kv_heads(k.to(compute_dtype), heads_q)
    vc = _expand_kv_heads(v.to(compute_dtype), heads_q)
    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * spec.softmax_scale
    scores, sink = _logits(scores, spec, inputs)
    lse = torch.logsumexp(scores, dim=-1)
    if sink is not None:
        lse = torch.logaddexp(lse, sink)
    # exp(-inf - -inf) is NaN: rows with no visible key take probability 0 everywhere.
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse.unsqueeze(-1))
    if dropout is not None and dropout.p > 0:
        probs = probs * dropout.scale(*probs.shape, device=probs.device, dtype=compute_dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vc)
    return out, lse


def attention_same_precision(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Spec, *,
                             inputs=None, dropout=None) -> torch.Tensor:
    """What a straightforward PyTorch program computes in the inputs' own dtype.

    Its error against the float64 reference is the yardstick for a kernel's
    tolerance: scores and the P·V product are rounded to q.dtype, softmax (and any
    score mod or sink) runs in float32 (as PyTorch users write it and as
    FlashAttention's tests do).
    """
    heads_q = q.shape[2]
    kx = _expand_kv_heads(k, heads_q)
    vx = _expand_kv_heads(v, heads_q)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx).float() * spec.softmax_scale
    scores, sink = _logits(scores, spec, inputs)
    if sink is not None:
        # The sink is one more column of the softmax, dropped once it has taken its share.
        scores = torch.cat([scores, sink.unsqueeze(-1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
    if sink is not None:
        probs = probs[..., :-1]
    if dropout is not None and dropout.p > 0:
        # The kept probabilities rescaled in float32, then rounded as P @ V's operand.
        scale = dropout.scale(*probs.shape, device=probs.device, dtype=torch.float32)
        probs = (probs.float() * scale).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vx)


def attention_fp8_same_precision(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descales, spec: Spec, *,
                                 inputs=None, p_shift: int = 8, stale: tuple[int, float] | None = None) -> torch.Tensor:
    """The yardstick of fp8 kernels: what PyTorch computes rounding what such a kernel rounds.

    q8, k8, v8 in float8_e4m3fn, `descales` (q, k, v) as (batch, heads_kv) float32 tensors. Scores
    in float32 from the e4m3 values, scaled by softmax_scale * q_descale * k_descale; softmax in
    float32; P times 2^p_shift rounded to e4m3 for P @ V (float32), the sums taken unrounded; O
    divided by the sum and 2^p_shift, times v_descale. Returns float32 (batch, seqlen_q, heads_q, dv).
    P is taken at each row's maximum, or, with `stale` = (tile_n, stale_log2), at the maxima a
    kernel keeping stale ones uses (_kept_maxima_pv): then a row's largest P need not be 2^p_shift,
    so it too is rounded.
    """
    heads_q = q8.shape[2]
    group = heads_q // k8.shape[2]
    qd, kd, vd = (d.float().repeat_interleave(group, dim=1) for d in descales)  # (b, heads_q)
    kx = _expand_kv_heads(k8.float(), heads_q)
    vx = _expand_kv_heads(v8.float(), heads_q)
    scale = (qd * kd * spec.softmax_scale)[:, :, None, None]
    scores = torch.einsum("bqhd,bkhd->bhqk", q8.float(), kx) * scale
    scores, sink = _logits(scores, spec, inputs)
    if stale is not None:
        if sink is not None:
            raise ValueError("the kept-maxima yardstick has no sinks")
        out, total = _kept_maxima_pv(scores, vx, *stale, p_shift)
        norm = torch.where(total > 0, vd[:, :, None] / total, torch.zeros_like(total))
        return out * norm.permute(0, 2, 1).unsqueeze(-1)
    top = scores.amax(dim=-1, keepdim=True)
    if sink is not None:
        top = torch.maximum(top, sink.unsqueeze(-1))
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    probs = torch.exp(scores - top) * 2.0 ** p_shift
    total = probs.sum(dim=-1)
    if sink is not None:
        total = total + torch.exp(sink - top[..., 0]) * 2.0 ** p_shift
    p8 = probs.to(torch.float8_e4m3fn).float()
    out = torch.einsum("bhqk,bkhd->bqhd", p8, vx)
    norm = torch.where(total > 0, vd[:, :, None] / total, torch.zeros_like(total))  # (b, h, sq)
    return out * norm.permute(0, 2, 1).unsqueeze(-1)


def _kept_maxima_pv(scores: torch.Tensor, vx: torch.Tensor, tile_n: int, stale_log2: float, p_shift: int):
    """(P @ V, row sums) as a kernel with kept maxima (the sm90 stale_max tuning) forms them from
    float32 scores (batch, heads, sq, sk): key tiles of `tile_n` visited last to first; a row keeps
    its reference max while the new one exceeds it by at most 2^stale_log2 in the exponent; P taken
    at that reference times 2^p_shift, rounded to e4m3 for P @ V; earlier sums and products scaled
    when the reference moves. A row with nothing visible yet takes exponents at 0."""
    ref = torch.full(scores.shape[:-1], -math.inf, device=scores.device)
    out = torch.zeros(*scores.shape[:-1], vx.shape[-1], device=scores.device)
    total = torch.zeros(scores.shape[:-1], device=scores.device)
    for start in reversed(range(0, scores.shape[-1], tile_n)):
        tile = scores[..., start:start + tile_n]
        new = torch.maximum(ref, tile.amax(dim=-1))
        new = torch.where((new - ref) * math.log2(math.e) <= stale_log2, ref, new)
        base = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        factor = torch.exp(ref - base)
        probs = torch.exp(tile - base[..., None]) * 2.0 ** p_shift
        p8 = probs.to(torch.float8_e4m3fn).float()
        out = out * factor[..., None] + torch.einsum("bhqk,bkhd->bhqd", p8, vx[:, start:start + tile_n])
        total, ref = total * factor + probs.sum(dim=-1), new
    return out.permute(0, 2, 1, 3), total


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                     interleaved: bool) -> torch.Tensor:
    """float64 rotary embedding of x (batch, s, heads, d): its first 2 * cos.shape[1] columns, in
    pairs taken as complex numbers x1 + i x2, turned by e^(i theta) with cos theta / sin theta from
    rows positions (batch, s) of the tables. Pairs are columns (2m, 2m + 1) when `interleaved`,
    else (m, m + half) (GPT-NeoX). The yardstick of the KV-cache call's fused rotation."""
    x = x.double()
    half = cos.shape[1]
    turn = torch.complex(cos.double(), sin.double())[positions][:, :, None, :]  # (batch, s, 1, half)
    head = x[..., :2 * half]
    if interleaved:
        pairs = torch.view_as_complex(head.reshape(*head.shape[:-1], half, 2).contiguous())
        turned = torch.view_as_real(pairs * turn).flatten(-2)
    else:
        pairs = torch.complex(head[..., :half], head[..., half:])
        turned = torch.cat((torch.real(pairs * turn), torch.imag(pairs * turn)), dim=-1)
    return torch.cat((turned, x[..., 2 * half:]), dim=-1)
