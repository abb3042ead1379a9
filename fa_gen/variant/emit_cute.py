"""Tree -> CuTe DSL expression text, for the kernel templates.

The text uses only `cute`, `cutlass`, `Int32` and `Float32` (what every template
imports) and the variable names the template passes for the expression's names.
Integers are Int32, floats Float32; every int-to-float conversion is an explicit
`Float32(...)` and every operation is parenthesised, so the text means the same
wherever it is pasted.

Semantics the DSL does not share with the language are spelt out: Int32 `%`
truncates (C), so `a % d` becomes `a - (a // d) * d` over the DSL's flooring `//`;
`and/or/not` become `& | ~` on traced Booleans (fold.py guarantees no Python-bool
operand reaches them).

Integer division by a loop-invariant divisor of a dividend that is never negative (an index,
say: `kv_idx // chunk`) goes through a FastDivmod divisor made where the divisor lives (a
multiply-high and a shift per element, where a general signed floor division costs a few dozen
instructions); the language already proves every divisor >= 1.

Hoisting: a template evaluates the expression inside loops (rows, then columns).
`levels` names what each loop level introduces (e.g. [{"q_idx"}, {"kv_idx", "score"}]);
every non-trivial subtree that does not depend on a level's names is bound to a
temporary in `bindings` at the outermost level it can live at, so per-head work
(an ALiBi slope: exp2 and a load) runs once per tile, not once per score.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from .inputs import InputDecl, find_input
from .tree import Binary, Call, Compare, Const, Logic, Name, Node, Read, ToFloat, Type, Unary, names_used

# Element dtypes a read must convert to Float32 (float32 and int32 elements are used as they are).
_NARROW_FLOATS = ("float16", "bfloat16")
_TRANSCENDENTAL = {"tanh": "tanh", "exp": "exp", "exp2": "exp2", "log": "log", "sqrt": "sqrt"}


@dataclass(frozen=True)
class CuteCode:
    """`bindings[i]`: (temporary, text) assignments to run, in order, at loop level i (0: before
    every loop); `expr`: the expression's text at the innermost level, over those temporaries."""

    bindings: tuple[tuple[tuple[str, str], ...], ...]
    expr: str


def default_read(tensor: str, indices: tuple[str, ...]) -> str:
    return f"{tensor}[{', '.join(indices)}]"


def emit_cute(tree: Node, names: Mapping[str, str], *, inputs: tuple[InputDecl, ...] = (),
              levels: Sequence[Collection[str]] = (), read: Callable[[str, tuple[str, ...]], str] = default_read,
              fastmath: bool = False, temp_prefix: str = "vx_") -> CuteCode:
    """CuTe DSL text of `tree`.

    names     expression name -> the template's variable (b, h, q_idx, kv_idx, seqlen_q, seqlen_k,
              heads_q, score, and each input the tree reads: its tensor or scalar variable)
    read      (tensor variable, index texts) -> text of one element (e.g. to add a bounds guard)
    fastmath  passed to transcendental calls (tanh, exp, ...); also turns a float division by a
              loop-invariant divisor into a multiplication by its reciprocal, hoisted with it
              (one rounding more: a ulp or so, where a per-element div.rn costs a dozen instructions)
    temp_prefix  names of the hoisted temporaries: give each expression emitted into one scope its own
    """
    missing = sorted(names_used(tree) - set(names))
    if missing:
        raise ValueError(f"emit_cute needs a variable for each name the expression reads; missing: {missing}")
    emitter = _Emitter(names, inputs, levels, read, fastmath, temp_prefix)
    text, depth = emitter.emit(tree)
    text = emitter.bind_if_hoisted(tree, text, depth, len(levels))
    return CuteCode(tuple(tuple(b) for b in emitter.bindings), text)


class _Emitter:
    def __init__(self, names, inputs, levels, read, fastmath, temp_prefix):
        self.names = names
        self.inputs = inputs
        self.depth_of = {name: i + 1 for i, level in enumerate(levels) for name in level}
        self.bindings: list[list[tuple[str, str]]] = [[] for _ in levels]
        self.read = read
        self.fastmath = fastmath
        self.temp_prefix = temp_prefix
        self.divisors: dict[str, str] = {}   # divisor text -> its FastDivmod temporary

    def emit(self, node: Node) -> tuple[str, int]:
        """(text, loop depth the node needs); children below the node's depth are hoisted."""
        children = [self.emit(child) for child in node.children()]
        depth = max((d for _, d in children), default=self.leaf_depth(node))
        if self.fastmath and isinstance(node, Binary) and node.op == "/" and children[1][1] < depth:
            return self.times_reciprocal(node, children, depth), depth
        if self.divides_by_invariant(node, children, depth):
            return self.fast_division(node, children, depth), depth
        texts = [self.bind_if_hoisted(child, text, d, depth) for child, (text, d) in zip(node.children(), children)]
        return getattr(self, f"text_{type(node).__name__}")(node, texts), depth

    def times_reciprocal(self, node: Binary, children, depth: int) -> str:
        """`a / b` with `b` invariant at this depth: a * (1 / b), the reciprocal bound where b lives."""
        (a, a_depth), (b, b_depth) = children
        numerator = self.bind_if_hoisted(node.left, a, a_depth, depth)
        divisor = self.bind_if_hoisted(node.right, b, b_depth, depth)
        reciprocal = f"{self.temp_prefix}{sum(map(len, self.bindings))}"
        self.bindings[b_depth].append((reciprocal, f"(Float32(1.0) / {divisor})"))
        return f"({numerator} * {reciprocal})"

    def divides_by_invariant(self, node: Node, children, depth: int) -> bool:
        """`a // b` or `a % b` with `b` not a constant (constant divisors are cheap already),
        invariant at this depth, and `a` never negative (FastDivmod is unsigned)."""
        if not (isinstance(node, Binary) and node.op in ("//", "%") and children[1][1] < depth):
            return False
        if isinstance(node.right, Const):
            return False
        from .intervals import static_range  # torch; emitting happens at render time only

        return static_range(node.left, self.inputs)[0] >= 0

    def fast_division(self, node: Binary, children, depth: int) -> str:
        """The quotient or remainder through a FastDivmod divisor bound where the divisor lives."""
        (a, a_depth), (b, b_depth) = children
        dividend = self.bind_if_hoisted(node.left, a, a_depth, depth)
        # One divisor per divisor text: `q_idx // chunk == kv_idx // chunk` makes it once.
        divisor = self.divisors.get(b)
        if divisor is None:
            divisor = self.divisors[b] = f"{self.temp_prefix}{sum(map(len, self.bindings))}"
            self.bindings[b_depth].append((divisor, f"cute.fast_divmod_create_divisor_v2({b})"))
        return f"({dividend} {node.op} {divisor})"

    def leaf_depth(self, node: Node) -> int:
        return self.depth_of.get(node.id, 0) if isinstance(node, Name) else 0

    def bind_if_hoisted(self, node: Node, text: str, depth: int, parent_depth: int) -> str:
        if depth >= parent_depth or isinstance(node, (Const, Name)):
            return text
        temp = f"{self.temp_prefix}{sum(map(len, self.bindings))}"
        self.bindings[depth].append((temp, text))
        return temp

    # --- one method per node type: text from the children's texts -----------------------------

    def text_Const(self, node: Const, _) -> str:
        if node.type is Type.BOOL:
            return f"cutlass.Boolean({node.value})"
        return f"Int32({node.value})" if node.type is Type.INT else f"Float32({node.value!r})"

    def text_Name(self, node: Name, _) -> str:
        return self.names[node.id]

    def text_Read(self, node: Read, indices: list[str]) -> str:
        text = self.read(self.names[node.input], tuple(indices))
        decl = find_input(self.inputs, node.input)
        return f"Float32({text})" if decl is not None and decl.dtype in _NARROW_FLOATS else text

    def text_ToFloat(self, node: ToFloat, texts: list[str]) -> str:
        return f"Float32({texts[0]})"

    def text_Unary(self, node: Unary, texts: list[str]) -> str:
        return f"(~{texts[0]})" if node.op == "not" else f"(-{texts[0]})"

    def text_Binary(self, node: Binary, texts: list[str]) -> str:
        a, b = texts
        if node.op == "%":
            # Python's modulo (the divisor's sign) from the DSL's flooring division.
            return f"({a} - ({a} // {b}) * {b})"
        if node.op == "**":
            return self.power(node, a, b)
        return f"({a} {node.op} {b})"

    def power(self, node: Binary, base: str, exponent: str) -> str:
        if isinstance(node.right, Const) and node.right.type is Type.INT:
            n = node.right.value
            one = "Int32(1)" if node.type is Type.INT else "Float32(1.0)"
            return one if n == 0 else "(" + " * ".join([base] * n) + ")"
        # A positive constant base c: c ** e = exp2(e * log2(c)).
        log2_base = math.log2(node.left.value)
        scaled = exponent if log2_base == 1.0 else f"(Float32({log2_base!r}) * {exponent})"
        return f"cute.math.exp2({scaled}, fastmath={self.fastmath})"

    def text_Compare(self, node: Compare, texts: list[str]) -> str:
        return f"({texts[0]} {node.op} {texts[1]})"

    def text_Logic(self, node: Logic, texts: list[str]) -> str:
        return "(" + (" & " if node.op == "and" else " | ").join(texts) + ")"

    def text_Call(self, node: Call, texts: list[str]) -> str:
        if node.func == "where":
            cond, a, b = texts
            return f"({a} if {cond} else {b})"
        if node.func in ("min", "max"):
            return f"cutlass.{node.func}({', '.join(texts)})"
        if node.func == "abs":
            return f"cute.math.absi({texts[0]})" if node.type is Type.INT else f"cute.math.abs({texts[0]})"
        return f"cute.math.{_TRANSCENDENTAL[node.func]}({texts[0]}, fastmath={self.fastmath})"
