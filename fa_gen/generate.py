"""Write the renders of specs to `generated/<spec name>/<arch>/` (committed for shipped specs)."""

from __future__ import annotations

from pathlib import Path

from .archs import family_for
from .paths import generated_dir, specs_dir
from .render import render
from .spec import Spec
from .spec_load import load_spec


def shipped_specs() -> list[Spec]:
    return [load_spec(path) for path in sorted(specs_dir().glob("*.yaml"))]


def expected_files(spec: Spec) -> dict[Path, str]:
    """Relative path -> text of every file the renders of `spec` produce."""
    files = {}
    for arch in spec.archs:
        for kind in family_for(spec, arch).kernel_files(spec):
            rendered = render(spec, arch, kind=kind)
            files[Path(spec.name) / arch / rendered.filename] = rendered.text
    return files


def write(spec: Spec, root: Path | None = None) -> list[Path]:
    root = root or generated_dir()
    written = []
    for rel, text in expected_files(spec).items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
        written.append(target)
    return written


def stale_files(root: Path | None = None) -> list[str]:
    """Differences between `generated/` and the renders of the shipped specs (empty: in sync)."""
    root = root or generated_dir()
    expected = {}
    for spec in shipped_specs():
        expected.update(expected_files(spec))
    problems = []
    for rel, text in expected.items():
        target = root / rel
        if not target.exists():
            problems.append(f"missing: {rel}")
        elif target.read_text() != text:
            problems.append(f"differs: {rel}")
    present = {p.relative_to(root) for p in root.rglob("*") if p.is_file()} if root.exists() else set()
    problems.extend(f"not produced by any shipped spec: {rel}" for rel in sorted(present - set(expected)))
    return problems
