"""Random expressions of the variant language, and an evaluator written independently of fa_gen's.

The strategies draw expression *text* (so every test also exercises the parser) over
a fixed set of inputs; every subexpression is parenthesised so the text means what
the strategy built. `py_eval` evaluates a parsed tree at one point with plain Python
arithmetic and `math`: the definition the emitters are checked against.
"""

from __future__ import annotations

import math
import operator

import torch
from hypothesis import strategies as st

from fa_gen.variant.inputs import InputDecl
from fa_gen.variant.tree import Binary, Call, Compare, Const, Logic, Name, Read, ToFloat, Unary

INPUTS = (
    InputDecl("bias", "float32", ("heads_q", "seqlen_q", "seqlen_k")),
    InputDecl("kdoc", "int32", ("batch", "seqlen_k")),
    InputDecl("n", "int", None, default=2),
    InputDecl("qdoc", "int32", ("batch", "seqlen_q")),
    InputDecl("s", "float", None, default=0.5),
    InputDecl("slopes", "bfloat16", ("heads_q",)),
    InputDecl("tab", "int32", (8,)),
    InputDecl("w", "int", None, default=3, min=1, max=9),
)
INT_NAMES = ("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k", "heads_q", "w", "n")
DIVISORS = ("w", "1", "3", "7")
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")

# --- text ------------------------------------------------------------------------------------------

int_literals = st.integers(-9, 40).map(lambda v: f"({v})" if v < 0 else str(v))


def int_exprs(depth: int = 3):
    leaves = st.one_of(st.sampled_from(INT_NAMES), int_literals,
                       st.sampled_from(["qdoc[b, q_idx]", "kdoc[b, kv_idx]"]))
    if depth == 0:
        return leaves
    sub = int_exprs(depth - 1)
    return st.one_of(
        leaves,
        st.tuples(sub, st.sampled_from("+-*"), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(sub, st.sampled_from(["//", "%"]), st.sampled_from(DIVISORS)).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        sub.map(lambda a: f"abs({a})"),
        sub.map(lambda a: f"(-{a})"),
        sub.map(lambda a: f"({a} ** 2)"),
        st.tuples(st.sampled_from(["min", "max"]), st.lists(sub, min_size=2, max_size=3)).map(
            lambda t: f"{t[0]}({', '.join(t[1])})"),
        st.tuples(conditions(depth - 1), sub, sub).map(lambda t: f"where({t[0]}, {t[1]}, {t[2]})"),
        sub.map(lambda a: f"tab[min(max({a}, 0), 7)]"),
    )


def conditions(depth: int = 3):
    ints = int_exprs(max(depth - 1, 0))
    compare = st.tuples(ints, st.sampled_from(COMPARISONS), ints).map(lambda t: f"({t[0]} {t[1]} {t[2]})")
    chain = st.tuples(ints, ints, ints).map(lambda t: f"({t[0]} <= {t[1]} < {t[2]})")
    if depth == 0:
        return st.one_of(compare, st.sampled_from(["True", "False"]))
    sub = conditions(depth - 1)
    return st.one_of(
        compare, chain,
        st.tuples(sub, st.sampled_from(["and", "or"]), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        sub.map(lambda c: f"(not {c})"),
        st.tuples(sub, sub, sub).map(lambda t: f"where({t[0]}, {t[1]}, {t[2]})"),
    )


float_literals = st.floats(-4, 4, allow_nan=False).map(lambda v: f"({v!r})")


def float_exprs(depth: int = 3):
    leaves = st.one_of(st.sampled_from(["score", "s", "slopes[h]", "bias[h, q_idx, kv_idx]"]), float_literals)
    if depth == 0:
        return leaves
    sub = float_exprs(depth - 1)
    mixed = st.one_of(sub, int_exprs(1))
    return st.one_of(
        leaves,
        st.tuples(sub, st.sampled_from("+-*"), mixed).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(mixed, sub).map(lambda t: f"({t[0]} / (abs({t[1]}) + 1.0))"),
        st.tuples(st.sampled_from(["tanh", "exp", "exp2"]), sub).map(lambda t: f"{t[0]}({t[1]})"),
        sub.map(lambda a: f"log(abs({a}) + 1.0)"),
        sub.map(lambda a: f"sqrt(abs({a}))"),
        sub.map(lambda a: f"(2 ** {a})"),
        sub.map(lambda a: f"({a} ** 3)"),
        st.tuples(st.sampled_from(["min", "max"]), sub, mixed).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        st.tuples(conditions(1), sub, mixed).map(lambda t: f"where({t[0]}, {t[1]}, {t[2]})"),
        sub.map(lambda a: f"abs({a})"),
    )


def parse_or_reject(text: str, role):
    """The tree of a drawn text; texts whose literals alone overflow are rejected, not failed."""
    from hypothesis import assume

    from fa_gen.variant import ExprError, parse

    try:
        return parse(text, role, INPUTS)
    except ExprError as e:
        constant_overflow = any(m in e.reason for m in (
            "has no value", "does not fit", "not a finite number", "not a finite float32", "divides by zero"))
        assume(not constant_overflow)
        raise


# --- values ------------------------------------------------------------------------------------------

def random_tensors(generator: torch.Generator, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int) -> dict:
    """Values for the tensor inputs; document ids in a small range so that equalities happen."""
    def ints(*shape):
        return torch.randint(-3, 4, shape, generator=generator, dtype=torch.int32)
    return {
        "bias": torch.randn(heads_q, seqlen_q, seqlen_k, generator=generator),
        "kdoc": ints(batch, seqlen_k),
        "qdoc": ints(batch, seqlen_q),
        "slopes": torch.rand(heads_q, generator=generator).to(torch.bfloat16),
        "tab": ints(8),
    }


# --- the independent evaluator -----------------------------------------------------------------------

class Undefined(ArithmeticError):
    """The point leaves the range where the comparison means anything (overflow, inf, NaN)."""


INT_LIMIT = 2 ** 62


def py_eval(node, point: dict, int_limit: int = INT_LIMIT):
    """The value of `node` at `point` (name -> Python number, or tensor for tensor inputs)."""
    value = _eval(node, point, int_limit)
    if isinstance(value, float) and not math.isfinite(value):
        raise Undefined(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > int_limit:
        raise Undefined(value)
    return value


def _eval(node, p, limit):
    def ev(n):
        return py_eval(n, p, limit)
    if isinstance(node, Const):
        return node.value
    if isinstance(node, Name):
        return p[node.id]
    if isinstance(node, Read):
        return p[node.input][tuple(ev(i) for i in node.indices)].item()
    if isinstance(node, ToFloat):
        return float(ev(node.operand))
    if isinstance(node, Unary):
        return (not ev(node.operand)) if node.op == "not" else -ev(node.operand)
    if isinstance(node, Binary):
        return _binary(node.op, ev(node.left), ev(node.right))
    if isinstance(node, Compare):
        a, b = ev(node.left), ev(node.right)
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}[node.op]
    if isinstance(node, Logic):
        values = [ev(o) for o in node.operands]
        return all(values) if node.op == "and" else any(values)
    if isinstance(node, Call):
        return _call(node.func, [ev(a) for a in node.args])
    raise TypeError(node)


_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
           "//": operator.floordiv, "%": operator.mod, "**": operator.pow}


def _binary(op, a, b):
    try:
        return _BINARY[op](a, b)
    except (OverflowError, ZeroDivisionError) as e:
        raise Undefined(e) from None


def _call(func, args):
    try:
        if func == "where":
            return args[1] if args[0] else args[2]
        if func in ("min", "max"):
            return (min if func == "min" else max)(args)
        if func == "abs":
            return abs(args[0])
        if func == "exp2":
            return 2.0 ** args[0]
        return getattr(math, func)(args[0])
    except (OverflowError, ValueError) as e:
        raise Undefined(e) from None
