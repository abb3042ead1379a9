"""Which kernels a decode call launches, and each one's device time (torch.profiler, CUPTI).

    python bench/decode_kernels.py [--cells b1_sk128k_h32/8_p16,...] [--impls fa_gen_paged,fa_gen_split,...]
    python bench/decode_kernels.py --cells b32_sk16k_h32/1,b1_sk128k_h32/8 --impls fa_gen_split,fa_gen_attention

For each decode cell (paged ones of bench/bench_paged.py, contiguous ones of
bench/bench_decode.py, by name) and each implementation of its kind: CALLS calls, each
after an L2 flush, under the profiler; prints per kernel name its launches per call and mean
microseconds, then the sum per call. Where a decode path loses to another, this tells whether
the main kernel is slower or the call launches more kernels around it.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_decode as decode  # noqa: E402
import bench_paged as paged  # noqa: E402

CALLS = 10


def kernels_of(fn, flush: torch.Tensor) -> list[tuple[str, int, float]]:
    """(kernel name, launches per call, mean us) of fn's device work, flush kernels excluded."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    flushes = 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name
        if flushes < CALLS and ("fill" in name.lower() or "memset" in name.lower()) and event.device_time > 20:
            flushes += 1
            continue
        per_name[name].append(event.device_time)
    return sorted(((name[:90], round(len(times) / CALLS, 2), sum(times) / len(times)) for name, times in per_name.items()),
                  key=lambda row: -row[1] * row[2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="b1_sk128k_h32/8_p16,b8_sk32k_h32/8_p16,b64_sk8k_h32/8_p16")
    parser.add_argument("--impls", default="fa_gen_paged,fa_gen_contiguous,fa_gen_split,fa4_paged")
    args = parser.parse_args()
    flush = torch.empty(decode.FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    cells = {cell.name: cell for cell in paged.PAGED_CELLS}
    contiguous = {cell.name: cell for cell in decode.DECODE_CELLS}
    for name in args.cells.split(","):
        if name in contiguous:
            # (spec, q, k, v) of a contiguous decode cell; its implementations are bench_decode's.
            x = decode.seeded_decode_inputs(contiguous[name])
            make = lambda impl, x=x: getattr(decode, impl)(*x)  # noqa: E731
        else:
            cell = cells[name]
            x = paged.paged_inputs(cell)
            make = lambda impl, cell=cell, x=x: paged.PAGED_IMPLS[impl](cell, x)  # noqa: E731
        for impl in args.impls.split(","):
            try:
                rows = kernels_of(make(impl), flush)
            except Exception as exc:  # an anchor missing here must not stop the others
                print(f"{name} {impl}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            total = sum(n * us for _, n, us in rows)
            print(f"{name} {impl}: {total:.1f} us per call, {sum(n for _, n, _ in rows):g} kernels", flush=True)
            for kernel, n, us in rows:
                print(f"    {n:5g} x {us:8.1f} us  {kernel}", flush=True)
        del x
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
