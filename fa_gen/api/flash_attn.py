"""FlashAttention-compatible functions over fa_gen's kernels: the signatures, layouts and semantics of
`flash_attn` 2.x (plus FlashAttention-3/4's `learnable_sink` and `return_lse`).

    out = flash_attn_func(q, k, v, causal=True)                        # (batch, seqlen, heads, dim)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths, causal=True)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, block_table=table)  # paged prefill

Each call's configuration (fa_gen.api.flash_specs.FlashConfig) names one Spec, built once per
process and compiled once (then loaded from the disk cache); softcap values, ALiBi slopes and sinks
are runtime inputs of that spec. flash_attn_func and flash_attn_varlen_func go through the
differentiable custom ops of fa_gen.attention / fa_gen.attention_varlen (autograd,
torch.compile(fullgraph=True)); flash_attn_with_kvcache through fa_gen.attention_with_kvcache, and
flash_attn_varlen_func with a block_table through fa_gen.inference.forward_paged (forward only).
What fa_gen cannot serve is an UnsupportedError naming the argument and why.
"""

from __future__ import annotations

import math

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

from ..autograd import spec_from_key
from ..errors import InputError, UnsupportedError
from ..inference import forward_paged
from .attention import attention
from .fp8 import attention_fp8, attention_fp8_varlen
from .flash_specs import DTYPES, fold_window, flash_spec_key
from .varlen import attention_varlen


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, learnable_sink=None,
                    return_lse=False, q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention's flash_attn_func: q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k, heads_kv, d)
    -> out (batch, seqlen_q, heads, d_v); with return_attn_probs (out, lse, None), with return_lse
    (out, lse); lse (batch, heads, seqlen_q) float32. Differentiable (also in learnable_sink).
    float8_e4m3fn q, k, v (Hopper) take FlashAttention-3's q/k/v_descale, (batch, heads_kv) float32,
    and give a bf16 out, forward only (fa_gen.attention_fp8)."""
    _check_qkv(q, k, v, "(batch, seqlen, heads, head_dim)")
    key, inputs = _spec_and_inputs(q, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                   learnable_sink, heads=q.shape[2], batch=q.shape[0])
    descales = (q_descale, k_descale, v_descale)
    if _fp8_call(q, descales, dropout_p, learnable_sink):
        out, lse = attention_fp8(q, k, v, spec_from_key(key), *descales, inputs=inputs)
        return _results(out, lse, return_attn_probs, return_lse)
    out, lse = attention(q, k, v, spec_from_key(key), _deterministic(deterministic), inputs, dropout_p=dropout_p)
    return _results(out, lse, return_attn_probs, return_lse)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, learnable_sink=None,
                           return_lse=False, seqused_k=None, q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention's flash_attn_varlen_func over fa_gen.attention_varlen: q (total_q, heads, d),
    k/v (total_k, heads_kv, d), cu_seqlens_* (batch + 1) int32; lse (heads, total_q). Masks align
    per sequence (bottom-right); learnable_sink (heads,) enters every sequence's softmax.
    Differentiable (also in learnable_sink).
    With block_table (batch, max_blocks) int32, k/v are paged caches (num_blocks, block_size,
    heads_kv, d) and sequence b's keys are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] (or
    seqused_k[b]) slots of its blocks, as FlashAttention-2's paged prefill takes them: forward
    only, through fa_gen.inference.forward_paged (the split-KV kinds).
    float8_e4m3fn q, k, v (Hopper) take FlashAttention-3's q/k/v_descale, (batch, heads_kv)
    float32: contiguous through fa_gen.attention_fp8_varlen, paged (an fp8 KV cache) through the
    split kinds' fp8 build; forward only, out in bf16."""
    descales = (q_descale, k_descale, v_descale)
    if block_table is not None:
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, return_attn_probs, block_table, learnable_sink,
                             return_lse, seqused_k, descales)
    _check_qkv(q, k, v, "(total_tokens, heads, head_dim)")
    key, inputs = _spec_and_inputs(q, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                   learnable_sink, heads=q.shape[1], batch=None)
    if _fp8_call(q, descales, dropout_p, learnable_sink):
        if seqused_k is not None:
            raise UnsupportedError("seqused_k with float8_e4m3fn inputs (no block_table)", [
                "the fp8 varlen forward reads each sequence's cu_seqlens_k span; pass block_table for a cache"])
        out, lse = attention_fp8_varlen(q, k, v, _int32(cu_seqlens_q), _int32(cu_seqlens_k), int(max_seqlen_q),
                                        int(max_seqlen_k), spec_from_key(key), *descales, inputs=inputs)
        return _results(out, lse, return_attn_probs, return_lse)
    sinks = None if inputs is None else inputs.get("sinks")
    if dropout_p and sinks is not None and sinks.requires_grad and torch.is_grad_enabled():
        raise UnsupportedError(f"learnable_sink that requires grad with dropout_p={dropout_p}", [
            "with dropout the varlen backward gives dq, dk and dv only; detach learnable_sink"])
    if sinks is not None:  # the kernel reads them; their gradient is taken here (the varlen backward has none)
        inputs["sinks"] = sinks.detach()
    cu_seqlens_q = _int32(cu_seqlens_q)
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, _int32(cu_seqlens_k), int(max_seqlen_q),
                                int(max_seqlen_k), spec_from_key(key),
                                seqused_k=None if seqused_k is None else _int32(seqused_k),
                                deterministic=_deterministic(deterministic), inputs=inputs, dropout_p=dropout_p)
    if sinks is not None and sinks.requires_grad and torch.is_grad_enabled():
        out = _VarlenSinkGradient.apply(out, lse, sinks, cu_seqlens_q)
    return _results(out, lse, return_attn_probs, return_lse)


def _varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, return_attn_probs, block_table, learnable_sink, return_lse,
                  seqused_k, descales):
    """flash_attn_varlen_func with block_table: packed queries against paged K/V, forward only."""
    if dropout_p:
        raise UnsupportedError(f"dropout_p={dropout_p} with block_table", [
            "paged K/V are an inference path: the paged kernels have no dropout"])
    needs_grad = [name for name, t in (("q", q), ("k", k_cache), ("v", v_cache), ("learnable_sink", learnable_sink))
                  if isinstance(t, torch.Tensor) and t.requires_grad]
    if needs_grad and torch.is_grad_enabled():
        raise UnsupportedError(f"gradients through block_table (of {', '.join(needs_grad)})", [
            "paged K/V are served forward only; call under torch.no_grad() or detach the inputs"])
    _check_qkv(q, k_cache, v_cache, "(total_tokens, heads, head_dim)", "(num_blocks, block_size, heads_kv, head_dim)")
    key, inputs = _spec_and_inputs(q, v_cache, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                   learnable_sink, heads=q.shape[1], batch=None)
    # Each sequence's keys: seqused_k, else its cu_seqlens_k span (a device op, no sync).
    if seqused_k is not None:
        used = _int32(seqused_k).contiguous()
    else:
        cu_seqlens_k = _int32(cu_seqlens_k)
        used = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    fp8 = _fp8_call(q, descales, dropout_p, learnable_sink)
    out, lse = forward_paged(spec_from_key(key), q, k_cache, v_cache, _int32(block_table), _int32(cu_seqlens_q),
                             used, int(max_seqlen_q), inputs=inputs, descales=descales if fp8 else None)
    return _results(out, lse, return_attn_probs, return_lse)


class _VarlenSinkGradient(torch.autograd.Function):
    """Identity on a packed batch's `out` whose backward also gives the sink logits' gradient
    (fa_gen.variant.sink_grad): d sinks[h] = -sum over the real query rows of exp(sinks[h] - LSE) * D,
    D = rowsum(dO * O). dq, dk and dv come from the varlen backward, which reads the forward's LSE
    (the sink included) and so needs nothing more."""

    @staticmethod
    def forward(ctx, out, lse, sinks, cu_seqlens_q):
        ctx.save_for_backward(out, lse, sinks, cu_seqlens_q)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        out, lse, sinks, cu_seqlens_q = ctx.saved_tensors
        row_dot = (dout.float() * out.float()).sum(-1).transpose(0, 1)              # D: (heads, total_q)
        real = torch.arange(out.shape[0], device=out.device) < cu_seqlens_q[-1]     # rows past the batch: none
        terms = torch.where(real, torch.exp(sinks.float()[:, None] - lse.float()) * row_dot, 0.0)
        return dout, None, -terms.sum(1).to(sinks.dtype), None


# FlashAttention-2's packed forms: one tensor holds q, k and v (or k and v) along the axis before the
# heads; each is its view there (strided, as the kernels take them), and autograd gathers the views'
# gradients back into one tensor of the packed shape.

def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on qkv (batch, seqlen, 3, heads, d)."""
    q, k, v = _unpacked(qkv, 3, "qkv", "(batch, seqlen, 3, heads, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on q (batch, seqlen_q, heads, d) and kv (batch, seqlen_k, 2, heads_kv, d)."""
    k, v = _unpacked(kv, 2, "kv", "(batch, seqlen_k, 2, heads_kv, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func on qkv (total_tokens, 3, heads, d), queries and keys sharing cu_seqlens."""
    q, k, v = _unpacked(qkv, 3, "qkv", "(total_tokens, 3, heads, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func on q (total_q, heads, d) and kv (total_k, 2, heads_kv, d)."""
    k, v = _unpacked(kv, 2, "kv", "(total_k, 2, heads_kv, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def _unpacked(packed, parts: int, name: str, layout: str):
    """The `parts` views of `packed` along its axis before the heads (layout names the shape)."""
    dims = layout.count(",") + 1
    if not isinstance(packed, torch.Tensor) or packed.dim() != dims or packed.shape[-3] != parts:
        shown = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise InputError(f"{name} must be a {dims}-D tensor {layout}; got {shown}")
    return packed.unbind(-3)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention's flash_attn_with_kvcache over fa_gen.attention_with_kvcache: q (batch, seqlen_q,
    heads, d); k_cache/v_cache (batch_cache, seqlen_cache, heads_kv, d), or (num_blocks, page_size,
    heads_kv, d) with block_table (batch, max_blocks) int32; k/v new tokens appended in place at
    cache_seqlens (int or (batch,) int32); rotary_cos/rotary_sin rotate q and the new keys (fused
    into the append, FlashAttention's positions); cache_leftpad starts sequences past slot 0 of a
    contiguous cache. Forward only, as FlashAttention's. float8_e4m3fn q, caches and k/v (Hopper) take
    FlashAttention-3's q/k/v_descale, (batch, heads_kv) float32, and give a bf16 out."""
    if (k is None) != (v is None):
        raise InputError("flash_attn_with_kvcache: pass k and v together (new tokens to append), or neither")
    _check_qkv(q, k_cache, v_cache, "(batch, seqlen, heads, head_dim)")
    lengths = _cache_seqlens(cache_seqlens, q, k_cache, block_table, appending=k is not None)
    key, inputs = _spec_and_inputs(q, v_cache, softmax_scale, causal, window_size, softcap, alibi_slopes, None,
                                   heads=q.shape[2], batch=q.shape[0])
    result = _kvcache_function()(q, k_cache, v_cache, lengths, spec_from_key(key), k_new=k, v_new=v,
                                 page_table=block_table, cache_batch_idx=cache_batch_idx,
                                 num_splits=int(num_splits), pack_gqa=None, inputs=inputs, rotary_cos=rotary_cos,
                                 rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                                 cache_leftpad=_int32(cache_leftpad) if cache_leftpad is not None else None,
                                 q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    out, lse = result if isinstance(result, tuple) else (result, None)
    return (out, lse) if return_softmax_lse else out


# --- arguments -> (spec key, runtime inputs) ----------------------------------------------------------

def _spec_and_inputs(q, v, softmax_scale, causal, window_size, softcap, alibi_slopes, sink, heads, batch):
    """The registered key of the call's Spec and the values of its runtime inputs (None: none)."""
    left, right = fold_window(bool(causal), window_size)
    capped = _softcap_on(softcap)
    alibi = _alibi_kind(alibi_slopes, heads, batch)
    if sink is not None:
        _check_float_tensor("learnable_sink", sink, (heads,), "(heads,)")
    # guard_scalar: plain values pass through; under torch.compile a head dim that changed between
    # calls (now symbolic) becomes a constant again, guarded, as a spec needs (fold_window does the same).
    head_dim_qk, head_dim_v = guard_scalar(q.shape[-1]), guard_scalar(v.shape[-1])
    key = flash_spec_key(_dtype(q), head_dim_qk, head_dim_v, bool(causal), left, right,
                         _scale(softmax_scale, head_dim_qk), capped, alibi, sink is not None)
    inputs = {}
    if capped:
        inputs["softcap"] = float(softcap)
    if alibi is not None:
        inputs["slopes"] = alibi_slopes
    if sink is not None:
        # The spec reads float32 sinks; a half-precision parameter gets its gradient through the cast.
        inputs["sinks"] = sink if sink.dtype == torch.float32 else sink.float()
    return key, inputs or None


def _fp8_call(q, descales, dropout_p, learnable_sink) -> bool:
    """Whether q is float8_e4m3fn (a forward-only fp8 call, FlashAttention-3's descales); refuses
    what fp8 has no kernel for, and descales on 16-bit inputs."""
    if q.dtype != torch.float8_e4m3fn:
        if any(d is not None for d in descales):
            raise UnsupportedError("q_descale / k_descale / v_descale", ["descale factors are for float8_e4m3fn inputs"])
        return False
    if dropout_p:
        raise UnsupportedError(f"dropout_p={dropout_p} with float8_e4m3fn inputs", ["fp8 has no dropout kernel"])
    if learnable_sink is not None and learnable_sink.requires_grad and torch.is_grad_enabled():
        raise UnsupportedError("learnable_sink that requires grad with float8_e4m3fn inputs",
                               ["the fp8 forward has no backward; detach learnable_sink"])
    return True


def _dtype(q) -> str:
    if q.dtype not in DTYPES:
        raise UnsupportedError(f"q.dtype {q.dtype}", ["fa_gen kernels take torch.float16, torch.bfloat16 and "
                                                      "(flash_attn_func on Hopper) torch.float8_e4m3fn"])
    return DTYPES[q.dtype]


def _scale(softmax_scale, head_dim_qk: int) -> float | None:
    """None for the default 1/sqrt(head_dim) (given or not: one spec either way)."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise InputError(f"softmax_scale must be a finite number > 0 (or None); got {softmax_scale!r}")
    scale = float(guard_scalar(softmax_scale))  # compiled into the spec: a constant under torch.compile
    if not 0 < scale < math.inf:
        raise InputError(f"softmax_scale must be a finite number > 0 (or None); got {softmax_scale!r}")
    return None if scale == head_dim_qk ** -0.5 else scale


def _softcap_on(softcap) -> bool:
    if softcap is None:
        return False
    # Comparisons only (no math.isfinite): under torch.compile a changing value arrives as a SymFloat.
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise InputError(f"softcap must be a finite number >= 0 (0: off); got {softcap!r}")
    return True if softcap > 0 else False  # a constant under torch.compile (a guard), never a SymBool


def _alibi_kind(slopes, heads: int, batch: int | None) -> str | None:
    """"heads" for (heads,) slopes, "batch_heads" for (batch, heads); None without slopes."""
    if slopes is None:
        return None
    if batch is not None and isinstance(slopes, torch.Tensor) and slopes.dim() == 2:
        _check_float_tensor("alibi_slopes", slopes, (batch, heads), "(batch, heads)", fp32=True)
        return "batch_heads"
    if batch is None and isinstance(slopes, torch.Tensor) and slopes.dim() == 2:
        raise UnsupportedError("alibi_slopes of shape (batch, heads) in flash_attn_varlen_func", [
            "a packed batch takes one slope per head, (heads,); per-sequence slopes are not implemented yet"])
    _check_float_tensor("alibi_slopes", slopes, (heads,), "(heads,) or (batch, heads)", fp32=True)
    return "heads"


def _check_float_tensor(name: str, t, shape: tuple, shown: str, fp32: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor {shown}; got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"{name} must have shape {shown} = {tuple(shape)}; got {tuple(t.shape)}")
    if (fp32 and t.dtype != torch.float32) or not t.is_floating_point():
        raise InputError(f"{name} must be {'float32' if fp32 else 'a float tensor'}; got {t.dtype}")


def _check_qkv(q, k, v, layout: str, kv_layout: str | None = None) -> None:
    """q in `layout`, k and v in `kv_layout` (default: the same), one dtype."""
    for name, t, shape in (("q", q, layout), ("k", k, kv_layout or layout), ("v", v, kv_layout or layout)):
        dims = shape.count(",") + 1
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            shown = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"{name} must be a {dims}-D tensor {shape}; got {shown}")
    if not q.dtype == k.dtype == v.dtype:
        raise InputError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def _deterministic(flag) -> bool | None:
    """FlashAttention's deterministic=False means "need not be": fa_gen's None, which still
    follows torch.use_deterministic_algorithms."""
    return True if flag else None


def _results(out, lse, return_attn_probs: bool, return_lse: bool):
    if return_attn_probs:
        return out, lse, None  # FlashAttention-2 returns the dropout mask's probabilities third: none here
    return (out, lse) if return_lse else out


def _int32(t):
    if not isinstance(t, torch.Tensor):
        raise InputError(f"cu_seqlens / seqused_k must be int32 tensors; got {type(t).__name__}")
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _cache_seqlens(cache_seqlens, q, k_cache, block_table, appending: bool):
    """(batch,) int32 lengths of the cached sequences: an int for all, or the full cache when None."""
    batch = q.shape[0]
    if isinstance(cache_seqlens, torch.Tensor):
        return _int32(cache_seqlens)
    if cache_seqlens is None:
        if appending:
            raise InputError("flash_attn_with_kvcache: cache_seqlens is required with k/v (where to append)")
        cache_seqlens = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int) or cache_seqlens < 0:
        raise InputError(f"cache_seqlens must be an int >= 0 or a (batch,) int32 tensor; got {cache_seqlens!r}")
    return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)


def _kvcache_function():
    """fa_gen.attention_with_kvcache, looked up at the call (it lives beside this module's callers)."""
    import fa_gen

    function = getattr(fa_gen, "attention_with_kvcache", None)
    if function is None:
        raise UnsupportedError("flash_attn_with_kvcache", [
            "this fa_gen has no KV-cache forward (fa_gen.attention_with_kvcache) yet"])
    return function
