"""Symbolic derivative of a float expression with respect to one of its leaves.

The backward pass needs two: d(score mod)/d(score), by which it multiplies dS (the mod sits
between the scaled score and the softmax), and d(sink)/d(input element), which carries the
sink logits' gradient to the tensor the sink expression reads. Both are trees of the same
language, so the kernel and the reference emitters take them as they take any expression.

Where a function has no derivative, the convention is torch autograd's, so that the kernel
and autograd through the float64 reference agree everywhere they are compared:
  abs     sign(x), 0 at x = 0
  min/max the argument that wins; a tie splits the gradient in half between the two
          (more than two arguments fold pairwise from the left, as the reference computes them)
  where   the branch taken (the condition, a comparison of integers, has no derivative)
  x ** n  n * x ** (n - 1), and 0 for n = 0
  sqrt    dx / (2 sqrt(x)), and 0 where dx is 0 (at x = 0 autograd masks the branch that holds x
          there, where the chain rule would give 0 * inf = NaN)
Integer and condition subtrees have derivative 0 (their values move in steps, not with the
leaf), as have reads of inputs other than the leaf and names other than it.

The result is simplified while it is built (x * 1, x + 0, products with 0, constants
folded), so that a mod like `score + bias[h, q_idx, kv_idx]` has derivative exactly 1.0 and
the kernel spends nothing on it. Repeated subtrees are kept as the same nodes (tanh(u) in
1 - tanh(u) ** 2), for the emitters to compute once (fa_gen.variant.shared).
"""

from __future__ import annotations

import math

from .fold import FoldError, fold
from .tree import Binary, Call, Compare, Const, Name, Node, Read, Type, Unary, walk

ZERO = Const(Type.FLOAT, 0.0)
ONE = Const(Type.FLOAT, 1.0)


def derivative(tree: Node, wrt: Node) -> Node:
    """d tree / d wrt, a FLOAT tree; `wrt` is a leaf of `tree` (the `score` name, or a read of a
    float tensor input), matched by structure. Const 0.0 where `tree` does not depend on it."""
    return _Differentiator(wrt).d(tree)


def score_derivative(score_mod: Node) -> Node:
    """d(score mod)/d(score)."""
    return derivative(score_mod, Name(Type.FLOAT, "score"))


class _Differentiator:
    def __init__(self, wrt: Node):
        self.wrt = wrt
        self.memo: dict[Node, Node] = {}
        self.depends: dict[Node, bool] = {}

    def depends_on_wrt(self, node: Node) -> bool:
        known = self.depends.get(node)
        if known is None:
            known = node == self.wrt or any(self.depends_on_wrt(c) for c in node.children())
            self.depends[node] = known
        return known

    def d(self, node: Node) -> Node:
        if node == self.wrt:
            return ONE
        if node.type is not Type.FLOAT or not self.depends_on_wrt(node):
            return ZERO
        known = self.memo.get(node)
        if known is None:
            known = self.memo[node] = getattr(self, f"d_{type(node).__name__}")(node)
        return known

    # Leaves other than `wrt` never get here (they do not depend on it); ToFloat wraps an
    # integer, whose derivative is 0; so only operations remain.

    def d_Unary(self, node: Unary) -> Node:
        return neg(self.d(node.operand))

    def d_Binary(self, node: Binary) -> Node:
        a, b = node.left, node.right
        da, db = self.d(a), self.d(b)
        if node.op == "+":
            return add(da, db)
        if node.op == "-":
            return sub(da, db)
        if node.op == "*":
            return add(mul(da, b), mul(a, db))
        if node.op == "/":
            # torch: d/da = 1 / b, d/db = -a / (b * b)
            return sub(div(da, b), div(mul(a, db), mul(b, b)))
        if node.op == "**":
            return self.d_power(node, da, db)
        raise AssertionError(f"no float operator {node.op!r}")

    def d_power(self, node: Binary, da: Node, db: Node) -> Node:
        base, exponent = node.left, node.right
        if exponent.type is Type.INT:  # x ** n, n a constant from 0 up
            n = exponent.value
            if n == 0:
                return ZERO
            if n == 1:
                return da
            lower = base if n == 2 else Binary(Type.FLOAT, "**", base, Const(Type.INT, n - 1))
            return mul(mul(Const(Type.FLOAT, float(n)), lower), da)
        # c ** e with a positive constant base c: the node itself times ln(c).
        return mul(mul(node, Const(Type.FLOAT, math.log(base.value))), db)

    def d_Call(self, node: Call) -> Node:
        if node.func == "where":
            cond, a, b = node.args
            return where(cond, self.d(a), self.d(b))
        if node.func in ("min", "max"):
            return self.d_extremum(node.func, node.args)
        (x,) = node.args
        dx = self.d(x)
        if node.func == "tanh":
            return mul(sub(ONE, mul(node, node)), dx)
        if node.func == "exp":
            return mul(node, dx)
        if node.func == "exp2":
            return mul(mul(node, Const(Type.FLOAT, math.log(2.0))), dx)
        if node.func == "log":
            return div(dx, x)
        if node.func == "sqrt":
            # Where x stops moving (a min/max/where/abs that holds it at 0), the gradient is 0,
            # not 0 / (2 sqrt(0)) = NaN: autograd gets there by masking the branch not taken.
            return strong_zero(dx, div(dx, mul(Const(Type.FLOAT, 2.0), node)))
        if node.func == "abs":
            return mul(sign(x), dx)
        raise AssertionError(f"no derivative rule for {node.func}()")

    def d_extremum(self, func: str, args: tuple[Node, ...]) -> Node:
        """min/max folded pairwise from the left: the winner's derivative, half each on a tie."""
        acc, d_acc = args[0], self.d(args[0])
        for other in args[1:]:
            d_other = self.d(other)
            first_wins = Compare(Type.BOOL, ">" if func == "max" else "<", acc, other)
            other_wins = Compare(Type.BOOL, "<" if func == "max" else ">", acc, other)
            tie = mul(add(d_acc, d_other), Const(Type.FLOAT, 0.5))
            d_acc = where(first_wins, d_acc, where(other_wins, d_other, tie))
            acc = Call(Type.FLOAT, func, (acc, other))
        return d_acc


# --- builders that simplify as they go ----------------------------------------------------------

def _folded(node: Node) -> Node:
    """`node` with constant operands evaluated (left as it is where that has no value)."""
    try:
        return fold(node)
    except FoldError:
        return node


def _is(node: Node, value: float) -> bool:
    return isinstance(node, Const) and node.value == value


def add(a: Node, b: Node) -> Node:
    if _is(a, 0.0):
        return b
    if _is(b, 0.0):
        return a
    return _folded(Binary(Type.FLOAT, "+", a, b))


def sub(a: Node, b: Node) -> Node:
    if _is(b, 0.0):
        return a
    if _is(a, 0.0):
        return neg(b)
    return _folded(Binary(Type.FLOAT, "-", a, b))


def mul(a: Node, b: Node) -> Node:
    if _is(a, 0.0) or _is(b, 0.0):
        return ZERO
    if _is(a, 1.0):
        return b
    if _is(b, 1.0):
        return a
    if _is(a, -1.0):
        return neg(b)
    if _is(b, -1.0):
        return neg(a)
    return _folded(Binary(Type.FLOAT, "*", a, b))


def div(a: Node, b: Node) -> Node:
    if _is(a, 0.0):
        return ZERO
    if _is(b, 1.0):
        return a
    return _folded(Binary(Type.FLOAT, "/", a, b))


def neg(a: Node) -> Node:
    if isinstance(a, Unary) and a.op == "-":
        return a.operand
    return _folded(Unary(Type.FLOAT, "-", a))


def where(cond: Node, a: Node, b: Node) -> Node:
    if a == b:
        return a
    return _folded(Call(Type.FLOAT, "where", (cond, a, b)))


def strong_zero(factor: Node, product: Node) -> Node:
    """`product` (which has `factor` as a factor), or exactly 0 where `factor` is 0, even where the
    rest of the product is infinite."""
    if isinstance(factor, Const):
        return product
    return where(Compare(Type.BOOL, "==", factor, ZERO), ZERO, product)


def sign(x: Node) -> Node:
    """torch's sign: 1, -1, or 0 at 0."""
    return where(Compare(Type.BOOL, ">", x, ZERO), ONE,
                 where(Compare(Type.BOOL, "<", x, ZERO), Const(Type.FLOAT, -1.0), ZERO))


def reads_of(tree: Node, input_name: str) -> list[Read]:
    """The distinct reads of tensor input `input_name` in `tree` (each a leaf to differentiate by)."""
    found: list[Read] = []
    for node in walk(tree):
        if isinstance(node, Read) and node.input == input_name and node not in found:
            found.append(node)
    return found
