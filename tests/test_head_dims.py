"""L0 (CPU): head dims off the measured set. The sm90 forward, the sm80 forward kinds and the sm80
backward take any (qk, v) of multiples of 8 up to 256, padded to whole swizzle atoms in shared
memory; a gradient through a spec no family differentiates on the GPU is refused at the
forward call. The GPU suite is test_gpu_head_dims.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fa_gen.errors import UnsupportedError
from fa_gen.families.sm80 import HEAD_DIMS, tile_config
from fa_gen.families.warp_tiles import padded_head_dim
from fa_gen.render import render_target
from fa_gen.spec_load import load_spec
from fa_gen.target import resolve_target


def _spec(qk, v, mask="none", dtype="bf16"):
    return load_spec({"name": f"hd_q{qk}_v{v}", "dtype": dtype, "head_dim": qk if qk == v else {"qk": qk, "v": v},
                      "mask": mask})


@pytest.mark.parametrize("dim,padded", [(8, 32), (32, 32), (40, 64), (72, 96), (80, 96), (96, 96), (136, 160),
                                        (200, 224), (256, 256)])
def test_padding_rounds_up_to_whole_atoms(dim, padded):
    assert padded_head_dim(dim) == padded


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_120a"])
@pytest.mark.parametrize("qk,v", [(8, 8), (40, 72), (80, 80), (256, 200), (64, 128), (248, 8)])
def test_the_forward_serves_every_multiple_of_8(arch, qk, v):
    spec = _spec(qk, v)
    target = resolve_target(spec, arch, "forward")
    assert target.family.name == ("sm90" if arch == "sm_90a" else "sm80")
    context = target.context()
    assert (context["head_dim_qk_pad"], context["head_dim_v_pad"]) == (padded_head_dim(qk), padded_head_dim(v))
    for kind in ("forward_split", "forward_varlen_split_paged", "forward_split_pack8"):
        assert resolve_target(spec, arch, kind).family.name == "sm80"
    text = render_target(target).text
    padded = (qk, v) != (padded_head_dim(qk), padded_head_dim(v))
    assert ("\nCOLS_QK = " in text) == padded
    # The sm80 kinds copy padded rows chunk by chunk; the sm90 one's TMA zero-fills on its own.
    assert ("copy_columns(" in text) == (padded and target.family.name == "sm80")


def test_the_measured_pairs_render_as_before():
    """Padding code appears only where a head dim is padded (the generated/ sync test pins the text)."""
    for qk, v in HEAD_DIMS:
        text = render_target(resolve_target(_spec(qk, v), "sm_80", "forward")).text
        assert "\nCOLS_QK = " not in text and "copy_columns" not in text


def test_tiles_count_the_padded_columns():
    from fa_gen.families import sm90

    # 80 pads to 96: the tile and its shared memory are the 96 ones.
    assert tile_config(_spec(80, 80), "sm_80") == tile_config(_spec(96, 96), "sm_80")
    assert sm90.tile_config(_spec(80, 80)) == sm90.tile_config(_spec(96, 96))
    # Off the table: the measured tiles of the next size up (qk 72 -> 96, v 136 -> 160: d192's).
    assert sm90.tile_config(_spec(72, 136)) == sm90.tile_config(_spec(192, 192))


@pytest.mark.parametrize("kind", ["backward", "backward_varlen"])
@pytest.mark.parametrize("qk,v", [(80, 80), (40, 72), (256, 200), (8, 8)])
def test_the_backward_serves_the_padded_pairs(kind, qk, v):
    from fa_gen.families import sm90_backward
    from fa_gen.families.sm80 import backward_tile_config

    target = resolve_target(_spec(qk, v), "sm_90a", kind)
    # Hopper's own backward, fixed-length and varlen, where the padded pair is one of its measured
    # ones (80 -> 96); the sm80 backward for the rest.
    hopper = sm90_backward.padded_dims(_spec(qk, v)) in sm90_backward.served_pairs()
    assert target.family.name == ("sm90" if hopper else "sm80")
    assert hopper == ((qk, v) == (80, 80))
    text = render_target(target).text
    assert f"\nCOLS_QK = {qk}\n" in text and f"\nCOLS_V = {v}\n" in text
    # Tiles of the padded dims: 80 backs onto the 96 tiles.
    assert backward_tile_config(_spec(80, 80), "sm_80") == backward_tile_config(_spec(96, 96), "sm_80")


def test_a_gradient_no_family_gives_is_refused_before_the_kernel():
    from fa_gen.autograd import _backward_target

    with pytest.raises(UnsupportedError, match="backward"):
        _backward_target(_spec(64, 64, dtype="fp16").canonical, "sm_75", "backward")


def test_a_head_dim_off_the_grid_is_refused():
    with pytest.raises(Exception, match="multiple of 8"):
        _spec(12, 12)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_padded_kinds_compile(tmp_path, monkeypatch, arch):
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    cases = [(_spec(40, 72, "causal", "fp16"), "forward_varlen_split_paged_pack4"),
             (_spec(40, 72, "causal", "fp16"), "forward_varlen_split_paged_tiles"), (_spec(80, 80), "forward"),
             (_spec(80, 80), "backward"), (_spec(40, 72, "causal", "fp16"), "backward_varlen"),
             (_spec(80, 80, "causal"), "backward_varlen")]
    if arch == "sm_90a":  # the Hopper forwards (TMA zero-fills the padding), fixed and varlen
        cases += [(_spec(256, 200, "causal"), "forward"), (_spec(72, 136), "forward_varlen")]
    for i, (spec, kind) in enumerate(cases):
        path = tmp_path / f"k{i}.o"
        compile_to_object(render_target(resolve_target(spec, arch, kind)).text, arch, path, label=spec.name)
        assert path.stat().st_size > 0


def test_fa_gen_list_says_what_each_family_serves():
    out = subprocess.run([sys.executable, "-m", "fa_gen.cli", "list"], capture_output=True, text=True, check=True).stdout
    assert "sm80" in out and "forward and backward: qk and v each a multiple of 8 up to 256" in out
