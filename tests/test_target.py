"""L0: a kernel's (spec, arch, family, kind) is resolved once, by fa_gen.target, with the
registry's preference order, and render / runtime take the result as it is."""

from __future__ import annotations

import pytest

from fa_gen.errors import UnsupportedError
from fa_gen.render import render, render_target
from fa_gen.runtime import resolve_spec
from fa_gen.target import Target, resolve_target


def test_the_preferred_family_that_renders_the_kind():
    spec = resolve_spec("causal_bf16_d128")
    assert resolve_target(spec, "sm_90a").family.name == "sm90"
    assert resolve_target(spec, "sm_80").family.name == "sm80"
    # The Hopper family renders the whole-range varlen forward; the split and packed decode
    # kinds only the Ampere-class family does, so the Hopper GPU gets its.
    varlen = resolve_target(spec, "sm_90a", "forward_varlen")
    assert (varlen.family.name, varlen.kind) == ("sm90", "forward_varlen")
    split = resolve_target(spec, "sm_90a", "forward_varlen_split_pack4")
    assert (split.family.name, split.kind) == ("sm80", "forward_varlen_split_pack4")
    # A mask expression has no sm90 varlen kind (the refusal says why): the Ampere-class
    # family's, which applies the expression to every tile it visits, serves it.
    document = resolve_spec("document")
    with pytest.raises(UnsupportedError, match="mask expression"):
        resolve_target(document, "sm_90a", "forward_varlen", family="sm90")
    assert resolve_target(document, "sm_90a", "forward_varlen").family.name == "sm80"
    assert resolve_target(spec, "sm_90a", "forward", family="sm80").family.name == "sm80"


def test_refusals_name_every_family_and_what_it_renders():
    spec = resolve_spec("causal_bf16_d128")
    with pytest.raises(UnsupportedError) as refused:
        resolve_target(spec, "sm_90a", "no_such_kind")
    assert "sm90: renders no no_such_kind kernel" in str(refused.value)
    assert "sm80: renders no no_such_kind kernel" in str(refused.value)
    with pytest.raises(UnsupportedError, match="sm90"):
        resolve_target(spec, "sm_80", family="sm90")
    with pytest.raises(UnsupportedError, match="unknown family"):
        resolve_target(spec, "sm_80", family="sm99")


def test_render_takes_the_target_as_it_is():
    spec = resolve_spec("sliding_window_bf16_d128")
    target = resolve_target(spec, "sm_90a", "backward_varlen")
    assert isinstance(target, Target) and target.files == ("sm90/backward.py.j2", "backward_varlen.py")
    assert render_target(target).text == render(spec, "sm_90a", kind="backward_varlen").text
    forced = Target(spec, "sm_90a", resolve_target(spec, "sm_80").family, "forward")
    assert render_target(forced).family == "sm80"
