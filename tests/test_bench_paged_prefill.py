"""L0: the chunked-prefill-against-pages benchmark (bench/bench_paged_prefill.py) on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_paged_prefill as bench  # noqa: E402


def test_useful_flops_count_the_bottom_right_causal_pairs():
    cell = bench.PrefillCell("tiny", batch=2, seqlen_q=3, seqlen_k=5, page_size=1)
    visible = sum(5 - 3 + i + 1 for i in range(3))  # query i sees keys 0 .. seqlen_k - seqlen_q + i
    assert cell.flops == 4.0 * bench.HEAD_DIM * bench.HEADS[0] * 2 * visible
    square = bench.PrefillCell("sq", batch=1, seqlen_q=4, seqlen_k=4, page_size=1)
    assert square.flops == 4.0 * bench.HEAD_DIM * bench.HEADS[0] * 10


def test_pages_hold_the_contiguous_rows_in_table_order(monkeypatch):
    monkeypatch.setattr(bench, "HEAD_DIM", 8)
    monkeypatch.setattr(bench, "HEADS", (4, 2))
    cell = bench.PrefillCell("tiny", batch=2, seqlen_q=4, seqlen_k=32, page_size=8)
    x = bench.prefill_inputs(cell, device="cpu")
    assert x.page_table.shape == (2, 4) and sorted(x.page_table.flatten().tolist()) == list(range(8))
    assert x.cu_seqlens_q.tolist() == [0, 4, 8] and x.seqlens.tolist() == [32, 32]
    for b in range(2):
        for j in range(4):
            page = int(x.page_table[b, j])
            assert torch.equal(x.k_pages[page], x.k[b, 8 * j:8 * (j + 1)])
            assert torch.equal(x.v_pages[page], x.v[b, 8 * j:8 * (j + 1)])


def test_table_and_ratios():
    cell = {"name": "c", "results": [{"impl": "fa_gen_paged", "tflops": 600.0}, {"impl": "fa4_paged", "tflops": 500.0},
                                     {"impl": "fa_gen_contiguous", "error": "RuntimeError: x"}],
            "fa_gen_paged_over_fa4_paged": 1.2}
    text = bench.table([cell], ["fa_gen_paged", "fa4_paged", "fa_gen_contiguous"])
    assert "| c | 600 | 500 |" in text and "1.20" in text
