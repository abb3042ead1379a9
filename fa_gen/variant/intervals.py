"""Interval arithmetic over an expression tree: what values can it take, given ranges for its names?

Sound, never exact: the true set of values always lies inside the interval computed
(for a condition: `can_true` / `can_false` are never False while the condition can
take that value). Bounds are float64 tensors of any broadcastable shape, so one walk
classifies a single tile (0-d bounds) or every tile of a call at once (bounds shaped
like the tile grid). Integers are exact in float64 up to 2**53, far past Int32.

±inf stands for "unbounded", and a name missing from the environment is unbounded:
whatever the analysis does not know, it answers MAYBE.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum

import torch

from .language import STATIC_BOUNDS
from .tree import Binary, Call, Compare, Const, Logic, Name, Node, Read, ToFloat, Type, Unary

_F64 = torch.float64
_INF = math.inf


def _t(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=_F64)


@dataclass(frozen=True)
class Interval:
    """Every value lies in [lo, hi] (elementwise over the bounds' shape)."""

    lo: torch.Tensor
    hi: torch.Tensor

    @staticmethod
    def of(lo, hi) -> "Interval":
        return Interval(_t(lo), _t(hi))

    @staticmethod
    def point(value) -> "Interval":
        return Interval(_t(value), _t(value))

    @staticmethod
    def unbounded() -> "Interval":
        return Interval(_t(-_INF), _t(_INF))


@dataclass(frozen=True)
class Truth:
    """What a condition can evaluate to (elementwise)."""

    can_true: torch.Tensor
    can_false: torch.Tensor


class Tri(IntEnum):
    """A mask over a tile: NEVER visible (skip the tile), ALWAYS visible (no element mask), or MAYBE."""

    NEVER = 0
    MAYBE = 1
    ALWAYS = 2


def bounds(node: Node, env: Mapping[str, Interval]) -> Interval | Truth:
    """The values `node` can take when each name (and each tensor input's elements) lies in `env`."""
    return _RULES[type(node)](node, env)


def static_range(node: Node, inputs) -> tuple[float, float]:
    """Bounds of `node` over every call: the built-in names' ranges (language.STATIC_BOUNDS) and
    the declared bounds of the inputs (an InputDecl sequence), as floats (+-inf when open)."""
    env = {name: Interval.of(*b) for name, b in STATIC_BOUNDS.items()}
    for decl in inputs:
        env[decl.name] = Interval.of(-math.inf if decl.min is None else decl.min,
                                     math.inf if decl.max is None else decl.max)
    result = bounds(node, env)
    return float(result.lo), float(result.hi)


def tri_codes(truth: Truth) -> torch.Tensor:
    """Tri values (as int8) of a condition's Truth, elementwise."""
    never = torch.as_tensor(int(Tri.NEVER), dtype=torch.int8)
    always = torch.as_tensor(int(Tri.ALWAYS), dtype=torch.int8)
    maybe = torch.as_tensor(int(Tri.MAYBE), dtype=torch.int8)
    return torch.where(~truth.can_true, never, torch.where(~truth.can_false, always, maybe))


def classify(mask: Node, env: Mapping[str, Interval]) -> Tri:
    """ALWAYS / NEVER / MAYBE for a mask over one region (every bound in `env` 0-d)."""
    assert mask.type is Type.BOOL, "classify takes a condition"
    codes = tri_codes(bounds(mask, env))
    if codes.dim():
        raise ValueError("classify takes 0-d bounds; use bounds() and tri_codes() for grids")
    return Tri(int(codes))


# --- helpers ---------------------------------------------------------------------------------------

def _clean(lo: torch.Tensor, hi: torch.Tensor) -> Interval:
    # NaN comes from inf - inf or 0 * inf style corners: widening it to unbounded is always sound.
    return Interval(torch.where(torch.isnan(lo), _t(-_INF), lo), torch.where(torch.isnan(hi), _t(_INF), hi))


def _hull(values: list[torch.Tensor]) -> Interval:
    lo, hi = values[0], values[0]
    for v in values[1:]:
        lo, hi = torch.minimum(lo, v), torch.maximum(hi, v)
    return _clean(lo, hi)


def _select(cond: Truth, a, b):
    """The hull of where(cond, a, b): a's values when cond must hold, b's when it cannot, else both."""
    must, cannot = ~cond.can_false, ~cond.can_true
    if isinstance(a, Truth):
        can_true = torch.where(must, a.can_true, torch.where(cannot, b.can_true, a.can_true | b.can_true))
        can_false = torch.where(must, a.can_false, torch.where(cannot, b.can_false, a.can_false | b.can_false))
        return Truth(can_true, can_false)
    lo = torch.where(must, a.lo, torch.where(cannot, b.lo, torch.minimum(a.lo, b.lo)))
    hi = torch.where(must, a.hi, torch.where(cannot, b.hi, torch.maximum(a.hi, b.hi)))
    return Interval(lo, hi)


# --- leaves -----------------------------------------------------------------------------------------

def _const(node: Const, env) -> Interval | Truth:
    if node.type is Type.BOOL:
        return Truth(torch.as_tensor(bool(node.value)), torch.as_tensor(not node.value))
    return Interval.point(node.value)


def _name(node: Name, env) -> Interval:
    return env.get(node.id) or Interval.unbounded()


def _read(node: Read, env) -> Interval:
    # The environment holds the bounds of the tensor's elements (whole-tensor or per tile).
    return env.get(node.input) or Interval.unbounded()


def _to_float(node: ToFloat, env) -> Interval:
    return bounds(node.operand, env)


# --- arithmetic -------------------------------------------------------------------------------------

def _neg(a: Interval) -> Interval:
    return Interval(-a.hi, -a.lo)


def _add(a: Interval, b: Interval) -> Interval:
    return _clean(a.lo + b.lo, a.hi + b.hi)


def _sub(a: Interval, b: Interval) -> Interval:
    return _add(a, _neg(b))


def _mul(a: Interval, b: Interval) -> Interval:
    # 0 * unbounded is 0 for every finite value the bound stands for, not NaN.
    corners = [torch.nan_to_num(x * y, nan=0.0, posinf=_INF, neginf=-_INF)
               for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return _hull(corners)


def _div(a: Interval, b: Interval) -> Interval:
    """a / b; unbounded when b may be 0."""
    straddles = (b.lo <= 0) & (b.hi >= 0)
    # 1 / [lo, hi] = [1 / hi, 1 / lo] for a divisor of one sign.
    inverse = Interval(1.0 / torch.where(straddles, _t(1.0), b.hi), 1.0 / torch.where(straddles, _t(1.0), b.lo))
    q = _mul(a, inverse)
    return Interval(torch.where(straddles, _t(-_INF), q.lo), torch.where(straddles, _t(_INF), q.hi))


def _floor_div_corner(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    q = torch.floor(x / d)
    # floor(x / d) as d grows without bound tends to 0 for x >= 0 but to -1 for x < 0.
    limit = torch.where(x < 0, _t(-1.0), _t(0.0))
    return torch.where(torch.isinf(d) & torch.isfinite(x), limit, q)


def _floor_div(a: Interval, b: Interval) -> Interval:
    """a // b for a divisor >= 1 (parse guarantees it; anything else is unbounded).

    floor(a / b) rises with a; with b it falls for a >= 0 and rises for a < 0,
    so the extremes sit at the corners.
    """
    q = _hull([_floor_div_corner(x, d) for x in (a.lo, a.hi) for d in (b.lo, b.hi)])
    ok = b.lo >= 1
    return Interval(torch.where(ok, q.lo, _t(-_INF)), torch.where(ok, q.hi, _t(_INF)))


def _mod(a: Interval, b: Interval) -> Interval:
    """a % b for a divisor >= 1: in [0, b - 1], and exactly [a.lo % d, a.hi % d] when the
    divisor is one value d and a stays within one period."""
    ok = b.lo >= 1
    generic = Interval(torch.where(ok, _t(0.0), _t(-_INF)), torch.where(ok, b.hi - 1, _t(_INF)))
    point = ok & (b.lo == b.hi) & torch.isfinite(b.lo) & torch.isfinite(a.lo) & torch.isfinite(a.hi)
    d = torch.where(point, b.lo, _t(1.0))
    a_lo, a_hi = torch.where(point, a.lo, _t(0.0)), torch.where(point, a.hi, _t(0.0))
    same_period = point & (torch.floor(a_lo / d) == torch.floor(a_hi / d))
    return Interval(torch.where(same_period, torch.remainder(a_lo, d), generic.lo),
                    torch.where(same_period, torch.remainder(a_hi, d), generic.hi))


def _pow(a: Interval, b: Interval, node: Binary) -> Interval:
    if isinstance(node.right, Const) and node.right.type is Type.INT:
        n = int(node.right.value)
        if n == 0:
            return Interval.point(1.0)
        base = a if n % 2 else _abs(a)  # an even power is monotone in |x|
        return _clean(base.lo ** n, base.hi ** n)
    # A positive base (parse guarantees one): monotone in each argument, so corners bound it.
    positive = a.lo > 0
    q = _hull([torch.pow(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)])
    return Interval(torch.where(positive, q.lo, _t(-_INF)), torch.where(positive, q.hi, _t(_INF)))


def _abs(a: Interval) -> Interval:
    lo = torch.where(a.lo >= 0, a.lo, torch.where(a.hi <= 0, -a.hi, _t(0.0)))
    hi = torch.maximum(a.hi.abs(), a.lo.abs())
    return Interval(lo, hi)


_ARITHMETIC = {"+": _add, "-": _sub, "*": _mul, "/": _div, "//": _floor_div, "%": _mod}


def _binary(node: Binary, env) -> Interval:
    a, b = bounds(node.left, env), bounds(node.right, env)
    if node.op == "**":
        return _pow(a, b, node)
    return _ARITHMETIC[node.op](a, b)


def _unary(node: Unary, env):
    a = bounds(node.operand, env)
    if node.op == "not":
        return Truth(a.can_false, a.can_true)
    return _neg(a)


# --- conditions -------------------------------------------------------------------------------------

def _less(a: Interval, b: Interval, strict: bool) -> Truth:
    if strict:
        return Truth(a.lo < b.hi, a.hi >= b.lo)
    return Truth(a.lo <= b.hi, a.hi > b.lo)


def _equal(a: Interval, b: Interval) -> Truth:
    overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
    one_value = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    return Truth(overlap, ~one_value)


def _compare(node: Compare, env) -> Truth:
    a, b = bounds(node.left, env), bounds(node.right, env)
    if node.op in ("<", "<="):
        return _less(a, b, node.op == "<")
    if node.op in (">", ">="):
        return _less(b, a, node.op == ">")
    equal = _equal(a, b)
    return equal if node.op == "==" else Truth(equal.can_false, equal.can_true)


def _logic(node: Logic, env) -> Truth:
    parts = [bounds(operand, env) for operand in node.operands]
    can_true, can_false = parts[0].can_true, parts[0].can_false
    for p in parts[1:]:
        if node.op == "and":
            can_true, can_false = can_true & p.can_true, can_false | p.can_false
        else:
            can_true, can_false = can_true | p.can_true, can_false & p.can_false
    return Truth(can_true, can_false)


# --- calls ------------------------------------------------------------------------------------------

def _monotone(fn):
    def rule(a: Interval) -> Interval:
        return _clean(fn(a.lo), fn(a.hi))
    return rule


_MONOTONE = {"tanh": torch.tanh, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "sqrt": torch.sqrt}


def _call(node: Call, env):
    if node.func == "where":
        cond, a, b = (bounds(arg, env) for arg in node.args)
        return _select(cond, a, b)
    args = [bounds(arg, env) for arg in node.args]
    if node.func == "abs":
        return _abs(args[0])
    if node.func in ("min", "max"):
        pick = torch.minimum if node.func == "min" else torch.maximum
        lo, hi = args[0].lo, args[0].hi
        for a in args[1:]:
            lo, hi = pick(lo, a.lo), pick(hi, a.hi)
        return Interval(lo, hi)
    return _monotone(_MONOTONE[node.func])(args[0])


_RULES = {
    Const: _const, Name: _name, Read: _read, ToFloat: _to_float, Unary: _unary,
    Binary: _binary, Compare: _compare, Logic: _logic, Call: _call,
}
