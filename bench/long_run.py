"""Long-run check of the decode path (issue 24): 10^6 calls with random lengths, eager and
replayed from a CUDA graph, watching for growth in GPU memory, host memory and host time.

    python bench/long_run.py [--calls 1000000] [--window 10000] --out DIR

Each call is one decode step of `fa_gen.attention_with_kvcache` (bf16, causal, d128, batch 8,
32/8 heads, a paged cache of 64-token pages, 4k capacity) with k_new/v_new appended and fresh
random cache_seqlens: eager, the lengths tensor is rebuilt each call; graphed, one captured step
replays after the lengths are copied into its static tensor (no host sync either way). Per
window of calls: median host microseconds a call, GPU memory allocated and reserved, the
process's resident set. The run fails (exit 1) when the last window's memory exceeds the
first's by more than 1 MiB (GPU) or 64 MiB (host), or its median host time by more than 20%.
Writes <out>/<date>-<commit>-long-run.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fa_gen  # noqa: E402

SPEC = "causal_bf16_d128"
BATCH, HEADS_Q, HEADS_KV, DIM, PAGE, CAPACITY = 8, 32, 8, 128, 64, 4096


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def make_state(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = BATCH * CAPACITY // PAGE
    k_cache = torch.randn(pages, PAGE, HEADS_KV, DIM, generator=g, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(pages, generator=g, device="cuda").to(torch.int32).view(BATCH, -1).contiguous()
    q = torch.randn(BATCH, 1, HEADS_Q, DIM, generator=g, device="cuda").to(torch.bfloat16)
    k_new = torch.randn(BATCH, 1, HEADS_KV, DIM, generator=g, device="cuda").to(torch.bfloat16)
    return q, k_cache, v_cache, table, k_new, k_new.clone()


def step(q, k_cache, v_cache, lengths, table, k_new, v_new):
    return fa_gen.attention_with_kvcache(q, k_cache, v_cache, lengths, SPEC, k_new=k_new, v_new=v_new,
                                         page_table=table)


def run(mode: str, calls: int, window: int) -> list[dict]:
    q, k_cache, v_cache, table, k_new, v_new = make_state()
    lengths = torch.randint(1, CAPACITY - 1, (BATCH,), dtype=torch.int32, device="cuda")
    # Random lengths for every call, made on the device ahead of time (no host RNG on the path).
    pool = torch.randint(1, CAPACITY - 1, (window, BATCH), dtype=torch.int32, device="cuda")
    graph = None
    if mode == "graph":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step(q, k_cache, v_cache, lengths, table, k_new, v_new)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(q, k_cache, v_cache, lengths, table, k_new, v_new)
    windows = []
    for start in range(0, calls, window):
        times = []
        for i in range(min(window, calls - start)):
            t0 = time.perf_counter()
            if graph is not None:
                lengths.copy_(pool[i])
                graph.replay()
            else:
                step(q, k_cache, v_cache, pool[i].clone(), table, k_new, v_new)
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        windows.append({"first_call": start, "median_host_us": 1e6 * statistics.median(times),
                        "gpu_allocated": torch.cuda.memory_allocated(), "gpu_reserved": torch.cuda.memory_reserved(),
                        "rss": rss_bytes()})
        pool = torch.randint(1, CAPACITY - 1, (window, BATCH), dtype=torch.int32, device="cuda")
    return windows


def verdict(windows: list[dict]) -> list[str]:
    first, last = windows[0], windows[-1]
    problems = []
    if last["gpu_allocated"] - first["gpu_allocated"] > 1 << 20:
        problems.append(f"GPU memory grew {first['gpu_allocated']} -> {last['gpu_allocated']} bytes")
    if last["rss"] - first["rss"] > 64 << 20:
        problems.append(f"host memory grew {first['rss'] >> 20} -> {last['rss'] >> 20} MiB")
    if last["median_host_us"] > 1.2 * first["median_host_us"]:
        problems.append(f"host time grew {first['median_host_us']:.1f} -> {last['median_host_us']:.1f} us a call")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--window", type=int, default=10_000)
    parser.add_argument("--modes", default="eager,graph")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD here, which a "
                                                        "copied working tree may not match)")
    args = parser.parse_args(argv)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    record = {"commit": commit or "unknown", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "calls": args.calls, "window": args.window, "modes": {}}
    failed = False
    for mode in args.modes.split(","):
        windows = run(mode, args.calls, args.window)
        problems = verdict(windows)
        failed |= bool(problems)
        record["modes"][mode] = {"windows": windows, "problems": problems}
        first, last = windows[0], windows[-1]
        print(f"{mode}: {args.calls} calls; host {first['median_host_us']:.1f} -> {last['median_host_us']:.1f} us; "
              f"GPU allocated {first['gpu_allocated'] >> 20} -> {last['gpu_allocated'] >> 20} MiB; "
              f"RSS {first['rss'] >> 20} -> {last['rss'] >> 20} MiB; {'; '.join(problems) or 'no growth'}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{record['date']}-{record['commit']}-long-run.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
