"""Expression specs in the sm80 forward template (L0, CPU): what renders, what is refused,
and the per-call key-tile ranges the runtime passes for mask expressions.

Compiling every shipped expression spec is test_compile's job (they are shipped specs);
exactness on a GPU is tests/test_gpu_variants.py.
"""

from __future__ import annotations

import pytest
import torch

from fa_gen import generate
from fa_gen.errors import SpecError
from fa_gen.reference import visibility
from fa_gen.render import render
from fa_gen.spec_load import load_spec
from fa_gen.variant.emit_cute import emit_cute
from fa_gen.variant.parse import parse
from fa_gen.variant.language import Role
from fa_gen.variant.tiles import classify_tiles, key_tile_ranges
from tests.variants import variant_library_paths

EXPRESSION_SPECS = [s for s in generate.shipped_specs() if s.uses_expressions]


@pytest.mark.parametrize("spec", EXPRESSION_SPECS, ids=[s.name for s in EXPRESSION_SPECS])
def test_expression_specs_render_with_their_arguments(spec):
    text = render(spec, "sm_80").text
    for decl in spec.inputs:
        assert f"x_{decl.name}: " in text, decl.name
    assert ("mTileRange" in text) == (spec.mask_expr is not None)
    assert ("apply_score_mod" in text) == (spec.score_mod_expr is not None)


def test_expression_specs_render_no_backward():
    spec = EXPRESSION_SPECS[0]
    assert list(generate.expected_files(spec)) and all(p.name == "forward.py" for p in generate.expected_files(spec))


def test_sink_logits_are_refused_with_a_reason():
    with pytest.raises(SpecError, match="sink logits"):
        load_spec(variant_library_paths()["sink_logit"])


def test_loop_invariant_division_becomes_a_hoisted_reciprocal():
    tree = parse("softcap * tanh(score / softcap)", Role.SCORE_MOD, load_spec(
        variant_library_paths()["softcap"]).inputs)
    names = {"score": "score", "softcap": "c"}
    code = emit_cute(tree, names, levels=[{"q_idx"}, {"kv_idx", "score"}], fastmath=True)
    assert code.bindings[0] == (("vx_0", "(Float32(1.0) / c)"),)
    assert "score * vx_0" in code.expr and "/" not in code.expr
    exact = emit_cute(tree, names, levels=[{"q_idx"}, {"kv_idx", "score"}])
    assert "(score / c)" in exact.expr


@pytest.mark.parametrize("name, values", [("sliding_window_causal", {"window": 20}),
                                          ("chunked_causal", {"chunk": 24}),
                                          ("attention_sinks", {"window": 30, "sink_tokens": 3})])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(100, 100), (70, 130), (130, 70)])
def test_key_tile_ranges_hold_every_visible_key(name, values, seqlen_q, seqlen_k):
    spec = load_spec(variant_library_paths()[name], check_archs=False)
    tile_m, tile_n = 16, 8
    codes = classify_tiles(spec.mask_tree, spec.inputs, values, batch=2, heads_q=3, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, tile_m=tile_m, tile_n=tile_n)
    ranges = key_tile_ranges(codes, 2, 3)
    assert ranges.shape == (2, 3, -(-seqlen_q // tile_m), 2) and ranges.dtype == torch.int32
    visible = visibility(spec, seqlen_q, seqlen_k, batch=2, heads_q=3, inputs=values)
    keys = torch.arange(seqlen_k)
    for m in range(ranges.shape[2]):
        lo, hi = (int(x) for x in ranges[0, 0, m])
        rows = visible[0, 0, m * tile_m:(m + 1) * tile_m]
        inside = (keys >= lo * tile_n) & (keys < hi * tile_n)
        assert not (rows & ~inside).any(), (m, lo, hi)
        if rows.any():  # tight at the ends: the first and last tile of the range hold a visible key
            seen = rows.any(dim=0)
            assert seen[lo * tile_n:(lo + 1) * tile_n].any() and seen[(hi - 1) * tile_n:hi * tile_n].any()
