"""FP8 (e4m3) forward on Hopper beside fa_gen's bf16 forward and the bf16 anchors, in one process.

    python bench/bench_fp8.py --commit SHA --out DIR [--sweep] [--quick]

Rows per cell (TFLOP/s = 4*b*h*s^2*d, /2 causal):
  fa_gen_fp8         the fp8 kernel alone (V already in the kernel's transposed layout, descales made)
  fa_gen_fp8_call    fa_gen.attention_fp8 as users call it (V transposed and descales made per call)
  fa_gen_bf16        fa_gen's bf16 forward on the same (dequantised) values
  sdpa_cudnn, fa4    the bf16 anchors on the same values
Cells: batch*seqlen = 16k, heads*d = 2048 at d 128 and 256, causal and not; the Llama-3.1 cell
(64 query / 8 kv heads, d 128, 32k, causal). --sweep adds tile variants of the fp8 kernel
(spec tuning) at the non-causal cells; --tunings "stale_max=2;stale_max=1" times those tunings
of the fp8 kernel at every cell instead (after the default, in the order given: repeat one to
alternate). Writes DIR/DATE-COMMIT-fp8.json.
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

from implementations import IMPLEMENTATIONS, Case  # noqa: E402

from fa_gen import fp8  # noqa: E402
from fa_gen.runtime import build  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402
from fa_gen.timing import attention_flops, median_ms  # noqa: E402

TOKENS, HIDDEN, REPEATS = 16 * 1024, 2048, 30
# fp8 tile variants (spec tuning of the sm90 family, on top of the default tiles) tried with --sweep,
# per head dim: the previous defaults (d128 128 x 128 ping-pong), and a share of the exponentials on
# the FMA pipe (exp2_fma: the MUFU pipe carries the exponentials and P's conversions; session 22).
SWEEP = {128: [{"pingpong": 2}, {"tile_n": 128, "pingpong": 2}, {"exp2_fma": 2}, {"exp2_fma": 4},
               {"exp2_fma": 6}],
         256: [{"pingpong": 1}, {"exp2_fma": 2}, {"exp2_fma": 4}]}


def fp8_spec(head_dim: int, causal: bool, tuning: dict | None = None):
    name = f"bench_fp8_{'causal' if causal else 'full'}_d{head_dim}" + "".join(f"_{k}{v}" for k, v in (tuning or {}).items())
    fields = {"name": name, "dtype": "fp8_e4m3", "head_dim": head_dim, "mask": "causal" if causal else "none"}
    return load_spec({**fields, "tuning": {"sm90": tuning}} if tuning else fields)


def input_sets(count, batch, seqlen, heads_q, heads_kv, dim):
    """(bf16 q, k, v, fp8 q, k, v, descales) per set: random bf16 values quantised per (batch, head)."""
    sets = []
    for _ in range(count):
        q, k, v = (torch.randn(batch, seqlen, h, dim, device="cuda", dtype=torch.bfloat16)
                   for h in (heads_q, heads_kv, heads_kv))
        (k8, kd), (v8, vd) = fp8.quantize(k), fp8.quantize(v)
        group = heads_q // heads_kv
        qd = fp8.quantize(q)[1].view(batch, heads_kv, group).amax(-1)
        q8 = (q.float() / qd.repeat_interleave(group, 1)[:, None, :, None]).to(fp8.E4M3)
        # The bf16 rows see the values the fp8 rows stand for.
        deq = [fp8.dequantize(x, d, torch.bfloat16) for x, d in ((q8, qd), (k8, kd), (v8, vd))]
        sets.append((*deq, q8, k8, v8, (qd, kd, vd)))
    return sets


def time_rows(cell: dict, sets, causal: bool, flops: float, impls, tunings) -> list:
    rows = []

    def timed(name, fn, **extra):
        try:
            ms = median_ms(fn, sets, warmup=5, repeats=REPEATS)
            row = {"impl": name, "ms": ms, "tflops": flops / ms / 1e9, **extra}
        except Exception as exc:  # a row that cannot run is recorded, not fatal
            row = {"impl": name, "error": f"{type(exc).__name__}: {exc}"[:300], **extra}
        rows.append(row)
        print(cell["name"], row, flush=True)

    for tuning in [None] + tunings:
        kernel = build(fp8_spec(cell["head_dim"], causal, tuning))
        prepared = {}

        def kernel_only(*s, kernel=kernel, prepared=prepared):
            # Operands made once per input set: the kernel's own time.
            key = id(s[3])
            if key not in prepared:
                q8, k8, v8, scales = s[3:]
                b, sq, hq, _ = q8.shape
                out = torch.empty(b, sq, hq, v8.shape[-1], dtype=torch.bfloat16, device="cuda")
                lse = torch.empty(b, hq, sq, dtype=torch.float32, device="cuda")
                prepared[key] = kernel._operands(q8, k8, v8, out, lse, scales)
            kernel._function(*prepared[key])

        timed("fa_gen_fp8", kernel_only, tuning=tuning or {})
        if tuning is None:
            timed("fa_gen_fp8_call", lambda *s, kernel=kernel: kernel.forward(*s[3:6], descales=s[6]))
    case = Case("bf16", cell["head_dim"], causal, cell["seqlen"], cell["batch"], cell["heads_q"])
    group = cell["heads_q"] // cell["heads_kv"]
    for name in impls:
        if group > 1 and name == "sdpa_cudnn":
            # SDPA takes equal heads here: K/V repeated over the query heads once, outside the timing.
            fn = IMPLEMENTATIONS[name](case)
            wide = {id(s[0]): (s[0], s[1].repeat_interleave(group, 2), s[2].repeat_interleave(group, 2)) for s in sets}
            timed(name, lambda *s, fn=fn, wide=wide: fn(*wide[id(s[0])]), note="K/V repeated over heads beforehand")
            continue
        try:
            fn = IMPLEMENTATIONS["fa_gen" if name == "fa_gen_bf16" else name](case)
        except Exception as exc:
            rows.append({"impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        timed(name, lambda *s, fn=fn: fn(*s[:3]))
    return rows


def cells(quick: bool, head_dims=(128, 256)):
    seqlens = (8192,) if quick else (2048, 8192, 16384)
    for head_dim in head_dims:
        for causal in (False, True):
            for seqlen in seqlens:
                yield {"name": f"d{head_dim}{'_causal' if causal else ''}_s{seqlen}", "head_dim": head_dim,
                       "causal": causal, "seqlen": seqlen, "batch": TOKENS // seqlen,
                       "heads_q": HIDDEN // head_dim, "heads_kv": HIDDEN // head_dim}
    if 128 not in head_dims:
        return
    yield {"name": "llama3.1_h64/8_d128_causal_s32k", "head_dim": 128, "causal": True, "seqlen": 32768,
           "batch": 1, "heads_q": 64, "heads_kv": 8}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--quick", action="store_true", help="one seqlen (8k) per head dim and mask")
    parser.add_argument("--tunings", default=None, help='e.g. "stale_max=2;pingpong=1,tile_n=192" (every cell)')
    parser.add_argument("--impls", default="fa_gen_bf16,sdpa_cudnn,fa4")
    parser.add_argument("--head-dims", default="128,256", help="the cells' head dims (128 adds the Llama-3.1 cell)")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0")),
                        help="compile the kernels in this many processes first")
    args = parser.parse_args(argv)
    given = [dict((k, int(v)) for k, v in (kv.split("=") for kv in t.split(","))) for t in args.tunings.split(";")] \
        if args.tunings else None

    def tunings_of(cell) -> list:
        if given is not None:
            return given
        return SWEEP[cell["head_dim"]] if args.sweep and not cell["causal"] and cell["heads_q"] == cell["heads_kv"] else []
    report = {"commit": args.commit, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python bench/bench_fp8.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "method": f"median of {REPEATS} CUDA-event timings after 5 warm-ups, 3 rotated input sets; "
                        "TFLOP/s = 4*b*h*s^2*d (/2 causal); bf16 rows on the dequantised fp8 values",
              "cells": []}
    if args.jobs > 1:
        # Every fp8 kernel of the run, and fa_gen's bf16 ones, compiled in parallel first.
        from fa_gen.precompile import precompile
        from fa_gen.runtime import current_arch

        specs = {}
        for cell in cells(args.quick, tuple(int(d) for d in args.head_dims.split(','))):
            for tuning in [None] + tunings_of(cell):
                spec = fp8_spec(cell["head_dim"], cell["causal"], tuning)
                specs[spec.name] = spec
            bf16 = load_spec({"name": f"bench_{'causal' if cell['causal'] else 'full'}_bf16_d{cell['head_dim']}",
                              "dtype": "bf16", "head_dim": cell["head_dim"], "mask": "causal" if cell["causal"] else "none"})
            specs[bf16.name] = bf16
        precompile([(spec, current_arch()) for spec in specs.values()], jobs=args.jobs)
    for cell in cells(args.quick, tuple(int(d) for d in args.head_dims.split(','))):
        sets = input_sets(3, cell["batch"], cell["seqlen"], cell["heads_q"], cell["heads_kv"], cell["head_dim"])
        flops = attention_flops(cell["batch"], cell["heads_q"], cell["seqlen"], cell["seqlen"], cell["head_dim"],
                                cell["head_dim"], cell["causal"])
        cell["results"] = time_rows(cell, sets, cell["causal"], flops, args.impls.split(","), tunings_of(cell))
        report["cells"].append(cell)
        del sets
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{dt.date.today().isoformat()}-{args.commit}-fp8.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
