"""The two emitters against an independent evaluation of the same tree (L0, CPU).

emit_torch is checked on random expressions at random points against `py_eval`
(plain Python). emit_cute's text is checked for what it may reference, and then run:
the CuTe DSL JIT-compiles a @cute.jit function for the host CPU, so the emitted
Int32/Float32 arithmetic (flooring `//`, truncating `%` fixed up, selects, & | ~)
is executed by the DSL itself and compared with the same evaluation.
"""

from __future__ import annotations

import ast
import importlib.util
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fa_gen.variant import Role, parse
from fa_gen.variant.emit_cute import emit_cute
from fa_gen.variant.emit_torch import emit_torch
from fa_gen.variant.tree import Type, walk
from tests.variant_grammar import (INPUTS, Undefined, conditions, float_exprs, int_exprs, parse_or_reject, py_eval,
                                   random_tensors)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCALARS = {"w": 3, "n": -2, "s": 0.75}
TENSOR_INPUTS = [d.name for d in INPUTS if not d.is_scalar]


def _points(seed: int, count: int):
    """`count` random points: sizes, per-point indices (as int64 vectors), scalars, tensors, scores."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads_q = (int(x) for x in torch.randint(1, 4, (2,), generator=gen))
    seqlen_q, seqlen_k = (int(x) for x in torch.randint(1, 41, (2,), generator=gen))
    env = {"seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "heads_q": heads_q, **SCALARS}
    env.update(random_tensors(gen, batch, heads_q, seqlen_q, seqlen_k))
    for name, high in (("b", batch), ("h", heads_q), ("q_idx", seqlen_q), ("kv_idx", seqlen_k)):
        env[name] = torch.randint(0, high, (count,), generator=gen)
    env["score"] = torch.randn(count, generator=gen, dtype=torch.float64) * 4
    return env


def _at(env: dict, i: int) -> dict:
    return {k: (v[i].item() if k in ("b", "h", "q_idx", "kv_idx", "score") else v) for k, v in env.items()}


def _magnitude(tree, point) -> float:
    """The largest value any subexpression takes: float tolerances scale with it."""
    biggest = 1.0
    for node in walk(tree):
        if node.type is not Type.BOOL:
            biggest = max(biggest, abs(py_eval(node, point)))
    return biggest


texts_by_role = st.one_of(
    conditions().map(lambda t: (t, Role.MASK)),
    int_exprs().map(lambda t: (f"{t} * 1.0", Role.SCORE_MOD)),  # an int tree under one promotion
    float_exprs().map(lambda t: (t, Role.SCORE_MOD)),
)


@FAST
@given(case=texts_by_role, seed=st.integers(0, 2 ** 31))
def test_torch_emitter_matches_python_evaluation(case, seed):
    text, role = case
    tree = parse_or_reject(text, role)
    env = _points(seed, 16)
    got = emit_torch(tree)(env).expand(16)
    checked = 0
    for i in range(16):
        point = _at(env, i)
        try:
            want, scale = py_eval(tree, point), _magnitude(tree, point)
        except Undefined:
            continue
        checked += 1
        if tree.type is Type.BOOL:
            assert bool(got[i]) == want, (text, point)
        else:
            assert math.isclose(float(got[i]), want, rel_tol=1e-9, abs_tol=1e-9 * scale), (text, point)
    assume(checked)


# --- emit_cute: what the text may reference ------------------------------------------------------

NAMES = {n: n for n in ("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k", "heads_q", "score", *SCALARS)}
NAMES.update({name: f"t_{name}" for name in TENSOR_INPUTS})
LEVELS = [{"q_idx"}, {"kv_idx", "score"}]
DSL_GLOBALS = {"cute", "cutlass", "Int32", "Float32"}
ALLOWED_CALLS = {"Int32", "Float32", "cutlass.Boolean", "cutlass.min", "cutlass.max", "cute.math.absi",
                 "cute.fast_divmod_create_divisor_v2",
                 "cute.math.abs", "cute.math.tanh", "cute.math.exp", "cute.math.exp2", "cute.math.log",
                 "cute.math.sqrt"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else type(node).__name__


def _referenced(text: str) -> tuple[set[str], set[str]]:
    """(names, dotted call targets) in one expression's text."""
    tree = ast.parse(text, mode="eval")
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    calls = {_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return names, calls


@FAST
@given(case=texts_by_role)
def test_cute_text_is_python_over_allowed_names_only(case):
    text, role = case
    code = emit_cute(parse_or_reject(text, role), NAMES, inputs=INPUTS, levels=LEVELS)
    temps = {temp for level in code.bindings for temp, _ in level}
    visible = DSL_GLOBALS | set(NAMES.values())
    # Level i may use only what exists outside the loops below it: no row names at level 0, ...
    hidden_at = [{"q_idx", "kv_idx", "score"}, {"kv_idx", "score"}]
    bound = set()
    for level, hidden in zip(code.bindings, hidden_at):
        for temp, expr in level:
            names, calls = _referenced(expr)
            assert names <= (visible - hidden) | bound, (text, temp, expr)
            assert calls <= ALLOWED_CALLS, calls
            bound.add(temp)
    names, calls = _referenced(code.expr)
    assert names <= visible | temps and calls <= ALLOWED_CALLS, code.expr


def test_invariant_division_of_an_index_makes_one_fast_divisor_per_tile():
    tree = parse("q_idx // w == kv_idx // w and (kv_idx - q_idx) // w < 2", Role.MASK, INPUTS)
    code = emit_cute(tree, NAMES, inputs=INPUTS, levels=LEVELS)
    assert code.bindings[0] == (("vx_0", "cute.fast_divmod_create_divisor_v2(w)"),)
    assert "(kv_idx // vx_0)" in code.expr
    # kv_idx - q_idx may be negative: the flooring signed division stays.
    assert "((kv_idx - q_idx) // w)" in code.expr


def test_hoisting_moves_per_head_work_out_of_the_loops():
    tree = parse("score - 2 ** (-8 * (h + 1) / heads_q) * abs(q_idx - kv_idx)", Role.SCORE_MOD)
    code = emit_cute(tree, NAMES, levels=LEVELS)
    (slope,) = code.bindings[0]
    assert "cute.math.exp2" in slope[1] and "exp2" not in code.expr
    assert emit_cute(tree, NAMES).bindings == ()  # no levels: one expression, nothing hoisted


def test_missing_variable_is_an_error():
    with pytest.raises(ValueError, match="missing: \\['kv_idx'\\]"):
        emit_cute(parse("kv_idx < q_idx", Role.MASK), {"q_idx": "row"})


# --- emit_cute: run by the CuTe DSL on the host ---------------------------------------------------

INT32_LIMIT = 2 ** 31 - 1
_INDICES = ("b", "h", "q_idx", "kv_idx")
_SIZES_AND_SCALARS = ("seqlen_q", "seqlen_k", "heads_q", "w", "n")


def _module_source(codes, trees) -> str:
    """One @cute.jit host function writing each expression's value at each point.

    Point p's indices are row p of `points` and its score is scores[p]; results go to
    out_i[p, j] (conditions as 0/1, ints) or out_f[p, j] (floats).
    """
    params = ", ".join([f"t_{n}: cute.Tensor" for n in TENSOR_INPUTS] + [f"{n}: Int32" for n in _SIZES_AND_SCALARS]
                       + ["s: Float32"])
    lines = ["import cutlass", "import cutlass.cute as cute", "from cutlass import Float32, Int32", "",
             "@cute.jit",
             f"def evaluate(out_i: cute.Tensor, out_f: cute.Tensor, points: cute.Tensor, scores: cute.Tensor, {params}):",
             "    for p in cutlass.range(cute.size(scores), unroll=1):"]
    lines += [f"        {name} = points[p, {i}]" for i, name in enumerate(_INDICES)]
    lines.append("        score = scores[p]")
    for j, (code, tree) in enumerate(zip(codes, trees)):
        for level in code.bindings:
            lines += [f"        {temp} = {text}" for temp, text in level]
        if tree.type is Type.BOOL:
            lines.append(f"        out_i[p, {j}] = Int32(1) if {code.expr} else Int32(0)")
        elif tree.type is Type.INT:
            lines.append(f"        out_i[p, {j}] = {code.expr}")
        else:
            lines.append(f"        out_f[p, {j}] = {code.expr}")
    return "\n".join(lines) + "\n"


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the DSL reads the function's source from this file
    return module


def _run(module, env: dict, count: int):
    """(out_i, out_f), each (points, count), for the points of `env` (as `_points` makes them)."""
    from cutlass.cute.runtime import from_dlpack

    points = torch.stack([env[n].to(torch.int32) for n in _INDICES], dim=1).contiguous()
    scores = env["score"].to(torch.float32)
    out_i = torch.zeros(len(scores), count, dtype=torch.int32)
    out_f = torch.zeros(len(scores), count, dtype=torch.float32)
    tensors = [from_dlpack(env[n]) for n in TENSOR_INPUTS]
    module.evaluate(from_dlpack(out_i), from_dlpack(out_f), from_dlpack(points), from_dlpack(scores), *tensors,
                    *(env[n] for n in _SIZES_AND_SCALARS), env["s"])
    return out_i, out_f


# Integer-valued trees: conditions, and int expressions compared against 0 (still exercising every op).
exact_texts = st.one_of(conditions(), int_exprs().map(lambda t: f"({t}) >= 0"))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(exact_texts, min_size=8, max_size=8), seed=st.integers(0, 2 ** 31))
def test_cute_text_computes_what_python_does(tmp_path_factory, texts, seed):
    pytest.importorskip("cutlass")
    trees = [parse_or_reject(t, Role.MASK) for t in texts]
    codes = [emit_cute(t, NAMES, inputs=INPUTS, levels=LEVELS) for t in trees]
    path = tmp_path_factory.mktemp("cute") / "emitted.py"
    path.write_text(_module_source(codes, trees))
    module = _load(path)
    env = _points(seed, 32)
    out_i, _ = _run(module, env, len(trees))
    checked = 0
    for i in range(32):
        point = _at(env, i)
        for j, tree in enumerate(trees):
            try:
                want = py_eval(tree, point, int_limit=INT32_LIMIT)
            except Undefined:
                continue  # Int32 would overflow where Python does not
            checked += 1
            assert int(out_i[i, j]) == int(want), (texts[j], point)
    assume(checked)


# Every integer operator where the DSL's native meaning differs from Python's or is easy to get
# wrong: negative dividends, the select, the Boolean operators, min/max of three.
OPERATOR_TABLE = [
    "(q_idx - kv_idx) % 3 == 1", "(q_idx - kv_idx) % w == 2", "(q_idx - kv_idx) // 3 == -2",
    "(q_idx - kv_idx) // w < -1", "abs(q_idx - 2 * kv_idx) > 5", "min(q_idx, kv_idx - 4, n) == n",
    "max(-q_idx, kv_idx - 30, n) > -3", "where(q_idx > kv_idx, q_idx - kv_idx, kv_idx % 4) > 2",
    "not (q_idx < kv_idx or kv_idx == 3)", "0 <= q_idx - kv_idx < 4", "(-q_idx) ** 3 < -kv_idx ** 2",
    "q_idx != kv_idx and not q_idx == seqlen_q - 1",
    # Non-negative dividends by an invariant divisor: FastDivmod (w = 3, and 1 on the last rows).
    "kv_idx // w == q_idx // w and kv_idx <= q_idx", "(q_idx + 2 * kv_idx) % w == 1", "kv_idx % (w + 1) == 2",
]


def test_cute_operators_match_python_on_a_grid(tmp_path):
    pytest.importorskip("cutlass")
    trees = [parse(t, Role.MASK, INPUTS) for t in OPERATOR_TABLE]
    codes = [emit_cute(t, NAMES, inputs=INPUTS, levels=LEVELS) for t in trees]
    path = tmp_path / "operators.py"
    path.write_text(_module_source(codes, trees))
    module = _load(path)
    env = _points(3, 40 * 40)
    env["q_idx"], env["kv_idx"] = (x.flatten() for x in torch.meshgrid(torch.arange(40), torch.arange(40), indexing="ij"))
    env.update(seqlen_q=40, seqlen_k=40)
    out_i, _ = _run(module, env, len(trees))
    for i in range(40 * 40):
        point = _at(env, i)
        assert [bool(x) for x in out_i[i].tolist()] == [py_eval(t, point) for t in trees], point


LIBRARY_SCORE_MODS = [
    "30.0 * tanh(score / 30.0)",
    "score - 2 ** (-8 * (h + 1) / heads_q) * abs(q_idx + seqlen_k - seqlen_q - kv_idx)",
    "score - slopes[h] * abs(q_idx - kv_idx) + bias[h, q_idx, kv_idx]",
    "where(q_idx % w == 0, exp(score / 8.0), log(abs(score) + 1.0) + sqrt(abs(score))) + exp2(s)",
]


def test_cute_float_text_matches_python_within_float32(tmp_path):
    pytest.importorskip("cutlass")
    trees = [parse(t, Role.SCORE_MOD, INPUTS) for t in LIBRARY_SCORE_MODS]
    codes = [emit_cute(t, NAMES, inputs=INPUTS, levels=LEVELS) for t in trees]
    path = tmp_path / "emitted_float.py"
    path.write_text(_module_source(codes, trees))
    module = _load(path)
    env = _points(7, 64)
    _, out_f = _run(module, env, len(trees))
    for i in range(64):
        point = _at(env, i)
        for j, tree in enumerate(trees):
            want = py_eval(tree, point)
            assert math.isclose(float(out_f[i, j]), want, rel_tol=1e-5, abs_tol=1e-5), (LIBRARY_SCORE_MODS[j], point)
