"""The arch registry: which template family serves a (spec, arch), and why not.

An arch is named as the CuTe DSL / NVCC target is (`sm_80`, `sm_90a`, ...).
Families register themselves in preference order; the first one whose
`can_implement` returns no reasons serves the pair.
"""

from __future__ import annotations

from .arch_table import ARCHS, BLACKWELL_ARCHS, ArchInfo, arch_for_capability, arch_info, named_by  # noqa: F401 (the registry's names)
from .errors import UnsupportedError
from .families import REGISTRY
from .spec import Spec


def _families():
    return REGISTRY


def why_not(spec: Spec, arch: str) -> list[str]:
    """Every reason no family can implement `spec` on `arch` (empty: some family can)."""
    reasons: list[str] = []
    for family in _families():
        family_reasons = family.can_implement(spec, arch)
        if not family_reasons:
            return []
        reasons.extend(f"{family.name}: {r}" for r in family_reasons)
    return reasons or ["no template family is registered"]


def family_for(spec: Spec, arch: str, name: str | None = None):
    """The preferred family for (spec, arch), or the family called `name` if it can serve it."""
    if name is not None:
        family = family_named(name)
        reasons = family.can_implement(spec, arch)
        if reasons:
            raise UnsupportedError(f"family {name} for spec {spec.name!r} on {arch}", reasons)
        return family
    for family in _families():
        if not family.can_implement(spec, arch):
            return family
    raise UnsupportedError(f"spec {spec.name!r} on {arch}", why_not(spec, arch))


def family_named(name: str):
    for family in _families():
        if family.name == name:
            return family
    known = ", ".join(f.name for f in _families())
    raise UnsupportedError(f"family {name!r}", [f"unknown family; known: {known}"])


def supported_archs(spec: Spec) -> tuple[str, ...]:
    """Every registered arch, family-portable `f` targets aside, that some family can implement
    `spec` on (the default `archs`; an `f` target is built when a spec or a call names it)."""
    return tuple(a for a, info in ARCHS.items() if not info.portable and not why_not(spec, a))
