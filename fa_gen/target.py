"""What one kernel is, decided once: (spec, arch, family, kind).

The registry's preference order, the spec's archs and the kind's availability are read here and
nowhere else; render, the cache key and the runtime receive the Target and ask no one again.

    target = resolve_target(spec, "sm_90a", "backward")      # the preferred family that renders it
    target = resolve_target(spec, "sm_90a", "forward", family="sm80")   # a family by name
"""

from __future__ import annotations

from dataclasses import dataclass

from .archs import family_named
from .errors import UnsupportedError
from .families import REGISTRY
from .families.base import Family
from .spec import Spec


@dataclass(frozen=True)
class Target:
    spec: Spec
    arch: str
    family: Family
    kind: str

    @property
    def files(self) -> tuple[str, str]:
        """(template path under templates/, rendered filename) of this kind."""
        template, filename = kinds_of(self.family, self.spec)[self.kind]
        return f"{self.family.name}/{template}", filename

    def context(self) -> dict:
        """The template context: the family's, the kind's, and the target itself."""
        context = self.family.render_context(self.spec, self.arch)
        context.update(self.family.kind_context(self.spec, self.arch, self.kind))
        context.update(spec=self.spec, arch=self.arch, family=self.family.name, kind=self.kind)
        return context


def kinds_of(family: Family, spec: Spec) -> dict[str, tuple[str, str]]:
    """Every kind `family` renders for `spec`: those in generated/ and those made per call."""
    return {**family.kernel_files(spec), **family.call_kinds(spec)}


def resolve_target(spec: Spec, arch: str, kind: str = "forward", family: str | None = None) -> Target:
    """The Target of `kind` for (spec, arch): the family called `family`, or the first of the
    registry that serves the pair and renders the kind; UnsupportedError with every reason."""
    candidates = [family_named(family)] if family is not None else REGISTRY
    reasons = []
    for candidate in candidates:
        why_not = _reasons(candidate, spec, arch, kind)
        if not why_not:
            return Target(spec, arch, candidate, kind)
        reasons.extend(f"{candidate.name}: {r}" for r in why_not)
    what = f"{kind} of spec {spec.name!r} on {arch}" + (f" with family {family}" if family else "")
    raise UnsupportedError(what, reasons or ["no template family is registered"])


def _reasons(family: Family, spec: Spec, arch: str, kind: str) -> list[str]:
    problems = family.can_implement(spec, arch)
    if problems or kind in kinds_of(family, spec):
        return problems
    return family.kind_reasons(spec, kind) or [f"renders no {kind} kernel for this spec "
                                                f"(it renders {', '.join(kinds_of(family, spec))})"]
