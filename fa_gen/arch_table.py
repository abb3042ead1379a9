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
