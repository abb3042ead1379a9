"""Forward benchmark: fa_gen against the anchors, side by side in one process on one GPU.

    python bench/bench_forward.py --commit $(git rev-parse --short HEAD) [--out DIR]

Shapes follow FlashAttention's benchmarks: batch*seqlen = 16k tokens, heads*head_dim = 2048.
TFLOP/s = 4*b*h*s^2*d (halved for causal) over the median of >= 20 timed runs after warm-up,
with inputs rotated among several sets so L2 cannot serve repeats. Writes
<out>/<date>-<commit>.json and prints the ratio table fa_gen / anchor.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa_gen.spec_load import load_spec  # noqa: E402
from fa_gen.runtime import build  # noqa: E402
from fa_gen.timing import attention_flops, make_input_sets, median_ms  # noqa: E402

TOKENS = 16 * 1024
HIDDEN = 2048


def fa_gen_impl(head_dim: int, causal: bool, dtype: str):
    spec = load_spec({"name": f"bench_{'causal' if causal else 'full'}_{dtype}_d{head_dim}",
                      "dtype": dtype, "head_dim": head_dim, "mask": "causal" if causal else "none"})
    kernel = build(spec)
    return lambda q, k, v: kernel.forward(q, k, v)


def sdpa_impl(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def make(head_dim: int, causal: bool, dtype: str):
        def run(q, k, v):
            # SDPA wants (b, h, s, d); a transposed view keeps the same memory.
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return run
    return make


IMPLEMENTATIONS = {
    "fa_gen": fa_gen_impl,
    "sdpa_flash": sdpa_impl("FLASH_ATTENTION"),
}


def bench_cell(name, make, head_dim, causal, seqlen, dtype_name):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    try:
        fn = make(head_dim, causal, dtype_name)
        sets = make_input_sets(4, batch, seqlen, heads, heads, head_dim, head_dim, dtype)
        ms = median_ms(fn, sets, warmup=5, repeats=30)
    except Exception as exc:  # an anchor that cannot run a cell is recorded, not fatal
        return {"impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, head_dim, causal)
    return {"impl": name, "ms": ms, "tflops": flops / ms / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS))
    args = parser.parse_args()

    rows = []
    for dtype_name in args.dtypes.split(","):
        for head_dim in map(int, args.head_dims.split(",")):
            for causal in (False, True):
                for seqlen in map(int, args.seqlens.split(",")):
                    cell = {"dtype": dtype_name, "head_dim": head_dim, "causal": causal, "seqlen": seqlen,
                            "batch": TOKENS // seqlen, "heads": HIDDEN // head_dim, "results": []}
                    for name in args.impls.split(","):
                        cell["results"].append(bench_cell(name, IMPLEMENTATIONS[name], head_dim, causal,
                                                          seqlen, dtype_name))
                    rows.append(cell)
                    print(_format_row(cell), flush=True)
    report = {
        "commit": args.commit,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "method": "median of 30 CUDA-event timings after 5 warm-ups, 4 rotated input sets; "
                  "TFLOP/s = 4*b*h*s^2*d (/2 causal)",
        "cells": rows,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{dt.date.today().isoformat()}-{args.commit}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def _format_row(cell) -> str:
    by = {r["impl"]: r for r in cell["results"]}
    parts = [f"{cell['dtype']} d={cell['head_dim']:3d} {'causal' if cell['causal'] else 'full  '} s={cell['seqlen']:5d}"]
    for name, r in by.items():
        parts.append(f"{name} {r['tflops']:6.1f}" if "tflops" in r else f"{name} ERR")
    ours = by.get("fa_gen", {}).get("tflops")
    for name, r in by.items():
        if name != "fa_gen" and ours and "tflops" in r:
            parts.append(f"ratio/{name} {ours / r['tflops']:.2f}")
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
