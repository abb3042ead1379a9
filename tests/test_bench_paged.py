"""L0: the paged decode cells of the benchmark (bench/bench_paged.py, `--parts paged`) on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_decode  # noqa: E402
import bench_paged as bench  # noqa: E402


def test_paged_cells():
    shapes = {(c.batch, c.seqlen_k, c.heads_q, c.heads_kv, c.page_size) for c in bench.PAGED_CELLS}
    assert shapes == {(b, s * 1024, 32, 8, p) for b, s in ((64, 8), (8, 32), (1, 128)) for p in (16, 64, 256)}
    assert bench_decode.parse_args(["--parts", "paged", "--cells", "b1_sk128k_h32/8_p16"]).parts == "paged"


def test_pages_hold_the_contiguous_rows_in_table_order():
    cell = bench.PagedCell("tiny", batch=2, seqlen_k=64, heads_q=4, heads_kv=2, page_size=16)
    x = bench.paged_inputs(cell, device="cpu")
    assert x.page_table.dtype == torch.int32 and x.page_table.shape == (2, 4)
    assert sorted(x.page_table.flatten().tolist()) == list(range(8))
    for b in range(2):
        for j in range(4):
            page = int(x.page_table[b, j])
            assert torch.equal(x.k_pages[page], x.k[b, 16 * j:16 * (j + 1)])
            assert torch.equal(x.v_pages[page], x.v[b, 16 * j:16 * (j + 1)])


def test_summary_ratios():
    cell = {"name": "c", "results": [{"impl": "fa_gen_paged", "gbps": 90.0}, {"impl": "fa_gen_paged_graph", "gbps": 100.0},
                                     {"impl": "fa_gen_split", "gbps": 125.0},
                                     {"impl": "fa_gen_contiguous", "gbps": 120.0}, {"impl": "fa4_paged", "gbps": 80.0},
                                     {"impl": "fa4_paged_splits", "error": "RuntimeError: x"}]}
    summary = bench.summarize_paged(cell, 1000.0)
    assert summary["paged_over_contiguous"] == 0.8 and summary["contiguous_impl"] == "fa_gen_split"
    assert summary["paged_impl"] == "fa_gen_paged_graph"
    assert summary["paged_over_fa4_paged"] == 1.25 and summary["fa4_impl"] == "fa4_paged"
    assert "| c | 90 | 100 |" in bench.paged_table([summary], list(bench.PAGED_IMPLS))
