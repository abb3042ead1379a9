"""`tuning:` overrides reach the template, and values a family cannot use are refused with a line."""

import pytest

from fa_gen.errors import SpecError
from fa_gen.families.sm80 import tile_config
from fa_gen.render import render
from fa_gen.spec_load import load_spec, spec_from_yaml_text

BASE = "name: t\ndtype: bf16\nhead_dim: 128\n"


def test_override_reaches_the_tile_and_the_render():
    # sm_80: an arch the sm80 family serves by preference (sm90 takes sm_90a).
    tuned = spec_from_yaml_text(BASE + "tuning:\n  sm80: {tile_n: 16}\n", "t.yaml")
    plain = spec_from_yaml_text(BASE, "t.yaml")
    assert tile_config(tuned, "sm_80").tile_n == 16 and tile_config(plain, "sm_80").tile_n != 16
    assert tuned.sha256() != plain.sha256()
    assert render(tuned, "sm_80").text != render(plain, "sm_80").text


def test_sm90_override_reaches_the_render():
    tuned = spec_from_yaml_text(BASE + "tuning:\n  sm90: {tile_n: 112}\n", "t.yaml")
    plain = spec_from_yaml_text(BASE, "t.yaml")
    assert render(tuned, "sm_90a").family == "sm90"
    assert "TILE_N = 112" in render(tuned, "sm_90a").text and "TILE_N = 112" not in render(plain, "sm_90a").text


@pytest.mark.parametrize("tuning,line,message", [
    ("tuning:\n  sm81: {tile_n: 32}\n", 5, "tuning.sm81: unknown key 'sm81' (did you mean 'sm80'?)"),
    ("tuning:\n  sm80: {tile_q: 32}\n", 5, "tuning.sm80.tile_q: unknown key"),
    ("tuning:\n  sm80: {tile_n: 0}\n", 5, "tuning.sm80.tile_n: 0 is not allowed"),
    # A value its family rejects on every arch it serves is refused at that family's line,
    # even where another family could serve the arch instead.
    ("tuning:\n  sm80: {tile_n: 24}\n", 5, "tuning.sm80: {tile_n: 24} cannot be used on any arch sm80 serves"),
    ("tuning:\n  sm80: {tile_m: 256, tile_n: 128}\n", 5, "would spill"),
    ("tuning:\n  sm80: {tile_n: 16}\n  sm90: {tile_n: 24}\n", 6, "tuning.sm90:"),
    ("tuning: 3\n", 4, "expected a mapping of family -> parameters"),
])
def test_bad_tuning_is_refused_with_its_line(tuning, line, message):
    with pytest.raises(SpecError) as info:
        spec_from_yaml_text(BASE + tuning, "t.yaml")
    assert str(info.value).startswith(f"t.yaml:{line}: tuning")
    assert message in str(info.value)


def test_tuning_that_fits_only_some_archs_narrows_the_default():
    spec = load_spec({"name": "t", "dtype": "bf16", "head_dim": 128, "tuning": {"sm80": {"tile_n": 128, "num_warps": 8}}})
    assert "sm_90a" in spec.archs and "sm_86" not in spec.archs   # 99 KB cannot hold the tiles


def test_stale_max_reaches_the_softmax_and_shrinks_the_fp8_shift(tmp_path, monkeypatch):
    """stale_max 2 (d128's default) keeps a row's reference max within 2^8 and skips the O rescale
    by a warp vote; the render compiles for sm_90a; `stale_max: 1` and head dim 64 render the plain
    softmax. fp8 inputs take a threshold of 2^4 and shift P by 2^4 instead of 2^8 (e4m3 reaches 448)."""
    from fa_gen.backends.cute_dsl import compile_to_object

    text = render(spec_from_yaml_text(BASE, "t.yaml"), "sm_90a").text
    assert "vote_any_sync(moved)" in text and "<= Float32(8.0) else new_max" in text
    off = spec_from_yaml_text(BASE + "tuning:\n  sm90: {stale_max: 1}\n", "t.yaml")
    assert "vote_any_sync" not in render(off, "sm_90a").text
    assert "vote_any_sync" not in render(spec_from_yaml_text(BASE.replace("128", "64"), "t.yaml"), "sm_90a").text
    on64 = spec_from_yaml_text(BASE.replace("128", "64") + "tuning:\n  sm90: {stale_max: 2}\n", "t.yaml")
    assert "vote_any_sync(moved)" in render(on64, "sm_90a").text
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    compile_to_object(text, "sm_90a", tmp_path / "stale.o", label="stale")
    assert (tmp_path / "stale.o").stat().st_size > 0
    fp8_on = render(spec_from_yaml_text("name: t\ndtype: fp8_e4m3\nhead_dim: 128\ntuning:\n  sm90: {stale_max: 2}\n",
                                        "t.yaml"), "sm_90a").text
    assert "<= Float32(4.0) else new_max" in fp8_on and "P_SHIFT = 4.0" in fp8_on and "P_UNSHIFT = 0.0625" in fp8_on
    fp8_off = render(spec_from_yaml_text("name: t\ndtype: fp8_e4m3\nhead_dim: 128\n", "t.yaml"), "sm_90a").text
    assert "vote_any_sync" not in fp8_off and "P_SHIFT = 8.0" in fp8_off and "P_UNSHIFT = 0.00390625" in fp8_off


def test_exp2_fma_puts_a_share_of_the_exponentials_on_the_fma_pipe(tmp_path, monkeypatch):
    """exp2_fma N: of every 16 columns, the last N take exp2_cubic in steps without -inf; the render
    compiles for sm_90a (fp8 d128, 128 x 224), with fewer MUFU instructions than without; odd
    counts are refused."""
    import re

    from fa_gen.backends.cute_dsl import compile_to_object
    from fa_gen.sass import disassemble

    fp8 = "name: t\ndtype: fp8_e4m3\nhead_dim: 128\n"
    plain = render(spec_from_yaml_text(fp8, "t.yaml"), "sm_90a").text
    tuned = render(spec_from_yaml_text(fp8 + "tuning:\n  sm90: {exp2_fma: 4}\n", "t.yaml"), "sm_90a").text
    assert "def exp2_cubic" not in plain and "def exp2_cubic" in tuned
    assert "if const_expr(not check_inf and c % 16 >= 12):" in tuned
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    mufu = {}
    for name, text in (("plain", plain), ("tuned", tuned)):
        compile_to_object(text, "sm_90a", tmp_path / f"{name}.o", label=name)
        mufu[name] = len(re.findall(r"\bMUFU\.EX2\b", disassemble(tmp_path / f"{name}.o")))
    assert 0 < mufu["tuned"] < mufu["plain"]
    with pytest.raises(SpecError, match="exp2_fma 3 must be an even count"):
        spec_from_yaml_text(BASE + "tuning:\n  sm90: {exp2_fma: 3}\n", "t.yaml")


def test_exp2_cubic_is_within_its_stated_error():
    """common/softmax.j2's exp2_cubic, emulated in float32 with the template's own constants:
    relative error below 8e-5 from -125 to 126."""
    import re
    import struct

    import torch

    from fa_gen.render import environment

    text = environment().from_string('{% import "common/softmax.j2" as s %}{{ s.define_exp2_cubic() }}').render()
    low, magic, _, c3, c2, c1, c0 = (struct.unpack(">f", bytes.fromhex(h))[0] for h in re.findall(r"0f([0-9A-F]{8})", text))
    x = torch.linspace(-125, 126, 400001, dtype=torch.float32).clamp(min=low)
    t = x + magic
    f = x - (t - magic)
    p = ((c3 * f + c2) * f + c1) * f + c0
    got = (p.view(torch.int32) + (t.view(torch.int32) << 23)).view(torch.float32).double()
    assert ((got / torch.exp2(x.double()) - 1).abs().max()) < 8e-5
