"""Ad hoc (python bench/flush_probe.py): what the L2 flush before each timed decode call costs the
call itself. bench_decode's Timer used to zero a 256 MB buffer, which leaves the L2 (50 MB) full of
dirty lines: the decode kernel's first reads evict them, and the write-backs share the HBM with
its K/V reads. A 268 MB decode (the MQA cell) would carry ~50 MB of writes, a 2 GB one (b64) 2.5%.
Modes, each a Timer whose flush ends with K/V out of L2:
  dirty   a 256 MB buffer zeroed (bench_decode's Timer until session 20)
  clean   the same zeroing, then a 256 MB read sweep (the dirty lines written back before the start event)
  read    the read sweep alone (bench_decode's Timer.evict now)
H100, 2026-11-27 at 57f6dd1 (two rounds; fa_gen / FA4 / cuDNN as fractions of the copy): MQA
0.846 / 0.508 / 0.717 dirty, 0.926 / 0.515 / 0.777 clean, 0.915 / 0.514 / 0.778 read; b1 sk128k
0.952 / 0.136 / 0.927 dirty, 0.997 / 0.134 / 0.968 clean; b64 0.998 / 1.011 / 1.007 dirty,
1.007 / 1.022 / 1.019 clean; b128 0.955 / 0.977 / 0.970 dirty, 0.967 / 1.001 / 0.988 clean
(FA4 at its default num_splits=1). The copy: 3022 dirty, 3037 clean.
Cells and implementations are bench_decode's; copy bandwidth under each mode too.
Writes $OUT/flush_probe.json when OUT is set."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
import bench_decode as bd

CELLS = [c for c in bd.DECODE_CELLS if c.name in os.environ.get(
    "CELLS", "b32_sk16k_h32/1,b1_sk128k_h32/8,b64_sk8k_h32/8,b128_sk2k_h64/8").split(",")]
IMPLS = os.environ.get("IMPLS", "fa_gen_attention,fa4,sdpa_cudnn").split(",")


class SweepTimer(bd.Timer):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.dirty = torch.empty(bd.FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def evict(self):
        if self.mode in ("dirty", "clean"):
            self.dirty.zero_()
        if self.mode in ("clean", "read"):
            super().evict()


def main():
    out = {"device": torch.cuda.get_device_name(), "modes": {}}
    for rnd in range(2):
        for mode in ("dirty", "clean", "read"):
            timer = SweepTimer(mode)
            copy = bd.copy_bandwidth(timer)["gbps"]
            rows = out["modes"].setdefault(mode, {"copy": [], "cells": {}})
            rows["copy"].append(copy)
            print(mode, "round", rnd, "copy", round(copy), flush=True)
            for cell in CELLS:
                r = bd.run_decode_cell(cell, IMPLS, timer, copy)
                got = {x["impl"]: round(x["gbps"]) for x in r["results"] if "gbps" in x}
                rows["cells"].setdefault(cell.name, []).append(got)
                print(" ", cell.name, got, {k: round(v / copy, 3) for k, v in got.items()}, flush=True)
            del timer
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "flush_probe.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
