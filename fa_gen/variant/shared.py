"""Several expressions of one loop nest emitted together, each shared subtree computed once.

The backward of a score mod needs, at every score, the mod's value and its derivative
(fa_gen.variant.derivative), and the derivative reuses the value's pieces: tanh(u) in
(1 - tanh(u) * tanh(u)), exp(u) in exp(u) * u'. `emit_cute_shared` binds every subtree that
the expressions reach more than once to a temporary, at the loop level where its names live
(per tile, per row, per element), then emits each binding and each expression with
`emit_cute`, which hoists what is loop-invariant within them as it always does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from .emit_cute import default_read, emit_cute
from .inputs import InputDecl
from .tree import Binary, Call, Compare, Const, Logic, Name, Node, Read, ToFloat, Unary, names_used


@dataclass(frozen=True)
class SharedCode:
    """`bindings[i]`: (temporary, text) assignments to run, in order, at loop level i (0: before
    every loop, len(levels): per element, innermost); `exprs`: each root's text at the innermost
    level, over those temporaries."""

    bindings: tuple[tuple[tuple[str, str], ...], ...]
    exprs: tuple[str, ...]


def shared_subtrees(roots: Sequence[Node]) -> list[Node]:
    """Subtrees reached more than once (below a shared subtree, only through it), children
    before parents; leaves (names, constants) are never worth a temporary."""
    count: dict[Node, int] = {}
    order: list[Node] = []

    def visit(node: Node) -> None:
        count[node] = count.get(node, 0) + 1
        if count[node] == 1:
            for child in node.children():
                visit(child)
            order.append(node)

    for root in roots:
        visit(root)
    return [n for n in order if count[n] > 1 and not isinstance(n, (Const, Name))]


def emit_cute_shared(roots: Sequence[Node], names: Mapping[str, str], *, inputs: tuple[InputDecl, ...] = (),
                     levels: Sequence[Collection[str]] = (),
                     read: Callable[[str, tuple[str, ...]], str] = default_read,
                     fastmath: bool = False, temp_prefix: str = "sh_") -> SharedCode:
    """CuTe DSL text of every root, sharing the subtrees they have in common (see the module)."""
    level_of = {name: i + 1 for i, level in enumerate(levels) for name in level}
    names = dict(names)
    bindings: list[list[tuple[str, str]]] = [[] for _ in range(len(levels) + 1)]
    temps: dict[Node, Name] = {}
    for i, subtree in enumerate(shared_subtrees(roots)):
        body = _replace(subtree, temps)
        level = max((level_of.get(n, 0) for n in names_used(body)), default=0)
        temp = f"{temp_prefix}x{i}"
        code = emit_cute(body, names, inputs=inputs, levels=_with(levels[:level], level_of, names),
                         read=read, fastmath=fastmath, temp_prefix=f"{temp_prefix}{i}_")
        _extend(bindings, code.bindings)
        bindings[level].append((temp, code.expr))
        temps[subtree] = Name(subtree.type, temp)
        names[temp] = temp
        level_of[temp] = level
    exprs = []
    for j, root in enumerate(roots):
        code = emit_cute(_replace(root, temps), names, inputs=inputs, levels=_with(levels, level_of, names),
                         read=read, fastmath=fastmath, temp_prefix=f"{temp_prefix}r{j}_")
        _extend(bindings, code.bindings)
        exprs.append(code.expr)
    return SharedCode(tuple(tuple(b) for b in bindings), tuple(exprs))


def _with(levels: Sequence[Collection[str]], level_of: Mapping[str, int], names: Mapping[str, str]) -> list[set]:
    """`levels` with each temporary added to the level it is bound at (emit_cute hoists by them)."""
    grown = [set(level) for level in levels]
    for name, level in level_of.items():
        if name in names and 0 < level <= len(grown):
            grown[level - 1].add(name)
    return grown


def _extend(bindings: list[list[tuple[str, str]]], more) -> None:
    for level, assignments in enumerate(more):
        bindings[level].extend(assignments)


def _replace(node: Node, temps: Mapping[Node, Name]) -> Node:
    """`node` with every subtree bound to a temporary replaced by the temporary's name."""
    if node in temps:
        return temps[node]
    children = node.children()
    if not children:
        return node
    new = [_replace(c, temps) for c in children]
    if all(a is b for a, b in zip(new, children)):
        return node
    return _rebuild(node, new)


def _rebuild(node: Node, children: list[Node]) -> Node:
    if isinstance(node, (Unary, ToFloat)):
        return replace(node, operand=children[0])
    if isinstance(node, (Binary, Compare)):
        return replace(node, left=children[0], right=children[1])
    if isinstance(node, Logic):
        return replace(node, operands=tuple(children))
    if isinstance(node, Call):
        return replace(node, args=tuple(children))
    if isinstance(node, Read):
        return replace(node, indices=tuple(children))
    raise TypeError(f"cannot rebuild {type(node).__name__}")
