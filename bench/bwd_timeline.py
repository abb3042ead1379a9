"""Where a backward call's time goes when it is timed alone (bench_forward.py's per-call timing):
the CPU ops, the kernel launches and the kernels of one call on one timeline, fa_gen beside an
anchor. Per call and back to back differ by the GPU's idle time inside the call; this shows where.

    python bench/bwd_timeline.py [--cell 128:none:1024] [--impls fa_gen,fa4] [--dtype bf16]

Cell HEAD_DIM:MASK:SEQLEN at bench_forward's shapes (batch * seqlen = 16k, heads * head_dim = 2048).
Prints per implementation: the event-timed call, then each CUDA runtime call and kernel of the
third profiled call with its start and end in us from the call's first event record; first,
without the profiler, the median over 20 calls of each call's event-timed GPU window (what
bench_forward.py's per-call timing reads) beside the host time until autograd.grad returned.

    python bench/bwd_timeline.py --hidden --cell 128:none:1024,64:causal:2048 [--impls ...]

--hidden skips the profiler and splits each call's window into GPU time and host time: the same
call timed once as bench_forward.py does (the GPU idle until the host launches) and once behind a
2 ms spin kernel (the launches queued before the GPU reaches them, the host's part hidden); the
difference is what the host adds to a call timed alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_forward import HIDDEN, TOKENS, _forward_graph, _grad  # noqa: E402
from implementations import IMPLEMENTATIONS, Case  # noqa: E402
from fa_gen.timing import make_input_sets  # noqa: E402


def timeline(graph, calls: int = 3) -> list[tuple[float, float, str, str]]:
    """(start us, end us, kind, name) of the last of `calls` profiled calls, from its start event."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        _grad(*graph)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.profiler.record_function(f"call{i}"):
                start.record()
                _grad(*graph)
                end.record()
            end.synchronize()
    events = prof.events()
    last = [e for e in events if e.name == f"call{calls - 1}"][0]
    t0 = last.time_range.start
    rows = []
    for e in events:
        ts = e.time_range.start
        if ts < t0 - 1 or ts > last.time_range.end + 5000:
            continue
        kind = "gpu" if e.device_type == torch.autograd.DeviceType.CUDA else "cpu"
        if kind == "cpu" and not (e.name.startswith("cuda") or e.name.startswith("call") or "autograd" in e.name
                                  or e.name.startswith("fa_gen") or e.name.startswith("aten::empty")):
            continue
        rows.append((ts - t0, e.time_range.end - t0, kind, e.name[:90]))
    return sorted(rows)


def plain(graph, calls: int = 20) -> tuple[float, float]:
    """(median event-timed ms, median host ms until autograd.grad returned) over `calls` calls."""
    import statistics
    import time

    for _ in range(5):
        _grad(*graph)
    torch.cuda.synchronize()
    windows, hosts = [], []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        _grad(*graph)
        hosts.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        windows.append(start.elapsed_time(end))
    return statistics.median(windows), statistics.median(hosts)


def hidden(graph, calls: int = 20, spin_ms: float = 2.0) -> float:
    """Median event-timed ms of a call queued behind a spin kernel: its GPU time alone."""
    import statistics

    for _ in range(5):
        _grad(*graph)
    torch.cuda.synchronize()
    khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 1_980_000)  # the SM clock, kHz
    cycles = int(spin_ms * khz * 1e3)
    windows = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        _grad(*graph)
        end.record()
        end.synchronize()
        windows.append(start.elapsed_time(end))
    return statistics.median(windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cell", default="128:none:1024")
    parser.add_argument("--impls", default="fa_gen,fa4")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--hidden", action="store_true", help="GPU and host parts of each call, no profiler")
    args = parser.parse_args()
    for cell in args.cell.split(","):
        run_cell(args, cell)


def run_cell(args, cell: str) -> None:
    head_dim, mask, seqlen = cell.split(":")
    head_dim, seqlen = int(head_dim), int(seqlen)
    case = Case(args.dtype, head_dim, mask == "causal", seqlen, TOKENS // seqlen, HIDDEN // head_dim, True)
    (q, k, v), = make_input_sets(1, case.batch, case.seqlen, case.heads, case.heads, head_dim, head_dim,
                                 case.torch_dtype)
    for name in args.impls.split(","):
        fn = IMPLEMENTATIONS[name](case)
        graph = _forward_graph(fn, q, k, v)
        window, host = plain(graph)
        if args.hidden:
            gpu = hidden(graph)
            print(f"{name:8s} {args.dtype} d{head_dim:<3d} {mask:6s} s{seqlen:<5d} call {window * 1e3:7.1f} us, "
                  f"GPU alone {gpu * 1e3:7.1f} us, host's part {(window - gpu) * 1e3:6.1f} us "
                  f"(autograd.grad returned after {host * 1e3:6.1f} us)", flush=True)
            continue
        print(f"== {name} {args.dtype} d{head_dim} {mask} s{seqlen}: call {window:.3f} ms (events), "
              f"autograd.grad returned after {host:.3f} ms (host)")
        for start, end, kind, label in timeline(graph):
            print(f"  {start:9.1f} {end:9.1f} {kind} {label}")


if __name__ == "__main__":
    main()
