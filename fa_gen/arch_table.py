"""The arch table: each compile target (`sm_80`, `sm_90a`, ...) and what the families need to know
of it. Below the family registry (fa_gen.archs), which imports the families that read this."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UnsupportedError


@dataclass(frozen=True)
class ArchInfo:
    name: str
    compute_capability: tuple[int, int]
    # Largest dynamic shared memory one block may opt into, in bytes.
    max_smem_per_block: int
    # A family-portable target (`f`): its binary runs on every GPU of the family at or above its
    # capability (sm_100f on sm_100 and sm_103). Built when named; never a spec's default arch
    # nor a device's own (that is the arch-specific `a` target of its capability).
    portable: bool = False


# Shared memory per block: the CUDA programming guide's per-capability limits (Blackwell: 227 KB
# on 10.x and 11.0, 99 KB on 12.x; not yet measured on such hardware here).
_BLACKWELL = (
    ("sm_100", (10, 0), 227), ("sm_103", (10, 3), 227), ("sm_110", (11, 0), 227),
    ("sm_120", (12, 0), 99), ("sm_121", (12, 1), 99),
)

ARCHS: dict[str, ArchInfo] = {
    a.name: a
    for a in (
        ArchInfo("sm_75", (7, 5), 64 * 1024),
        ArchInfo("sm_80", (8, 0), 163 * 1024),
        ArchInfo("sm_86", (8, 6), 99 * 1024),
        ArchInfo("sm_89", (8, 9), 99 * 1024),
        ArchInfo("sm_90a", (9, 0), 227 * 1024),
        *(ArchInfo(f"{base}{suffix}", capability, kib * 1024, portable=suffix == "f")
          for base, capability, kib in _BLACKWELL for suffix in ("a", "f")),
    )
}

# The Blackwell targets (the CuTe DSL's `a` and `f` targets of capabilities 10.0 to 12.1).
BLACKWELL_ARCHS = tuple(name for name, info in ARCHS.items() if info.compute_capability[0] >= 10)


def arch_info(arch: str) -> ArchInfo:
    try:
        return ARCHS[arch]
    except KeyError:
        raise UnsupportedError(f"arch {arch!r}", [f"unknown arch; known: {', '.join(ARCHS)}"]) from None


def named_by(arch: str, archs: tuple[str, ...]) -> bool:
    """Whether a spec listing `archs` targets `arch`: listed itself, or, for a family-portable
    target, its capability's arch-specific one (a spec for sm_100a builds for sm_100f too)."""
    if arch in archs:
        return True
    info = ARCHS.get(arch)
    return info is not None and info.portable and arch_for_capability(*info.compute_capability) in archs


def arch_for_capability(major: int, minor: int) -> str:
    """The compile target for a device of this compute capability."""
    for info in ARCHS.values():
        if info.compute_capability == (major, minor) and not info.portable:
            return info.name
    raise UnsupportedError(f"compute capability {major}.{minor}",
                           [f"no target known; known: {', '.join(ARCHS)}"])


def programmatic_launch(arch: str) -> bool:
    """Whether kernels for `arch` may chain by programmatic dependent launch (PTX griddepcontrol,
    CUDA's programmatic stream serialization): compute capability 9.0 on."""
    info = ARCHS.get(arch)
    return info is not None and info.compute_capability >= (9, 0)
