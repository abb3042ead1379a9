"""Chunked prefill against a paged KV cache: fa_gen's KV-cache call beside the same shapes on
contiguous K/V and FlashAttention-4's paged and contiguous paths.

    python bench/bench_paged_prefill.py --out DIR [--rounds 3] [--cells b4_q2k_k8k_p16] [--impls ...]

Each cell is a batch of sequences, each with seqlen_k keys in the cache (the chunk's own keys
included) and a chunk of seqlen_q queries at its end: causal, aligned bottom-right (FlashAttention's
convention), bf16, d 128, 32 query / 8 KV heads. The pages are scattered in a seeded random order
and read through a (batch, seqlen_k / page_size) int32 page table with per-sequence lengths on the
device. TFLOP/s counts the useful FLOPs (4 d per visible query-key pair and head); timing and
checks are bench_decode's (L2 flushed by a read before each call; batch entry 0 against the float32
reference).

Implementations:
  fa_gen_paged       fa_gen.attention_with_kvcache(q, k_pages, v_pages, seqlens, spec, page_table=)
                     (the sm90 family's whole-range paged kind on Hopper: key tiles in TMA boxes)
  fa_gen_paged_split the same with num_splits=2: the split kinds that every page size can take
  fa_gen_contiguous  fa_gen.attention_with_kvcache(q, k, v, seqlens, spec) on contiguous K/V
  fa4_paged          flash_attn.cute.flash_attn_varlen_func(q, k_pages, v_pages, seqused_k=, page_table=, causal=True)
  fa4                flash_attn.cute.flash_attn_func(q, k, v, causal=True) on contiguous K/V
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as decode  # noqa: E402
import bench_paged  # noqa: E402

SEED = 0
HEADS = (32, 8)
HEAD_DIM = 128


@dataclass(frozen=True)
class PrefillCell:
    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    page_size: int

    @property
    def flops(self) -> float:
        visible = self.seqlen_q * (self.seqlen_k - self.seqlen_q) + self.seqlen_q * (self.seqlen_q + 1) / 2
        return 4.0 * HEAD_DIM * HEADS[0] * self.batch * visible


CELLS = tuple(PrefillCell(f"b{b}_q{q // 1024}k_k{k // 1024}k_p{p}", b, q, k, p)
              for b, q, k in ((4, 2048, 8192), (1, 8192, 8192)) for p in (16, 64, 256))


@dataclass
class PrefillInputs(bench_paged.PagedInputs):
    """bench_paged's inputs with seqlen_q queries a sequence, and their packed offsets."""
    cu_seqlens_q: torch.Tensor | None = None  # (batch + 1,) int32


def prefill_inputs(cell: PrefillCell, device="cuda") -> PrefillInputs:
    generator = torch.Generator(device=device).manual_seed(SEED)

    def draw(seqlen, heads):
        return torch.randn(cell.batch, seqlen, heads, HEAD_DIM, device=device, dtype=torch.bfloat16,
                           generator=generator)

    q, k, v = draw(cell.seqlen_q, HEADS[0]), draw(cell.seqlen_k, HEADS[1]), draw(cell.seqlen_k, HEADS[1])
    cu_q = torch.arange(0, cell.batch + 1, dtype=torch.int32, device=device) * cell.seqlen_q
    return PrefillInputs(q, k, v, *bench_paged.scattered_pages(k, v, cell.page_size, generator), cu_q)


SPEC = "causal_bf16_d128"


def fa_gen_paged(cell: PrefillCell, x: PrefillInputs, **options):
    import fa_gen

    described = "".join(f", {key}={value!r}" for key, value in options.items())
    return decode._with_meta(
        lambda: fa_gen.attention_with_kvcache(x.q, x.k_pages, x.v_pages, x.seqlens, SPEC, page_table=x.page_table,
                                              **options),
        call=f"fa_gen.attention_with_kvcache(q, k_pages, v_pages, seqlens, {SPEC!r}, page_table=page_table{described})")


def fa_gen_contiguous(cell: PrefillCell, x: PrefillInputs):
    import fa_gen

    return decode._with_meta(lambda: fa_gen.attention_with_kvcache(x.q, x.k, x.v, x.seqlens, SPEC),
                             call=f"fa_gen.attention_with_kvcache(q, k, v, seqlens, {SPEC!r})")


def fa4_paged(cell: PrefillCell, x: PrefillInputs):
    from flash_attn.cute import flash_attn_varlen_func

    packed = x.q.reshape(-1, *x.q.shape[2:])
    return decode._with_meta(
        lambda: flash_attn_varlen_func(packed, x.k_pages, x.v_pages, cu_seqlens_q=x.cu_seqlens_q,
                                       max_seqlen_q=cell.seqlen_q, max_seqlen_k=cell.seqlen_k, seqused_k=x.seqlens,
                                       page_table=x.page_table, causal=True),
        call="flash_attn.cute.flash_attn_varlen_func(q, k_pages, v_pages, cu_seqlens_q=, max_seqlen_q=, "
             "max_seqlen_k=, seqused_k=, page_table=, causal=True)", defaults=decode._fa4_defaults(flash_attn_varlen_func))


def fa4(cell: PrefillCell, x: PrefillInputs):
    from flash_attn.cute import flash_attn_func

    return decode._with_meta(lambda: flash_attn_func(x.q, x.k, x.v, causal=True),
                             call="flash_attn.cute.flash_attn_func(q, k, v, causal=True)",
                             defaults=decode._fa4_defaults(flash_attn_func))


IMPLS: dict[str, Callable] = {
    "fa_gen_paged": fa_gen_paged,
    "fa_gen_paged_split": lambda cell, x: fa_gen_paged(cell, x, num_splits=2),
    "fa_gen_contiguous": fa_gen_contiguous,
    "fa4_paged": fa4_paged,
    "fa4": fa4,
}


def _check(x: PrefillInputs) -> Callable[[Callable], dict]:
    """Batch entry 0 (queries at the end of its keys, bottom-right causal) against float32."""
    from fa_gen.reference import attention_reference
    from fa_gen.runtime import resolve_spec

    reference, _ = attention_reference(x.q[:1], x.k[:1], x.v[:1], resolve_spec(SPEC), torch.float32)

    def check(fn):
        out = decode._first(fn())
        return decode._check(out.reshape(x.q.shape[0], -1, *out.shape[-2:])[:1], reference)
    return check


def run_cell(cell: PrefillCell, impls: list[str], timer, rounds: int) -> dict:
    x = prefill_inputs(cell)
    check = _check(x)
    work = lambda ms: {"tflops": decode.tflops(cell.flops, ms)}   # noqa: E731
    results = decode.time_rounds(impls, lambda name, first: decode.time_impl(
        name, lambda: IMPLS[name](cell, x), timer, work, check if first else None), rounds)
    del x
    torch.cuda.empty_cache()
    timed = {r["impl"]: r["tflops"] for r in results if "tflops" in r}
    ratios = {f"fa_gen_paged_over_{other}": timed["fa_gen_paged"] / timed[other]
              for other in ("fa_gen_contiguous", "fa_gen_paged_split", "fa4_paged", "fa4")
              if "fa_gen_paged" in timed and other in timed}
    return {**asdict(cell), "useful_flops": cell.flops, "results": results, **ratios}


def table(cells: list[dict], impls: list[str]) -> str:
    lines = ["chunked prefill against a paged cache, causal bottom-right, TFLOP/s of useful FLOPs",
             "| cell | " + " | ".join(impls) + " | paged/contiguous | paged/FA4 paged |", "|---" * (len(impls) + 3) + "|"]
    for cell in cells:
        by = {r["impl"]: r for r in cell["results"]}
        lines.append(f"| {cell['name']} | " + " | ".join(decode._value(by.get(n), "tflops") for n in impls) + " | "
                     + decode._ratio(cell.get("fa_gen_paged_over_fa_gen_contiguous")) + " | "
                     + decode._ratio(cell.get("fa_gen_paged_over_fa4_paged")) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    args = parser.parse_args(argv)
    impls = args.impls.split(",")
    unknown = [n for n in impls if n not in IMPLS] + [c for c in (args.cells or "").split(",")
                                                      if c and c not in {x.name for x in CELLS}]
    if unknown:
        parser.error(f"unknown implementations or cells: {', '.join(unknown)}")
    cells = [c for c in CELLS if args.cells is None or c.name in args.cells.split(",")]
    timer = decode.Timer()
    results = [run_cell(cell, impls, timer, args.rounds) for cell in cells]
    print(table(results, impls))
    report = {"commit": args.commit, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python bench/bench_paged_prefill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "cells": results}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"paged-prefill-{args.commit}.json"
        path.write_text(json.dumps(report, indent=1))
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
