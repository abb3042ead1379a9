"""CuTe DSL backend: rendered Python module -> object file -> TVM-FFI callable.

The rendered module defines `FlashAttentionForward` (or names its entry class in
`ENTRY_CLASS`) and `compile_arguments()`
(fake tensors with symbolic shapes), so one compiled kernel serves every
runtime shape. Compilation needs no GPU: the target comes from `--gpu-arch`.
The object file embeds the cubin and the host launcher; loading it back takes
milliseconds, which is what the disk cache relies on.

Loading. The DSL loads an object through its MLIR execution engine, which costs importing the
DSL (about 0.9 s on a CPU host here, 1.6 s measured on the H200's). With FA_GEN_FAST_LOAD=1 the
object is linked once into a shared library beside it (`object-<sha256[:16]>.so`, named by the
object's bytes, so a rebuilt entry never meets a stale library; the system C compiler `$CC` or
`cc` links it against the DSL's runtime and TVM-FFI libraries) and later loads go through
TVM-FFI alone: the DSL is not imported on a warm start. The object code is the same and its
CUDA module still loads lazily on the first call. Any failure (no compiler, a library that does
not load) falls back to the DSL's loader. Opt-in until the GPU suites have run through it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import env
from ..errors import CompileError

ENTRY_SYMBOL = "fa_gen_forward"
_log = logging.getLogger(__name__)
COMPILE_OPTIONS = "--enable-tvm-ffi"


def compile_options(arch: str) -> str:
    """Everything besides the source that changes the object: part of the cache key."""
    return f"{COMPILE_OPTIONS} --gpu-arch {arch}"


def _import_rendered(source: str, module_name: str):
    # The DSL's AST preprocessor reads function source through `inspect`, so the
    # module must come from a real file, not exec() of a string.
    workdir = Path(tempfile.mkdtemp(prefix="fa_gen_src_"))
    path = workdir / f"{module_name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(module_name, None)
    return module


def compile_to_object(source: str, arch: str, object_path: Path, *, label: str = "kernel",
                      extra_options: str = "") -> float:
    """Compile rendered `source` for `arch` into `object_path`; returns seconds spent.
    `extra_options` (DSL compile flags, e.g. remark output) are for diagnostics: objects built
    with them must not go into the cache, whose keys do not include them."""
    import cutlass.cute as cute

    start = time.perf_counter()
    module = _import_rendered(source, f"fa_gen_rendered_{abs(hash(source)) & 0xFFFFFFFF:08x}")
    try:
        compiled = cute.compile(_entry_class(module)(), *module.compile_arguments(),
                                options=f"{compile_options(arch)} {extra_options}".strip())
        compiled.export_to_c(str(object_path), ENTRY_SYMBOL)
    except Exception as exc:  # the DSL raises many types; all mean "fa_gen rendered bad code"
        raise CompileError(f"CuTe DSL failed to compile {label} for {arch}: {exc}") from exc
    return time.perf_counter() - start


def _entry_class(module):
    # A forward render defines FlashAttentionForward; other kinds name theirs in ENTRY_CLASS.
    return getattr(module, "ENTRY_CLASS", None) or module.FlashAttentionForward


def load_object(object_path: Path):
    """Load a compiled object; returns the TVM-FFI function `(q, k, v, o, lse) -> None`."""
    if env.fast_load():
        function = load_shared(Path(object_path))
        if function is not None:
            return function
    from cutlass.cute.runtime import load_module

    module = load_module(str(object_path), enable_tvm_ffi=True)
    return getattr(module, ENTRY_SYMBOL)


def shared_library_path(object_path: Path) -> Path:
    """The shared library linked from `object_path`, named by the object's sha256."""
    digest = hashlib.sha256(Path(object_path).read_bytes()).hexdigest()[:16]
    return Path(object_path).parent / f"object-{digest}.so"


def load_shared(object_path: Path):
    """The entry function through TVM-FFI from the object's shared library (linked now if it
    is missing); None where that cannot be done (the caller falls back to the DSL)."""
    library = shared_library_path(object_path)
    if not library.exists() and not link_shared(object_path, library):
        return None
    try:
        import tvm_ffi

        return tvm_ffi.load_module(str(library))[ENTRY_SYMBOL]
    except Exception as exc:  # a torn or foreign file: the DSL's loader still works
        _log.warning("fa_gen: %s did not load through TVM-FFI (%s); using the DSL's loader", library, exc)
        return None


def link_shared(object_path: Path, library: Path) -> bool:
    """Link `object_path` into `library` (written under a temporary name, renamed whole)."""
    compiler = shutil.which(env.c_compiler())
    if compiler is None:
        return False
    from cutlass.cute.runtime import find_runtime_libraries

    libraries = [Path(p) for p in find_runtime_libraries(enable_tvm_ffi=True)]
    rpaths = [f"-Wl,-rpath,{d}" for d in dict.fromkeys(str(p.parent) for p in libraries)]
    temporary = library.with_name(f".{library.name}.{os.getpid()}.tmp")
    command = [compiler, "-shared", "-o", str(temporary), str(object_path), *map(str, libraries), *rpaths]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            _log.warning("fa_gen: linking %s failed: %s", library, result.stderr.strip()[:500])
            return False
        os.replace(temporary, library)
        return True
    except OSError as exc:
        _log.warning("fa_gen: linking %s failed: %s", library, exc)
        return False
    finally:
        temporary.unlink(missing_ok=True)


def ptxas_remarks(source: str, arch: str) -> str:
    """What ptxas says about rendered `source` on `arch` (its performance remarks, e.g. register
    spills or wgmma serialized for want of registers, C7512), as the DSL's YAML remark text."""
    with tempfile.TemporaryDirectory(prefix="fa_gen_remarks_") as workdir:
        remarks = Path(workdir) / "remarks.yaml"
        compile_to_object(source, arch, Path(workdir) / "kernel.o", label="remarks",
                          extra_options=f"--ptxas-options=-v --remark-filter=ptxas --remark-output={remarks}")
        return remarks.read_text() if remarks.exists() else ""
