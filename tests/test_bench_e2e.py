"""L0: the end-to-end benchmark (bench/bench_e2e.py) on CPU, no GPU needed: its arguments, the
model it builds, the prompt lengths, tokens/s and ratios, the JSON it writes, the attention share of
a profile, and a failing implementation recorded rather than raised."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_e2e as bench  # noqa: E402


def test_defaults_are_the_issue_s_run():
    args = bench.parse_args([])
    assert (args.batch, args.prompt, args.new_tokens, args.layers, args.head_dim) == (16, 2048, 256, 16, 64)
    assert args.impls == "fa_gen,sdpa" and args.scenarios == "uniform,left_padded" and not args.profile
    config = bench.model_config(args)
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (2048, 32, 8)
    wide = bench.model_config(bench.parse_args(["--head-dim", "128"]))
    assert (wide["hidden_size"], wide["num_attention_heads"], wide["num_key_value_heads"]) == (2048, 16, 4)


@pytest.mark.parametrize("argv", [["--impls", "fa_gen,flash"], ["--scenarios", "ragged"], ["--impls", ""],
                                  ["--batch", "0"], ["--new-tokens", "1"], ["--head-dim", "96"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_the_model_config_is_a_valid_llama_with_about_a_billion_parameters():
    transformers = pytest.importorskip("transformers", minversion="5.0")
    config = transformers.LlamaConfig(**bench.model_config(bench.parse_args([])))
    h, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * config.head_dim
    parameters = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + vocab * h
    assert 0.9e9 < parameters < 1.5e9 and config.head_dim == 64


def test_prompt_lengths():
    assert bench.prompt_lengths("uniform", 3, 2048) == [2048] * 3
    lengths = bench.prompt_lengths("left_padded", 16, 2048)
    assert len(lengths) == 16 and max(lengths) == 2048 and min(lengths) >= 512 and len(set(lengths)) > 4
    assert lengths == bench.prompt_lengths("left_padded", 16, 2048)  # seeded


def test_tokens_per_s_and_ratios():
    r = bench.summarize({"prefill_ms": 500.0, "decode_ms": 2550.0}, batch=16, new_tokens=256, real_tokens=32768)
    assert r["prefill_tokens_per_s"] == pytest.approx(65536) and r["decode_tokens_per_s"] == pytest.approx(1600)
    slower = bench.summarize({"prefill_ms": 1000.0, "decode_ms": 5100.0}, 16, 256, 32768)
    assert bench.ratios({"fa_gen": r, "sdpa": slower}) == {"prefill": pytest.approx(2.0), "decode": pytest.approx(2.0)}
    assert bench.ratios({"fa_gen": {"error": "x"}, "sdpa": slower}) == {"prefill": None, "decode": None}


def test_report_json_and_table(tmp_path):
    args = bench.parse_args(["--commit", "abc1234", "--layers", "2"])
    results = {"fa_gen": bench.summarize({"prefill_ms": 10.0, "decode_ms": 20.0}, 16, 256, 100),
               "sdpa": {"error": "RuntimeError: boom"}}
    scenario = {"name": "uniform", "lengths": [2048] * 16, "real_tokens": 32768, "results": results,
                "ratios": bench.ratios(results)}
    report = bench.make_report(args, ["--layers", "2"], "NVIDIA H100", [scenario], {"torch": "2.x"})
    path = bench.write_report(report, tmp_path)
    assert path.name == f"{report['date'][:10]}-abc1234-e2e.json"
    loaded = json.loads(path.read_text())
    assert {"commit", "date", "device", "model", "batch", "prompt", "new_tokens", "scenarios", "command"} <= set(loaded)
    assert loaded["model"]["num_hidden_layers"] == 2 and loaded["scenarios"][0]["results"]["sdpa"]["error"]
    text = bench.table([scenario])
    assert "RuntimeError: boom" in text and "ratio" in text


def test_attention_share_picks_attention_kernels_by_name():
    kernels = {"kernel_cutlass_FlashAttentionForward_0": 3.0, "kernel_cutlass_MergeStates_0": 1.0,
               "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>": 2.0,
               "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": 1.0,
               "sm90_xmma_gemm_bf16bf16_bf16f32": 12.0, "void at::native::index_elementwise_kernel": 1.0}
    share = bench.attention_share(kernels)
    assert share["attention_ms"] == pytest.approx(7.0) and share["total_ms"] == pytest.approx(20.0)
    assert share["share"] == pytest.approx(0.35) and share["top"][0]["name"].startswith("sm90_xmma")
    assert not share["top"][0]["attention"]
    assert bench.attention_share({})["share"] is None


def test_a_failing_implementation_is_recorded():
    class Broken:
        def set_attn_implementation(self, impl):
            raise ValueError(f"no {impl}")

    result = bench.run_impl(Broken(), "fa_gen", None, None, bench.parse_args([]))
    assert result == {"error": "ValueError: no fa_gen"}
