"""Subprocess side of tests/test_cache.py: one `get_or_build`, its outcome as JSON on stdout.

    python tests/_cache_worker.py --kind toy --count-file F [--start-file S] [--build-seconds T]
    python tests/_cache_worker.py --kind cute --count-file F

The cache root comes from FA_GEN_CACHE_DIR, as in real use. Every call of
the build function appends a line to the count file, so the parent test can
count compiles across processes. `toy` "compiles" by copying the source
(fast); `cute` compiles a real elementwise CuTe DSL kernel to an object file
(`CUTE_DSL_ARCH` picks the target, no GPU needed) and loads it back through
TVM-FFI.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from fa_gen.cache import KernelCache, CacheKey

TOY_SOURCE = "OBJ: toy kernel source\n"

CUTE_SOURCE = '''
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream


@cute.kernel
def double_kernel(mA: cute.Tensor, mB: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < mA.shape[0]:
        mB[i] = mA[i] * 2.0


@cute.jit
def double(mA: cute.Tensor, mB: cute.Tensor, stream):
    n = mA.shape[0]
    double_kernel(mA, mB).launch(grid=((n + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream)


def compile_arguments():
    n = cute.sym_int()  # one object serves every length
    a = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    b = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    return a, b, make_fake_stream(use_tvm_ffi_env_stream=True)
'''

ENTRY_SYMBOL = "fa_gen_forward"


def count_build(count_file: Path) -> None:
    with open(count_file, "a") as handle:
        handle.write(f"{os.getpid()}\n")


def toy_build(source: str, object_path: Path, count_file: Path, seconds: float) -> None:
    count_build(count_file)
    time.sleep(seconds)  # holds the entry lock long enough for a rival to queue on it
    object_path.write_text(source)


def toy_load(object_path: Path) -> str:
    text = object_path.read_text()
    if not text.startswith("OBJ:"):
        raise ValueError("not a toy object")
    return text


def _import_source(source: str, workdir: Path):
    # The DSL reads kernel source through `inspect`, so it must live in a real file.
    path = workdir / "cute_toy_kernel.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("cute_toy_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cute_build(source: str, object_path: Path, count_file: Path) -> None:
    import cutlass.cute as cute

    count_build(count_file)
    module = _import_source(source, Path(tempfile.mkdtemp(prefix="fa_gen_test_src_")))
    compiled = cute.compile(module.double, *module.compile_arguments(), options="--enable-tvm-ffi")
    compiled.export_to_c(str(object_path), ENTRY_SYMBOL)


def cute_load(object_path: Path):
    from cutlass.cute.runtime import load_module

    return getattr(load_module(str(object_path), enable_tvm_ffi=True), ENTRY_SYMBOL)


def _is_tvm_ffi_function(value) -> bool:
    import tvm_ffi

    return isinstance(value, tvm_ffi.Function)


def wait_for_start(start_file: Path | None) -> None:
    """A barrier: say we are ready, then wait for the parent to create `start_file`.

    So racing processes reach the cache at the same moment however slowly each one started.
    """
    if start_file is None:
        return
    start_file.with_name(f"{start_file.name}.ready.{os.getpid()}").touch()
    while not start_file.exists():
        time.sleep(0.005)


def run(args: argparse.Namespace) -> dict:
    if args.kind == "cute":
        # Imported up front so build and load times exclude them (tvm_ffi pulls in torch).
        import cutlass  # noqa: F401
        import tvm_ffi  # noqa: F401

        source, arch = CUTE_SOURCE, os.environ.get("CUTE_DSL_ARCH", "sm_80")
        build = lambda src, path: cute_build(src, path, args.count_file)  # noqa: E731
        load = cute_load
    else:
        source, arch = TOY_SOURCE, "sm_80"
        build = lambda src, path: toy_build(src, path, args.count_file, args.build_seconds)  # noqa: E731
        load = toy_load
    key = CacheKey.for_source(uri=f"{args.kind}_double", arch=arch, kind="forward", source=source,
                              fields={"spec": "{}", "options": "--enable-tvm-ffi"},
                              toolchain=args.toolchain)
    cache = KernelCache()
    wait_for_start(args.start_file)
    value = cache.get_or_build(key, source, build, load)
    stats = cache.stats
    return {
        "value": value if isinstance(value, str) else type(value).__qualname__,
        "is_tvm_ffi_function": args.kind == "cute" and _is_tvm_ffi_function(value),
        "builds": stats.builds, "hits_disk": stats.hits_disk, "repaired": stats.repaired,
        "build_seconds": stats.last_build_seconds, "load_seconds": stats.last_load_seconds,
        "entry": str(stats.last_entry),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("toy", "cute"), default="toy")
    parser.add_argument("--count-file", type=Path, required=True)
    parser.add_argument("--start-file", type=Path)
    parser.add_argument("--build-seconds", type=float, default=0.0)
    # Passed by the parent so that racing processes agree even while fa_gen's
    # sources (part of the real fingerprint) are being edited; None: this process's.
    parser.add_argument("--toolchain")
    json.dump(run(parser.parse_args()), sys.stdout)


if __name__ == "__main__":
    main()
