"""Timing and FLOP counting shared by the CLI and bench/: CUDA events, median, rotated inputs."""

from __future__ import annotations

import statistics

import torch


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim_qk: int,
                    head_dim_v: int, causal: bool) -> float:
    """Forward FLOPs as FlashAttention's benchmarks count them (causal halves the work)."""
    flops = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim_qk + head_dim_v)
    return flops / 2 if causal else flops


def median_ms(fn, input_sets: list, warmup: int = 5, repeats: int = 30) -> float:
    """Median time of fn(*inputs) in ms, cycling through `input_sets` so L2 cannot serve repeats."""
    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        inputs = input_sets[i % len(input_sets)]
        start.record()
        fn(*inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_input_sets(count: int, batch: int, seqlen: int, heads_q: int, heads_kv: int,
                    head_dim_qk: int, head_dim_v: int, dtype: torch.dtype) -> list:
    def one():
        def draw(h, d):
            return torch.randn(batch, seqlen, h, d, device="cuda", dtype=dtype)
        return draw(heads_q, head_dim_qk), draw(heads_kv, head_dim_qk), draw(heads_kv, head_dim_v)
    return [one() for _ in range(count)]


def time_forward(kernel, batch: int, seqlen: int, heads: int) -> tuple[float, float]:
    """(TFLOP/s, median ms) of `kernel` at a square shape."""
    spec = kernel.spec
    dtype = kernel._dtype
    sets = make_input_sets(3, batch, seqlen, heads, heads, spec.head_dim_qk, spec.head_dim_v, dtype)
    ms = median_ms(lambda q, k, v: kernel.forward(q, k, v), sets)
    causal = spec.window_right == 0 and spec.window_left is None
    flops = attention_flops(batch, heads, seqlen, seqlen, spec.head_dim_qk, spec.head_dim_v, causal)
    return flops / ms / 1e9, ms
