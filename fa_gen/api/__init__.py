"""The public API: one layer above the custom ops (fa_gen.autograd, fa_gen.varlen) and the kernel
runtime (fa_gen.runtime, fa_gen.backward, fa_gen.inference, fa_gen.combine), which never import it.

    attention(q, k, v, spec)                          fixed-length batches, differentiable
    attention_varlen(q, k, v, cu_q, cu_k, ...)       packed (varlen) batches, differentiable
    attention_with_kvcache(q, k_cache, v_cache, ...) append to a (paged) KV cache and attend, inference
    attention_fp8(q8, k8, v8, spec, q_descale, ...)  e4m3 inputs with descale factors, forward (fa_gen.fp8)
    attention_fp8_varlen(q8, k8, v8, cu_q, cu_k, ...) the same over a packed batch
    merge_attention_states(outs, lses)               merge partial results by LSE
    mla_decode(q, kv_cache, cache_seqlens, spec)     MLA decode over a latent (paged) cache (fa_gen.mla)
    flash_mla_with_kvcache / get_mla_metadata        FlashMLA's signatures (fa_gen.api.flash_mla)
    flash_attn_func / flash_attn_varlen_func / flash_attn_with_kvcache, and the packed forms
    flash_attn_(varlen_)qkvpacked_func / flash_attn_(varlen_)kvpacked_func
                                                     FlashAttention's signatures (fa_gen.api.flash_attn)
"""

from ..combine import merge_attention_states
from ..mla import mla_decode
from .attention import attention
from .fp8 import attention_fp8, attention_fp8_varlen
from .flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                         flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .flash_mla import flash_mla_with_kvcache, get_mla_metadata
from .kvcache import attention_with_kvcache
from .varlen import attention_varlen

__all__ = ["attention", "attention_fp8", "attention_fp8_varlen", "attention_varlen", "attention_with_kvcache",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "flash_mla_with_kvcache", "get_mla_metadata", "merge_attention_states", "mla_decode"]
