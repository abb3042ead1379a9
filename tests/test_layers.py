"""L0: the package's import graph has no cycles, and its layers import only downwards:

    fa_gen.integrations (adapters for other libraries: transformers)
    fa_gen.api (public functions)
      -> fa_gen.autograd, fa_gen.varlen (custom ops + autograd)
        -> kernel runtime (runtime, backward, inference, varlen_backward, combine, render, cache, ...)

Read from the source with ast: imports inside functions count, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fa_gen

ROOT = Path(fa_gen.__file__).parent
OPS = {"fa_gen.autograd", "fa_gen.varlen"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """fa_gen modules `path` imports (module level or inside functions); `from . import x` names x."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules)
        if node.module and target in modules:
            found.add(target)
    return found - {name}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(paths)) for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, as a path of module names, or [] if there is none."""
    state: dict[str, int] = {}
    trail: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        trail.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return trail[trail.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        trail.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_layers_import_downwards():
    graph = _graph()
    for module, imported in graph.items():
        if module.startswith("fa_gen.integrations") or module == "fa_gen":
            continue
        upward = {m for m in imported if m.startswith("fa_gen.integrations")}
        if module.startswith("fa_gen.api"):
            assert not upward, f"{module} imports {sorted(upward)} from a layer above it"
            continue
        upward |= {m for m in imported if m.startswith("fa_gen.api")}
        if module not in OPS:
            upward |= imported & OPS
        assert not upward, f"{module} imports {sorted(upward)} from a layer above it"


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []
