"""What scattered pages cost the memory system alone, with no attention kernel involved.

    python bench/paged_roofline.py [--gib 2] [--page-sizes 1,16,64,256]

A paged KV cache (num_pages, page_size, heads_kv=8, d=128) bf16 is read whole by a Triton
kernel that follows a page table and only sums what it reads (read-only, as attention reads
K/V): once with the pages in table order (page i of the table is page i in memory: the
contiguous case) and once through a shuffled table (the paged decode cells' layout,
bench/bench_paged.py). Same kernel, same bytes: the ratio is what the scattering alone costs
(DRAM locality, TLB reach), the most a paged decode kernel can keep of its contiguous speed at
that page size. GB/s = bytes read / time. The `_per_head` columns read as an attention CTA
does: one KV head's slice of each page (rows 8 * 128 elements apart), 1024 rows a program.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode as decode  # noqa: E402


ROW = 8 * 128  # elements of one slot (heads_kv x d)


@triton.jit
def _read_pages(cache, table, out, PAGE: tl.constexpr, PAGES_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(PAGES_PER_PROGRAM):
        page = tl.load(table + program * PAGES_PER_PROGRAM + i).to(tl.int64)
        base = cache + page * PAGE
        for start in range(0, PAGE, BLOCK):
            total += tl.load(base + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out + program, tl.sum(total, axis=0))


@triton.jit
def _read_head_slices(cache, table, out, PAGE_SIZE: tl.constexpr, PAGES_PER_PROGRAM: tl.constexpr,
                      HEADS: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr):
    """As an attention CTA reads a KV head: program (p, h) walks PAGES_PER_PROGRAM consecutive
    table entries and reads head h's (page_size, D) slice of each page (rows HEADS * D apart)."""
    program, head = tl.program_id(0), tl.program_id(1)
    total = tl.zeros((ROWS, D), dtype=tl.float32)
    offsets = tl.arange(0, ROWS)[:, None] * (HEADS * D) + tl.arange(0, D)[None, :]
    for i in range(PAGES_PER_PROGRAM):
        page = tl.load(table + program * PAGES_PER_PROGRAM + i).to(tl.int64)
        base = cache + page * (PAGE_SIZE * HEADS * D) + head * D
        for row in range(0, PAGE_SIZE, ROWS):
            total += tl.load(base + row * (HEADS * D) + offsets).to(tl.float32)
    tl.store(out + program * HEADS + head, tl.sum(tl.sum(total, axis=1), axis=0))


def read_head_slices(cache: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> None:
    """Each program reads 1024 rows of one head (256 KB of a d-128 bf16 head), as a split does."""
    page_size, heads, d = cache.shape[1:]
    per_program = max(1, 1024 // page_size)
    _read_head_slices[(table.numel() // per_program, heads)](cache, table, out, page_size, per_program, heads, d,
                                                             min(page_size, 32))


def read_pages(cache: torch.Tensor, table: torch.Tensor, out: torch.Tensor, per_program: int) -> None:
    page = cache[0].numel()
    _read_pages[(table.numel() // per_program,)](cache, table, out, page, per_program, min(page, 4096))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="cache size read (GiB)")
    parser.add_argument("--page-sizes", default="1,16,64,256")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    timer = decode.Timer()
    rows = []
    for page_size in map(int, args.page_sizes.split(",")):
        # At least 32 KB per program: pages of one slot go 16 to a program.
        per_program = max(1, 16 // page_size)
        num_pages = int(args.gib * 2**30) // (page_size * ROW * 2) // per_program * per_program
        cache = torch.randn(num_pages, page_size, 8, 128, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(num_pages * 8, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        orders = {"in_order": torch.arange(num_pages, device="cuda"),
                  "shuffled": torch.randperm(num_pages, generator=g, device="cuda")}
        result = {"page_size": page_size, "num_pages": num_pages}
        for name, order in orders.items():
            ms = timer.median_ms(lambda c=cache, o=order, t=out: read_pages(c, o, t, per_program))
            result[name] = round(cache.numel() * 2 / ms / 1e6)
            ms = timer.median_ms(lambda c=cache, o=order, t=out: read_head_slices(c, o, t))
            result[f"{name}_per_head"] = round(cache.numel() * 2 / ms / 1e6)
        result["shuffled_over_in_order"] = round(result["shuffled"] / result["in_order"], 3)
        result["per_head_shuffled_over_in_order"] = round(result["shuffled_per_head"] / result["in_order_per_head"], 3)
        rows.append(result)
        print(json.dumps(result), flush=True)
        cache = out = orders = None
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
