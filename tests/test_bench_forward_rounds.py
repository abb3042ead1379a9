"""bench/bench_forward.py's rounds on CPU: the order rotates each round and the medians merge."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_forward  # noqa: E402


def test_rounds_rotate_the_order_and_report_medians(monkeypatch):
    calls = []
    speeds = {"fa_gen": [300.0, 330.0, 310.0], "fa4": [290.0, 280.0, 320.0], "sdpa_cudnn": [100.0, 100.0, 100.0]}

    def fake_time_case(name, case, sets, family=None):
        calls.append(name)
        tflops = speeds[name][sum(c == name for c in calls) - 1]
        return {"impl": name, "ms": 1000.0 / tflops, "tflops": tflops}

    monkeypatch.setattr(bench_forward, "time_case", fake_time_case)
    monkeypatch.setattr(bench_forward, "make_input_sets", lambda *a, **k: [])
    case = bench_forward.Case("bf16", 128, False, 512, 32, 16)
    cell = bench_forward.run_cell(case, ["fa_gen", "fa4", "sdpa_cudnn"], rounds=3)
    assert calls == ["fa_gen", "fa4", "sdpa_cudnn", "fa4", "sdpa_cudnn", "fa_gen", "sdpa_cudnn", "fa_gen", "fa4"]
    by = {r["impl"]: r for r in cell["results"]}
    assert by["fa_gen"]["tflops"] == 310.0 and by["fa_gen"]["tflops_rounds"] == [300.0, 330.0, 310.0]
    assert by["fa4"]["tflops"] == 290.0 and by["fa4"]["ms"] == 1000.0 / 290.0


def test_a_failed_round_makes_the_result_an_error():
    rounds = [{"impl": "fa4", "ms": 1.0, "tflops": 500.0}, {"impl": "fa4", "error": "RuntimeError: boom"}]
    assert bench_forward.merge_rounds(rounds) == {"impl": "fa4", "error": "RuntimeError: boom"}
    assert bench_forward.merge_rounds(rounds[:1]) == rounds[0]
