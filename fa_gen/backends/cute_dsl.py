"""CuTe DSL backend: rendered Python module -> object file -> TVM-FFI callable.

The rendered module defines `FlashAttentionForward` (or names its entry class in
`ENTRY_CLASS`) and `compile_arguments()`
(fake tensors with symbolic shapes), so one compiled kernel serves every
runtime shape. Compilation needs no GPU: the target comes from `--gpu-arch`.
The object file embeds the cubin and the host launcher; loading it back takes
milliseconds, which is what the disk cache relies on.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path

from ..errors import CompileError

ENTRY_SYMBOL = "fa_gen_forward"
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
    from cutlass.cute.runtime import load_module

    module = load_module(str(object_path), enable_tvm_ffi=True)
    return getattr(module, ENTRY_SYMBOL)


def ptxas_remarks(source: str, arch: str) -> str:
    """What ptxas says about rendered `source` on `arch` (its performance remarks, e.g. register
    spills or wgmma serialized for want of registers, C7512), as the DSL's YAML remark text."""
    with tempfile.TemporaryDirectory(prefix="fa_gen_remarks_") as workdir:
        remarks = Path(workdir) / "remarks.yaml"
        compile_to_object(source, arch, Path(workdir) / "kernel.o", label="remarks",
                          extra_options=f"--ptxas-options=-v --remark-filter=ptxas --remark-output={remarks}")
        return remarks.read_text() if remarks.exists() else ""
