"""The project's forward benchmark: fa_gen against the anchors, side by side in one process.

    python bench/bench_forward.py --commit $(git rev-parse --short HEAD) [--out DIR] [--plot]
    python bench/bench_forward.py --backward ...   # the backward pass instead

--backward times the backward alone: per input set the forward runs once (outside the timing)
with inputs that require grad, then each timed call is torch.autograd.grad(out, (q, k, v),
dout, retain_graph=True); TFLOP/s = 2.5 x the forward FLOPs (FlashAttention's convention).
Each backward cell also reports "b2b": the input sets' backwards queued back to back between two
events, per call, so per-call host overhead (autograd, custom-op dispatch) hides as in training.

Shapes follow FlashAttention's benchmarks: batch*seqlen = 16k tokens, heads*head_dim = 2048.
TFLOP/s = 4*b*h*s^2*d (halved for causal) over the median of >= 20 timed runs after warm-up,
with inputs rotated among several sets so L2 cannot serve repeats. Writes
<out>/<date>-<commit>.json (and a PNG with --plot) and prints fa_gen / best anchor per cell.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from implementations import ANCHORS, BACKWARD_IMPLEMENTATIONS, IMPLEMENTATIONS, Case  # noqa: E402

from fa_gen.timing import attention_flops, make_input_sets, median_ms  # noqa: E402

TOKENS = 16 * 1024
HIDDEN = 2048
REPEATS = 30


# Backward FLOPs per forward FLOP: five GEMMs against the forward's two.
BACKWARD_FLOP_RATIO = 2.5


def time_case(name: str, case: Case, input_sets) -> dict:
    try:
        fn = IMPLEMENTATIONS[name](case)
        extra = {}
        if case.backward:
            graphs = [_forward_graph(fn, *inputs) for inputs in input_sets]
            ms = median_ms(_grad, graphs, warmup=5, repeats=REPEATS)
            extra["ms_back_to_back"] = _back_to_back_ms(graphs)
        else:
            ms = median_ms(fn, input_sets, warmup=5, repeats=REPEATS)
    except Exception as exc:  # an anchor that cannot run a cell is recorded, not fatal
        return {"impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
    flops = attention_flops(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim,
                            case.head_dim, case.causal)
    if case.backward:
        flops *= BACKWARD_FLOP_RATIO
        extra["tflops_back_to_back"] = flops / extra["ms_back_to_back"] / 1e9
    return {"impl": name, "ms": ms, "tflops": flops / ms / 1e9, **extra}


def _forward_graph(fn, q, k, v):
    """(out, inputs, dout): one forward with inputs that require grad, its graph kept for timing."""
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
    out = fn(*inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out, inputs, torch.randn_like(out)


def _grad(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout, retain_graph=True)


def _back_to_back_ms(graphs, repeats: int = 10) -> float:
    """Per-call time of one backward per graph queued back to back between two events: the host
    runs ahead as in training, so per-call host overhead hides behind the previous call."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for graph in graphs:
            _grad(*graph)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(graphs))
    return statistics.median(times)


def cases(args):
    for dtype in args.dtypes.split(","):
        for head_dim in map(int, args.head_dims.split(",")):
            for causal in (False, True):
                for seqlen in map(int, args.seqlens.split(",")):
                    yield Case(dtype, head_dim, causal, seqlen, TOKENS // seqlen, HIDDEN // head_dim,
                               args.backward)


def run_cell(case: Case, impls: list[str]) -> dict:
    sets = make_input_sets(4, case.batch, case.seqlen, case.heads, case.heads, case.head_dim,
                           case.head_dim, case.torch_dtype)
    cell = {"dtype": case.dtype, "head_dim": case.head_dim, "causal": case.causal, "seqlen": case.seqlen,
            "batch": case.batch, "heads": case.heads, "results": [time_case(n, case, sets) for n in impls]}
    del sets
    return cell


def ratio_to_best_anchor(cell: dict) -> tuple[float | None, str | None]:
    by = {r["impl"]: r.get("tflops") for r in cell["results"]}
    anchors = {n: t for n, t in by.items() if n in ANCHORS and t}
    if not by.get("fa_gen") or not anchors:
        return None, None
    best = max(anchors, key=anchors.get)
    return by["fa_gen"] / anchors[best], best


def format_row(cell: dict) -> str:
    head = (f"{cell['dtype']} d={cell['head_dim']:3d} {'causal' if cell['causal'] else 'full  '} "
            f"s={cell['seqlen']:5d}")
    parts = [head] + [_format_result(r) for r in cell["results"]]
    ratio, best = ratio_to_best_anchor(cell)
    if ratio is not None:
        parts.append(f"fa_gen/{best} {ratio:.2f}")
    return " | ".join(parts)


def _format_result(r: dict) -> str:
    if "tflops" not in r:
        return f"{r['impl']}   ERR"
    back_to_back = f" (b2b {r['tflops_back_to_back']:5.1f})" if "tflops_back_to_back" in r else ""
    return f"{r['impl']} {r['tflops']:6.1f}{back_to_back}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--impls", default=None,
                        help="comma-separated; default every implementation (forward) or "
                             + ",".join(BACKWARD_IMPLEMENTATIONS) + " (--backward)")
    parser.add_argument("--backward", action="store_true", help="time the backward pass instead")
    parser.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    args = parser.parse_args()

    default_impls = BACKWARD_IMPLEMENTATIONS if args.backward else IMPLEMENTATIONS
    impls = (args.impls or ",".join(default_impls)).split(",")
    rows = []
    for case in cases(args):
        rows.append(run_cell(case, impls))
        print(format_row(rows[-1]), flush=True)
    report = {
        "commit": args.commit,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "mode": "backward" if args.backward else "forward",
        "method": f"median of {REPEATS} CUDA-event timings after 5 warm-ups, 4 rotated input sets; "
                  + ("backward alone: autograd.grad(out, (q, k, v), dout, retain_graph=True) after one "
                     "forward per input set; TFLOP/s = 2.5*4*b*h*s^2*d (/2 causal); b2b: the 4 sets' "
                     "backwards queued back to back, median of 10, per call" if args.backward else
                     "TFLOP/s = 4*b*h*s^2*d (/2 causal)")
                  + "; batch*seqlen = 16k, heads*head_dim = 2048",
        "cells": rows,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{dt.date.today().isoformat()}-{args.commit}" + ("-bwd" if args.backward else "")
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    if args.plot:
        from plot import plot_report

        print(f"wrote {plot_report(report, out_dir / f'{stem}.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
