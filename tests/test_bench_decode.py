"""L0: the decode / varlen-prefill benchmark (bench/bench_decode.py) on CPU, no GPU needed.

Its cells are the ones asked for, its byte and FLOP counts match small hand-computed numbers,
its summaries pick fa_gen's faster path and the best anchor, the JSON writer names and fills
the file, a missing fa_gen.attention_varlen is recorded as "unavailable" (never raised), and
the SDPA caller falls back to expanded K/V heads when enable_gqa=True is refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import fa_gen

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_decode as bench  # noqa: E402

K = 1024


def test_decode_cells():
    shapes = [(c.batch, c.seqlen_k, c.heads_q, c.heads_kv, c.head_dim, c.dtype) for c in bench.DECODE_CELLS]
    assert shapes == [
        (64, 8 * K, 32, 8, 128, "bf16"),
        (8, 32 * K, 32, 8, 128, "bf16"),
        (1, 128 * K, 32, 8, 128, "bf16"),
        (128, 2 * K, 64, 8, 128, "bf16"),
        (32, 16 * K, 32, 1, 128, "bf16"),     # MQA
        (64, 8 * K, 32, 8, 64, "bf16"),
        (64, 8 * K, 32, 8, 128, "fp16"),
    ]
    names = [c.name for c in bench.DECODE_CELLS]
    assert len(set(names)) == len(names)
    assert names[0] == "b64_sk8k_h32/8" and names[5] == "b64_sk8k_h32/8_d64" and names[6] == "b64_sk8k_h32/8_fp16"
    assert set(bench.DECODE_DEFAULT) == {"fa_gen_attention", "fa_gen_raw", "fa_gen_split", "fa4", "sdpa_cudnn",
                                         "sdpa_flash"}
    assert set(bench.DECODE_DEFAULT) <= set(bench.DECODE_IMPLS)


def test_varlen_cells_and_document_lengths():
    assert [(c.heads_q, c.heads_kv, c.head_dim, c.dtype) for c in bench.VARLEN_CELLS] == [
        (16, 16, 128, "bf16"), (16, 4, 128, "bf16")]
    lengths = bench.document_lengths()
    assert lengths == bench.document_lengths()          # seeded: the same every run
    assert len(lengths) == 8 and sum(lengths) == 16 * K
    assert min(lengths) >= bench.MIN_DOCUMENT and len(set(lengths)) > 1
    assert bench.document_lengths(seed=1) != lengths
    cu = bench.cu_seqlens([3, 5, 2])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 8, 10]


def test_bytes_and_flops_by_hand():
    cell = bench.DecodeCell("tiny", batch=2, seqlen_k=3, heads_q=4, heads_kv=2, head_dim=8)
    assert cell.kv_bytes == 2 * (2 * 3 * 2 * 8) * 2          # K and V, bf16: 384
    assert cell.kv_bytes == 384
    assert bench.DECODE_CELLS[0].kv_bytes == 2 << 30        # 64 x 8k x 8 x 128 x 2 B, twice: 2 GiB
    assert bench.DECODE_CELLS[2].kv_bytes == 512 << 20       # 128k x 8 x 128 x 2 B, twice
    assert bench.DECODE_CELLS[4].kv_bytes == 256 << 20       # MQA: one K/V head
    assert bench.gbps(2e9, 1.0) == 2000.0                    # 2 GB in 1 ms
    # 4 * sum_i(L_i^2 / 2) * heads * d: lengths 2 and 4, one head, d = 1 -> 4 * (2 + 8) = 40
    assert bench.useful_causal_flops([2, 4], heads=1, head_dim=1) == 40
    assert bench.useful_causal_flops([10], heads=3, head_dim=5) == 4 * 50 * 3 * 5
    assert bench.tflops(1e12, 1.0) == 1000.0


def _fake_decode_cell() -> dict:
    cell = bench.DECODE_CELLS[0]
    results = [
        {"impl": "fa_gen_attention", "gbps": 1900.0, "check": {"ok": True, "max_abs_err": 1e-3}},
        {"impl": "fa_gen_raw", "gbps": 2000.0, "check": {"ok": True, "max_abs_err": 1e-3}},
        {"impl": "fa4", "gbps": 2500.0, "check": {"ok": True, "max_abs_err": 1e-3}},
        {"impl": "sdpa_cudnn", "error": "RuntimeError: No available kernel"},
        {"impl": "sdpa_flash", "gbps": 1000.0, "kv_expanded": 4},
    ]
    return bench.summarize_decode({"name": cell.name, "kv_bytes": cell.kv_bytes, "results": results}, 4000.0)


def test_decode_summary():
    cell = _fake_decode_cell()
    assert cell["fa_gen"] == {"impl": "fa_gen_raw", "gbps": 2000.0}
    assert cell["best_anchor"] == "fa4"
    assert cell["fa_gen_over_best_anchor"] == pytest.approx(0.8)
    assert cell["fa_gen_over_copy"] == pytest.approx(0.5)
    by = {r["impl"]: r for r in cell["results"]}
    assert by["fa4"]["fraction_of_copy"] == pytest.approx(0.625)
    assert "fraction_of_copy" not in by["sdpa_cudnn"]
    row = bench.decode_table([cell], {"gbps": 4000.0}, ["fa4", "sdpa_cudnn", "sdpa_flash"]).splitlines()[-1]
    assert row == "| b64_sk8k_h32/8 | 2000 (raw) | 2500 | ERR | 1000 | 0.80 (fa4) | 0.50 |"


def test_decode_summary_without_fa_gen():
    cell = bench.summarize_decode({"name": "x", "results": [{"impl": "fa_gen_raw", "error": "E"},
                                                            {"impl": "fa4", "gbps": 10.0}]}, 100.0)
    assert cell["fa_gen"] is None and cell["fa_gen_over_best_anchor"] is None and cell["best_anchor"] == "fa4"


def _fake_varlen_cell() -> dict:
    results = [{"impl": "fa_gen", "unavailable": "fa_gen.attention_varlen does not exist at this commit"},
               {"impl": "fa4_varlen", "tflops": 400.0},
               {"impl": "sdpa_cudnn_padded", "tflops": 200.0, "layout": "padded"},
               {"impl": "sdpa_flash_padded", "error": "RuntimeError: boom"}]
    return bench.summarize_varlen({"name": "h16", "useful_flops": 1.0, "results": results})


def test_varlen_summary():
    cell = _fake_varlen_cell()
    by = {r["impl"]: r for r in cell["results"]}
    assert by["sdpa_cudnn_padded"]["over_fa4_varlen"] == pytest.approx(0.5)
    assert by["fa4_varlen"]["over_fa4_varlen"] == 1.0
    assert cell["fa_gen_over_fa4_varlen"] is None
    row = bench.varlen_table([cell], list(bench.VARLEN_IMPLS), [1]).splitlines()[-1]
    assert row == "| h16 | unavailable | 400 | 200 | ERR | - |"
    done = bench.summarize_varlen({"name": "h16", "results": [{"impl": "fa_gen", "tflops": 300.0},
                                                               {"impl": "fa4_varlen", "tflops": 400.0}]})
    assert done["fa_gen_over_fa4_varlen"] == pytest.approx(0.75)


def test_json_writer(tmp_path):
    copy = {"gbps": 4000.0, "ms": 1.0}
    lengths = bench.document_lengths()
    report = bench.make_report("abc1234", "Fake GPU", copy, [_fake_decode_cell()], [_fake_varlen_cell()], lengths,
                               ["--commit", "abc1234"])
    path = bench.write_report(report, tmp_path)
    assert path.name == f"{report['date'][:10]}-abc1234-decode.json"
    back = json.loads(path.read_text())
    for key in ("commit", "date", "device", "torch", "fa_gen", "flash_attn", "method", "copy", "decode", "varlen"):
        assert key in back
    assert back["device"] == "Fake GPU" and back["command"] == "python bench/bench_decode.py --commit abc1234"
    assert back["varlen"]["lengths"] == lengths and back["varlen"]["total_tokens"] == 16 * K
    assert back["decode"][0]["fa_gen"]["impl"] == "fa_gen_raw"
    assert back["varlen"]["cells"][0]["results"][0]["unavailable"]


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    report = bench.make_report("abc1234", "Fake GPU", {"gbps": 4000.0}, [_fake_decode_cell()],
                               [_fake_varlen_cell()], bench.document_lengths(), [])
    path = bench.write_report(report, tmp_path, plot=True)
    assert path.with_suffix(".png").stat().st_size > 0


def test_missing_attention_varlen_is_unavailable(monkeypatch):
    monkeypatch.delattr(fa_gen, "attention_varlen", raising=False)
    cell = bench.VARLEN_CELLS[0]
    result = bench.time_impl("fa_gen", lambda: bench.VARLEN_IMPLS["fa_gen"](cell, None), None,
                             lambda ms: {"tflops": 1 / ms})
    assert result == {"impl": "fa_gen", "unavailable": "fa_gen.attention_varlen does not exist at this commit"}


def test_attention_varlen_call_convention(monkeypatch):
    """fa_gen.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, spec)."""
    seen = []
    monkeypatch.setattr(fa_gen, "attention_varlen", lambda *args: seen.append(args) or ("out", "lse"),
                        raising=False)
    cell = bench.VARLEN_CELLS[1]
    inputs = bench.varlen_inputs(bench.VarlenCell("small", 2, 1, 8), [3, 5], device="cpu")
    fn = bench.VARLEN_IMPLS["fa_gen"](cell, inputs)
    assert fn() == ("out", "lse")
    q, k, v, cu_q, cu_k, max_q, max_k, spec = seen[0]
    assert (q, k, v) == (inputs.q, inputs.k, inputs.v)
    assert cu_q.tolist() == cu_k.tolist() == [0, 3, 8] and max_q == max_k == 5
    assert spec == "causal_bf16_d128"
    assert fn.meta["layout"] == "packed"


def test_varlen_inputs_pad_each_document():
    inputs = bench.varlen_inputs(bench.VarlenCell("small", 2, 1, 8), [3, 5], device="cpu")
    q_padded = inputs.padded[0]
    assert q_padded.shape == (2, 5, 2, 8) and inputs.k.shape == (8, 1, 8)
    assert torch.equal(q_padded[0, :3], inputs.q[:3]) and torch.equal(q_padded[1], inputs.q[3:])
    assert not q_padded[0, 3:].any()


def test_fa_gen_specs():
    assert bench.fa_gen_spec(False, "bf16", 128) == "full_bf16_d128"
    assert bench.fa_gen_spec(True, "bf16", 128) == "causal_bf16_d128"
    built = bench.fa_gen_spec(False, "bf16", 64)            # not shipped: built from its fields
    assert built.head_dim_qk == 64 and built.dtype.value == "bf16" and built.mask.value == "none"
    assert bench.fa_gen_spec(False, "fp16", 128).dtype.value == "fp16"


def test_sdpa_gqa_fallback_on_cpu():
    """enable_gqa=True where the backend takes it (MATH on CPU); expanded K/V heads where it refuses
    (cuDNN on CPU refuses everything: the expanded call is recorded, and fails only when timed)."""
    q = torch.randn(2, 1, 4, 8)
    k, v = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    math = bench.sdpa("MATH", q, k, v)
    assert "enable_gqa=True" in math.meta["call"] and "kv_expanded" not in math.meta
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1), v.transpose(1, 2).repeat_interleave(2, 1))
    torch.testing.assert_close(math(), expected.transpose(1, 2))
    refused = bench.sdpa("CUDNN_ATTENTION", q, k, v)
    assert refused.meta["kv_expanded"] == 2
    assert "expanded x2" in refused.meta["call"] and "reads 2x" in refused.meta["call"]
    assert refused.meta["gqa_refused"]


def test_parse_args_rejects_unknown_names():
    args = bench.parse_args(["--commit", "c", "--cells", "b1_sk128k_h32/8,h16/4", "--impls", "fa_gen_raw,fa4"])
    assert args.cells == "b1_sk128k_h32/8,h16/4"
    with pytest.raises(SystemExit):
        bench.parse_args(["--impls", "fa5"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--cells", "nope"])


class _OneCallTimer:
    """Stands in for bench.Timer on CPU: calls fn once, reports 2 ms (device) and 4 ms (host)."""

    def median_ms(self, fn, hide_host=True):
        fn()
        return 2.0 if hide_host else 4.0


def test_decode_cell_on_cpu_records_every_impl():
    """The whole cell on CPU: SDPA's flash backend (which PyTorch also has on CPU) is timed and
    checked; fa_gen (no GPU) and FA4 (not installed here) are errors in the cell, not exceptions."""
    cell = bench.DecodeCell("tiny", batch=2, seqlen_k=64, heads_q=4, heads_kv=2, head_dim=64)
    out = bench.run_decode_cell(cell, ["fa_gen_raw", "fa4", "sdpa_flash"], _OneCallTimer(), copy_gbps=1.0,
                                device="cpu")
    by = {r["impl"]: r for r in out["results"]}
    assert "error" in by["fa_gen_raw"] and out["fa_gen"] is None
    assert by["sdpa_flash"]["check"]["ok"], by["sdpa_flash"]
    assert by["sdpa_flash"]["gbps"] == pytest.approx(cell.kv_bytes / 2.0 / 1e6)
    assert by["sdpa_flash"]["gbps_host"] == pytest.approx(cell.kv_bytes / 4.0 / 1e6)
    assert out["best_anchor"] == "sdpa_flash" and out["kv_bytes"] == cell.kv_bytes


def test_varlen_cell_on_cpu_checks_the_padded_batch(monkeypatch):
    monkeypatch.delattr(fa_gen, "attention_varlen", raising=False)
    lengths = [40, 24, 64]
    out = bench.run_varlen_cell(bench.VarlenCell("tiny", 2, 1, 64), lengths,
                                ["fa_gen", "sdpa_flash_padded"], _OneCallTimer(), device="cpu")
    by = {r["impl"]: r for r in out["results"]}
    assert "unavailable" in by["fa_gen"]
    padded = by["sdpa_flash_padded"]
    assert padded["layout"] == "padded" and padded["check"]["ok"] and padded["check"]["document"] == 1
    assert padded["tflops"] == pytest.approx(bench.useful_causal_flops(lengths, 2, 64) / 2.0 / 1e9)


def test_rounds_rotate_the_order_and_take_medians():
    calls = []

    def time_one(name, check):
        calls.append((name, check))
        ms = {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 6.0], "c": [7.0, 9.0, 8.0]}[name][sum(n == name for n, _ in calls) - 1]
        return {"impl": name, "ms": ms, "gbps": 10.0 / ms}

    results = bench.time_rounds(["a", "b", "c"], time_one, rounds=3)
    assert [n for n, _ in calls] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [c for _, c in calls] == [True] * 3 + [False] * 6
    assert [r["impl"] for r in results] == ["a", "b", "c"]
    assert [r["ms"] for r in results] == [2.0, 5.0, 8.0]
    assert results[0]["gbps"] == pytest.approx(5.0) and results[0]["ms_rounds"] == [3.0, 1.0, 2.0]


def test_a_failed_round_is_the_result():
    rounds = iter([{"impl": "a", "ms": 1.0}, {"impl": "a", "error": "boom"}])
    (result,) = bench.time_rounds(["a"], lambda name, check: next(rounds), rounds=2)
    assert result == {"impl": "a", "error": "boom"}
