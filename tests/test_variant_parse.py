"""Parsing expressions: the whitelist, the types, folding, and errors that point at line and column (L0, CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen.errors import SpecError
from fa_gen.spec_load import spec_from_yaml_text
from fa_gen.variant import ExprError, Role, canonical, parse
from fa_gen.variant.tree import Binary, Call, Compare, Const, Logic, Name, ToFloat, Type
from tests.variant_grammar import INPUTS, conditions, float_exprs, parse_or_reject

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
texts_by_role = st.one_of(conditions().map(lambda t: (t, Role.MASK)),
                          float_exprs().map(lambda t: (t, Role.SCORE_MOD)))


# --- valid text ------------------------------------------------------------------------------------

@FAST
@given(case=texts_by_role, data=st.data())
def test_layout_does_not_change_the_tree_or_the_canonical_text(case, data):
    text, role = case
    tree = parse_or_reject(text, role)
    # Same expression, other spacing and line breaks (as a YAML block would hold it).
    spaced = "".join(c + data.draw(st.sampled_from(["", " ", "\n  "])) if c in ", " else c for c in text)
    assert parse(spaced, role, INPUTS) == tree
    assert parse(f"  {text}\n", role, INPUTS) == tree
    assert canonical(spaced) == canonical(text)
    assert parse(canonical(text), role, INPUTS) == tree
    assert canonical(canonical(text)) == canonical(text)


def test_types_and_promotions():
    tree = parse("score * 2 + h", Role.SCORE_MOD)
    assert tree == Binary(Type.FLOAT, "+", Binary(Type.FLOAT, "*", Name(Type.FLOAT, "score"), Const(Type.FLOAT, 2.0)),
                          ToFloat(Type.FLOAT, Name(Type.INT, "h")))
    assert parse("q_idx // 2 == 3", Role.MASK).left.type is Type.INT
    assert parse("kv_idx <= q_idx", Role.MASK).type is Type.BOOL


@pytest.mark.parametrize("text, folded", [
    ("kv_idx < -8", Compare(Type.BOOL, "<", Name(Type.INT, "kv_idx"), Const(Type.INT, -8))),
    ("kv_idx < 2 ** 3 - 7 // 2", Compare(Type.BOOL, "<", Name(Type.INT, "kv_idx"), Const(Type.INT, 5))),
    ("kv_idx < q_idx and True", Compare(Type.BOOL, "<", Name(Type.INT, "kv_idx"), Name(Type.INT, "q_idx"))),
    ("kv_idx < q_idx or 1 > 0", Const(Type.BOOL, True)),
    ("where(3 > 4, q_idx, kv_idx) > 0", Compare(Type.BOOL, ">", Name(Type.INT, "kv_idx"), Const(Type.INT, 0))),
    ("not (1 < 2) or q_idx > 0", Compare(Type.BOOL, ">", Name(Type.INT, "q_idx"), Const(Type.INT, 0))),
    ("-7 % 3 == q_idx", Compare(Type.BOOL, "==", Const(Type.INT, 2), Name(Type.INT, "q_idx"))),  # Python's %
])
def test_constants_fold_with_python_semantics(text, folded):
    assert parse(text, Role.MASK) == folded


def test_chained_comparison_is_a_conjunction():
    tree = parse("0 <= kv_idx - q_idx < 4", Role.MASK)
    assert isinstance(tree, Logic) and tree.op == "and" and [c.op for c in tree.operands] == ["<=", "<"]


def test_functions():
    tree = parse("max(q_idx, kv_idx, 3) > abs(q_idx - kv_idx)", Role.MASK)
    assert isinstance(tree.left, Call) and len(tree.left.args) == 3 and tree.right.func == "abs"
    assert parse("tanh(h)", Role.SINK).args[0] == ToFloat(Type.FLOAT, Name(Type.INT, "h"))


# --- errors: message and column --------------------------------------------------------------------

# (text, role, column of the error, a piece of the message)
ERRORS = [
    ("kv_idx <= q_id", Role.MASK, 11, "name 'q_id' is not defined (did you mean 'q_idx'?); allowed names: b, h,"),
    ("   kv_idx <= q_id", Role.MASK, 14, "name 'q_id' is not defined"),  # leading spaces count, and parse
    ("kv_idx < window", Role.MASK, 10, "allowed names: b, h, q_idx, kv_idx, seqlen_q, seqlen_k, heads_q, bias"),
    ("score > 0", Role.MASK, 1, "'score' is only defined in score_mod"),
    ("score + kv_idx * 1.0", Role.SINK, 1, "'score' is only defined in score_mod"),
    ("kv_idx * 1.0", Role.SINK, 1, "'kv_idx' is not defined in a sink expression"),
    ("kv_idx < q_idx &", Role.MASK, 17, "invalid syntax"),
    ("kv_idx < q_idx & kv_idx > 0", Role.MASK, 16, "'&' is not allowed; write 'and'"),
    ("kv_idx < q_idx | kv_idx > 0", Role.MASK, 16, "'|' is not allowed; write 'or'"),
    ("~(kv_idx < q_idx)", Role.MASK, 1, "'~' is not allowed; write 'not'"),
    ("q_idx is kv_idx", Role.MASK, 7, "'is' is not allowed; write '=='"),
    ("kv_idx if q_idx else 0", Role.MASK, 1, "write where(cond, a, b)"),
    ("q_idx.real < 3", Role.MASK, 1, "attribute access is not allowed"),
    ("'a' == kv_idx", Role.MASK, 1, "a string is not allowed"),
    ("kv_idx < len(q_idx)", Role.MASK, 10, "function 'len' is not allowed; allowed functions: where, abs"),
    ("tan(score)", Role.SCORE_MOD, 1, "(did you mean 'tanh'?)"),
    ("min(q_idx) < 3", Role.MASK, 1, "min() takes at least 2 argument(s), got 1"),
    ("where(q_idx, 1, 2) > 0", Role.MASK, 7, "'where's first argument' takes conditions; 'q_idx' is an int"),
    ("where(q_idx > 0, 1, q_idx < 2)", Role.MASK, 18, "both branches to be conditions or both numbers"),
    ("abs(x=q_idx) > 0", Role.MASK, 1, "positional arguments only"),
    ("kv_idx", Role.MASK, 1, "a mask must be a condition (e.g. kv_idx <= q_idx); 'kv_idx' is an int"),
    ("kv_idx < q_idx * 0.5", Role.MASK, 10, "masks are integer-only"),
    ("kv_idx / 2 < q_idx", Role.MASK, 1, "'kv_idx / 2' is a float"),
    ("score > 0", Role.SCORE_MOD, 1, "a score_mod must be a float (a logit); 'score > 0' is a condition"),
    ("h + 1", Role.SINK, 1, "a sink must be a float (a logit); 'h + 1' is an int"),
    ("(kv_idx < 3) + 1 > 0", Role.MASK, 2, "'+' takes numbers; 'kv_idx < 3' is a condition"),
    ("kv_idx and q_idx", Role.MASK, 1, "'and' takes conditions; 'kv_idx' is an int"),
    ("q_idx // kv_idx > 0", Role.MASK, 10, "the divisor of '//' must be known to be >= 1"),
    ("q_idx % n > 0", Role.MASK, 9, "'n' may lie in [-inf, inf]"),
    ("score // 2.0", Role.SCORE_MOD, 1, "'//' takes integers; 'score' is a float"),
    ("kv_idx ** q_idx > 0", Role.MASK, 1, "'**' takes a positive constant base"),
    ("kv_idx < 2 ** 40", Role.MASK, 10, "'2 ** 40' is a float"),
    ("kv_idx < 3000000000", Role.MASK, 10, "3000000000 does not fit in a 32-bit integer"),
    ("kv_idx < 1 // 0", Role.MASK, 15, "the divisor of '//' must be known to be >= 1"),
    ("log(0.0) + score", Role.SCORE_MOD, 1, "'log(0.0)': log has no value here"),
    ("score + 1e400", Role.SCORE_MOD, 9, "1e400 is not a finite number"),
    ("bias > 0", Role.SCORE_MOD, 1, "'bias' is a tensor input: read one element, e.g. bias[h, q_idx, kv_idx]"),
    ("bias[h, q_idx] + score", Role.SCORE_MOD, 1, "'bias' has 3 dimension(s) (heads_q, seqlen_q, seqlen_k); got 2"),
    ("bias[h, kv_idx, q_idx] + score", Role.SCORE_MOD, 9, "dimension 1 of 'bias' is seqlen_q, so its index must be q_idx"),
    ("tab[q_idx] > 0", Role.MASK, 5, "index 0 of 'tab' must lie in [0, 7], but 'q_idx' may lie in [0, inf]"),
    ("tab[min(kv_idx - q_idx, 7)] > 0", Role.MASK, 5, "'min(kv_idx - q_idx, 7)' may lie in [-inf, 7]"),
    ("tab[0:2] > 0", Role.MASK, 5, "slices are not allowed"),
    ("tab[score] > 0", Role.SCORE_MOD, 5, "an index must be an integer; 'score' is a float"),
    ("w[0] > 0", Role.MASK, 1, "'w' is a scalar input; only declared tensor inputs can be indexed"),
    ("q_idx[0] > 0", Role.MASK, 1, "'q_idx' is not a tensor input"),
    ("   ", Role.MASK, 1, "the expression is empty"),
    ("[q_idx] == 0", Role.MASK, 1, "a list is not allowed"),
]


@pytest.mark.parametrize("text, role, column, fragment", ERRORS, ids=[e[0] for e in ERRORS])
def test_error_names_the_column(text, role, column, fragment):
    with pytest.raises(ExprError) as caught:
        parse(text, role, INPUTS)
    error = caught.value
    assert error.column == column and error.expr_line == 1, str(error)
    assert fragment in str(error)
    assert str(error).startswith(f"column {column}: ")


# A bad piece placed at a known offset of a valid expression: (piece, offset of the error in it).
BAD_PIECES = [("kv_idy > 0", 0), ("q_idx > 0 & kv_idx > 1", 10), ("q_idx.real > 0", 0), ("'a' == 1", 0),
              ("q_idx is 3", 6), ("tab[q_idx] > 0", 4), ("sin(q_idx) > 0", 0), ("score < 1", 0)]


@FAST
@given(good=conditions(), bad=st.sampled_from(BAD_PIECES), before=st.booleans(), breaks=st.data())
def test_error_points_at_line_and_column_of_the_bad_piece(good, bad, before, breaks):
    piece, at = bad
    text, offset = (f"({piece}) or ({good})", 1 + at) if before else (f"({good}) and ({piece})", len(good) + 8 + at)
    # Break lines at some spaces of the good part: the reported line and column follow.
    chars = list(text)
    for i, c in enumerate(chars):
        if c == " " and not (offset - 2 <= i <= offset + len(piece)) and breaks.draw(st.booleans()):
            chars[i] = "\n"
    text = "".join(chars)
    with pytest.raises(ExprError) as caught:
        parse(text, Role.MASK, INPUTS)
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    assert (caught.value.expr_line, caught.value.column) == (line, column), (text, str(caught.value))


# --- errors in a YAML spec: file, line and column ----------------------------------------------------

STYLES = ("plain", "single", "double", "flow", "block")


def _mask_lines(expr: str, style: str, indent: int) -> tuple[list[str], int, int]:
    """`mask:` with `expr` written in `style`; (lines, line offset of the error from the mask line, its
    column), the error being the name kv_idy, which the block style puts at the start of its own line."""
    at = expr.index("kv_idy")
    pad = " " * indent
    if style == "flow":
        return [f'mask: {{expr: "{expr}"}}'], 0, len('mask: {expr: "') + at + 1
    if style == "block":
        return ["mask:", f"{pad}expr: |", f"{pad}  {expr[:at]}", f"{pad}  {expr[at:]}"], 3, indent + 3
    quote = {"plain": "", "single": "'", "double": '"'}[style]
    return ["mask:", f"{pad}expr: {quote}{expr}{quote}"], 1, indent + len("expr: ") + len(quote) + at + 1


def _flow(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_flow, value)) + "]"
    return str(value)


@FAST
@given(good=conditions(), style=st.sampled_from(STYLES), preamble=st.integers(0, 3), indent=st.integers(2, 6))
def test_yaml_error_points_at_file_line_and_column(good, style, preamble, indent):
    mask, line_offset, column = _mask_lines(f"({good}) and kv_idy > w", style, indent)
    lines = ["# a spec"] * preamble + ["name: x", "dtype: bf16", "head_dim: 128"]
    mask_line = len(lines) + 1
    lines += mask + ["inputs:"] + [f"  {d.name}: {_flow(d.to_dict())}" for d in INPUTS]
    text = "\n".join(lines) + "\n"
    with pytest.raises(SpecError) as caught:
        spec_from_yaml_text(text, path="specs/m.yaml", check_archs=False)
    want = (f"specs/m.yaml:{mask_line + line_offset}: mask.expr: column {column}: "
            "name 'kv_idy' is not defined (did you mean 'kv_idx'?)")
    assert str(caught.value).startswith(want), (str(caught.value), text)


def test_folded_scalar_gives_the_column_within_the_expression():
    text = "name: x\ndtype: bf16\nhead_dim: 128\nmask:\n  expr: >\n    kv_idx <= q_idx\n    and kv_idy > 0\n"
    with pytest.raises(SpecError, match=r"^s.yaml:5: mask.expr: column 21 of the expression: name 'kv_idy'"):
        spec_from_yaml_text(text, path="s.yaml", check_archs=False)


def test_mapping_source_gives_the_column_within_the_expression():
    from fa_gen.spec_load import load_spec

    with pytest.raises(SpecError) as caught:
        load_spec({"name": "x", "dtype": "bf16", "head_dim": 128, "mask": {"expr": "kv_idx <= q_id"}},
                  check_archs=False)
    assert str(caught.value).startswith("mask.expr: column 11: name 'q_id' is not defined")


def test_import_does_not_pull_in_torch():
    code = "import sys, fa_gen, fa_gen.variant, fa_gen.spec_load; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- size limits: clear errors, never a RecursionError ---------------------------------------

@pytest.mark.parametrize("text,message", [
    (" + ".join(["score"] * 100), "nested more than 64 levels deep"),         # a long chain
    ("-" * 80 + "score", "nested more than 64 levels deep"),                  # unary minus after minus
    (" + ".join(["score"] * 5000), "too large or nested too deeply to parse"),  # past Python's parser
    ("-" * 5000 + "score", "too large or nested too deeply to parse"),
    ("(" * 300 + "score" + ")" * 300, "too many nested parentheses"),
])
def test_oversized_expressions_are_spec_errors(text, message):
    with pytest.raises(ExprError, match=message):
        parse(text, Role.SCORE_MOD)


def test_too_many_parts_is_a_spec_error():
    # Balanced (shallow) but large: 2048 leaves in a tree of depth 12.
    parts = ["score"] * 2048
    while len(parts) > 1:
        parts = [f"({a} + {b})" for a, b in zip(parts[::2], parts[1::2])]
    with pytest.raises(ExprError, match="more than 2000 parts"):
        parse(parts[0], Role.SCORE_MOD)


def test_the_limits_leave_room_for_real_variants():
    from fa_gen.variant import language as lang

    chain = " + ".join(f"{i}.0 * score" for i in range(30))  # 59 levels
    assert parse(chain, Role.SCORE_MOD) is not None
    assert lang.MAX_EXPR_DEPTH * 10 < sys.getrecursionlimit()  # every pass recurses well within it


def test_a_spec_with_an_oversized_expression_says_where():
    text = "name: x\ndtype: bf16\nhead_dim: 128\nscore_mod:\n  expr: " + " + ".join(["score"] * 100) + "\n"
    with pytest.raises(SpecError, match=r"score_mod\.expr: .*64 levels deep"):
        spec_from_yaml_text(text)


@pytest.mark.parametrize("text,message", [
    ("score - 1e38 * 10", "not a finite float32"), ("score * exp(100.0)", "not a finite float32"),
    ("score + 3.5e38", "not a finite float32"), ("score / 0.0", "divides by zero"),
    ("score / (2.0 - 2.0)", "divides by zero"),
])
def test_constants_a_kernel_cannot_hold_are_spec_errors(text, message):
    """float32 kernels would hold inf (and the softmax NaN) where the float64 reference is finite."""
    with pytest.raises(ExprError, match=message):
        parse(text, Role.SCORE_MOD)
    assert parse("score - 1e30", Role.SCORE_MOD) is not None  # a large finite stand-in for -inf is fine
