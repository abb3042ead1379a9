"""Per-call host overhead at a tiny shape: fa_gen against SDPA (and FlashAttention-4 if present).

    python bench/overhead.py

A tiny shape makes the GPU work negligible, so the time per call in a tight
loop (synchronising only at the end) is the host path: argument checks,
allocation and the launch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa_gen.runtime import build  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kernel = build(load_spec({"name": "overhead_bf16_d128", "dtype": "bf16", "head_dim": 128, "mask": "causal"}))
    rows = {"fa_gen kernel(q, k, v)": lambda: kernel(q, k, v)}
    rows["sdpa (flash)"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    try:
        from flash_attn.cute import flash_attn_func

        flash_attn_func(q, k, v, causal=True)
        rows["flash_attn.cute (FA4)"] = lambda: flash_attn_func(q, k, v, causal=True)
    except Exception as exc:  # the anchor is optional
        print(f"FA4 not measured: {type(exc).__name__}: {exc}")
    for name, fn in rows.items():
        print(f"{name:28s} {per_call_us(fn):7.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
