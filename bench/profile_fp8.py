"""One fp8 forward (and the bf16 one at the same shape) for ncu: what bounds the fp8 kernel.

    ncu --kernel-name regex:FlashAttention --launch-skip 2 --launch-count 1 --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section InstructionStats \
        python bench/profile_fp8.py [--head-dim 128] [--dtype fp8|bf16] [--tuning pingpong=2,tile_n=224]

Shape: batch 2, seqlen 8k, 16 heads, non-causal (a bench/bench_fp8.py cell); three launches.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa_gen import fp8  # noqa: E402
from fa_gen.runtime import build  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--tuning", default="", help='sm90 tuning, e.g. "pingpong=2,tile_n=224"')
    args = parser.parse_args()
    tuning = {key: int(value) for key, value in (item.split("=") for item in args.tuning.split(",") if item)}
    d = args.head_dim
    heads = 2048 // d
    dtype = "fp8_e4m3" if args.dtype == "fp8" else "bf16"
    fields = {"name": f"profile_{dtype}_d{d}", "dtype": dtype, "head_dim": d, "mask": "none"}
    kernel = build(load_spec({**fields, "tuning": {"sm90": tuning}} if tuning else fields))
    q, k, v = (torch.randn(2, 8192, heads, d, device="cuda") for _ in range(3))
    if args.dtype == "fp8":
        q, k, v = (x.clamp(-448, 448).to(fp8.E4M3) for x in (q, k, v))
        vt = fp8.transpose_v(v)
        for _ in range(3):
            kernel.forward(q, k, vt)
    else:
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        for _ in range(3):
            kernel.forward(q, k, v)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
