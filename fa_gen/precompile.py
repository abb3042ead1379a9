"""Compile many (spec, arch[, family]) kernels in parallel processes, filling the disk cache.

The CuTe DSL compiles on one core; a machine with many cores compiles a whole
test matrix in the time of a few kernels. Workers share nothing but the disk
cache, whose per-entry lock makes concurrent builds of one key safe.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import time

from .spec import Spec


def _build_one(spec: Spec, arch: str, family: str | None = None) -> tuple[str, str, float, bool]:
    from .runtime import build

    kernel = build(spec, arch, family=family)
    kernel.load_variants()
    return spec.name, arch, kernel.info.seconds, kernel.info.compiled


def precompile(pairs: list[tuple], jobs: int | None = None, log=print) -> float:
    """Build every (spec, arch) or (spec, arch, family) into the disk cache; returns wall seconds."""
    start = time.perf_counter()
    jobs = jobs or max(1, multiprocessing.cpu_count())
    context = multiprocessing.get_context("spawn")  # no inherited CUDA or DSL state
    with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        pending = [pool.submit(_build_one, *pair) for pair in pairs]
        for done in futures.as_completed(pending):
            name, arch, seconds, compiled = done.result()
            log(f"  {name} {arch}: {'compiled' if compiled else 'cached'} in {seconds:.1f} s")
    return time.perf_counter() - start


def _load_kind(spec: Spec, arch: str, kind: str) -> tuple[str, str]:
    from .inference import inference_kernel

    inference_kernel(spec, arch, kind)
    return spec.name, kind


def precompile_kinds(work: list[tuple[Spec, str, str]], jobs: int = 0) -> None:
    """Compile every (spec, arch, kind) inference kernel (fa_gen.inference.inference_kernel) into
    the disk cache, in `jobs` processes when jobs > 1, then load each into this process."""
    if jobs > 1:
        context = multiprocessing.get_context("spawn")  # no inherited CUDA or DSL state
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            list(pool.map(_load_kind, *zip(*work)))
    for item in work:
        _load_kind(*item)
