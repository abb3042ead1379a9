"""Expression text -> typed tree, through Python's `ast` and a whitelist.

Only what the language defines gets through: the names of the expression's role
and the spec's declared inputs, numbers, arithmetic, comparisons, and/or/not and
the functions of `language.FUNCTIONS`. Everything else (attributes, strings,
lambdas, bitwise operators, slices, ...) is an `ExprError` that points at the
column where it starts and says what to write instead.

Types are checked here, once: a mask is a condition, a score a float; `//` and `%`
take integers and a divisor proven >= 1; tensor reads are proven in bounds (a
seqlen_k dimension is read with kv_idx, a fixed-size one with an index whose
interval fits). Masks are integer-only: the kernel's Int32 and the reference's
int64 then agree on every element.
"""

from __future__ import annotations

import ast
import difflib
import functools
import math

from ..errors import SpecError
from . import language as lang
from .fold import FoldError, fold
from .inputs import InputDecl, find_input
from .language import Role
from .tree import Binary, Call, Compare, Const, Logic, Name, Node, Read, ToFloat, Type, Unary, walk


class ExprError(SpecError):
    """An expression is invalid; `line` and `column` (1-based) locate it within the expression text."""

    def __init__(self, reason: str, *, line: int, column: int, offset: int):
        self.expr_line = line
        self.column = column
        self.offset = offset
        where = f"line {line}, column {column}" if line > 1 else f"column {column}"
        super().__init__(f"{where}: {reason}")
        self.reason = reason


def parse(text: str, role: Role, inputs: tuple[InputDecl, ...] = ()) -> Node:
    """The typed, folded tree of `text` as an expression of `role` over `inputs`."""
    return _Builder(text, role, inputs).build()


@functools.lru_cache(maxsize=256)
def parse_cached(text: str, role: Role, inputs: tuple[InputDecl, ...] = ()) -> Node:
    """`parse` for text already validated (a spec's canonical text): trees are immutable."""
    return parse(text, role, inputs)


def names_written(text: str) -> frozenset[str]:
    """Every name the text of a valid expression spells out, read or not once folded (an input
    inside a branch that folds away is still written: declaring it is not an error)."""
    return frozenset(n.id for n in ast.walk(ast.parse(_one_line(text).lstrip(), mode="eval")) if isinstance(n, ast.Name))


def canonical(text: str) -> str:
    """One spelling per expression (spacing, redundant parentheses dropped): part of a spec's identity."""
    return ast.unparse(ast.parse(_one_line(text).lstrip(), mode="eval").body)


def _one_line(text: str) -> str:
    # Newlines become spaces so a multi-line YAML block needs no parentheses, and every
    # character keeps its offset (which `_Builder.error` maps back to a line and column).
    return text.replace("\r", " ").replace("\n", " ")


_OPS = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
    ast.Pow: "**", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
}
_INSTEAD = {
    ast.BitAnd: "'&' is not allowed; write 'and'",
    ast.BitOr: "'|' is not allowed; write 'or'",
    ast.BitXor: "'^' is not allowed (for a power write '**')",
    ast.Invert: "'~' is not allowed; write 'not'",
    ast.LShift: "'<<' is not allowed; multiply by a power of two",
    ast.RShift: "'>>' is not allowed; write '//' with a power of two",
    ast.MatMult: "'@' is not allowed",
    ast.Is: "'is' is not allowed; write '=='",
    ast.IsNot: "'is not' is not allowed; write '!='",
    ast.In: "'in' is not allowed",
    ast.NotIn: "'not in' is not allowed",
    ast.IfExp: "a conditional expression is not allowed; write where(cond, a, b)",
    ast.Attribute: "attribute access is not allowed",
    ast.Lambda: "lambda is not allowed",
    ast.NamedExpr: "':=' is not allowed",
    ast.Starred: "'*' unpacking is not allowed",
}


class _Builder:
    def __init__(self, text: str, role: Role, inputs: tuple[InputDecl, ...]):
        self.text = text
        self.line = _one_line(text)
        # Python rejects leading spaces as an indent: parse without them, count offsets with them.
        self.parsed = self.line.lstrip()
        self.lead = len(self.line) - len(self.parsed)
        self.role = role
        self.inputs = inputs

    # --- entry and positions -------------------------------------------------------------------

    def build(self) -> Node:
        if not self.line.strip():
            raise self.error(0, "the expression is empty")
        try:
            tree = ast.parse(self.parsed, mode="eval")
        except SyntaxError as e:
            # Python gives no offset (0) when the text ends too early: point just past its end.
            offset = self.lead + e.offset - 1 if e.offset else len(self.line.rstrip())
            raise self.error(min(offset, len(self.line)), e.msg) from None
        except (RecursionError, MemoryError):
            # Python's own parser gives up on very long chains (a + a + ... or - - ... a).
            raise self.error(0, f"the expression is too large or nested too deeply to parse (at most "
                                f"{lang.MAX_EXPR_NODES} terms, {lang.MAX_EXPR_DEPTH} levels deep)") from None
        self.check_size(tree.body)
        root = self.visit(tree.body)
        self.check_root(root)
        return root

    def check_size(self, body: ast.AST) -> None:
        """Refuse a tree past MAX_EXPR_NODES nodes or MAX_EXPR_DEPTH levels (walked with an explicit
        stack: the check itself must not recurse), pointing at the first node past the depth."""
        nodes, stack = 0, [(body, 1)]
        while stack:
            node, depth = stack.pop()
            nodes += 1
            if depth > lang.MAX_EXPR_DEPTH:
                raise self.error(node, f"the expression is nested more than {lang.MAX_EXPR_DEPTH} levels deep (every "
                                       f"operator of a chain like a + b + c is one level); at most {lang.MAX_EXPR_DEPTH}")
            if nodes > lang.MAX_EXPR_NODES:
                raise self.error(body, f"the expression has more than {lang.MAX_EXPR_NODES} parts; at most "
                                       f"{lang.MAX_EXPR_NODES}")
            stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node)
                         if not isinstance(child, (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)))

    def error(self, where, reason: str) -> ExprError:
        """An ExprError at a character offset, an ast node or a tree node."""
        if isinstance(where, ast.AST):
            offset = self._char(where.col_offset)
        elif isinstance(where, Node):
            offset = where.span[0]
        else:
            offset = where
        starts = [0]
        for part in self.text.split("\n")[:-1]:
            starts.append(starts[-1] + len(part) + 1)
        line = max(i for i, start in enumerate(starts) if start <= offset)
        return ExprError(reason, line=line + 1, column=offset - starts[line] + 1, offset=offset)

    def _char(self, byte_offset: int) -> int:
        # ast reports UTF-8 byte offsets into the parsed text; messages count characters of the whole.
        return self.lead + len(self.parsed.encode()[:byte_offset].decode(errors="ignore"))

    def operator_offset(self, left: ast.AST, right: ast.AST) -> int:
        """Where the operator between two operands starts (ast records operands, not operators)."""
        offset = self._char(left.end_col_offset)
        while offset < self._char(right.col_offset) and self.line[offset] in " )":
            offset += 1
        return offset

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self._char(node.col_offset), self._char(node.end_col_offset)

    def snippet(self, node: Node) -> str:
        start, end = node.span
        text = self.line[start:end].strip()
        return text if len(text) <= 40 else text[:37] + "..."

    def make(self, node: Node) -> Node:
        try:
            folded = fold(node)
        except FoldError as e:
            raise self.error(node, f"'{self.snippet(node)}': {e}") from None
        if isinstance(folded, Const) and folded.type is Type.INT and not (
                lang.INT32_MIN <= folded.value <= lang.INT32_MAX):
            raise self.error(node, f"{folded.value} does not fit in a 32-bit integer")
        return folded

    # --- dispatch -------------------------------------------------------------------------------

    def visit(self, node: ast.AST) -> Node:
        method = getattr(self, f"visit_{type(node).__name__}", None)
        if method is None:
            reason = _INSTEAD.get(type(node)) or f"{_describe(node)} is not allowed"
            raise self.error(node, reason)
        return method(node)

    def visit_Constant(self, node: ast.Constant) -> Node:
        value, span = node.value, self.span(node)
        if isinstance(value, bool):
            return Const(Type.BOOL, value, span=span)
        if isinstance(value, int):
            return self.make(Const(Type.INT, value, span=span))
        if isinstance(value, float):
            if not math.isfinite(value):
                raise self.error(node, f"{self.line[span[0]:span[1]]} is not a finite number")
            return Const(Type.FLOAT, value, span=span)
        what = "a string" if isinstance(value, str) else _describe(node)
        raise self.error(node, f"{what} is not allowed; expressions take numbers, names and True/False")

    def visit_Name(self, node: ast.Name) -> Node:
        name, span = node.id, self.span(node)
        if name in lang.builtin_names(self.role):
            return Name(lang.builtin_type(name), name, span=span)
        unavailable = lang.why_builtin_unavailable(name, self.role)
        if unavailable:
            raise self.error(node, unavailable)
        decl = find_input(self.inputs, name)
        if decl is None:
            raise self.error(node, self.undefined(name))
        if not decl.is_scalar:
            raise self.error(node, f"'{name}' is a tensor input: read one element, e.g. {_example_read(decl)}")
        return Name(decl.type, name, span=span)

    def undefined(self, name: str) -> str:
        allowed = [*lang.builtin_names(self.role), *(d.name for d in self.inputs)]
        if name in lang.FUNCTIONS:
            return f"'{name}' is a function: call it, e.g. {name}(...)"
        close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"name '{name}' is not defined{hint}; allowed names: {', '.join(allowed)}"

    def visit_Subscript(self, node: ast.Subscript) -> Node:
        target = node.value
        if not isinstance(target, ast.Name):
            raise self.error(node, "only a declared tensor input can be indexed")
        decl = find_input(self.inputs, target.id)
        if decl is None or decl.is_scalar:
            what = "a scalar input" if decl else "not a tensor input"
            raise self.error(node, f"'{target.id}' is {what}; only declared tensor inputs can be indexed")
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if len(items) != len(decl.shape):
            raise self.error(node, f"'{decl.name}' has {len(decl.shape)} dimension(s) "
                                   f"({', '.join(map(str, decl.shape))}); got {len(items)} index(es)")
        indices = tuple(self.index(decl, dim, item) for dim, item in enumerate(items))
        return Read(decl.type, decl.name, indices, span=self.span(node))

    def index(self, decl: InputDecl, dim: int, item: ast.AST) -> Node:
        if isinstance(item, ast.Slice):
            raise self.error(item, "slices are not allowed; index each dimension with one integer")
        index = self.visit(item)
        expected = decl.index_name(dim)
        if expected is not None:
            if not (isinstance(index, Name) and index.id == expected):
                raise self.error(index, f"dimension {dim} of '{decl.name}' is {decl.shape[dim]}, "
                                        f"so its index must be {expected}")
            return index
        if index.type is not Type.INT:
            raise self.error(index, f"an index must be an integer; '{self.snippet(index)}' is {_kind(index.type)}")
        lo, hi = self.static_range(index)
        if lo < 0 or hi > decl.shape[dim] - 1:
            raise self.error(index, f"index {dim} of '{decl.name}' must lie in [0, {decl.shape[dim] - 1}], "
                                    f"but '{self.snippet(index)}' may lie in [{_num(lo)}, {_num(hi)}]; "
                                    "clamp it with min(max(..., 0), ...)")
        return index

    def static_range(self, node: Node) -> tuple[float, float]:
        """Bounds of `node` over every call: built-ins' ranges and the inputs' declared bounds."""
        # Imported here: intervals needs torch, which `import fa_gen` must not pull in.
        from .intervals import static_range

        return static_range(node, self.inputs)

    # --- operators ------------------------------------------------------------------------------

    def visit_UnaryOp(self, node: ast.UnaryOp) -> Node:
        operand = self.visit(node.operand)
        span = self.span(node)
        if isinstance(node.op, ast.Not):
            return self.make(Unary(Type.BOOL, "not", self.condition(operand, "not"), span=span))
        if isinstance(node.op, ast.Invert):
            raise self.error(node, _INSTEAD[ast.Invert])
        number = self.number(operand, "unary " + ("-" if isinstance(node.op, ast.USub) else "+"))
        if isinstance(node.op, ast.UAdd):
            return number
        return self.make(Unary(number.type, "-", number, span=span))

    def visit_BinOp(self, node: ast.BinOp) -> Node:
        op = _OPS.get(type(node.op))
        if op is None:
            raise self.error(self.operator_offset(node.left, node.right),
                             _INSTEAD.get(type(node.op), "this operator is not allowed"))
        left, right = self.visit(node.left), self.visit(node.right)
        left, right = self.number(left, op), self.number(right, op)
        span = self.span(node)
        if op == "**":
            return self.power(node, left, right, span)
        if op in ("//", "%"):
            return self.integer_division(op, left, right, span)
        if op == "/":
            return self.make(Binary(Type.FLOAT, op, self.as_float(left), self.as_float(right), span=span))
        left, right, type_ = self.promote(left, right)
        return self.make(Binary(type_, op, left, right, span=span))

    def integer_division(self, op: str, left: Node, right: Node, span) -> Node:
        for operand in (left, right):
            if operand.type is not Type.INT:
                raise self.error(operand, f"'{op}' takes integers; '{self.snippet(operand)}' is a float")
        lo, hi = self.static_range(right)
        if lo < 1:
            raise self.error(right, f"the divisor of '{op}' must be known to be >= 1 (a positive constant, or "
                                    f"an input declared with min >= 1); '{self.snippet(right)}' may lie in "
                                    f"[{_num(lo)}, {_num(hi)}]")
        return self.make(Binary(Type.INT, op, left, right, span=span))

    def power(self, node: ast.BinOp, base: Node, exponent: Node, span) -> Node:
        if isinstance(exponent, Const) and exponent.type is Type.INT and 0 <= exponent.value <= lang.MAX_INT_EXPONENT:
            return self.make(Binary(base.type, "**", base, exponent, span=span))
        if isinstance(base, Const) and base.value > 0:
            return self.make(Binary(Type.FLOAT, "**", self.as_float(base), self.as_float(exponent), span=span))
        raise self.error(node, f"'**' takes a positive constant base (as in 2 ** x) or a constant integer "
                               f"exponent from 0 to {lang.MAX_INT_EXPONENT} (as in x ** 2)")

    def visit_BoolOp(self, node: ast.BoolOp) -> Node:
        op = "and" if isinstance(node.op, ast.And) else "or"
        operands = tuple(self.condition(self.visit(v), op) for v in node.values)
        return self.make(Logic(Type.BOOL, op, operands, span=self.span(node)))

    def visit_Compare(self, node: ast.Compare) -> Node:
        # a < b < c means (a < b) and (b < c), as in Python.
        operands = [node.left, *node.comparators]
        for i, op_node in enumerate(node.ops):
            if type(op_node) not in _OPS:
                raise self.error(self.operator_offset(operands[i], operands[i + 1]),
                                 _INSTEAD.get(type(op_node), "this comparison is not allowed"))
        terms = [self.visit(operand) for operand in operands]
        parts = []
        for i, op_node in enumerate(node.ops):
            op = _OPS[type(op_node)]
            left, right, _ = self.promote(self.number(terms[i], op), self.number(terms[i + 1], op))
            parts.append(self.make(Compare(Type.BOOL, op, left, right, span=self.span(node))))
        if len(parts) == 1:
            return parts[0]
        return self.make(Logic(Type.BOOL, "and", tuple(parts), span=self.span(node)))

    def visit_Call(self, node: ast.Call) -> Node:
        if not isinstance(node.func, ast.Name) or node.func.id not in lang.FUNCTIONS:
            name = node.func.id if isinstance(node.func, ast.Name) else _describe(node.func)
            close = difflib.get_close_matches(str(name), list(lang.FUNCTIONS), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise self.error(node, f"function '{name}' is not allowed{hint}; "
                                   f"allowed functions: {', '.join(lang.FUNCTIONS)}")
        func = node.func.id
        if node.keywords:
            raise self.error(node, f"{func}() takes positional arguments only")
        low, high = lang.FUNCTIONS[func]
        if len(node.args) < low or (high is not None and len(node.args) > high):
            wanted = f"{low}" if low == high else f"at least {low}"
            raise self.error(node, f"{func}() takes {wanted} argument(s), got {len(node.args)}")
        args = [self.visit(a) for a in node.args]
        return self.make(self.call(func, args, self.span(node)))

    def call(self, func: str, args: list[Node], span) -> Node:
        if func == "where":
            cond = self.condition(args[0], "where's first argument")
            a, b = args[1], args[2]
            if (a.type is Type.BOOL) != (b.type is Type.BOOL):
                raise self.error(b if a.type is Type.BOOL else a,
                                 "where() needs both branches to be conditions or both numbers")
            if a.type is Type.BOOL:
                return Call(Type.BOOL, func, (cond, a, b), span=span)
            a, b, type_ = self.promote(a, b)
            return Call(type_, func, (cond, a, b), span=span)
        numbers = [self.number(a, f"{func}()") for a in args]
        if func in lang.TRANSCENDENTAL:
            return Call(Type.FLOAT, func, (self.as_float(numbers[0]),), span=span)
        if func == "abs":
            return Call(numbers[0].type, func, tuple(numbers), span=span)
        type_ = Type.FLOAT if any(n.type is Type.FLOAT for n in numbers) else Type.INT
        if type_ is Type.FLOAT:
            numbers = [self.as_float(n) for n in numbers]
        return Call(type_, func, tuple(numbers), span=span)

    # --- types ----------------------------------------------------------------------------------

    def number(self, node: Node, op: str) -> Node:
        if node.type is Type.BOOL:
            raise self.error(node, f"'{op}' takes numbers; '{self.snippet(node)}' is a condition "
                                   "(for 1 or 0 write where(cond, 1, 0))")
        return node

    def condition(self, node: Node, op: str) -> Node:
        if node.type is not Type.BOOL:
            raise self.error(node, f"'{op}' takes conditions; '{self.snippet(node)}' is {_kind(node.type)} "
                                   "(compare it, e.g. x != 0)")
        return node

    def as_float(self, node: Node) -> Node:
        return node if node.type is Type.FLOAT else self.make(ToFloat(Type.FLOAT, node, span=node.span))

    def promote(self, a: Node, b: Node) -> tuple[Node, Node, Type]:
        if Type.FLOAT in (a.type, b.type):
            return self.as_float(a), self.as_float(b), Type.FLOAT
        return a, b, Type.INT

    def check_root(self, root: Node) -> None:
        for node in walk(root):
            # Kernels compute in float32: a constant it cannot hold would be inf there (and
            # inf - inf a NaN in the softmax), where the float64 reference stays finite.
            if isinstance(node, Const) and node.type is Type.FLOAT and not abs(node.value) <= lang.FLOAT32_MAX:
                raise self.error(node, f"the constant {node.value!r} ('{self.snippet(node)}') is not a finite float32 "
                                       f"(at most {lang.FLOAT32_MAX:.6g} in magnitude)")
            if isinstance(node, Binary) and node.op == "/" and isinstance(node.right, Const) and node.right.value == 0:
                raise self.error(node, f"'{self.snippet(node)}' divides by zero")
        if self.role is Role.MASK:
            if root.type is not Type.BOOL:
                raise self.error(root, f"a mask must be a condition (e.g. kv_idx <= q_idx); "
                                       f"'{self.snippet(root)}' is {_kind(root.type)}")
            # The outermost float that is not a mere promotion names what made the mask float.
            floats = [n for n in walk(root) if n.type is Type.FLOAT and not isinstance(n, ToFloat)]
            if floats:
                raise self.error(floats[0], f"masks are integer-only (so every device decides them exactly "
                                            f"as the reference does); '{self.snippet(floats[0])}' is a float")
        elif root.type is not Type.FLOAT:
            raise self.error(root, f"a {self.role.value} must be a float (a logit); '{self.snippet(root)}' is "
                                   f"{_kind(root.type)}")


def _kind(type_: Type) -> str:
    return {Type.BOOL: "a condition", Type.INT: "an int", Type.FLOAT: "a float"}[type_]


def _describe(node: ast.AST) -> str:
    names = {ast.List: "a list", ast.Tuple: "a tuple", ast.Dict: "a dict", ast.Set: "a set",
             ast.ListComp: "a comprehension", ast.GeneratorExp: "a comprehension", ast.Await: "await",
             ast.JoinedStr: "an f-string", ast.Yield: "yield"}
    return names.get(type(node), f"'{type(node).__name__}'")


def _example_read(decl: InputDecl) -> str:
    indices = [decl.index_name(d) or "0" for d in range(len(decl.shape))]
    return f"{decl.name}[{', '.join(indices)}]"


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) else str(x)
