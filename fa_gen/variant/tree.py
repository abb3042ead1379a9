"""The typed expression tree that `parse` builds and every emitter walks.

Nodes are frozen and compare by structure only: `span` (where the node sits in
the expression text, for messages) is left out of equality, so a tree parsed
from a spec's canonical text equals the one parsed from what the user wrote.
Every node carries its type; int operands of float operations are wrapped in an
explicit `ToFloat`, so the emitters never decide a conversion themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum


class Type(str, Enum):
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"


@dataclass(frozen=True)
class Node:
    type: Type
    # (start, end) character offsets in the expression text; (0, 0) for nodes made up by folding.
    span: tuple[int, int] = field(default=(0, 0), compare=False, repr=False, kw_only=True)

    def children(self) -> tuple["Node", ...]:
        return ()


@dataclass(frozen=True)
class Const(Node):
    value: bool | int | float


@dataclass(frozen=True)
class Name(Node):
    """A built-in name (q_idx, seqlen_k, score, ...) or a scalar input."""

    id: str


@dataclass(frozen=True)
class Read(Node):
    """One element of a tensor input: `input[indices...]`."""

    input: str
    indices: tuple[Node, ...]

    def children(self) -> tuple[Node, ...]:
        return self.indices


@dataclass(frozen=True)
class Unary(Node):
    op: str  # "-" or "not"
    operand: Node

    def children(self) -> tuple[Node, ...]:
        return (self.operand,)


@dataclass(frozen=True)
class Binary(Node):
    op: str  # + - * / // % **
    left: Node
    right: Node

    def children(self) -> tuple[Node, ...]:
        return (self.left, self.right)


@dataclass(frozen=True)
class Compare(Node):
    op: str  # < <= > >= == !=
    left: Node
    right: Node

    def children(self) -> tuple[Node, ...]:
        return (self.left, self.right)


@dataclass(frozen=True)
class Logic(Node):
    op: str  # "and" or "or"
    operands: tuple[Node, ...]

    def children(self) -> tuple[Node, ...]:
        return self.operands


@dataclass(frozen=True)
class Call(Node):
    func: str  # where abs min max tanh exp exp2 log sqrt
    args: tuple[Node, ...]

    def children(self) -> tuple[Node, ...]:
        return self.args


@dataclass(frozen=True)
class ToFloat(Node):
    """An int operand used where a float is needed (Python's implicit promotion, made explicit)."""

    operand: Node

    def children(self) -> tuple[Node, ...]:
        return (self.operand,)


def walk(node: Node) -> Iterator[Node]:
    """Every node of the tree, parents before children."""
    yield node
    for child in node.children():
        yield from walk(child)


def names_used(node: Node) -> frozenset[str]:
    """Built-in names, scalar inputs and tensor inputs the tree reads."""
    used = set()
    for n in walk(node):
        if isinstance(n, Name):
            used.add(n.id)
        elif isinstance(n, Read):
            used.add(n.input)
    return frozenset(used)


def calls_used(node: Node) -> frozenset[str]:
    """Functions the tree calls (a template may budget transcendental units by these)."""
    return frozenset(n.func for n in walk(node) if isinstance(n, Call))
