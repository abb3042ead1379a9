"""Benchmark cells under ncu, fa_gen beside an anchor in one process: what bounds a cell.

    python bench/profile_cells.py --ncu --out DIR fwd:bf16:128:causal:16384 bwd:bf16:64:causal:4096 ...

A cell is MODE:DTYPE:HEAD_DIM:MASK:SEQLEN with bench/bench_forward.py's shapes (batch * seqlen =
16k, heads * head_dim = 2048). With --ncu the script runs itself under ncu once per (cell,
implementation); the launch it profiles sits between cudaProfilerStart and cudaProfilerStop
(ncu --profile-from-start off), so ncu sees only those kernels, the backward's pre- and post-
processing kernels included. (An NVTX range did not do for the backward: ranges belong to the
thread that pushes them, and autograd launches the backward's kernels from its own thread, so
session 10's backward profiles came back empty.) Reports land in DIR as
CSV (ncu --page details) plus one summary line per kernel on stdout: duration, tensor-pipe and
issue-slot use, DRAM throughput, the top warp stall reasons. --pipes adds a second ncu run per
(cell, implementation) with the per-pipe instruction shares (ALU, FMA, FMA-heavy, FP16, XU,
uniform), each % of its peak: which pipe a kernel's element math fills.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Metrics of the summary line: (label, ncu section's metric name as --page details prints it).
SUMMARY = (
    ("time", "Duration"),
    ("sm%", "Compute (SM) Throughput"),
    ("dram%", "DRAM Throughput"),
    ("issue%", "Issue Slots Busy"),
    ("regs", "Registers Per Thread"),
    ("occ%", "Achieved Occupancy"),
    ("l2hit%", "L2 Hit Rate"),
    ("l1hit%", "L1/TEX Hit Rate"),
    ("memmax%", "Max Bandwidth"),
)
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "WarpStateStats",
            "SchedulerStats", "Occupancy", "LaunchStats")
# Tensor-pipe use and stall reasons (cycles per issued instruction), by raw metric; a run whose
# ncu lacks one of them is repeated with the sections alone.
STALLS = ("barrier", "long_scoreboard", "short_scoreboard", "wait", "math_pipe_throttle", "mio_throttle",
          "lg_throttle", "sleeping", "no_instruction", "dispatch_stall", "membar", "selected", "not_selected")
METRICS = ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
           *(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS))

# Per-pipe issue shares (--pipes), in a run of their own: a metric this ncu lacks loses only them.
PIPES = tuple(f"sm__inst_executed_pipe_{p}.avg.pct_of_peak_sustained_active"
              for p in ("alu", "fma", "fmaheavy", "fp16", "xu", "uniform"))


def parse_cell(text: str):
    from implementations import Case

    mode, dtype, head_dim, mask, seqlen = text.split(":")
    if mode not in ("fwd", "bwd") or mask not in ("causal", "none"):
        raise SystemExit(f"bad cell {text!r}: MODE (fwd|bwd):DTYPE:HEAD_DIM:MASK (causal|none):SEQLEN")
    d, s = int(head_dim), int(seqlen)
    return Case(dtype, d, mask == "causal", s, max(1, 16384 // s), 2048 // d, mode == "bwd")


def run_cell(text: str, impl: str, launches: int) -> None:
    """`launches` calls of impl on the cell, the last inside the profiler's capture range (what ncu keeps)."""
    import torch

    from implementations import IMPLEMENTATIONS

    case = parse_cell(text)
    fn = {**IMPLEMENTATIONS, "fa_gen_dropout": _fa_gen_dropout}[impl](case)
    q, k, v = (torch.randn(case.batch, case.seqlen, case.heads, case.head_dim, device="cuda",
                           dtype=case.torch_dtype, requires_grad=case.backward) for _ in range(3))
    dout = torch.randn(case.batch, case.seqlen, case.heads, case.head_dim, device="cuda", dtype=case.torch_dtype)
    for i in range(launches):
        out = fn(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        last = i == launches - 1
        if last:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        if case.backward:
            torch.autograd.grad(out, (q, k, v), dout)
        elif last:  # the forward again inside the range
            fn(q, k, v)
        if last:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


def _fa_gen_dropout(case):
    """fa_gen.attention at dropout p = 0.1: the forward_dropout kernel (and, for a backward cell,
    backward_dropout), to profile beside fa_gen at p = 0."""
    from implementations import case_spec

    from fa_gen.api import attention

    spec = case_spec(case)
    return lambda q, k, v: attention(q, k, v, spec, dropout_p=0.1)


def profile(cell: str, impl: str, out: Path, pipes: bool = False) -> None:
    name = f"{cell}-{impl}".replace(":", "_")
    base = ["ncu", "--profile-from-start", "off", "--csv", "--page", "details",
            *[f"--section={s}" for s in SECTIONS]]
    script = [sys.executable, __file__, "--run", cell, impl]
    result = subprocess.run([*base, "--metrics", ",".join(METRICS), *script], capture_output=True, text=True)
    if result.returncode:
        result = subprocess.run([*base, *script], capture_output=True, text=True)
    (out / f"{name}.csv").write_text(result.stdout)
    if result.returncode:
        (out / f"{name}.err").write_text(result.stderr)
        print(f"{name}: ncu rc {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
        return
    for line in summarize(result.stdout):
        print(f"{name}: {line}", flush=True)
    if pipes:
        result = subprocess.run(["ncu", "--profile-from-start", "off", "--csv", "--page", "raw", "--metrics",
                                 ",".join(PIPES), *script], capture_output=True, text=True)
        (out / f"{name}-pipes.csv").write_text(result.stdout)
        for line in pipe_shares(result.stdout):
            print(f"{name}: {line}", flush=True)


def summarize(text: str) -> list[str]:
    """One line per profiled kernel: the SUMMARY metrics, the raw METRICS, the top three stalls."""
    rows = list(csv.DictReader(io.StringIO(text[text.find('"ID"'):])))
    kernels: dict[tuple, dict] = {}
    for row in rows:
        key = (row["ID"], row["Kernel Name"][:40])
        kernels.setdefault(key, {})[row["Metric Name"]] = (row["Metric Value"], row.get("Metric Unit", ""))
    lines = []
    for (kid, kernel), metrics in kernels.items():
        parts = [f"{label}={metrics[m][0]}{metrics[m][1] if label == 'time' else ''}"
                 for label, m in SUMMARY if m in metrics]
        parts += [f"{m.split('__')[1].split('_cycles')[0]}%={metrics[m][0]}" for m in METRICS[:2] if m in metrics]
        if "Warp Cycles Per Issued Instruction" in metrics:
            parts.append(f"cpi={metrics['Warp Cycles Per Issued Instruction'][0]}")
        stalls = sorted(((_number(metrics[m][0]), m.split("stalled_")[1].split("_per_")[0])
                         for m in METRICS[2:] if m in metrics), reverse=True)[:5]
        parts += [f"{name}={v:.2f}" for v, name in stalls]
        lines.append(f"#{kid} {kernel} " + " ".join(parts))
    return lines


def pipe_shares(text: str) -> list[str]:
    """One line per kernel of an ncu --page raw CSV of PIPES: each pipe's share of its peak."""
    rows = list(csv.reader(io.StringIO(text[text.find('"ID"'):])))
    if len(rows) < 3:
        return [f"pipes: no metrics ({text.strip().splitlines()[-1:] if text.strip() else 'empty'})"]
    header, rows = rows[0], rows[2:]   # the second row holds the units
    lines = []
    for row in rows:
        record = dict(zip(header, row))
        parts = [f"{m.split('pipe_')[1].split('.')[0]}={record[m]}" for m in PIPES if m in record]
        lines.append(f"#{record.get('ID')} {record.get('Kernel Name', '')[:40]} pipes% " + " ".join(parts))
    return lines


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cells", nargs="*")
    parser.add_argument("--impls", default="fa_gen,fa4", help="of bench/implementations.py, or fa_gen_dropout (p = 0.1)")
    parser.add_argument("--ncu", action="store_true", help="profile each (cell, impl) under ncu")
    parser.add_argument("--out", default="/tmp/profile_cells")
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--pipes", action="store_true", help="with --ncu: per-pipe instruction shares too")
    parser.add_argument("--run", nargs=2, metavar=("CELL", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_cell(*args.run, args.launches)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for cell in args.cells:
        parse_cell(cell)
        for impl in args.impls.split(","):
            if args.ncu:
                profile(cell, impl, out, args.pipes)
            else:
                run_cell(cell, impl, args.launches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
