"""fa_gen: FlashAttention-class kernels generated from declarative YAML specs.

    kern = fa_gen.build("specs/causal_bf16_d128.yaml")
    out, lse = kern(q, k, v)
    out, lse = fa_gen.attention(q, k, v, spec="causal_bf16_d128")
"""

from .errors import CompileError, FaGenError, InputError, SpecError, UnsupportedError
from .spec import Alignment, DType, MaskKind, Spec
from .spec_load import load_spec
from .version import __version__


def build(spec, arch=None, family=None):
    """Compile (or load from cache) the kernel of `spec`; see `fa_gen.runtime.build`."""
    from .runtime import build as _build

    return _build(spec, arch, family)


def attention(q, k, v, spec, deterministic=None, inputs=None, dropout_p=0.0):
    """`out, lse = attention(q, k, v, spec)`, differentiable; see `fa_gen.api.attention`."""
    from .api import attention as _attention

    return _attention(q, k, v, spec, deterministic, inputs, dropout_p)


def attention_fp8(q, k, v, spec, q_descale=None, k_descale=None, v_descale=None, inputs=None):
    """Attention over float8 e4m3 q, k, v with per-(batch, kv head) descale factors, forward only;
    see `fa_gen.api.fp8` (fa_gen.fp8.quantize makes the inputs)."""
    from .api import attention_fp8 as _attention_fp8

    return _attention_fp8(q, k, v, spec, q_descale, k_descale, v_descale, inputs)


def attention_fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, spec, q_descale=None,
                         k_descale=None, v_descale=None, inputs=None):
    """attention_fp8 over a packed (varlen) batch, forward only; see `fa_gen.api.fp8`."""
    from .api import attention_fp8_varlen as _function

    return _function(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, spec, q_descale, k_descale,
                     v_descale, inputs)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, spec, **options):
    """Differentiable attention over a packed (varlen) batch; see `fa_gen.api.varlen`."""
    from .api import attention_varlen as _attention_varlen

    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, spec, **options)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, spec, **options):
    """Append k_new/v_new to a (paged) KV cache and attend over it, forward only; see `fa_gen.api.kvcache`."""
    from .api import attention_with_kvcache as _attention_with_kvcache

    return _attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, spec, **options)


def flash_attn_func(q, k, v, *args, **kwargs):
    """FlashAttention-2's flash_attn_func (plus learnable_sink, return_lse); see `fa_gen.api.flash_attn`."""
    from .api import flash_attn_func as _function

    return _function(q, k, v, *args, **kwargs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **kwargs):
    """FlashAttention-2's flash_attn_varlen_func (plus seqused_k, return_lse); see `fa_gen.api.flash_attn`."""
    from .api import flash_attn_varlen_func as _function

    return _function(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **kwargs)


def flash_attn_with_kvcache(q, k_cache, v_cache, *args, **kwargs):
    """FlashAttention-2's flash_attn_with_kvcache over `attention_with_kvcache`; see `fa_gen.api.flash_attn`."""
    from .api import flash_attn_with_kvcache as _function

    return _function(q, k_cache, v_cache, *args, **kwargs)


def mla_decode(q, kv_cache, cache_seqlens, spec, block_table=None, num_splits=None, arch=None):
    """`out, lse = mla_decode(q, kv_cache, cache_seqlens, spec)`: MLA decode (q/k 576, v the
    cache's first 512 columns), contiguous or paged (block_table); see `fa_gen.mla`."""
    from .api import mla_decode as _mla_decode

    return _mla_decode(q, kv_cache, cache_seqlens, spec, block_table, num_splits, arch)


def merge_attention_states(outs, lses):
    """`out, lse = merge_attention_states(outs, lses)`: merge partial results by LSE; see `fa_gen.combine`."""
    from .api import merge_attention_states as _merge

    return _merge(outs, lses)


# FlashAttention-2's packed forms (q, k and v, or k and v, in one tensor; fa_gen.api.flash_attn).
_FLASH_PACKED = ("flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func")


def __getattr__(name):
    # `fa_gen.reference`, `fa_gen.distributed` and `fa_gen.fp8` without importing torch at package import time,
    # and the packed FlashAttention forms from fa_gen.api on first use.
    if name in ("reference", "distributed", "fp8"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in _FLASH_PACKED:
        from .api import flash_attn

        return getattr(flash_attn, name)
    raise AttributeError(name)


__all__ = [
    "Alignment", "CompileError", "DType", "FaGenError", "InputError", "MaskKind", "Spec",
    "SpecError", "UnsupportedError", "attention", "attention_fp8", "attention_fp8_varlen", "attention_varlen", "attention_with_kvcache", "build",
    "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", *_FLASH_PACKED, "load_spec",
    "merge_attention_states",
    "mla_decode",
    "__version__",
]
