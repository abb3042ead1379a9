"""A/B of sm90 forward tunings (spec `tuning: {sm90: ...}`) beside the default tiles and the anchors,
in one process: what a change of the tile table would buy before it is made.

    python bench/ab_tuning.py --commit SHA --out DIR --tunings '{"pingpong": 1};{"tile_n": 96}' \
        [--dtypes bf16] [--head-dims 64,128] [--seqlens 2048,8192] [--anchors sdpa_cudnn,fa4]

TFLOP/s as bench/bench_forward.py counts them (batch*seqlen = 16k, heads*d = 2048, causal and not).
A spec with a tuning has no short-sequence kind; where the default picks one, the default's
"forward" kind is timed beside it, so that a tuning is compared with the same kind too.
Writes DIR/DATE-COMMIT-ab-tuning.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_forward import HIDDEN, TOKENS, time_fn  # noqa: E402
from implementations import IMPLEMENTATIONS, Case  # noqa: E402

from fa_gen.runtime import build  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402
from fa_gen.timing import attention_flops, make_input_sets  # noqa: E402


def spec_for(case: Case, tuning: dict | None):
    name = f"ab_{case.dtype}_d{case.head_dim}_{'causal' if case.causal else 'full'}" + \
        "".join(f"_{k}{v}" for k, v in (tuning or {}).items())
    fields = {"name": name, "dtype": case.dtype, "head_dim": case.head_dim, "mask": "causal" if case.causal else "none"}
    return load_spec({**fields, "tuning": {"sm90": tuning}} if tuning else fields)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tunings", required=True, help="JSON objects separated by ';'")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--anchors", default="sdpa_cudnn,fa4")
    args = parser.parse_args(argv)
    tunings = [None] + [json.loads(t) for t in args.tunings.split(";") if t.strip()]
    cases = [Case(dtype, d, causal, s, TOKENS // s, HIDDEN // d)
             for dtype in args.dtypes.split(",") for d in map(int, args.head_dims.split(","))
             for causal in (False, True) for s in map(int, args.seqlens.split(","))]
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    if jobs > 1:
        from fa_gen.precompile import precompile
        from fa_gen.runtime import current_arch

        precompile([(spec_for(c, t), current_arch()) for c in cases for t in tunings], jobs=jobs)
    cells = []
    for case in cases:
        sets = make_input_sets(4, case.batch, case.seqlen, case.heads, case.heads, case.head_dim, case.head_dim,
                               case.torch_dtype)
        flops = attention_flops(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim, case.head_dim,
                                case.causal)
        rows = []
        for tuning in tunings:
            kernel = build(spec_for(case, tuning))
            rows.append({"impl": "fa_gen", "tuning": tuning or {}, **time_fn(lambda q, k, v: kernel.forward(q, k, v),
                                                                             sets, flops)})
            kind = kernel.kind_for(case.seqlen, case.seqlen)
            if tuning is None and kind != "forward" and len(tunings) > 1:
                # A spec with a tuning has one kernel (no short-sequence kind): the default's
                # "forward" kind too, so that the tunings are compared like with like.
                pinned = kernel.pinned("forward")
                rows.append({"impl": "fa_gen", "tuning": {}, "kind": "forward (not " + kind + ")",
                             **time_fn(lambda q, k, v: pinned.forward(q, k, v), sets, flops)})
        for name in args.anchors.split(","):
            try:
                rows.append({"impl": name, **time_fn(IMPLEMENTATIONS[name](case), sets, flops)})
            except Exception as exc:  # an anchor that cannot run a cell is recorded
                rows.append({"impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        cell = {"dtype": case.dtype, "head_dim": case.head_dim, "causal": case.causal, "seqlen": case.seqlen,
                "results": rows}
        print(json.dumps({k: cell[k] for k in ("dtype", "head_dim", "causal", "seqlen")}),
              " | ".join(f"{r['impl']}{r.get('tuning', '')}{' ' + r['kind'] if 'kind' in r else ''}: {r.get('tflops', 0):.0f}"
                         for r in rows), flush=True)
        cells.append(cell)
        del sets
    report = {"commit": args.commit, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "command": "python bench/ab_tuning.py " + " ".join(sys.argv[1:]),
              "cells": cells}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{dt.date.today().isoformat()}-{args.commit}-ab-tuning.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
