"""The spec's variant fields read from YAML: `inputs`, `mask: {expr}`, `score_mod`, `sink`.

Part of the loader (`spec_load`), kept apart because expressions add one thing the
other fields do not need: errors point at a column. An expression's column in the
expression text is mapped back to the YAML file for the usual ways of writing it
(a plain or quoted scalar on one line, a `|` block); when the text cannot be
matched to the file (folded or multi-line quoted scalars), the column is given
within the expression and says so.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from ..spec_text import is_int, not_allowed, show, show_typed
from .inputs import SCALAR_TYPES, TENSOR_DTYPES, InputDecl
from .language import SHAPE_SYMBOLS, Role, reserved_names
from .parse import ExprError, canonical, names_written, parse

INPUT_NAME_PATTERN = r"[a-z_][a-z0-9_]*"
TENSOR_KEYS = ("shape", "dtype", "min", "max")
SCALAR_KEYS = ("scalar", "default", "min", "max")
EXPR_KEYS = ("expr",)


# --- inputs ------------------------------------------------------------------------------------------

def read_inputs(top) -> tuple[InputDecl, ...]:
    """`inputs: {name: {shape: [...], dtype: ...} | {scalar: int|float, ...}}`, sorted by name."""
    if "inputs" not in top.data:
        return ()
    value = top.data["inputs"]
    if not isinstance(value, Mapping) or not value:
        raise top.error("inputs", "expected a mapping of input name -> declaration, e.g. "
                                  "{slopes: {shape: [heads_q], dtype: float32}, window: {scalar: int, default: 256}}; "
                                  f"got {show_typed(value)}")
    node = top.child("inputs")
    node.check_keys(tuple(value))  # duplicates only: every name is allowed here
    return tuple(sorted((_input(node, name) for name in value), key=lambda d: d.name))


def _input(node, name) -> InputDecl:
    if not isinstance(name, str) or not re.fullmatch(INPUT_NAME_PATTERN, name) or name in reserved_names():
        why = "is a built-in name or keyword" if name in reserved_names() else "is not a valid name"
        raise node.error(name, f"{show(name)} {why}; an input is named with lowercase letters, digits "
                               "and _ (not b, h, q_idx, kv_idx, seqlen_q, seqlen_k, heads_q, score, a function "
                               "name or a shape symbol)")
    value = node.data[name]
    if isinstance(value, Mapping) and "scalar" in value:
        return _scalar_input(node.child(name), name)
    if isinstance(value, Mapping) and "shape" in value:
        return _tensor_input(node.child(name), name)
    raise node.error(name, f"expected {{shape: [...], dtype: ...}} for a tensor or {{scalar: int|float, "
                           f"default: ...}} for a scalar; got {show_typed(value)}")


def _tensor_input(node, name: str) -> InputDecl:
    node.check_keys(TENSOR_KEYS, ("shape", "dtype"))
    dtype = _choice(node, "dtype", tuple(TENSOR_DTYPES))
    shape = _shape(node)
    lo, hi = (_bound(node, key, integer=dtype == "int32") for key in ("min", "max"))
    _check_order(node, lo, hi)
    return InputDecl(name, dtype, shape, min=lo, max=hi)


def _shape(node) -> tuple:
    value = node.data["shape"]
    allowed = f"a list of sizes, each one of {', '.join(SHAPE_SYMBOLS)} or an integer >= 1"
    if not isinstance(value, (list, tuple)) or not value:
        shown = show_typed(value) if value else "an empty list"
        raise node.error("shape", f"expected {allowed}; got {shown}")
    lines = getattr(value, "item_lines", None)
    for index, size in enumerate(value):
        line = lines[index] if lines else None
        field = f"shape[{index}]"
        if isinstance(size, str) and size in SHAPE_SYMBOLS:
            if size in value[:index]:
                raise node.error(field, f"{size} appears twice; each shape symbol may appear once", line=line)
        elif not (is_int(size) and size >= 1):
            raise node.error(field, f"{not_allowed(size, SHAPE_SYMBOLS)} or an integer >= 1", line=line)
    return tuple(value)


def _scalar_input(node, name: str) -> InputDecl:
    node.check_keys(SCALAR_KEYS, ("scalar",))
    kind = _choice(node, "scalar", tuple(SCALAR_TYPES))
    default, lo, hi = (_bound(node, key, integer=kind == "int", as_float=kind == "float")
                       for key in ("default", "min", "max"))
    _check_order(node, lo, hi)
    if default is not None:
        for bound, key, ok in ((lo, "min", lambda b: default >= b), (hi, "max", lambda b: default <= b)):
            if bound is not None and not ok(bound):
                raise node.error("default", f"{default} is outside its declared {key} {bound}")
    return InputDecl(name, kind, None, default=default, min=lo, max=hi)


def _choice(node, key, allowed: tuple[str, ...]) -> str:
    value = node.data[key]
    if isinstance(value, str) and value in allowed:
        return value
    raise node.error(key, not_allowed(value, allowed))


def _bound(node, key, *, integer: bool, as_float: bool = False):
    if key not in node.data:
        return None
    value = node.data[key]
    number = is_int(value) or (not integer and isinstance(value, float) and math.isfinite(value))
    if not number:
        what = "an integer" if integer else "a finite number"
        raise node.error(key, f"expected {what}, got {show_typed(value)}")
    return float(value) if as_float else value


def _check_order(node, lo, hi) -> None:
    if lo is not None and hi is not None and lo > hi:
        raise node.error("max", f"{hi} is below min {lo}")


# --- expressions -------------------------------------------------------------------------------------

def read_expr_mapping(top, key: str, role: Role, inputs: tuple[InputDecl, ...]) -> str | None:
    """`score_mod: {expr: "..."}` or `sink: {expr: "..."}`: the expression's canonical text."""
    if key not in top.data:
        return None
    value = top.data[key]
    if not isinstance(value, Mapping):
        raise top.error(key, f"expected a mapping {{expr: \"...\"}}, got {show_typed(value)}")
    node = top.child(key)
    node.check_keys(EXPR_KEYS, EXPR_KEYS)
    return read_expr(node, role, inputs)


def read_expr(node, role: Role, inputs: tuple[InputDecl, ...]) -> str:
    """The `expr` of `node`, parsed and checked; errors point at the line and column."""
    text = node.data["expr"]
    if not isinstance(text, str) or not text.strip():
        shown = "an empty string" if isinstance(text, str) else show_typed(text)
        raise node.error("expr", f"expected an expression (a string), got {shown}")
    try:
        parse(text, role, inputs)
    except ExprError as e:
        yaml_node = getattr(node.data, "value_nodes", {}).get("expr")
        line, where = _locate(yaml_node, text, e.expr_line, e.column)
        raise node.error("expr", f"{where}: {e.reason}", line=line) from None
    return canonical(text)


def check_inputs_used(top, inputs: tuple[InputDecl, ...], texts: dict[Role, str | None]) -> None:
    """Every declared input is named by some expression (an unused one is a typo or a leftover)."""
    used = set()
    for text in texts.values():
        if text is not None:
            used |= names_written(text)
    for decl in inputs:
        if decl.name not in used:
            node = top.child("inputs")
            raise node.error(decl.name, "declared but no expression reads it")


def _locate(yaml_node, text: str, line: int, column: int) -> tuple[int | None, str]:
    """(file line, "column N") for `column` of `line` (1-based) of the expression text.

    Falls back to the expression's own line and column when there is no file, or the
    text is not found in it as written (escapes, folded scalars).
    """
    within = f"line {line}, column {column}" if line > 1 else f"column {column}"
    mark = getattr(yaml_node, "start_mark", None)
    if mark is None or not isinstance(getattr(mark, "buffer", None), str):
        return None, within
    file_lines = mark.buffer.rstrip("\0").split("\n")
    text_lines = text.split("\n")
    style = getattr(yaml_node, "style", None)
    if style in (None, "'", '"') and len(text_lines) == 1:
        start = mark.column + (1 if style else 0)
        if file_lines[mark.line][start:start + len(text)] == text:
            return mark.line + 1, f"column {start + column}"
    if style == "|":
        first = mark.line + 1
        indent = len(file_lines[first]) - len(file_lines[first].lstrip(" ")) if first < len(file_lines) else 0
        matches = all(first + i < len(file_lines) and file_lines[first + i].rstrip("\r") == " " * indent + t
                      for i, t in enumerate(text_lines) if t)
        if matches:
            return first + line, f"column {indent + column}"
    return mark.line + 1, f"{within} of the expression"
