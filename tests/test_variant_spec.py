"""The spec grammar's variant fields: inputs, mask/score_mod/sink expressions, identity, the library (L0, CPU)."""

from __future__ import annotations

import pytest

from fa_gen.errors import SpecError
from fa_gen.paths import specs_dir
from fa_gen.schema import json_schema
from fa_gen.spec import MaskKind
from fa_gen.spec_load import load_spec, parse_yaml, spec_from_yaml_text
from fa_gen.variant.inputs import InputDecl
from tests.variants import variant_library_paths

LIBRARY_PATHS = list(variant_library_paths().values())
LIBRARY = ("alibi", "alibi_supplied", "attention_sinks", "chunked_causal", "document", "prefix_lm",
           "relative_bias", "sink_logit", "sliding_window_causal", "softcap")
BASE = "name: v\ndtype: bf16\nhead_dim: 128\n"  # lines 1-3 of every spec below


def load_text(text: str, **kw):
    return spec_from_yaml_text(BASE + text, path="specs/v.yaml", check_archs=False, **kw)


# --- the library -------------------------------------------------------------------------------------

def test_library_holds_every_named_variant():
    assert tuple(p.stem for p in LIBRARY_PATHS) == LIBRARY


@pytest.mark.parametrize("path", LIBRARY_PATHS, ids=[p.stem for p in LIBRARY_PATHS])
def test_library_spec_loads_and_fits_the_schema(path):
    spec = load_spec(path, check_archs=False)
    assert spec.name == path.stem and spec.uses_expressions
    # Unshipped library specs name no archs; shipped ones (specs/) name the archs CI compiles.
    assert (spec.archs == ()) == (path.parent.name == "library")
    assert path.read_text().startswith("# "), "each library spec opens with a one-line comment"
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(json_schema()).validate(parse_yaml(path.read_text()))


# --- inputs ----------------------------------------------------------------------------------------------

def test_inputs_load_sorted_and_typed():
    spec = load_text('mask: {expr: "kv_idx < q_idx + w + z[h] + t[b, 3]"}\ninputs:\n'
                     "  w: {scalar: int, default: 2, min: 0, max: 9}\n"
                     "  z: {shape: [heads_q], dtype: int32, min: -4}\n"
                     "  t: {shape: [batch, 4], dtype: int32}\n")
    assert spec.inputs == (InputDecl("t", "int32", ("batch", 4)), InputDecl("w", "int", None, default=2, min=0, max=9),
                           InputDecl("z", "int32", ("heads_q",), min=-4))
    soft = load_text('score_mod: {expr: "c * tanh(score / c)"}\ninputs:\n  c: {scalar: float, default: 30}\n')
    assert soft.inputs[0].default == 30.0 and isinstance(soft.inputs[0].default, float)


# (text after BASE, line of the error, field, a piece of the message)
INVALID = [
    ('mask: {expr: "kv_idx < q_idx", kind: causal}\n', 4, "mask.kind", "not allowed with expr"),
    ('mask: {expr: "kv_idx < q_idx", alignment: top_left}\n', 4, "mask.alignment", "not allowed with expr"),
    ('mask: {expr: "kv_idx < q_idx", exp: 1}\n', 4, "mask.exp", "unknown key 'exp' (did you mean 'expr'?)"),
    ("mask: {expr: 3}\n", 4, "mask.expr", "expected an expression (a string), got 3 (an integer)"),
    ('mask: {expr: ""}\n', 4, "mask.expr", "got an empty string"),
    ("mask: {kind: expr}\n", 4, "mask.kind", "'expr' is not allowed; allowed: none, causal, sliding_window"),
    ("mask: expr\n", 4, "mask", "allowed: none, causal, sliding_window"),
    ('score_mod: "score * 2.0"\n', 4, "score_mod", 'expected a mapping {expr: "..."}'),
    ('score_mod: {exp: "score"}\n', 4, "score_mod.exp", "did you mean 'expr'?"),
    ("score_mod: {}\n", 4, "score_mod.expr", "required key is missing"),
    ('score_mod:\n  expr: "kv_idx < 3"\n', 5, "score_mod.expr", "column 10: a score_mod must be a float"),
    ('sink: {expr: "kv_idx * 1.0"}\n', 4, "sink.expr", "column 15: 'kv_idx' is not defined in a sink expression"),
    ("inputs: []\n", 4, "inputs", "expected a mapping of input name -> declaration"),
    ('mask: {expr: "q_idx < 3"}\ninputs:\n  w: {scalar: int}\n', 6, "inputs.w", "declared but no expression reads it"),
    ('mask: {expr: "q_idx < 3"}\ninputs:\n  kv_idx: {scalar: int}\n', 6, "inputs.kv_idx", "is a built-in name"),
    ('mask: {expr: "q_idx < 3"}\ninputs:\n  Doc: {scalar: int}\n', 6, "inputs.Doc", "is not a valid name"),
    ('mask: {expr: "q_idx < w"}\ninputs:\n  w: {scalar: double}\n', 6, "inputs.w.scalar",
     "'double' is not allowed; allowed: int, float"),
    ('mask: {expr: "q_idx < w"}\ninputs:\n  w: {scalar: int, default: 1.5}\n', 6, "inputs.w.default",
     "expected an integer, got 1.5 (a float)"),
    ('mask: {expr: "q_idx < w"}\ninputs:\n  w: {scalar: int, default: 0, min: 1}\n', 6, "inputs.w.default",
     "0 is outside its declared min 1"),
    ('mask: {expr: "q_idx < w"}\ninputs:\n  w: {scalar: int, min: 5, max: 1}\n', 6, "inputs.w.max", "1 is below min 5"),
    ('mask: {expr: "q_idx < w"}\ninputs:\n  w: {scalar: int, default: 3, defualt: 4}\n', 6, "inputs.w.defualt",
     "did you mean 'default'?"),
    ('mask: {expr: "q_idx < w"}\ninputs:\n  w: 3\n', 6, "inputs.w", "expected {shape: [...], dtype: ...} for a tensor"),
    ('mask: {expr: "d[b] > 0"}\ninputs:\n  d: {shape: [batch], dtype: int64}\n', 6, "inputs.d.dtype",
     "'int64' is not allowed (did you mean 'int32'?); allowed: int32, float32, float16, bfloat16"),
    ('mask: {expr: "d[b] > 0"}\ninputs:\n  d: {shape: [batch]}\n', 6, "inputs.d.dtype", "required key is missing"),
    ('mask: {expr: "d[b] > 0"}\ninputs:\n  d:\n    shape: [batch, seqlen]\n    dtype: int32\n', 7,
     "inputs.d.shape[1]", "did you mean 'seqlen_q'?"),
    ('mask: {expr: "d[b] > 0"}\ninputs:\n  d:\n    shape:\n      - batch\n      - 0\n    dtype: int32\n', 9,
     "inputs.d.shape[1]", "0 is not allowed; allowed: batch, heads_q, seqlen_q, seqlen_k or an integer >= 1"),
    ('mask: {expr: "d[b] > 0"}\ninputs:\n  d: {shape: [batch, batch], dtype: int32}\n', 6, "inputs.d.shape[1]",
     "batch appears twice"),
    ('mask: {expr: "d[b] > 0"}\ninputs:\n  d: {shape: [], dtype: int32}\n', 6, "inputs.d.shape", "got an empty list"),
    ('mask: {expr: "d[b] > 0"}\ninputs:\n  d: {shape: [batch], dtype: float32, min: a}\n', 6, "inputs.d.min",
     "expected a finite number, got 'a' (a string)"),
    ('mask: {expr: "q_idx < w"}\ninputs:\n  w: {scalar: int}\n  w: {scalar: int}\n', 7, "inputs.w", "duplicate key"),
]


@pytest.mark.parametrize("text, line, field, fragment", INVALID, ids=[f"{f}:{frag[:24]}" for _, _, f, frag in INVALID])
def test_invalid_variant_field_names_line_and_field(text, line, field, fragment):
    with pytest.raises(SpecError) as caught:
        load_text(text)
    error = caught.value
    assert (error.line, error.field) == (line, field), str(error)
    assert str(error).startswith(f"specs/v.yaml:{line}: {field}: ") and fragment in str(error), str(error)


def test_an_input_written_in_a_branch_that_folds_away_may_be_declared():
    # The folded tree no longer reads kdoc, but the text names it: undeclared it would be an
    # unknown name, so declaring it cannot be an error either.
    spec = load_text('mask: {expr: "where(1 > 2, kdoc[b, kv_idx] == 0, kv_idx <= q_idx)"}\ninputs:\n'
                     "  kdoc: {shape: [batch, seqlen_k], dtype: int32}\n")
    assert [d.name for d in spec.inputs] == ["kdoc"]


# --- archs and identity ------------------------------------------------------------------------------------

def test_check_archs_off_keeps_listed_archs_in_registry_order():
    spec = load_text('mask: {expr: "kv_idx <= q_idx"}\narchs: [sm_90a, sm_80]\n')
    assert spec.archs == ("sm_80", "sm_90a") and spec.mask is MaskKind.EXPR
    with pytest.raises(SpecError, match="unknown arch"):
        load_text('mask: {expr: "kv_idx <= q_idx"}\narchs: [sm_99]\n')


def test_expressionless_specs_keep_their_canonical_fields():
    # The fields of spec version 1: cache keys of every existing spec stay what they were.
    old_keys = {"spec_version", "name", "dtype", "head_dim_qk", "head_dim_v", "mask", "window_left", "window_right",
                "alignment", "softmax_scale", "archs", "return_lse", "tuning"}
    for path in specs_dir().glob("*.yaml"):
        spec = load_spec(path)
        if not spec.uses_expressions:
            # fp8 specs (added later) name their output dtype as well.
            assert set(spec.to_dict()) == old_keys | ({"out_dtype"} if spec.is_fp8 else set()), path


def test_identity_follows_meaning_not_spelling():
    a = load_text('mask: {expr: "kv_idx<=q_idx  and (kv_idx > q_idx - w)"}\ninputs:\n  w: {scalar: int, default: 4}\n')
    b = load_text('mask:\n  expr: |\n    kv_idx <= q_idx\n    and kv_idx > q_idx - w\n'
                  "inputs:\n  w:\n    scalar: int\n    default: 4\n")
    assert a == b and a.sha256() == b.sha256()
    assert a.mask_expr == "kv_idx <= q_idx and kv_idx > q_idx - w"
    c = load_text('mask: {expr: "kv_idx <= q_idx and kv_idx > q_idx - w"}\ninputs:\n  w: {scalar: int, default: 5}\n')
    d = load_text('mask: {expr: "kv_idx <= q_idx and kv_idx >= q_idx - w"}\ninputs:\n  w: {scalar: int, default: 4}\n')
    assert len({a.sha256(), c.sha256(), d.sha256()}) == 3
    assert a.to_dict()["inputs"] == {"w": {"scalar": "int", "default": 4}}


def test_trees_come_from_the_canonical_text():
    spec = load_text('score_mod: {expr: "score - s[h] * abs(q_idx - kv_idx)"}\nsink: {expr: "s[h] * 0.5"}\n'
                     "inputs:\n  s: {shape: [heads_q], dtype: float32}\n")
    assert spec.score_mod_tree.type.value == "float" and spec.sink_tree is not None and spec.mask_tree is None
    assert spec.is_masked is False and spec.uses_expressions


@pytest.mark.parametrize("mapping", [
    {"mask": {"expr": "kv_idx < q_idx", "kind": "causal"}},
    {"mask": {"kind": "expr"}},
    {"score_mod": {"expr": "score", "extra": 1}},
    {"inputs": {"w": {"scalar": "int", "shape": [4]}}},
    {"inputs": {"w": {"shape": ["seqlen"], "dtype": "int32"}}},
    {"inputs": {"W": {"scalar": "int"}}},
], ids=["expr_with_kind", "kind_expr", "score_mod_extra_key", "scalar_with_shape", "bad_symbol", "bad_name"])
def test_schema_rejects_what_the_loader_rejects(mapping):
    jsonschema = pytest.importorskip("jsonschema")
    full = {"name": "a", "dtype": "bf16", "head_dim": 128, **mapping}
    with pytest.raises(SpecError):
        load_spec(full, check_archs=False)
    assert not jsonschema.Draft202012Validator(json_schema()).is_valid(full)
