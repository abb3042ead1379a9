"""Paged decode cells of bench/bench_decode.py (`--parts paged`): fa_gen's paged KV cache beside
the same shapes on contiguous K/V and FlashAttention-4's paged path.

    python bench/bench_decode.py --parts paged --out DIR
    python bench/bench_decode.py --parts paged --cells b1_sk128k_h32/8_p16 --impls fa_gen_paged,fa4_paged

Each cell is a decode step (seqlen_q = 1, no mask, every sequence seqlen_k keys) whose K and V
live in pages of `page_size` rows, scattered in a random order (a seeded permutation of all
pages), read through a (batch, seqlen_k / page_size) int32 page table with per-sequence lengths
on the device. GB/s counts the K and V bytes read, as in the contiguous decode cells; timing
and checks are bench_decode's (Timer, time_impl, decode_check on batch entry 0).

Implementations:
  fa_gen_paged       fa_gen.attention_with_kvcache(q, k_pages, v_pages, seqlens, spec, page_table=)
  fa_gen_paged_graph the same call captured once in a CUDA graph, each timed call a replay (device time alone)
  fa_gen_contiguous  fa_gen.attention_with_kvcache(q, k, v, seqlens, spec): the same call on contiguous K/V
  fa_gen_split       fa_gen.inference.forward_split(spec, q, k, v): the contiguous decode path
  fa4_paged          flash_attn.cute.flash_attn_varlen_func(q, k_pages, v_pages, seqused_k=, page_table=)
  fa4_paged_splits   the same with num_splits=0 (FA4's split heuristic)
Summary per cell: the faster fa_gen paged path over the faster contiguous fa_gen path, and over the
faster FA4 paged call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch

import bench_decode as decode

PAGE_SIZES = (16, 64, 256)
SEED = 0


@dataclass(frozen=True)
class PagedCell(decode.DecodeCell):
    """A decode cell whose K/V sit in pages of `page_size` rows."""
    page_size: int = 16


def _paged_cells() -> tuple[PagedCell, ...]:
    cells = []
    for batch, seqlen_k in ((64, 8 * 1024), (8, 32 * 1024), (1, 128 * 1024)):
        for page_size in PAGE_SIZES:
            name = f"b{batch}_sk{seqlen_k // 1024}k_h32/8_p{page_size}"
            cells.append(PagedCell(name, batch, seqlen_k, 32, 8, page_size=page_size))
    return tuple(cells)


PAGED_CELLS = _paged_cells()


@dataclass
class PagedInputs:
    q: torch.Tensor            # (batch, 1, heads_q, d)
    k: torch.Tensor            # (batch, seqlen_k, heads_kv, d), contiguous
    v: torch.Tensor
    k_pages: torch.Tensor      # (num_pages, page_size, heads_kv, d): the same rows, pages shuffled
    v_pages: torch.Tensor
    page_table: torch.Tensor   # (batch, seqlen_k / page_size) int32
    seqlens: torch.Tensor      # (batch,) int32, all seqlen_k


def paged_inputs(cell: PagedCell, device="cuda") -> PagedInputs:
    dtype = decode.TORCH_DTYPES[cell.dtype]
    generator = torch.Generator(device=device).manual_seed(SEED)

    def draw(seqlen, heads):
        return torch.randn(cell.batch, seqlen, heads, cell.head_dim, device=device, dtype=dtype, generator=generator)

    q, k, v = draw(1, cell.heads_q), draw(cell.seqlen_k, cell.heads_kv), draw(cell.seqlen_k, cell.heads_kv)
    return PagedInputs(q, k, v, *scattered_pages(k, v, cell.page_size, generator))


def scattered_pages(k: torch.Tensor, v: torch.Tensor, page_size: int, generator: torch.Generator):
    """(k_pages, v_pages, page_table, seqlens) of contiguous k/v (batch, seqlen_k, heads, d):
    every page_size rows on a page, the pages in a seeded random order; all sequences full."""
    batch, seqlen_k = k.shape[:2]
    per_sequence = seqlen_k // page_size
    order = torch.randperm(batch * per_sequence, device=k.device, generator=generator)
    pages = []
    for x in (k, v):
        paged = torch.empty((batch * per_sequence, page_size, *x.shape[2:]), dtype=x.dtype, device=x.device)
        paged[order] = x.reshape(batch * per_sequence, page_size, *x.shape[2:])
        pages.append(paged)
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=k.device)
    return (*pages, order.view(batch, per_sequence).to(torch.int32), seqlens)


def _spec(cell: PagedCell):
    return decode.fa_gen_spec(False, cell.dtype, cell.head_dim)


def fa_gen_paged(cell: PagedCell, x: PagedInputs):
    import fa_gen

    spec = _spec(cell)
    return decode._with_meta(
        lambda: fa_gen.attention_with_kvcache(x.q, x.k_pages, x.v_pages, x.seqlens, spec, page_table=x.page_table),
        call=f"fa_gen.attention_with_kvcache(q, k_pages, v_pages, seqlens, {decode._spec_label(spec)!r}, "
             "page_table=page_table)")


def fa_gen_paged_graph(cell: PagedCell, x: PagedInputs):
    """The paged decode step captured once in a CUDA graph (after a warm-up call on a side
    stream, which compiles and loads its kernels); each call replays it."""
    step = fa_gen_paged(cell, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()

    def replay():
        graph.replay()
        return result

    return decode._with_meta(replay, call=step.meta["call"] + " captured in a torch.cuda.CUDAGraph; graph.replay()")


def fa_gen_contiguous(cell: PagedCell, x: PagedInputs):
    import fa_gen

    spec = _spec(cell)
    return decode._with_meta(lambda: fa_gen.attention_with_kvcache(x.q, x.k, x.v, x.seqlens, spec),
                             call=f"fa_gen.attention_with_kvcache(q, k, v, seqlens, {decode._spec_label(spec)!r})")


def fa4_paged(cell: PagedCell, x: PagedInputs, **options):
    from flash_attn.cute import flash_attn_varlen_func

    described = "".join(f", {key}={value!r}" for key, value in options.items())
    return decode._with_meta(
        lambda: flash_attn_varlen_func(x.q, x.k_pages, x.v_pages, max_seqlen_q=1, max_seqlen_k=cell.seqlen_k,
                                       seqused_k=x.seqlens, page_table=x.page_table, **options),
        call="flash_attn.cute.flash_attn_varlen_func(q, k_pages, v_pages, max_seqlen_q=1, max_seqlen_k=, "
             f"seqused_k=, page_table={described})", defaults=decode._fa4_defaults(flash_attn_varlen_func))


PAGED_IMPLS: dict[str, Callable] = {
    "fa_gen_paged": fa_gen_paged,
    "fa_gen_paged_graph": fa_gen_paged_graph,
    "fa_gen_contiguous": fa_gen_contiguous,
    "fa_gen_split": lambda cell, x: decode.fa_gen_split(_spec(cell), x.q, x.k, x.v),
    "fa4_paged": fa4_paged,
    "fa4_paged_splits": lambda cell, x: fa4_paged(cell, x, num_splits=0),
}
PAGED = ("fa_gen_paged", "fa_gen_paged_graph")
CONTIGUOUS = ("fa_gen_contiguous", "fa_gen_split")
FA4_PAGED = ("fa4_paged", "fa4_paged_splits")


def run_paged_cell(cell: PagedCell, impls: list[str], timer, copy_gbps: float, device="cuda", rounds: int = 1) -> dict:
    x = paged_inputs(cell, device)
    check = decode.decode_check(_spec(cell), x.q, x.k, x.v)
    work = lambda ms: {"gbps": decode.gbps(cell.kv_bytes, ms)}   # noqa: E731
    results = decode.time_rounds(impls, lambda name, first: decode.time_impl(
        name, lambda: PAGED_IMPLS[name](cell, x), timer, work, check if first else None), rounds)
    del x
    torch.cuda.empty_cache()
    return summarize_paged({**asdict(cell), "kv_bytes": cell.kv_bytes, "results": results}, copy_gbps)


def summarize_paged(cell: dict, copy_gbps: float) -> dict:
    """Adds each result's fraction of copy, and the faster fa_gen paged path over the faster
    contiguous fa_gen path and over the faster FA4 paged call."""
    timed = {r["impl"]: r for r in cell["results"] if "gbps" in r}
    for r in timed.values():
        r["fraction_of_copy"] = r["gbps"] / copy_gbps

    def best(names):
        found = [(timed[n]["gbps"], n) for n in names if n in timed]
        return max(found) if found else (None, None)

    paged, cell["paged_impl"] = best(PAGED)
    contiguous, contiguous_impl = best(CONTIGUOUS)
    fa4, fa4_impl = best(FA4_PAGED)
    cell["paged_over_contiguous"] = paged / contiguous if paged and contiguous else None
    cell["contiguous_impl"] = contiguous_impl
    cell["paged_over_fa4_paged"] = paged / fa4 if paged and fa4 else None
    cell["fa4_impl"] = fa4_impl
    return cell


def paged_table(cells: list[dict], impls: list[str]) -> str:
    lines = ["paged decode, GB/s of K+V read (pages shuffled)",
             "| cell | " + " | ".join(impls) + " | paged/contiguous | paged/FA4 paged |",
             "|---" * (len(impls) + 3) + "|"]
    for cell in cells:
        by = {r["impl"]: r for r in cell["results"]}
        ratios = (decode._ratio(cell["paged_over_contiguous"]), decode._ratio(cell["paged_over_fa4_paged"]))
        lines.append(f"| {cell['name']} | " + " | ".join(decode._value(by.get(n), "gbps") for n in impls)
                     + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)
