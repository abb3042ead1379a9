"""Expression specs in the CuTe DSL forward templates (sm80, sm90) (L0, CPU): what renders,
what is refused, and the per-call key-tile lists the runtime passes for mask expressions.

Compiling every shipped expression spec is test_compile's job (they are shipped specs);
exactness on a GPU is tests/test_gpu_variants.py.
"""

from __future__ import annotations

import pytest
import torch

from fa_gen import generate
from fa_gen.reference import visibility
from fa_gen.render import render
from fa_gen.spec_load import load_spec
from fa_gen.variant.emit_cute import emit_cute
from fa_gen.variant.parse import parse
from fa_gen.variant.language import Role
from fa_gen.variant.tiles import LIST_HEADER, LIST_PAD, classify_tiles, key_tile_lists
from tests.variants import variant_library_paths

EXPRESSION_SPECS = [s for s in generate.shipped_specs() if s.uses_expressions]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("spec", EXPRESSION_SPECS, ids=[s.name for s in EXPRESSION_SPECS])
def test_expression_specs_render_with_their_arguments(spec, arch):
    rendered = render(spec, arch)
    assert rendered.family == {"sm_80": "sm80", "sm_90a": "sm90"}[arch]
    text = rendered.text
    for decl in spec.inputs:
        assert f"x_{decl.name}: " in text, decl.name
    assert ("mTileList" in text) == (spec.mask_expr is not None)
    assert ("apply_score_mod" in text) == (spec.score_mod_expr is not None)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("spec", EXPRESSION_SPECS, ids=[s.name for s in EXPRESSION_SPECS])
def test_expression_specs_render_their_backward(spec, arch):
    """The backward takes the forward's inputs, the query-tile lists under a mask expression, and
    applies a score mod in place (constant derivative) or with its derivative in one pass."""
    assert any(p.name == "backward.py" for p in generate.expected_files(spec))
    text = render(spec, arch, kind="backward").text
    for decl in spec.inputs:
        assert f"x_{decl.name}: " in text, decl.name
    assert ("mTileList" in text) == (spec.mask_expr is not None)
    assert "mTileOrder" not in text
    varies = spec.name == "softcap"   # the shipped mod whose derivative is not a constant
    assert ("def probs_and_score_gradient" in text) == varies
    assert ("def apply_score_mod" in text) == (spec.score_mod_expr is not None and not varies)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_sink_logits_enter_the_final_normalisation(arch):
    text = render(load_spec(variant_library_paths()["sink_logit"]), arch).text
    assert "ops.x_sinks[ops.head]" in text and "sink[r] = " in text
    assert "top = cutlass.max(row_top, sink[r])" in text


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
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(100, 100), (70, 130), (130, 70), (96, 64)])
def test_key_tile_lists_visit_every_visible_key_and_mask_every_cut_tile(name, values, seqlen_q, seqlen_k):
    spec = load_spec(variant_library_paths()[name], check_archs=False)
    tile_m, tile_n = 16, 8
    num_n = -(-seqlen_k // tile_n)
    codes = classify_tiles(spec.mask_tree, spec.inputs, values, batch=2, heads_q=3, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, tile_m=tile_m, tile_n=tile_n)
    lists = key_tile_lists(codes, seqlen_k, tile_n)
    assert lists.shape == (1, 1, -(-seqlen_q // tile_m), LIST_HEADER + num_n + LIST_PAD)
    assert lists.dtype == torch.int32
    visible = visibility(spec, seqlen_q, seqlen_k, batch=2, heads_q=3, inputs=values)[0, 0]
    for m in range(lists.shape[2]):
        n_masked, n_visit, *tiles = (int(x) for x in lists[0, 0, m])
        listed, padding = tiles[:n_visit], tiles[n_visit:]
        assert padding == [-1] * len(padding) and len(set(listed)) == n_visit
        masked, whole = listed[:n_masked], listed[n_masked:]
        assert masked == sorted(masked, reverse=True) and whole == sorted(whole, reverse=True)
        rows = visible[m * tile_m:(m + 1) * tile_m]
        seen = [bool(rows[:, n * tile_n:(n + 1) * tile_n].any()) for n in range(num_n)]
        # Every tile holding a visible key is visited; a tile visited without a mask holds only
        # visible keys; a tile holding the seqlen_k tail takes the mask and comes first.
        assert {n for n in range(num_n) if seen[n]} <= set(listed), m
        for n in whole:
            assert rows[:, n * tile_n:(n + 1) * tile_n].all(), (m, n)
            assert (n + 1) * tile_n <= seqlen_k
        if seqlen_k % tile_n and num_n - 1 in listed:
            assert listed[0] == num_n - 1
