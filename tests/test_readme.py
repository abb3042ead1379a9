"""The README's two set-up commands are the ones CI and users run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\s*\$ (.+)$", block, flags=re.M)


def test_readme_has_exactly_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert "fa-gen build" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci.splitlines()


def _section(title: str) -> str:
    return (ROOT / "README.md").read_text().split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_both_doors_have_a_five_line_example_that_parses():
    import ast

    blocks = re.findall(r"```python\n(.*?)```", _section("FlashAttention-compatible functions and transformers"),
                        flags=re.S)
    assert len(blocks) == 2, blocks
    for block in blocks:
        assert len(block.strip().splitlines()) == 5, block
        ast.parse(block)
    assert "fa_gen.flash_attn_func(" in blocks[0] and "fa_gen.flash_attn_varlen_func(" in blocks[0]
    assert 'attn_implementation="fa_gen"' in blocks[1] and "fa_hf.register()" in blocks[1]


def test_the_readme_names_the_tested_model_families():
    import pytest

    pytest.importorskip("transformers", minversion="5.0")
    from tests.test_transformers_integration import FAMILIES

    text = _section("FlashAttention-compatible functions and transformers")
    names = {"llama": "Llama", "gemma2": "Gemma2", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
             "gemma3": "Gemma3", "gpt_oss": "gpt-oss"}
    for family in FAMILIES:
        prefix = next(p for p in names if family.startswith(p))
        assert names[prefix] in text, family


def test_the_readme_e2e_benchmark_command_parses():
    import shlex
    import sys

    command = re.search(r"`(python bench/bench_e2e\.py [^`]*)`", _section("FlashAttention-compatible functions "
                                                                         "and transformers")).group(1)
    argv = shlex.split(command.replace("$(git rev-parse --short HEAD)", "abc1234"))[2:]
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_e2e

    args = bench_e2e.parse_args(argv)
    assert args.commit == "abc1234" and args.profile
