"""Constant folding, applied to each node as `parse` builds it.

Why fold at all: an operation on literals alone (`-8`, `1 / 30`, `True and c`) would
otherwise reach the kernel as Python values, where `~True == -2` and `not` on a
traced value misbehave. After folding, every operator has at least one traced
operand, and conditions are simplified (`c and True` is `c`).

Folding uses Python's own semantics (floor `//`, `%` with the divisor's sign), which
are the language's semantics.
"""

from __future__ import annotations

import dataclasses
import math
import operator

from .tree import Binary, Call, Compare, Const, Logic, Node, ToFloat, Type, Unary


class FoldError(ArithmeticError):
    """A constant subexpression has no value (division by zero, log of 0, overflow)."""


_BINARY = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "%": operator.mod, "**": operator.pow,
}
_COMPARE = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
    "==": operator.eq, "!=": operator.ne,
}
_CALLS = {
    "abs": abs, "min": min, "max": max, "tanh": math.tanh, "exp": math.exp,
    "exp2": lambda x: 2.0 ** x, "log": math.log, "sqrt": math.sqrt,
}


def fold(node: Node) -> Node:
    """`node` with constant operands evaluated and constant conditions simplified."""
    if isinstance(node, Logic):
        return _fold_logic(node)
    if isinstance(node, Call) and node.func == "where" and isinstance(node.args[0], Const):
        chosen = node.args[1] if node.args[0].value else node.args[2]
        return dataclasses.replace(chosen, span=node.span)
    children = node.children()
    if not children or not all(isinstance(c, Const) for c in children):
        return node
    return Const(node.type, _typed(node.type, _evaluate(node, [c.value for c in children])), span=node.span)


def _evaluate(node: Node, values: list):
    try:
        if isinstance(node, Unary):
            return (not values[0]) if node.op == "not" else -values[0]
        if isinstance(node, Binary):
            return _BINARY[node.op](*values)
        if isinstance(node, Compare):
            return _COMPARE[node.op](*values)
        if isinstance(node, ToFloat):
            return float(values[0])
        if isinstance(node, Call):
            # (where with a constant condition never gets here: fold() picks its branch first)
            return _CALLS[node.func](*values)
    except ZeroDivisionError:
        raise FoldError("division by zero") from None
    except (ValueError, OverflowError) as e:
        raise FoldError(f"{node.func if isinstance(node, Call) else node.op} has no value here ({e})") from None
    raise TypeError(f"cannot fold {type(node).__name__}")


def _typed(type_: Type, value):
    if type_ is Type.BOOL:
        return bool(value)
    if type_ is Type.INT:
        return int(value)
    value = float(value)
    if not math.isfinite(value):
        raise FoldError(f"the value is {value}, not a finite number")
    return value


def _fold_logic(node: Logic) -> Node:
    # `and` drops True operands and is False if any is False; `or` the other way round.
    neutral = node.op == "and"
    kept = []
    for operand in node.operands:
        if isinstance(operand, Const):
            if operand.value != neutral:
                return Const(Type.BOOL, not neutral, span=node.span)
            continue
        kept.append(operand)
    if not kept:
        return Const(Type.BOOL, neutral, span=node.span)
    if len(kept) == 1:
        return kept[0]
    return dataclasses.replace(node, operands=tuple(kept))
