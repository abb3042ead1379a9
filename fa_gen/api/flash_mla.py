"""FlashMLA's call signatures over fa_gen.mla_decode (Hopper MLA decode):

    metadata, num_splits = get_mla_metadata(cache_seqlens, seqlen_q * heads_q // heads_kv, heads_kv)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, metadata, num_splits,
                                      softmax_scale=None, causal=False)

q (batch, seqlen_q, heads_q, 576); k_cache (num_blocks, page_size, 1, 576) paged by block_table
(batch, max_blocks) int32 (or None: k_cache is (batch, capacity, 1, 576)); V is k_cache's first
head_dim_v = 512 columns; cache_seqlens (batch,) int32. out (batch, seqlen_q, heads_q, 512),
lse (batch, heads_q, seqlen_q) fp32. Causal is bottom-right (multi-token decode), as FlashMLA's.

The scheduling metadata is accepted and not needed: fa_gen sizes its key splits from the shapes
alone inside the call (no host sync, CUDA-graph safe), so get_mla_metadata returns (None, None)
and flash_mla_with_kvcache ignores what it is given there. The spec behind a call is the one
FlashAttention's signatures build for the same (dtype, head dims, causal, softmax_scale)
(fa_gen.api.flash_specs), so both reach one compiled kernel.
"""

from __future__ import annotations

import torch

from ..autograd import spec_from_key
from ..errors import UnsupportedError
from ..mla import mla_decode
from ..spec import MLA_HEAD_DIMS
from .flash_attn import _scale
from .flash_specs import DTYPES, flash_spec_key, fold_window


def get_mla_metadata(cache_seqlens: torch.Tensor, num_heads_per_head_k: int, num_heads_k: int, *args, **kwargs):
    """(tile_scheduler_metadata, num_splits) as FlashMLA returns them: (None, None) here, the
    splits being chosen per call from shapes (see the module docstring)."""
    if num_heads_k != 1:
        raise UnsupportedError(f"num_heads_k={num_heads_k}", ["MLA decode reads one latent KV head"])
    return None, None


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata=None,
                           num_splits=None, softmax_scale: float | None = None, causal: bool = False):
    """FlashMLA's flash_mla_with_kvcache: (out, softmax_lse); see the module docstring."""
    if head_dim_v != MLA_HEAD_DIMS[1] or q.shape[-1] != MLA_HEAD_DIMS[0]:
        raise UnsupportedError(f"head dims qk {q.shape[-1]}, v {head_dim_v}", [
            f"fa_gen's MLA decode takes qk {MLA_HEAD_DIMS[0]} (512 latent + 64 rope) and v {MLA_HEAD_DIMS[1]}"])
    if q.dtype not in DTYPES:
        raise UnsupportedError(f"q.dtype {q.dtype}", ["MLA decode takes torch.bfloat16 and torch.float16"])
    left, right = fold_window(bool(causal), (-1, -1))
    scale = _scale(softmax_scale, MLA_HEAD_DIMS[0])  # checked; None for the default 1/sqrt(576)
    spec = spec_from_key(flash_spec_key(DTYPES[q.dtype], *MLA_HEAD_DIMS, bool(causal), left, right, scale, False, None,
                                        False))
    return mla_decode(q, k_cache, cache_seqlens, spec, block_table=block_table)
