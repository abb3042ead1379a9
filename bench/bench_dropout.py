"""Attention dropout speed: fa_gen at p = 0.1 against its own p = 0 and FA2's dropout (SDPA's
flash backend), forward and backward, in one process on one GPU.

    python bench/bench_dropout.py --commit $(git rev-parse --short HEAD) [--out DIR]

Shapes follow bench_forward.py: batch*seqlen = 16k tokens, heads*head_dim = 2048, bf16.
Forward rows time fa_gen.attention / scaled_dot_product_attention; backward rows run the forward
once with inputs that require grad and time torch.autograd.grad(out, (q, k, v), dout) alone.
TFLOP/s counts the undropped FLOPs (FlashAttention's convention: 2.5x the forward's for the
backward). Each row prints fa_gen(p) / FA2(p) and fa_gen(0.1) / fa_gen(0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fa_gen  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402
from fa_gen.timing import attention_flops, make_input_sets, median_ms  # noqa: E402

TOKENS = 16 * 1024
HIDDEN = 2048
BACKWARD_FLOP_RATIO = 2.5


def fa_gen_call(spec, p: float):
    def call(q, k, v):
        out = fa_gen.attention(q, k, v, spec, dropout_p=p)
        return out[0] if isinstance(out, tuple) else out
    return call


def sdpa_flash_call(causal: bool, p: float):
    def call(q, k, v):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal, dropout_p=p)
        return out.transpose(1, 2)
    return call


def time_row(fn, sets, flops: float, backward: bool) -> dict:
    """{"ms", "tflops"} of fn over `sets`, or {"error"} when it refuses."""
    try:
        if backward:
            graphs = []
            for q, k, v in sets:
                q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                out = fn(q, k, v)
                graphs.append((out, (q, k, v), torch.randn_like(out)))
            ms = median_ms(lambda out, inputs, dout: torch.autograd.grad(out, inputs, dout, retain_graph=True),
                           graphs, warmup=3, repeats=20)
            flops = flops * BACKWARD_FLOP_RATIO
        else:
            with torch.no_grad():
                ms = median_ms(fn, sets, warmup=5, repeats=30)
    except Exception as exc:  # an anchor that refuses a shape is a row entry, not a crash
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return {"ms": ms, "tflops": flops / ms / 1e9}


def run_cell(head_dim: int, seqlen: int, causal: bool, backward: bool) -> dict:
    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    name = f"bench_{'causal' if causal else 'full'}_bf16_d{head_dim}"
    spec = load_spec({"name": name, "dtype": "bf16", "head_dim": head_dim, "mask": "causal" if causal else "none"})
    sets = make_input_sets(3, batch, seqlen, heads, heads, head_dim, head_dim, torch.bfloat16)
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, head_dim, causal)
    cell = {"head_dim": head_dim, "seqlen": seqlen, "batch": batch, "heads": heads, "causal": causal,
            "backward": backward, "spec": name, "results": {}}
    for p in (0.0, 0.1):
        cell["results"][f"fa_gen_p{p}"] = time_row(fa_gen_call(spec, p), sets, flops, backward)
        cell["results"][f"fa2_p{p}"] = time_row(sdpa_flash_call(causal, p), sets, flops, backward)
    return cell


def ratio(cell: dict, a: str, b: str) -> float | None:
    ra, rb = cell["results"][a], cell["results"][b]
    return ra["tflops"] / rb["tflops"] if "tflops" in ra and "tflops" in rb else None


def format_cell(cell: dict) -> str:
    def tf(name):
        r = cell["results"][name]
        return f"{r['tflops']:6.1f}" if "tflops" in r else "  err "
    def rt(value):
        return f"{value:5.2f}" if value is not None else "  -  "
    kind = "bwd" if cell["backward"] else "fwd"
    mask = "causal" if cell["causal"] else "full  "
    return (f"{kind} d{cell['head_dim']:<3} {mask} s{cell['seqlen']:<6} fa_gen p0 {tf('fa_gen_p0.0')} p.1 "
            f"{tf('fa_gen_p0.1')} | FA2 p0 {tf('fa2_p0.0')} p.1 {tf('fa2_p0.1')} | "
            f"fa_gen/FA2 p.1 {rt(ratio(cell, 'fa_gen_p0.1', 'fa2_p0.1'))} p0 {rt(ratio(cell, 'fa_gen_p0.0', 'fa2_p0.0'))}"
            f" | fa_gen p.1/p0 {rt(ratio(cell, 'fa_gen_p0.1', 'fa_gen_p0.0'))}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,8192")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--warm-only", action="store_true", help="compile the run's kernels, time nothing")
    return parser.parse_args(argv)


def _warm(head_dim: int, causal: bool, backward: bool) -> str:
    """Compile (into the disk cache) every kernel one (head dim, mask) row set calls."""
    spec = load_spec({"name": f"bench_{'causal' if causal else 'full'}_bf16_d{head_dim}", "dtype": "bf16",
                      "head_dim": head_dim, "mask": "causal" if causal else "none"})
    for p in (0.0, 0.1):
        q, k, v = (torch.randn(1, 130, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
                   for _ in range(3))
        out = fa_gen_call(spec, p)(q, k, v)
        if backward:
            out.sum().backward()
    torch.cuda.synchronize()
    return spec.name


def warm(args) -> None:
    """Every kernel of the run compiled first, in parallel processes (the DSL compiles on one core)."""
    import concurrent.futures as futures
    import multiprocessing

    work = [(d, c, not args.forward_only) for d in map(int, args.head_dims.split(",")) for c in (False, True)]
    with futures.ProcessPoolExecutor(len(work), mp_context=multiprocessing.get_context("spawn")) as pool:
        for name in pool.map(_warm, *zip(*work)):
            print(f"compiled {name}", flush=True)


def main() -> int:
    args = parse_args()
    warm(args)
    if args.warm_only:
        return 0
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    cells = []
    for backward in (False,) if args.forward_only else (False, True):
        for head_dim in map(int, args.head_dims.split(",")):
            for seqlen in map(int, args.seqlens.split(",")):
                for causal in (False, True):
                    cell = run_cell(head_dim, seqlen, causal, backward)
                    print(format_cell(cell), flush=True)
                    cells.append(cell)
    report = {"commit": commit, "date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "mode": "dropout",
              "command": " ".join(sys.argv), "cells": cells}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{report['date']}-{commit}-dropout.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
