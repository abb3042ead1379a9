"""Host time of one decode step through the KV-cache call: where the Python path spends it.

    python bench/kvcache_host.py [--profile]

A tiny decode shape (1 sequence, 256 cached keys, one new token, 32 query / 8 KV heads, d 128)
keeps the GPU work to a few microseconds, so the time per call in a tight loop (one
synchronisation at the end) is the host path: argument checks, allocations and launches. Rows:
fa_gen.attention_with_kvcache with and without an append, flash_attn_with_kvcache (the
FlashAttention-compatible wrapper) with and without rotary tables, the paged cache, and
FlashAttention-4's flash_attn_func at the same shape where present. --profile adds the cProfile of the
wrapper's call (top 30 by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fa_gen  # noqa: E402
from overhead import per_call_us  # noqa: E402  (bench/overhead.py: a tight loop, one sync at the end)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    k_cache = torch.randn(1, 512, 8, 128, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    k_new, v_new = torch.randn(1, 1, 8, 128, device=dev, dtype=dt), torch.randn(1, 1, 8, 128, device=dev, dtype=dt)
    lengths = torch.tensor([255], dtype=torch.int32, device=dev)
    angles = torch.rand(512, 64, device=dev) * 6.28
    cos, sin = torch.cos(angles).to(dt), torch.sin(angles).to(dt)
    pages = k_cache.view(32, 16, 8, 128)
    table = torch.arange(32, dtype=torch.int32, device=dev)[None]
    spec = "causal_bf16_d128"
    rows = {
        "attention_with_kvcache, no append": lambda: fa_gen.attention_with_kvcache(q, k_cache, v_cache, lengths, spec),
        "attention_with_kvcache, append": lambda: fa_gen.attention_with_kvcache(q, k_cache, v_cache, lengths, spec,
                                                                                k_new=k_new, v_new=v_new),
        "flash_attn_with_kvcache, append": lambda: fa_gen.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True),
        "flash_attn_with_kvcache, append + rotary": lambda: fa_gen.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths, causal=True),
        "flash_attn_with_kvcache, paged p16 append": lambda: fa_gen.flash_attn_with_kvcache(
            q, pages, pages.clone(), k_new, v_new, cache_seqlens=lengths, block_table=table, causal=True),
        "flash_attn_func (decode shape)": lambda: fa_gen.flash_attn_func(q, k_cache, v_cache, causal=True),
    }
    try:
        from flash_attn.cute import flash_attn_func as fa4_func

        rows["FA4 flash_attn_func (decode shape)"] = lambda: fa4_func(q, k_cache, v_cache, causal=True)
    except Exception as error:  # noqa: BLE001
        print(f"FA4: unavailable ({type(error).__name__})")
    rows["sdpa (decode shape, gqa)"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), enable_gqa=True)
    for name, fn in rows.items():
        print(f"{name:45s} {per_call_us(fn):8.1f} us a call")
    if args.profile:
        fn = rows["flash_attn_with_kvcache, append"]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(500):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
