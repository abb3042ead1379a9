"""Varlen (packed) backward on a Hopper GPU: fa_gen's own sm90 `backward_varlen` kernel beside
the sm80 one it replaces there, FlashAttention-4's varlen backward, and fa_gen's fixed-length
backward on the same tokens where the documents are of equal length.

    python bench/bench_varlen_backward.py --out bench/results [--commit SHA] [--check]

Cells: (documents, mask, head dim), heads * head dim = 2048, bf16. "mixed" is bench_decode's 8
seeded documents summing to 16k; "equal" is 8 x 2048 (also run as a fixed (8, 2048) batch:
`fa_gen_fixed`). Only the backward is timed: the forward runs once per cell for out and LSE.
TFLOP/s counts the useful FLOPs of each document: 2.5 x its forward's (causal: half).
Timing: calls queued back to back between two CUDA events, median of 7 (as
bench_backward_sm90.time_ms): the host runs ahead, as in training. The implementations take
turns for --rounds rounds and each reports its median round (clocks drift over a run). --profile
adds each implementation's per-kernel device time (torch.profiler, 5 calls) to the rows.

Implementations: `fa_gen` (fa_gen.varlen_backward.backward_varlen, the preferred family),
`fa_gen_sm80` (the same call pinned to the sm80 family), `fa_gen_autograd` (torch.autograd.grad
through fa_gen.attention_varlen), `fa4` (torch.autograd.grad through
flash_attn.cute.flash_attn_varlen_func), `fa_gen_fixed` (equal cells: build_backward on the
(8, 2048) batch). --check first compares the preferred kernel's gradients of the cell's first
document with float64 autograd (and requires them finite everywhere).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_backward_sm90 import kernel_times, time_ms  # noqa: E402
from bench_decode import cu_seqlens, document_lengths  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402
from fa_gen.timing import attention_flops  # noqa: E402

WIDTH = 2048  # heads * head dim
DOCUMENT_SETS = {"mixed": document_lengths(), "equal": [2048] * 8}


def spec_for(head_dim: int, causal: bool):
    return load_spec({"name": f"vlbwd_d{head_dim}_{'causal' if causal else 'full'}", "dtype": "bf16",
                      "head_dim": head_dim, "mask": "causal" if causal else "none"})


class Cell:
    def __init__(self, documents: str, causal: bool, head_dim: int, seed: int = 0):
        self.documents, self.causal, self.head_dim = documents, causal, head_dim
        self.lengths = DOCUMENT_SETS[documents]
        self.heads = WIDTH // head_dim
        self.spec = spec_for(head_dim, causal)
        total = sum(self.lengths)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.q, self.k, self.v, self.dout = (torch.randn(total, self.heads, head_dim, generator=gen, device="cuda")
                                             .to(torch.bfloat16) for _ in range(4))
        self.cu = cu_seqlens(self.lengths, "cuda")
        self.max_len = max(self.lengths)
        from fa_gen.inference import forward_varlen

        self.out, self.lse = forward_varlen(self.spec, self.q, self.k, self.v, self.cu, self.cu, self.max_len,
                                            self.max_len)
        self.flops = 2.5 * sum(attention_flops(1, self.heads, n, n, head_dim, head_dim, causal=causal)
                               for n in self.lengths)

    @property
    def name(self) -> str:
        return f"{self.documents}_{'causal' if self.causal else 'full'}_d{self.head_dim}"


def fa_gen_kernel(family: str | None):
    def make(cell: Cell):
        from fa_gen.varlen_backward import backward_varlen

        c = cell
        return lambda: backward_varlen(c.spec, c.dout, c.q, c.k, c.v, c.out, c.lse, c.cu, c.cu, c.max_len,
                                       c.max_len, family=family)
    return make


def _autograd(function):
    """torch.autograd.grad of `function(q, k, v)` (leaves made here) for the cell's dout."""
    def make(cell: Cell):
        leaves = [t.detach().requires_grad_() for t in (cell.q, cell.k, cell.v)]
        out = function(cell, *leaves)
        out = out[0] if isinstance(out, tuple) else out
        return lambda: torch.autograd.grad(out, leaves, cell.dout, retain_graph=True)
    return make


def _fa_gen_varlen(cell: Cell, q, k, v):
    import fa_gen

    return fa_gen.attention_varlen(q, k, v, cell.cu, cell.cu, cell.max_len, cell.max_len, cell.spec)


def _fa4_varlen(cell: Cell, q, k, v):
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cell.cu, cu_seqlens_k=cell.cu, max_seqlen_q=cell.max_len,
                                  max_seqlen_k=cell.max_len, causal=cell.causal)


def fa_gen_fixed(cell: Cell):
    if len(set(cell.lengths)) != 1:
        raise ValueError("documents of unequal length have no fixed-length batch")
    from fa_gen.backward import build_backward
    from fa_gen.runtime import build

    shape = (len(cell.lengths), cell.lengths[0], cell.heads, cell.head_dim)
    q, k, v, dout = (t.view(shape) for t in (cell.q, cell.k, cell.v, cell.dout))
    out, lse = build(cell.spec).forward(q, k, v)
    backward = build_backward(cell.spec)
    return lambda: backward(dout, q, k, v, out, lse)


IMPLEMENTATIONS = {
    "fa_gen": fa_gen_kernel(None),
    "fa_gen_sm80": fa_gen_kernel("sm80"),
    "fa_gen_autograd": _autograd(_fa_gen_varlen),
    "fa4": _autograd(_fa4_varlen),
    "fa_gen_fixed": fa_gen_fixed,
}


def check(cell: Cell) -> list[str]:
    """Why fa_gen's varlen backward of `cell` is wrong (empty when it is right): the preferred
    family's gradients against float64 autograd of the first document, and finite everywhere."""
    from fa_gen.reference import attention_reference

    got = fa_gen_kernel(None)(cell)()
    n = cell.lengths[0]
    leaves = [t[:n].unsqueeze(0).double().requires_grad_() for t in (cell.q, cell.k, cell.v)]
    attention_reference(*leaves, cell.spec)[0].backward(cell.dout[:n].unsqueeze(0).double())
    problems = []
    for name, g, leaf in zip("qkv", got, leaves):
        err = float((g[:n].double() - leaf.grad[0]).abs().max())
        scale = float(leaf.grad.abs().max())
        if not bool(torch.isfinite(g).all()) or err > 0.02 * max(scale, 1e-3):
            problems.append(f"{cell.name} d{name}: max err {err:.3g} at scale {scale:.3g}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    parser.add_argument("--documents", type=lambda s: s.split(","), default=list(DOCUMENT_SETS))
    parser.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLEMENTATIONS))
    parser.add_argument("--check", action="store_true", help="check each cell's gradients before timing it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="per-kernel device times too")
    args = parser.parse_args(argv)
    rows, failures = [], []
    for documents in args.documents:
        for head_dim in args.head_dims:
            for causal in (False, True):
                cell = Cell(documents, causal, head_dim)
                if args.check:
                    failures += check(cell)
                row = {"cell": cell.name, "documents": cell.lengths, "heads": cell.heads, "head_dim": head_dim,
                       "causal": causal}
                runs, times = {}, {}
                for name in args.impls:
                    try:
                        runs[name] = IMPLEMENTATIONS[name](cell)
                    except Exception as exc:  # an anchor missing here is a row entry, not a crash
                        row[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                for _ in range(args.rounds):
                    for name, run in runs.items():
                        times.setdefault(name, []).append(time_ms(run))
                for name, ms in times.items():
                    row[name] = round(cell.flops / sorted(ms)[len(ms) // 2] / 1e9, 1)
                    if args.profile:
                        row[f"{name}_kernels_us"] = kernel_times(runs[name])
                best = [row[n] for n in ("fa4",) if isinstance(row.get(n), float)]
                if best and isinstance(row.get("fa_gen"), float):
                    row["fa_gen/fa4"] = round(row["fa_gen"] / best[0], 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    for problem in failures:
        print("CHECK FAILED:", problem, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        date = dt.date.today().isoformat()
        path = args.out / f"{date}-{args.commit}-varlen-backward.json"
        path.write_text(json.dumps({"date": date, "commit": args.commit, "device": torch.cuda.get_device_name(),
                                    "command": "python bench/bench_varlen_backward.py " + " ".join(argv or sys.argv[1:]),
                                    "unit": "TFLOP/s (useful FLOPs, 2.5x forward)", "rows": rows,
                                    "check_failures": failures}, indent=1))
        print("wrote", path)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
