"""fa_gen as an attention implementation of Hugging Face transformers (>= 5.0).

    import fa_gen.integrations.transformers as fa_hf
    fa_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fa_gen", dtype=torch.bfloat16)

`register()` adds `attention_forward` to transformers' AttentionInterface and, for the same name,
transformers' FlashAttention mask function to its AttentionMaskInterface: the model then hands each
layer the 2-D padding mask (batch, seqlen_k), or None when no token is padding, instead of a 4-D mask.

What a layer gets and what fa_gen runs (q, k, v arrive as (batch, heads, seqlen, dim), GQA k/v with
fewer heads; the output leaves as (batch, seqlen, heads, dim)):
- a padding mask (left- or right-padded prefill, left-padded decode as generate() sends): the real
  tokens are packed (fa_gen.integrations.padding, once per forward for all layers), run through
  flash_attn_varlen_func with bottom-right masks per sequence, and re-padded with zeros;
- packed sequences (one row; `cu_seq_lens_q/k` kwargs as DataCollatorWithFlattening gives them, or
  position ids restarting inside the row): flash_attn_varlen_func;
- otherwise flash_attn_func (a decode step's one query against the cache: bottom-right causal).
`scaling`, `sliding_window` (FlashAttention's (w - 1, w - 1), causal folding the right side),
`softcap`, `is_causal` and `s_aux` sinks (gpt-oss; in padded and packed batches too, differentiable)
are taken from what the layer passes. Dropout > 0 and 4-D masks are UnsupportedErrors, never a
silent wrong answer.
"""

from __future__ import annotations

import torch

from ..api.flash_attn import flash_attn_func, flash_attn_varlen_func
from ..errors import UnsupportedError
from .padding import LastResult, gather, packed_from_position_ids, scatter, unpad_mask

NAME = "fa_gen"
MIN_TRANSFORMERS = 5

_unpad = LastResult(unpad_mask)
_packed_positions = LastResult(packed_from_position_ids)


def register(name: str = NAME) -> str:
    """Make `attn_implementation=name` use fa_gen in transformers; returns the name."""
    _require_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _require_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("fa_gen.integrations.transformers needs Hugging Face transformers >= "
                          f"{MIN_TRANSFORMERS}.0: pip install 'transformers>={MIN_TRANSFORMERS}'") from None
    major = int(transformers.__version__.split(".")[0])
    if major < MIN_TRANSFORMERS:
        raise ImportError(f"fa_gen.integrations.transformers needs transformers >= {MIN_TRANSFORMERS}.0 "
                          f"(its AttentionInterface and mask interface); found {transformers.__version__}")
    return transformers


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """transformers' attention function signature: (attn_output (batch, seqlen_q, heads, dim_v), None)."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    options = {"dropout_p": dropout, "softmax_scale": scaling, "causal": causal,
               "window_size": window_size(sliding_window), "softcap": softcap or 0.0}
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if attention_mask is not None:
        return _padded(q, k, v, attention_mask, s_aux, options), None
    packed = _packed(q, k, kwargs)
    if packed is not None:
        return _packed_attention(q, k, v, packed, s_aux, options), None
    return flash_attn_func(q, k, v, learnable_sink=s_aux, **options), None


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """transformers' window (each query sees `sliding_window` keys, itself included) as
    FlashAttention's (left, right); causal sets right to 0."""
    if sliding_window is None:
        return -1, -1
    return sliding_window - 1, sliding_window - 1


def _padded(q, k, v, mask, s_aux, options):
    """Unpad to a packed batch, attend, pad back (zeros at padded query rows)."""
    if mask.dim() != 2:
        raise UnsupportedError(f"a {mask.dim()}-D attention_mask", [
            "the fa_gen attention implementation takes the 2-D padding mask transformers builds for it "
            "(custom 4-D masks: use attn_implementation='sdpa' or 'eager')"])
    if k.shape[1] > mask.shape[1]:  # a static cache: the slots past the mask are unused
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    mask = mask[:, -k.shape[1]:]
    batch, seqlen_q = q.shape[:2]
    packing = _unpad(mask, seqlen_q)
    out = flash_attn_varlen_func(
        gather(q, packing.indices_q, seqlen_q), gather(k, packing.indices_k, packing.seqlen_k),
        gather(v, packing.indices_k, packing.seqlen_k), packing.cu_seqlens_q, packing.cu_seqlens_k,
        packing.max_seqlen_q, packing.max_seqlen_k, learnable_sink=s_aux, **options)
    return scatter(out, packing.indices_q, batch, seqlen_q)


def _packed(q, k, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) of sequences packed into one row, or None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(cu_q.diff().max()) if max_q is None else int(max_q)
        max_k = int(cu_k.diff().max()) if max_k is None else int(max_k)
        return cu_q, cu_k, max_q, max_k
    position_ids = kwargs.get("position_ids")
    if position_ids is None or q.shape[0] != 1 or q.shape[1] == 1 or position_ids.shape[-1] != q.shape[1]:
        return None
    found = _packed_positions(position_ids)
    if found is None:
        return None
    if k.shape[1] != q.shape[1]:
        raise UnsupportedError("packed sequences (position ids) with a KV cache", [
            f"{q.shape[1]} queries against {k.shape[1]} keys: packing is for training and cache-less prefill"])
    cu_seqlens, longest = found
    return cu_seqlens, cu_seqlens, longest, longest


def _packed_attention(q, k, v, packed, s_aux, options):
    cu_q, cu_k, max_q, max_k = packed
    if q.shape[0] != 1:
        raise UnsupportedError(f"cu_seq_lens with a batch of {q.shape[0]} rows", [
            "packed sequences come as one row (batch 1), as DataCollatorWithFlattening builds them"])
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, learnable_sink=s_aux, **options)
    return out.unsqueeze(0)
