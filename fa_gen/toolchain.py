"""The toolchain fingerprint: everything besides the spec that can change a compiled kernel.

Part of every cache key, and the top directory of the disk cache, so a new
fa_gen, an edited template, another CuTe DSL wheel or CUDA flavor, or another
Python never reuses an object built by a different toolchain.

Computed once per process (first kernel build or load) and kept: the sources
hash reads every fa_gen `.py` file and template, and scanning installed
distributions costs tens of milliseconds.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import sys
from pathlib import Path

from . import paths
from .version import __version__

_PACKAGE_DIR = Path(__file__).resolve().parent
_CUTLASS_DSL_PREFIX = "nvidia-cutlass-dsl"
# The NVRTC family's compiler and headers; NVRTC's own version and those of the headers it
# finds (which may come from a CUDA toolkit instead) are in its compile options as well.
_OTHER_DISTRIBUTIONS = ("apache-tvm-ffi", "cuda-python", "cuda-bindings", "nvidia-cutlass", "nvidia-cuda-nvrtc",
                        "nvidia-cuda-cccl", "nvidia-cuda-runtime")
_LOADED_CUTLASS_IR = "cutlass._mlir._mlir_libs._cutlass_ir"
_FLAVOR_SO = re.compile(r"^_cutlass_ir\.cu(\d+)\.")


def canonical_json(value: object) -> str:
    """One spelling per value: sorted keys, no blanks, and only JSON-native types.

    No `default=` fallback on purpose: `str()` of an arbitrary object may embed
    an address or vary by version, which would make keys silently unstable.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _tree_files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.rglob(pattern)
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def _hash_tree(digest: "hashlib._Hash", label: str, root: Path, pattern: str) -> None:
    # The relative path goes into the hash too, so renaming or moving a file counts.
    for path in _tree_files(root, pattern):
        digest.update(f"{label}/{path.relative_to(root).as_posix()}\0".encode())
        digest.update(path.read_bytes())
        digest.update(b"\0")


def sources_sha256() -> str:
    """sha256 over fa_gen's own `.py` sources and the whole templates tree."""
    digest = hashlib.sha256()
    _hash_tree(digest, "fa_gen", _PACKAGE_DIR, "*.py")
    # Through the module attribute, read at call time, so tests can point it elsewhere.
    _hash_tree(digest, "templates", paths.templates_dir(), "*")
    return digest.hexdigest()


def _distribution_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {name: None for name in _OTHER_DISTRIBUTIONS}
    for dist in importlib.metadata.distributions():
        name = _installed_name(dist)
        if name.startswith(_CUTLASS_DSL_PREFIX) or name in versions:
            versions[name] = dist.version
    return dict(sorted(versions.items()))


def _installed_name(dist) -> str:
    """A distribution's normalised name, from its `<name>-<version>.dist-info` folder where it
    has one (no metadata parse: reading every installed package's METADATA cost a warm start
    ~0.1 s), else from its metadata."""
    folder = Path(str(getattr(dist, "_path", "")))
    if folder.suffix == ".dist-info" and "-" in folder.stem:
        return folder.stem.rsplit("-", 1)[0].lower().replace("_", "-").replace(".", "-")
    return (dist.metadata["Name"] or "").lower().replace("_", "-")


def _driver_cuda_major() -> int | None:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value // 1000
    except (OSError, AttributeError):
        pass
    return None


def _flavor_of(filename: str) -> int | None:
    match = _FLAVOR_SO.match(filename)
    return int(match.group(1)) if match else None


def _predicted_dsl_flavor() -> int | None:
    """The CUDA major whose `_cutlass_ir` the DSL will load, found without importing it.

    Mirrors `cutlass/_mlir/_mlir_libs/__init__.py`: the newest installed flavor
    the driver supports, or the newest one when there is no driver. Importing
    cutlass to ask costs ~1.5 s, too much for a fingerprint.
    """
    spec = importlib.util.find_spec("cutlass")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs_dir = Path(next(iter(spec.submodule_search_locations))) / "_mlir" / "_mlir_libs"
    flavors = sorted(f for f in map(_flavor_of, (p.name for p in libs_dir.glob("_cutlass_ir.cu*")))
                     if f is not None)
    driver_major = _driver_cuda_major()
    usable = [f for f in flavors if driver_major is None or f <= driver_major]
    return usable[-1] if usable else None


def dsl_cuda_flavor() -> str | None:
    """`cu12`/`cu13`: the CUDA toolkit flavor the CuTe DSL compiles with, or None without the DSL.

    Both flavors can be installed side by side and the DSL picks one by the
    driver, so the same wheels compile different objects on different machines.
    The exact CUDA minor follows from the flavor's wheel version, already in the fingerprint.
    """
    loaded = sys.modules.get(_LOADED_CUTLASS_IR)
    flavor = _flavor_of(Path(getattr(loaded, "__file__", "") or "").name) if loaded else None
    flavor = flavor if flavor is not None else _predicted_dsl_flavor()
    return f"cu{flavor}" if flavor is not None else None


@functools.lru_cache(maxsize=1)
def _fingerprint_json() -> str:
    return canonical_json({
        "fa_gen": __version__,
        "sources_sha256": sources_sha256(),
        "distributions": _distribution_versions(),
        "dsl_cuda": dsl_cuda_flavor(),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    })


def fingerprint() -> dict:
    """The toolchain as a JSON-able dict (a fresh copy; computed once per process)."""
    return json.loads(_fingerprint_json())


def fingerprint_hash() -> str:
    """sha256 of the canonical JSON of `fingerprint()`."""
    return sha256_text(_fingerprint_json())


def clear_fingerprint_cache() -> None:
    """Forget the per-process fingerprint (tests that edit sources or templates)."""
    _fingerprint_json.cache_clear()
