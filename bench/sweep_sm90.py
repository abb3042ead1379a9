"""Sweep sm90 tile configurations on the device: check each candidate once, time it, write JSON.

    python bench/sweep_sm90.py --out DIR [--head-dims 64,128,192/128] [--masks none,causal]
        [--seqlens 2048,8192] [--configs "128,128,2,1;128,176,2,1"] [--anchors fa4,sdpa_cudnn,fa_gen_sm80]

A config is tile_m,tile_n,num_stages,pingpong[,l2_kv_mb[,persist_m_blocks[,persist_l2_groups]]][,KEY=VALUE...]
(the sm90 family's `tuning` parameters; pingpong and persist_l2_groups 1 = off, 2 = on; e.g.
"128,128,2,2,1,64,2" walks causal tiles sequence by sequence, head by head); without
--configs, each head dim's candidates below are swept (the table's default first). Every
candidate is compiled in parallel first, checked against the float64 reference at one ragged
GQA shape, then timed at the benchmark shapes (batch*seqlen = 16k tokens, heads*head_dim =
2048), beside the anchors. Commit-worthy winners go in fa_gen/families/sm90.py's tile table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from implementations import IMPLEMENTATIONS, Case  # noqa: E402

from fa_gen.check import Shape, check_kernel  # noqa: E402
from fa_gen.errors import SpecError  # noqa: E402
from fa_gen.families.sm90 import _DEFAULT_TILES, TileConfig, _tile_reasons  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402
from fa_gen.timing import attention_flops, make_input_sets, median_ms  # noqa: E402

TOKENS = 16 * 1024
HIDDEN = 2048
# Candidates per head dim, beside the table's default: (tile_m, tile_n, num_stages, pingpong).
CANDIDATES = {
    64: [(128, 128, 2, 2), (192, 128, 3, 2), (192, 128, 2, 1), (192, 96, 2, 2)],
    96: [(128, 128, 3, 2), (128, 128, 2, 1), (128, 160, 2, 2), (128, 176, 2, 2), (128, 96, 3, 2)],
    128: [(128, 128, 2, 1), (128, 176, 2, 2), (128, 112, 2, 2), (128, 96, 3, 2)],
    192: [(128, 112, 2, 2), (128, 96, 2, 1), (128, 96, 2, 2), (128, 80, 2, 2), (128, 64, 3, 2)],
    256: [(128, 80, 2, 2), (128, 64, 2, 1), (128, 64, 2, 2)],
    (192, 128): [(128, 128, 2, 2), (128, 112, 2, 2), (128, 112, 2, 1), (128, 96, 2, 2), (192, 80, 2, 2),
                 (192, 64, 2, 2)],
}
CHECK_SHAPE = Shape(2, 1000, 1037, 8, 2)


PARAMS = ("tile_m", "tile_n", "num_stages", "pingpong", "l2_kv_mb", "persist_m_blocks", "persist_l2_groups")


def dims_of(text: str) -> tuple[int, int]:
    """A --head-dims entry: "128" (qk = v) or "192/128" (qk / v)."""
    qk, _, v = text.partition("/")
    return int(qk), int(v or qk)


def dims_label(dims: tuple[int, int]) -> str:
    return f"d{dims[0]}" if dims[0] == dims[1] else f"d{dims[0]}v{dims[1]}"


def make_spec(head_dim, mask: str, dtype: str, cfg: tuple):
    """head_dim: an int or (qk, v); cfg: values of PARAMS in order, then optional (name, value)
    pairs (any sm90 tuning key)."""
    qk, v = (head_dim, head_dim) if isinstance(head_dim, int) else head_dim
    positional = [x for x in cfg if not isinstance(x, tuple)]
    tuning = {**dict(zip(PARAMS, positional)), **dict(x for x in cfg if isinstance(x, tuple))}
    label = "_".join(f"{x[0]}{x[1]}" if isinstance(x, tuple) else str(x) for x in cfg)
    return load_spec({"name": f"sweep_{mask}_{dtype}_{dims_label((qk, v))}_" + label, "dtype": dtype,
                      "head_dim": {"qk": qk, "v": v}, "mask": mask, "tuning": {"sm90": tuning}})


def candidates(head_dim, configs: str | None, defaults_only: bool = False) -> list[tuple[int, ...]]:
    """head_dim: an int or (qk, v); CANDIDATES are keyed by qk where qk = v."""
    dims = (head_dim, head_dim) if isinstance(head_dim, int) else head_dim
    if configs:
        return [tuple((x.split("=")[0], int(x.split("=")[1])) if "=" in x else int(x) for x in c.split(","))
                for c in configs.split(";")]
    d = _DEFAULT_TILES[dims]
    default = (d.tile_m, d.tile_n, d.num_stages, d.pingpong)
    if defaults_only:
        return [default]
    listed = CANDIDATES.get(dims[0], []) if dims[0] == dims[1] else CANDIDATES.get(dims, [])
    return [default] + [c for c in listed if c != default]


def usable(spec) -> bool:
    return not _tile_reasons(TileConfig(**dict(spec.tuning_for("sm90"))), spec, "sm_90a")


def time_kernel(fn, case: Case) -> float:
    sets = make_input_sets(3, case.batch, case.seqlen, case.heads, case.heads, case.head_dim, case.dim_v,
                           case.torch_dtype)
    ms = median_ms(fn, sets, warmup=5, repeats=20)
    flops = attention_flops(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim, case.dim_v,
                            case.causal)
    return flops / ms / 1e9


def power_steady_state(seconds: float = 3.0) -> None:
    """Run bf16 GEMMs for `seconds` first: a cool GPU clocks higher until it reaches its power
    cap, so without this the first candidates timed look faster (up to 11% on an H200)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--masks", default="none,causal")
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--configs", default=None, help="tile_m,tile_n,num_stages,pingpong[,l2_kv_mb[,persist_m_blocks[,persist_l2_groups]]];...")
    parser.add_argument("--defaults-only", action="store_true", help="only the tile table's entries")
    parser.add_argument("--anchors", default="", help="e.g. fa4,sdpa_cudnn,fa_gen_sm80")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    from fa_gen.precompile import precompile
    from fa_gen.runtime import build

    head_dims = [dims_of(d) for d in args.head_dims.split(",")]
    masks = args.masks.split(",")
    specs = []
    for d in head_dims:
        for m in masks:
            for c in candidates(d, args.configs, args.defaults_only):
                try:
                    spec = make_spec(d, m, args.dtype, c)
                except SpecError as exc:  # a tuning that cannot fit sm_90a is refused at load
                    print(f"skipped {dims_label(d)} {m} {c}: {str(exc).splitlines()[-1][:160]}", flush=True)
                    continue
                if usable(spec):
                    specs.append(spec)
    start = time.perf_counter()
    precompile([(s, "sm_90a") for s in specs], jobs=args.jobs, log=lambda *_: None)
    print(f"compiled {len(specs)} candidates in {time.perf_counter() - start:.0f} s", flush=True)

    rows = []
    power_steady_state()
    for spec in specs:
        kernel = build(spec, "sm_90a", family="sm90")
        check = check_kernel(kernel, CHECK_SHAPE, seed=1)
        mask = spec.mask.value
        dims = (spec.head_dim_qk, spec.head_dim_v)
        row = {"config": spec.tuning_for("sm90"), "head_dim": spec.head_dim_qk, "head_dim_v": spec.head_dim_v, "mask": mask,
               "check": str(check), "ok": check.ok, "tflops": {}}
        for seqlen in map(int, args.seqlens.split(",")):
            case = Case(args.dtype, spec.head_dim_qk, mask == "causal", seqlen, TOKENS // seqlen,
                        HIDDEN // spec.head_dim_qk, head_dim_v=spec.head_dim_v)
            row["tflops"][seqlen] = round(time_kernel(lambda q, k, v: kernel.forward(q, k, v), case), 1)
        rows.append(row)
        config = ",".join(f"{k}={v}" for k, v in row["config"].items())
        print(f"{dims_label(dims):<4} {mask:7s} {config:70s} {'ok ' if check.ok else 'BAD'} "
              + " ".join(f"{s}:{t}" for s, t in row["tflops"].items()), flush=True)

    anchors = {}
    for name in filter(None, args.anchors.split(",")):
        for d in head_dims:
            for mask in masks:
                for seqlen in map(int, args.seqlens.split(",")):
                    case = Case(args.dtype, d[0], mask == "causal", seqlen, TOKENS // seqlen, HIDDEN // d[0],
                                head_dim_v=d[1])
                    try:
                        tflops = round(time_kernel(IMPLEMENTATIONS[name](case), case), 1)
                    except Exception as exc:  # an anchor that cannot run a cell is recorded, not fatal
                        tflops = f"{type(exc).__name__}: {exc}"[:200]
                    anchors.setdefault(name, {}).setdefault(f"{dims_label(d)}_{mask}", {})[seqlen] = tflops
        print(name, json.dumps(anchors[name]), flush=True)

    out = Path(args.out) / "sweep_sm90.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "dtype": args.dtype,
                               "candidates": rows, "anchors": anchors}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    # Tiles are patched in, which the cache's by-target index cannot see: a dump directory turns it off.
    os.environ.setdefault("FA_GEN_DUMP_DIR", "/tmp/fa_gen_sweep_sources")
    main()
