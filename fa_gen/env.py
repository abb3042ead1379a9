"""Every environment variable fa_gen reads, in one place.

Each knob is read when its function is called, never at import time, so a
test (or a long-lived process) that changes `os.environ` sees the new value.
Nothing else in fa_gen touches `os.environ` for configuration.

Knobs:

- `FA_GEN_CACHE_DIR`: root of the kernel cache. Default
  `$XDG_CACHE_HOME/fa_gen`, else `~/.cache/fa_gen`.
- `FA_GEN_DISABLE_CACHE`: no disk cache; kernels are built into a temporary
  directory and kept in memory only.
- `FA_GEN_FORCE_RECOMPILE`: ignore existing disk entries, rebuild and
  overwrite them (once per kernel per process).
- `FA_GEN_ARCH`: target arch (`sm_80`, `sm_90a`, ...) instead of the one of
  the current GPU; lets a machine without a GPU compile.
- `FA_GEN_DUMP_DIR`: write every rendered source into this directory.
- `FA_GEN_FAST_LOAD`: load cached kernels as shared libraries through TVM-FFI,
  without importing the CuTe DSL (fa_gen.backends.cute_dsl); on by default
  (0 loads every kernel through the DSL's own loader).
- `CC`: the C compiler that links those libraries (default `cc`).

Boolean knobs accept 1/true/yes/on and 0/false/no/off (any case); an empty
value counts as unset. Anything else is an error rather than a guess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import FaGenError

CACHE_DIR = "FA_GEN_CACHE_DIR"
DISABLE_CACHE = "FA_GEN_DISABLE_CACHE"
FORCE_RECOMPILE = "FA_GEN_FORCE_RECOMPILE"
ARCH = "FA_GEN_ARCH"
DUMP_DIR = "FA_GEN_DUMP_DIR"
FAST_LOAD = "FA_GEN_FAST_LOAD"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _raw(name: str) -> str | None:
    """The variable's value with surrounding blanks removed; None when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def _flag(name: str, default: bool = False) -> bool:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    allowed = "/".join(sorted(_TRUE)) + " or " + "/".join(sorted(_FALSE))
    raise FaGenError(f"{name}={value!r} is not a boolean; use {allowed}")


def _path(name: str) -> Path | None:
    value = _raw(name)
    return Path(value).expanduser() if value is not None else None


def cache_dir() -> Path:
    """Root of the on-disk kernel cache (`FA_GEN_CACHE_DIR`, else the XDG cache dir)."""
    explicit = _path(CACHE_DIR)
    if explicit is not None:
        return explicit
    xdg = _raw("XDG_CACHE_HOME")
    # The XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    if xdg is not None and os.path.isabs(xdg):
        return Path(xdg) / "fa_gen"
    return Path.home() / ".cache" / "fa_gen"


def cache_disabled() -> bool:
    """True when `FA_GEN_DISABLE_CACHE` asks for no disk cache (memory only)."""
    return _flag(DISABLE_CACHE)


def force_recompile() -> bool:
    """True when `FA_GEN_FORCE_RECOMPILE` asks to ignore and overwrite disk entries."""
    return _flag(FORCE_RECOMPILE)


def target_arch() -> str | None:
    """The arch named by `FA_GEN_ARCH` (e.g. `sm_90a`), or None to use the current GPU's.

    Returned as written; `archs.arch_info` validates it and lists the known ones.
    """
    return _raw(ARCH)


def dump_dir() -> Path | None:
    """Directory named by `FA_GEN_DUMP_DIR` to receive every rendered source, or None."""
    return _path(DUMP_DIR)


def fast_load() -> bool:
    """True unless `FA_GEN_FAST_LOAD` is off: cached kernels load through TVM-FFI alone (verified
    on the H100 at 391b14f: tests/test_gpu_forward.py, 97 passed through it)."""
    return _flag(FAST_LOAD, default=True)


def c_compiler() -> str:
    """The C compiler (`CC`, else `cc`) that links a cached object into a shared library."""
    return _raw("CC") or "cc"


@dataclass(frozen=True)
class _Knob:
    name: str
    read: Callable[[], object]


_KNOBS = (
    _Knob(CACHE_DIR, cache_dir),
    _Knob(DISABLE_CACHE, cache_disabled),
    _Knob(FORCE_RECOMPILE, force_recompile),
    _Knob(ARCH, target_arch),
    _Knob(DUMP_DIR, dump_dir),
    _Knob(FAST_LOAD, fast_load),
)


def _effective(knob: _Knob) -> object:
    # describe() is what a user runs to debug their setup, so a bad value is
    # shown as such instead of aborting the listing.
    try:
        value = knob.read()
    except FaGenError as exc:
        return f"<invalid: {exc}>"
    return str(value) if isinstance(value, Path) else value


def describe() -> dict[str, dict[str, object]]:
    """Every knob: `{name: {"value": effective value, "raw": as set or None, "help": doc}}`."""
    return {
        knob.name: {
            "value": _effective(knob),
            "raw": os.environ.get(knob.name),
            "help": (knob.read.__doc__ or "").strip().splitlines()[0],
        }
        for knob in _KNOBS
    }
