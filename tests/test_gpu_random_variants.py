"""L1: random mask and score-mod expressions, compiled into kernels, against the float64 reference.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_random_variants.py
Each example draws a spec (a mask expression, a score mod, or both, over the inputs of
tests/variant_grammar.py), a family that takes expressions on this GPU, a shape and input
values, compiles the kernel (or loads it from the cache) and checks it as every L1 test does.

The grammar is a small, numerically tame one: integer arithmetic without products (int32 in
the kernel, int64 in the reference: they agree while nothing overflows) and score mods
built from bounded or slowly growing functions (no exp or powers, which overflow float32 on
random scores and make both sides inf). Compiles cost seconds each, hence few examples.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen.check import Shape, check_kernel
from fa_gen.spec_load import load_spec
from fa_gen.variant.parse import names_written

from .variant_grammar import INPUTS, random_tensors
from .variants import cute_dsl_families

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

# Spec text of each input of the grammar (tests/variant_grammar.INPUTS), in the spec's YAML form.
INPUT_FIELDS = {d.name: ({"dtype": d.dtype, "shape": list(d.shape)} if not d.is_scalar else
                         {"scalar": d.dtype, "default": d.default, **({"min": d.min} if d.min is not None else {}),
                          **({"max": d.max} if d.max is not None else {})})
                for d in INPUTS}


def index_exprs(depth: int):
    leaves = st.one_of(st.sampled_from(["q_idx", "kv_idx", "b", "h", "w", "n", "seqlen_q", "seqlen_k",
                                        "qdoc[b, q_idx]", "kdoc[b, kv_idx]"]),
                       st.integers(-9, 300).map(lambda v: f"({v})"))
    if depth == 0:
        return leaves
    sub = index_exprs(depth - 1)
    return st.one_of(
        leaves,
        st.tuples(sub, st.sampled_from("+-"), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(sub, st.sampled_from(["//", "%"]), st.sampled_from(["w", "3", "64"])).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"),
        sub.map(lambda a: f"abs({a})"),
        st.tuples(st.sampled_from(["min", "max"]), sub, sub).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
    )


def mask_exprs(depth: int = 2):
    compare = st.tuples(index_exprs(1), st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), index_exprs(1)).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})")
    if depth == 0:
        return compare
    sub = mask_exprs(depth - 1)
    return st.one_of(compare,
                     st.tuples(sub, st.sampled_from(["and", "or"]), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
                     sub.map(lambda c: f"(not {c})"))


def score_exprs(depth: int = 2):
    leaves = st.one_of(st.sampled_from(["score", "s", "slopes[h]", "bias[h, q_idx, kv_idx]"]),
                       st.floats(-4, 4, allow_nan=False).map(lambda v: f"({v!r})"))
    if depth == 0:
        return leaves
    sub = score_exprs(depth - 1)
    scaled_index = index_exprs(1).map(lambda a: f"({a} * 0.01)")
    return st.one_of(
        leaves,
        st.tuples(sub, st.sampled_from("+-*"), st.one_of(sub, scaled_index)).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(["tanh", "abs"]), sub).map(lambda t: f"{t[0]}({t[1]})"),
        sub.map(lambda a: f"log(abs({a}) + 1.0)"),
        sub.map(lambda a: f"sqrt(abs({a}))"),
        st.tuples(st.sampled_from(["min", "max"]), sub, sub).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        st.tuples(mask_exprs(0), sub, sub).map(lambda t: f"where({t[0]}, {t[1]}, {t[2]})"),
    )


def _spec(mask: str | None, score_mod: str | None, dtype: str):
    """The spec of one drawn variant: only the inputs its expressions read are declared."""
    used = set()
    for text in (mask, score_mod):
        if text:
            used |= names_written(text)
    inputs = {name: fields for name, fields in INPUT_FIELDS.items() if name in used}
    fields = {"name": "random_variant", "dtype": dtype, "head_dim": 64}
    if inputs:
        fields["inputs"] = inputs
    if mask:
        fields["mask"] = {"expr": mask}
    if score_mod:
        fields["score_mod"] = {"expr": score_mod}
    return load_spec(fields)


variants = st.one_of(
    st.tuples(mask_exprs(), st.none()),
    st.tuples(st.none(), score_exprs()),
    st.tuples(mask_exprs(), score_exprs()),
)
shapes = st.builds(lambda b, sq, sk, hkv, ratio: Shape(b, sq, sk, hkv * ratio, hkv),
                   st.integers(1, 2), st.integers(1, 700), st.integers(1, 700), st.integers(1, 2), st.integers(1, 3))


@settings(max_examples=int(os.environ.get("FA_GEN_L1_RANDOM_EXPRESSIONS", "10")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(variant=variants, dtype=st.sampled_from(["bf16", "fp16"]), shape=shapes, seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_random_expression_kernels_match_reference(variant, dtype, shape, seed, data):
    from fa_gen.runtime import build

    from fa_gen.runtime import current_arch

    family = data.draw(st.sampled_from(cute_dsl_families(current_arch(), expressions=True)), label="family")
    spec = _spec(*variant, dtype)
    kernel = build(spec, family=family)
    generator = torch.Generator().manual_seed(seed)
    values = {name: value.cuda() for name, value in random_tensors(
        generator, shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k).items()
        if any(d.name == name for d in spec.inputs)}
    result = check_kernel(kernel, shape, seed=seed, inputs=values)
    assert result.ok, f"{family} mask={variant[0]} score_mod={variant[1]}: {result}"
