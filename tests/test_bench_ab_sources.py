"""bench/ab_sources.py on CPU: a commit's sources extracted without results, and the rows a
bench_decode report yields for the comparison (the GPU part runs on the device)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ab_sources  # noqa: E402


def test_prepare_extracts_sources_without_results(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    tree = ab_sources.prepare("HEAD", into=tmp_path)
    assert (tree / "fa_gen" / "__init__.py").is_file()
    assert (tree / "templates" / "sm80" / "forward.py.j2").is_file()
    assert (tree / "bench" / "bench_decode.py").is_file()
    assert not (tree / "bench" / "results").exists()
    assert not (tree / "generated").exists()


def test_rows_cover_decode_paged_and_varlen_cells():
    report = {
        "decode": [{"name": "b1", "results": [{"impl": "fa_gen_split", "gbps": 3800.0}, {"impl": "fa4", "error": "x"}]}],
        "paged": [{"name": "b1_p16", "results": [{"impl": "fa_gen_paged", "gbps": 3500.0}]}],
        "varlen": {"cells": [{"name": "h16", "results": [{"impl": "fa_gen", "tflops": 522.0}]}]},
    }
    assert ab_sources.rows(json.loads(json.dumps(report)), "gbps") == {
        ("b1", "fa_gen_split"): 3800.0, ("b1_p16", "fa_gen_paged"): 3500.0, ("h16", "fa_gen"): 522.0}


def test_rows_name_bench_forward_cells_by_dtype_head_dim_mask_and_length():
    report = {"cells": [{"dtype": "bf16", "head_dim": 128, "causal": False, "seqlen": 512, "batch": 32, "heads": 16,
                         "results": [{"impl": "fa_gen", "tflops": 430.0}, {"impl": "fa4", "error": "x"}]},
                        {"dtype": "fp16", "head_dim": 64, "causal": True, "seqlen": 1024, "batch": 16, "heads": 32,
                         "results": [{"impl": "sdpa_cudnn", "tflops": 280.0}]}]}
    assert ab_sources.rows(report, "tflops") == {
        ("bf16_d128_full_s512", "fa_gen"): 430.0, ("fp16_d64_causal_s1024", "sdpa_cudnn"): 280.0}


def test_rows_of_backward_reports_take_each_implementation_column():
    fixed = {"rows": [{"head_dim": 128, "causal": True, "seqlen": 2048, "batch": 8, "heads": 16, "dtype": "bf16",
                       "fa_gen_sm80": 242.1, "fa4": "error: RuntimeError: x"}]}
    varlen = {"rows": [{"cell": "mixed_causal_d64", "documents": [5, 7], "heads": 32, "head_dim": 64, "causal": True,
                        "fa_gen": 387.4, "fa4": 388.4, "fa_gen/fa4": 0.997}]}
    assert ab_sources.rows(fixed, "tflops") == {("bf16_d128_causal_s2048", "fa_gen_sm80"): 242.1}
    assert ab_sources.rows(varlen, "tflops") == {("mixed_causal_d64", "fa_gen"): 387.4,
                                                 ("mixed_causal_d64", "fa4"): 388.4}
    assert set(ab_sources.BENCHES) >= {"backward", "varlen_backward"}

