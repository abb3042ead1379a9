"""The project's forward benchmark: fa_gen against the anchors, side by side in one process.

    python bench/bench_forward.py --commit $(git rev-parse --short HEAD) [--out DIR] [--plot]
    python bench/bench_forward.py --backward ...   # the backward pass instead
    python bench/bench_forward.py --variants [NAME,...] [--seqlens 1024,8192] [--family sm80]
    python bench/bench_forward.py --rounds 3 ...   # each cell's implementations 3 times, order rotated

--backward times the backward alone: per input set the forward runs once (outside the timing)
with inputs that require grad, then each timed call is torch.autograd.grad(out, (q, k, v),
dout, retain_graph=True); TFLOP/s = 2.5 x the forward FLOPs (FlashAttention's convention).
Each backward cell also reports "b2b": the input sets' backwards queued back to back between two
events, per call, so per-call host overhead (autograd, custom-op dispatch) hides as in training.

--variants times the library's expression variants (bench/variants.py: softcap, ALiBi, relative
bias, sliding window, chunked causal, attention sinks, prefix-LM, documents, sink logits), each
as fa_gen runs its shipped spec, beside FlexAttention (the same function as mask_mod/score_mod)
and FlashAttention-4 where it has the variant; TFLOP/s over the visible (query, key) pairs only.
Before timing, every implementation of a variant is checked against fa_gen.reference on a small
shape. Prints fa_gen / Flex and fa_gen / FA4 per cell and marks those below the issue's bars.

Shapes follow FlashAttention's benchmarks: batch*seqlen = 16k tokens, heads*head_dim = 2048.
TFLOP/s = 4*b*h*s^2*d (halved for causal) over the median of >= 20 timed runs after warm-up,
with inputs rotated among several sets so L2 cannot serve repeats. Writes
<out>/<date>-<commit>[-bwd|-variants][-suffix].json (and a PNG with --plot) and prints fa_gen /
best anchor per cell.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_rounds  # noqa: E402
import variants  # noqa: E402
from bench_rounds import timed_rounds  # noqa: E402
from implementations import ANCHORS, BACKWARD_IMPLEMENTATIONS, IMPLEMENTATIONS, Case, fa_gen_impl  # noqa: E402

from fa_gen.errors import FaGenError  # noqa: E402
from fa_gen.timing import attention_flops, make_input_sets, median_ms  # noqa: E402

TOKENS = 16 * 1024
HIDDEN = 2048
REPEATS = 30


# Backward FLOPs per forward FLOP: five GEMMs against the forward's two.
BACKWARD_FLOP_RATIO = 2.5


def time_fn(fn, input_sets, flops: float, backward: bool = False) -> dict:
    """{"ms", "tflops"} of fn(q, k, v) over `input_sets` (with `backward`: its backward alone)."""
    if not backward:
        ms = median_ms(fn, input_sets, warmup=5, repeats=REPEATS)
        return {"ms": ms, "tflops": flops / ms / 1e9}
    graphs = [_forward_graph(fn, *inputs) for inputs in input_sets]
    ms = median_ms(_grad, graphs, warmup=5, repeats=REPEATS)
    b2b = _back_to_back_ms(graphs)
    flops *= BACKWARD_FLOP_RATIO
    return {"ms": ms, "tflops": flops / ms / 1e9, "ms_back_to_back": b2b, "tflops_back_to_back": flops / b2b / 1e9}


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def time_case(name: str, case: Case, input_sets, family: str | None = None) -> dict:
    flops = attention_flops(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim,
                            case.head_dim, case.causal)
    try:
        make = fa_gen_impl(family) if name == "fa_gen" and family else IMPLEMENTATIONS[name]
        return {"impl": name, **time_fn(make(case), input_sets, flops, case.backward)}
    except Exception as exc:  # an anchor that cannot run a cell is recorded, not fatal
        return {"impl": name, "error": _error(exc)}


def _forward_graph(fn, q, k, v):
    """(out, inputs, dout): one forward with inputs that require grad, its graph kept for timing."""
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
    out = fn(*inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out, inputs, torch.randn_like(out)


def _grad(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout, retain_graph=True)


def _back_to_back_ms(graphs, repeats: int = 10) -> float:
    """Per-call time of one backward per graph queued back to back between two events: the host
    runs ahead as in training, so per-call host overhead hides behind the previous call."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for graph in graphs:
            _grad(*graph)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(graphs))
    return statistics.median(times)


def cases(args):
    for dtype in args.dtypes.split(","):
        for head_dim in map(int, args.head_dims.split(",")):
            for causal in (False, True):
                for seqlen in map(int, args.seqlens.split(",")):
                    yield Case(dtype, head_dim, causal, seqlen, TOKENS // seqlen, HIDDEN // head_dim,
                               args.backward)


def run_cell(case: Case, impls: list[str], family: str | None = None, rounds: int = 1) -> dict:
    """Every implementation timed `rounds` times in rotated orders (bench_rounds), each result the
    median of its rounds (merge_rounds)."""
    sets = make_input_sets(4, case.batch, case.seqlen, case.heads, case.heads, case.head_dim,
                           case.head_dim, case.torch_dtype)
    timed = timed_rounds(impls, lambda name, _: time_case(name, case, sets, family), rounds)
    cell = {"dtype": case.dtype, "head_dim": case.head_dim, "causal": case.causal, "seqlen": case.seqlen,
            "batch": case.batch, "heads": case.heads, "results": [merge_rounds(timed[n]) for n in impls]}
    del sets
    return cell


def merge_rounds(results: list[dict]) -> dict:
    """One implementation's rounds as one result: the median of each timing (ms, tflops and their
    back-to-back forms) and the rounds' TFLOP/s under "tflops_rounds"; a round that failed makes
    the result that round's error."""
    return bench_rounds.merge_rounds(results, ("ms", "tflops", "ms_back_to_back", "tflops_back_to_back"), "tflops")


def ratio_to_best_anchor(cell: dict) -> tuple[float | None, str | None]:
    by = {r["impl"]: r.get("tflops") for r in cell["results"]}
    anchors = {n: t for n, t in by.items() if n in ANCHORS and t}
    if not by.get("fa_gen") or not anchors:
        return None, None
    best = max(anchors, key=anchors.get)
    return by["fa_gen"] / anchors[best], best


def format_row(cell: dict) -> str:
    head = (f"{cell['dtype']} d={cell['head_dim']:3d} {'causal' if cell['causal'] else 'full  '} "
            f"s={cell['seqlen']:5d}")
    parts = [head] + [_format_result(r) for r in cell["results"]]
    ratio, best = ratio_to_best_anchor(cell)
    if ratio is not None:
        parts.append(f"fa_gen/{best} {ratio:.2f}")
    return " | ".join(parts)


def _format_result(r: dict) -> str:
    if "tflops" not in r:
        return f"{r['impl']}   ERR"
    back_to_back = f" (b2b {r['tflops_back_to_back']:5.1f})" if "tflops_back_to_back" in r else ""
    return f"{r['impl']} {r['tflops']:6.1f}{back_to_back}"


# ---- --variants: the library's expression variants beside Flex and FA4 ----------------------

VARIANT_SEQLENS = "1024,4096,8192,16384"
VARIANT_IMPLS = ("fa_gen", "flex", "fa4")


def variant_makers(variant, family: str | None, impls, lse: bool) -> dict:
    """impl -> make(inputs, shape) -> fn(q, k, v) -> (out, lse or None); FA4 only where it has the variant."""
    makers = {
        "fa_gen": lambda inputs, shape: variants.make_fa_gen(variant, inputs, family),
        "flex": lambda inputs, shape: variants.make_flex(variant, inputs, shape, lse=lse),
        "fa4": lambda inputs, shape: variants.make_fa4(variant, inputs, shape, lse=lse),
    }
    return {name: makers[name] for name in impls if name != "fa4" or variant.fa4 is not None}


def variant_shape(spec, seqlen: int):
    """batch*seqlen = 16k tokens, heads*head_dim = 2048 (h = 16 at d = 128), square."""
    heads = HIDDEN // spec.head_dim_qk
    return variants.Shape(TOKENS // seqlen, seqlen, seqlen, heads, heads)


def time_variant(name: str, make, inputs, shape, flops: float, input_sets) -> dict:
    try:
        fn = make(inputs, shape)
    except FaGenError as exc:  # no family implements the spec yet: recorded, the run goes on
        return {"impl": name, "unsupported": _error(exc)}
    except Exception as exc:
        return {"impl": name, "error": _error(exc)}
    try:
        timed = time_fn(fn, input_sets, flops)
    except Exception as exc:
        return {"impl": name, **getattr(fn, "meta", {}), "error": _error(exc)}
    return {"impl": name, **getattr(fn, "meta", {}), **timed}   # meta: fa_gen's family, Flex's options


def run_variant_cell(variant, spec, seqlen: int, impls, family: str | None) -> dict:
    shape = variant_shape(spec, seqlen)
    inputs = variant.inputs(shape, "cuda")
    pairs = variants.visible_pairs(spec, shape, inputs, device="cuda")
    flops = variants.variant_flops(spec, shape, pairs)
    sets = make_input_sets(4, shape.batch, seqlen, shape.heads_q, shape.heads_kv, spec.head_dim_qk,
                           spec.head_dim_v, variants.TORCH_DTYPES[spec.dtype.value])
    makers = variant_makers(variant, family, impls, lse=False)
    results = [time_variant(n, m, inputs, shape, flops, sets) for n, m in makers.items()]
    if "fa4" in impls and variant.fa4 is None:
        results.append({"impl": "fa4", "absent": "FlashAttention-4 has no such variant"})
    del sets
    cell = {"variant": variant.name, "spec": variant.spec, "notes": variant.notes, "dtype": spec.dtype.value,
            "head_dim": spec.head_dim_qk, "seqlen": seqlen, "batch": shape.batch, "heads": shape.heads_q,
            "visible_pairs": pairs, "visible_fraction": pairs / (shape.batch * shape.heads_q * seqlen * seqlen),
            "results": results}
    cell["ratios"] = variant_ratios(cell, variant)
    return cell


def variant_ratios(cell: dict, variant) -> dict:
    """anchor -> {"ratio": fa_gen / anchor, "bar": the issue's, "meets": ratio >= bar}."""
    by = {r["impl"]: r.get("tflops") for r in cell["results"]}
    bars = {"flex": variants.FLEX_MIN, "fa4": variant.fa4_min}
    ratios = {}
    for anchor, bar in bars.items():
        if by.get("fa_gen") and by.get(anchor):
            ratio = by["fa_gen"] / by[anchor]
            ratios[anchor] = {"ratio": ratio, "bar": bar, "meets": ratio >= bar}
    return ratios


def check_line(name: str, verdicts: dict) -> str:
    parts = []
    for impl, verdict in verdicts.items():
        if "error" in verdict:
            parts.append(f"{impl} ERROR {verdict['error'][:120]}")
        else:
            parts.append(f"{impl} {'ok' if verdict['ok'] else 'WRONG'} (out {verdict['out_err']:.1e} "
                         f"<= {verdict['out_tol']:.1e}, lse {verdict['lse_err']:.1e} <= {verdict['lse_tol']:.1e})")
    return f"check {name} at {variants.CHECK_SHAPE}: " + "; ".join(parts)


def _cell_text(r: dict) -> str:
    if "tflops" in r:
        return f"{r['tflops']:.0f}"
    return "unsupported" if "unsupported" in r else "-" if "absent" in r else "ERR"


def _ratio_text(cell: dict, anchor: str, wrong: set) -> str:
    entry = cell["ratios"].get(anchor)
    if entry is None:
        return "-"
    mark = "" if entry["meets"] else f" ✗ (< {entry['bar']:g})"
    suspect = " (check failed)" if wrong & {"fa_gen", anchor} else ""
    return f"{entry['ratio']:.2f}{mark}{suspect}"


def variant_table(cells: list, checks: dict) -> str:
    """The closing note's table: TFLOP/s and fa_gen's ratios, ✗ where below the issue's bar."""
    lines = ["| variant | s | b×h, d | fa_gen | Flex | FA4 | fa_gen/Flex | fa_gen/FA4 |",
             "|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        by = {r["impl"]: r for r in cell["results"]}
        wrong = {impl for impl, v in checks.get(cell["variant"], {}).items() if not v.get("ok")}
        family = by.get("fa_gen", {}).get("family")
        fa_gen = _cell_text(by["fa_gen"]) + (f" ({family})" if family else "") if "fa_gen" in by else "-"
        lines.append(f"| {cell['variant']} | {cell['seqlen']} | {cell['batch']}×{cell['heads']}, {cell['head_dim']} "
                     f"| {fa_gen} | {_cell_text(by['flex']) if 'flex' in by else '-'} "
                     f"| {_cell_text(by['fa4']) if 'fa4' in by else '-'} "
                     f"| {_ratio_text(cell, 'flex', wrong)} | {_ratio_text(cell, 'fa4', wrong)} |")
    return "\n".join(lines)


def format_variant_row(cell: dict) -> str:
    head = f"{cell['variant']:22s} s={cell['seqlen']:5d} b={cell['batch']:2d} h={cell['heads']:2d}"
    parts = [head] + [f"{r['impl']} {_cell_text(r)}" for r in cell["results"]]
    parts += [f"fa_gen/{a} {e['ratio']:.2f}{'' if e['meets'] else ' ✗'}" for a, e in cell["ratios"].items()]
    return " | ".join(parts)


def run_variants(args) -> tuple[list, dict]:
    names = list(variants.BY_NAME) if args.variants == "all" else args.variants.split(",")
    impls = (args.impls or ",".join(VARIANT_IMPLS)).split(",")
    cells, checks = [], {}
    for name in names:
        variant = variants.BY_NAME[name]
        spec = variants.load_variant_spec(variant)
        checks[name] = variants.check_variant(variant, spec, variant_makers(variant, args.family, impls, lse=True))
        print(check_line(name, checks[name]), flush=True)
        for seqlen in map(int, (args.seqlens or VARIANT_SEQLENS).split(",")):
            cells.append(run_variant_cell(variant, spec, seqlen, impls, args.family))
            print(format_variant_row(cells[-1]), flush=True)
    return cells, checks


# ---- the command -----------------------------------------------------------------------------

METHOD = {
    "forward": "TFLOP/s = 4*b*h*s^2*d (/2 causal)",
    "backward": "backward alone: autograd.grad(out, (q, k, v), dout, retain_graph=True) after one "
                "forward per input set; TFLOP/s = 2.5*4*b*h*s^2*d (/2 causal); b2b: the 4 sets' "
                "backwards queued back to back, median of 10, per call",
    "variants": "TFLOP/s = 2*visible_pairs*(d_qk + d_v), visible pairs counted exactly from the spec's mask "
                "(b*h*(query, key) pairs it keeps); inputs built from the shape (bench/variants.py); Flex: "
                "torch.compile(flex_attention, dynamic=False), block mask built once per shape outside the "
                "timing; every implementation checked against fa_gen.reference first (checks)",
}


def write_report(args, mode: str, cells: list, **extra) -> dict:
    report = {
        "commit": args.commit,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "mode": mode,
        "command": "python bench/bench_forward.py " + " ".join(sys.argv[1:]),
        "family": args.family,
        "method": f"median of {REPEATS} CUDA-event timings after 5 warm-ups, 4 rotated input sets"
                  + (f", then the median of {args.rounds} rounds, the implementations' order rotated each round"
                     if getattr(args, "rounds", 1) > 1 else "") + "; "
                  + METHOD[mode] + "; batch*seqlen = 16k, heads*head_dim = 2048",
        **extra,
        "cells": cells,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = {"forward": "", "backward": "-bwd", "variants": "-variants"}[mode]
    stem = f"{dt.date.today().isoformat()}-{args.commit}{suffix}" + (f"-{args.suffix}" if args.suffix else "")
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    if args.plot:
        from plot import plot_report

        print(f"wrote {plot_report(report, out_dir / f'{stem}.png')}")
    return report


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--suffix", default="", help="appended to the JSON's name")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--seqlens", default=None,
                        help="default 512,...,16384 (--variants: " + VARIANT_SEQLENS + ")")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--impls", default=None,
                        help="comma-separated; default every implementation (forward), "
                             + ",".join(BACKWARD_IMPLEMENTATIONS) + " (--backward) or "
                             + ",".join(VARIANT_IMPLS) + " (--variants)")
    parser.add_argument("--family", default=None,
                        help="force fa_gen's template family (e.g. sm80) for A/B; default: the registry's choice")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--backward", action="store_true", help="time the backward pass instead")
    mode.add_argument("--variants", nargs="?", const="all", default=None, metavar="NAME,...",
                      help="time the expression variants (all, or those named: "
                           + ",".join(variants.BY_NAME) + ")")
    parser.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time each cell's implementations this many times, the order rotated each "
                             "round; medians reported (forward and --backward)")
    args = parser.parse_args(argv)
    unknown = set((args.variants or "all").split(",")) - set(variants.BY_NAME) - {"all"}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(variants.BY_NAME)}")
    return args


def main() -> int:
    args = parse_args()
    if args.variants:
        cells, checks = run_variants(args)
        write_report(args, "variants", cells, checks=checks, check_shape=str(variants.CHECK_SHAPE),
                     bars={"flex": variants.FLEX_MIN, "fa4": variants.FA4_MIN, "fa4_softcap": 1.3})
        print("\n✗: below the issue's bar (fa_gen >= 1.5x Flex; >= 1.0x FA4, softcap >= 1.3x)\n")
        print(variant_table(cells, checks))
        return 0
    default_impls = BACKWARD_IMPLEMENTATIONS if args.backward else IMPLEMENTATIONS
    impls = (args.impls or ",".join(default_impls)).split(",")
    args.seqlens = args.seqlens or "512,1024,2048,4096,8192,16384"
    rows = []
    for case in cases(args):
        rows.append(run_cell(case, impls, args.family, args.rounds))
        print(format_row(rows[-1]), flush=True)
    write_report(args, "backward" if args.backward else "forward", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
