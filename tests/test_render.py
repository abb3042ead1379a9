"""Rendering: every shipped spec renders for every arch it names, and generated/ is in sync."""

import ast

import pytest

from fa_gen import generate
from fa_gen.render import render

SHIPPED = generate.shipped_specs()


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda s: s.name)
def test_shipped_spec_renders_valid_python(spec):
    for arch in spec.archs:
        rendered = render(spec, arch)
        if rendered.filename.endswith(".cu"):  # CUDA C++ for NVRTC: compiled by test_compile
            assert "fa_gen_forward" in rendered.text and "// fa_gen-launch: {" in rendered.text
            continue
        ast.parse(rendered.text)  # rendered code is Python the DSL can read
        assert "FlashAttentionForward" in rendered.text and "def compile_arguments" in rendered.text


def test_generated_is_in_sync():
    stale = generate.stale_files()
    assert not stale, "generated/ drifted from specs + templates; run `fa-gen generate`:\n" + "\n".join(stale)


def test_renders_differ_where_specs_differ():
    # A render that ignored the spec would make every shipped spec's source identical.
    texts = {render(spec, spec.archs[0]).text for spec in SHIPPED}
    assert len(texts) == len(SHIPPED)
