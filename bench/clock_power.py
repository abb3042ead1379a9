"""SM clock and board power while a kernel runs back to back: whether a timing gap between two
kernels at boost clocks is work or power.

    python bench/clock_power.py --out DIR [--cells fwd:bf16:128:none:16384,...] [--tunings '{"l2_kv_mb": 8}']

Under Nsight Compute (clocks locked) fa_gen's and FA4's d128 non-causal 16k kernels take the
same time, at boost clocks FA4's is up to 6% faster: a board at its power limit lowers the
clock of the kernel that draws more. For each cell (bench/profile_cells.py's MODE:DTYPE:
HEAD_DIM:MASK:SEQLEN) and implementation (fa_gen, fa_gen with each --tunings sm90 tuning,
FA4), in turns for --rounds rounds: calls back to back for --seconds while `nvidia-smi` samples
the SM clock and power every 50 ms; per run the mean clock (MHz), mean power (W), ms per call,
and the energy per call (J). Writes DIR/DATE-clock-power.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from implementations import IMPLEMENTATIONS, case_spec  # noqa: E402
from profile_cells import parse_cell  # noqa: E402


def fa_gen_tuned(tuning: dict):
    """fa_gen's forward (or autograd backward) with an sm90 tuning on the cell's spec."""
    def make(case):
        from fa_gen.api import attention
        from fa_gen.runtime import build
        from fa_gen.spec_load import load_spec

        base = case_spec(case)
        spec = load_spec({"name": base.name + "".join(f"_{k}{v}" for k, v in tuning.items()),
                          "dtype": case.dtype, "head_dim": case.head_dim, "mask": "causal" if case.causal else "none",
                          "tuning": {"sm90": tuning}})
        if case.backward:
            return lambda q, k, v: attention(q, k, v, spec)
        kernel = build(spec)
        return lambda q, k, v: kernel.forward(q, k, v)
    return make


def backward_step(fn, q, k, v, dout):
    """One forward and autograd's backward through it (what bench_forward --backward times per call)."""
    out = fn(q, k, v)
    return torch.autograd.grad(out[0] if isinstance(out, tuple) else out, (q, k, v), dout)


def sampled(seconds: float, step):
    """Run `step` until `seconds` pass, with nvidia-smi sampling; (calls, wall s, [(MHz, W)])."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # nvidia-smi's first sample
    torch.cuda.synchronize()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(5):
            step()
        calls += 5
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    smi.terminate()
    samples = parse_samples(smi.communicate()[0])
    return calls, wall, samples[3:-2] or samples


def parse_samples(text: str) -> list[tuple[float, float]]:
    """(MHz, W) of each `nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits`
    line; lines that are not two numbers (a warning, '[N/A]', a cut last line) are left out."""
    samples = []
    for line in text.splitlines():
        fields = line.split(",")
        try:
            if len(fields) == 2:
                samples.append((float(fields[0]), float(fields[1])))
        except ValueError:
            continue
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="fwd:bf16:128:none:16384,bwd:bf16:128:none:16384")
    parser.add_argument("--tunings", default="", help="sm90 tunings (JSON objects separated by ';')")
    parser.add_argument("--impls", default="fa_gen,fa4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    makers = {name: IMPLEMENTATIONS[name] for name in args.impls.split(",")}
    for text in filter(None, (t.strip() for t in args.tunings.split(";"))):
        makers[f"fa_gen {text}"] = fa_gen_tuned(json.loads(text))
    rows = []
    for cell in args.cells.split(","):
        case = parse_cell(cell)
        q, k, v = (torch.randn(case.batch, case.seqlen, case.heads, case.head_dim, device="cuda",
                               dtype=case.torch_dtype, requires_grad=case.backward) for _ in range(3))
        dout = torch.randn_like(q)
        steps = {}
        for name, make in makers.items():
            if case.backward and name.startswith("fa_gen {"):
                continue  # the tunings are the forward's tiles
            fn = make(case)
            steps[name] = (lambda fn=fn: backward_step(fn, q, k, v, dout)) if case.backward else (lambda fn=fn: fn(q, k, v))
            for _ in range(3):
                steps[name]()
        runs = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                calls, wall, samples = sampled(args.seconds, step)
                mhz = statistics.mean(s[0] for s in samples)
                watts = statistics.mean(s[1] for s in samples)
                runs[name].append({"ms": 1e3 * wall / calls, "mhz": mhz, "watts": watts,
                                   "joules_per_call": watts * wall / calls, "samples": len(samples)})
        for name, results in runs.items():
            best = min(results, key=lambda r: r["ms"])
            row = {"cell": cell, "impl": name, "runs": results}
            rows.append(row)
            print(f"{cell:28s} {name:28s} " + " | ".join(
                f"{r['ms']:.3f} ms {r['mhz']:.0f} MHz {r['watts']:.0f} W {r['joules_per_call']:.3f} J" for r in results)
                  + f"  (best {best['ms']:.3f} ms)", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{dt.date.today().isoformat()}-clock-power.json"
        path.write_text(json.dumps({"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                    "device": torch.cuda.get_device_name(),
                                    "command": "python bench/clock_power.py " + " ".join(argv or sys.argv[1:]),
                                    "rows": rows}, indent=1))
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
