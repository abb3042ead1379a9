"""The arch registry: which template family serves a (spec, arch), and why not.

An arch is named as the CuTe DSL / NVCC target is (`sm_80`, `sm_90a`, ...).
Families register themselves in preference order; the first one whose
`can_implement` returns no reasons serves the pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UnsupportedError
from .spec import Spec


@dataclass(frozen=True)
class ArchInfo:
    name: str
    compute_capability: tuple[int, int]
    # Largest dynamic shared memory one block may opt into, in bytes.
    max_smem_per_block: int


ARCHS: dict[str, ArchInfo] = {
    a.name: a
    for a in (
        ArchInfo("sm_75", (7, 5), 64 * 1024),
        ArchInfo("sm_80", (8, 0), 163 * 1024),
        ArchInfo("sm_86", (8, 6), 99 * 1024),
        ArchInfo("sm_89", (8, 9), 99 * 1024),
        ArchInfo("sm_90a", (9, 0), 227 * 1024),
        ArchInfo("sm_100a", (10, 0), 227 * 1024),
        ArchInfo("sm_120a", (12, 0), 99 * 1024),
    )
}


def arch_info(arch: str) -> ArchInfo:
    try:
        return ARCHS[arch]
    except KeyError:
        raise UnsupportedError(f"arch {arch!r}", [f"unknown arch; known: {', '.join(ARCHS)}"]) from None


def arch_for_capability(major: int, minor: int) -> str:
    """The compile target for a device of this compute capability."""
    for info in ARCHS.values():
        if info.compute_capability == (major, minor):
            return info.name
    raise UnsupportedError(f"compute capability {major}.{minor}",
                           [f"no target known; known: {', '.join(ARCHS)}"])


def _families():
    # Imported lazily: families import this module for ArchInfo.
    from .families import REGISTRY

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
    """Every registered arch that some family can implement `spec` on (the default `archs`)."""
    return tuple(a for a in ARCHS if not why_not(spec, a))
