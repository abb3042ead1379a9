"""The public API: one layer above the custom ops (fa_gen.autograd, fa_gen.varlen) and the kernel
runtime (fa_gen.runtime, fa_gen.backward, fa_gen.inference, fa_gen.combine), which never import it.

    attention(q, k, v, spec)                          fixed-length batches, differentiable
    attention_varlen(q, k, v, cu_q, cu_k, ...)       packed (varlen) batches, differentiable
    merge_attention_states(outs, lses)               merge partial results by LSE
"""

from ..combine import merge_attention_states
from .attention import attention
from .varlen import attention_varlen

__all__ = ["attention", "attention_varlen", "merge_attention_states"]
