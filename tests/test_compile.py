"""L0: every shipped spec compiles to an object (embedded cubin) for every arch it names,
its forward kernel and its backward kernel (rendered by the family `build_backward` picks).

Compiling needs no GPU. The kernels are built in parallel into a cache shared
by this test session, and a second process then loads one without recompiling.
"""

import concurrent.futures as futures
import json
import multiprocessing
import os
import subprocess
import sys

import pytest

from fa_gen import generate

SHIPPED = generate.shipped_specs()
PAIRS = [(spec, arch) for spec in SHIPPED for arch in spec.archs]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fa_gen_cache")
    old = os.environ.get("FA_GEN_CACHE_DIR")
    os.environ["FA_GEN_CACHE_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("FA_GEN_CACHE_DIR", None)
    else:
        os.environ["FA_GEN_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def compiled(cache_dir):
    from fa_gen.precompile import precompile

    seconds = precompile(PAIRS, jobs=int(os.environ.get("FA_GEN_JOBS", os.cpu_count() or 1)))
    print(f"\ncompiled {len(PAIRS)} kernels in {seconds:.0f} s")
    return cache_dir


def _has_backward(spec, arch):
    from fa_gen.backward import backward_family
    from fa_gen.errors import UnsupportedError

    try:
        backward_family(spec, arch)
        return True
    except UnsupportedError:
        return False


# Every (spec, arch) whose serving families include one that renders a backward kernel.
BACKWARD_PAIRS = [(spec, arch) for spec, arch in PAIRS if _has_backward(spec, arch)]


def _build_backward(spec, arch):
    from fa_gen.backward import build_backward

    return build_backward(spec, arch).info.seconds


@pytest.fixture(scope="module")
def compiled_backward(cache_dir):
    jobs = int(os.environ.get("FA_GEN_JOBS", os.cpu_count() or 1))
    context = multiprocessing.get_context("spawn")  # no inherited CUDA or DSL state
    with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        seconds = list(pool.map(_build_backward, *zip(*BACKWARD_PAIRS)))
    print(f"\ncompiled {len(BACKWARD_PAIRS)} backward kernels, {sum(seconds):.0f} s of compile time")
    return cache_dir


def _object_for(cache_dir, spec, arch, kind="forward"):
    # Entries are named <spec>_<kind>_<12-hex digest>; "forward" must not match "forward_short".
    matches = [p for p in cache_dir.rglob("meta.json")
               if p.parent.parent.name == arch and p.parent.name.rsplit("_", 1)[0] == f"{spec.name}_{kind}"]
    assert len(matches) == 1, f"expected one cache entry for {spec.name} {arch}, found {matches}"
    return next(p for p in matches[0].parent.iterdir() if p.suffix == ".o")


@pytest.mark.parametrize("spec,arch", PAIRS, ids=[f"{s.name}-{a}" for s, a in PAIRS])
def test_compiles_to_cubin(compiled, spec, arch):
    from fa_gen.backends import nvrtc

    path = _object_for(compiled, spec, arch)
    data = path.read_bytes()
    if data.startswith(nvrtc.MAGIC):  # NVRTC (sm75): a launch-configuration line, then a bare cubin
        data = nvrtc.read_object(path)[1]
        assert data.startswith(b"\x7fELF"), "the NVRTC object holds no cubin"
    # The object embeds the cubin; ptxas records the target it assembled for.
    assert f"-arch {arch}".encode() in data, f"no {arch} cubin in the object"


@pytest.mark.parametrize("spec,arch", BACKWARD_PAIRS, ids=[f"{s.name}-{a}" for s, a in BACKWARD_PAIRS])
def test_backward_compiles_to_cubin(compiled_backward, spec, arch):
    data = _object_for(compiled_backward, spec, arch, "backward").read_bytes()
    assert f"-arch {arch}".encode() in data, f"no {arch} cubin in the backward object"


def _variant_kinds(spec, arch):
    from fa_gen.archs import family_for

    return [kind for _, kind in family_for(spec, arch).forward_variants(spec, arch) if kind != "forward"]


# Forward kinds a kernel picks per call (a short-sequence tile); precompile builds them too.
VARIANT_PAIRS = [(spec, arch, kind) for spec, arch in PAIRS for kind in _variant_kinds(spec, arch)]


@pytest.mark.parametrize("spec,arch,kind", VARIANT_PAIRS, ids=[f"{s.name}-{a}-{k}" for s, a, k in VARIANT_PAIRS])
def test_forward_variants_compile_to_cubin(compiled, spec, arch, kind):
    data = _object_for(compiled, spec, arch, kind).read_bytes()
    assert f"-arch {arch}".encode() in data, f"no {arch} cubin in the {kind} object"


def test_second_process_loads_without_recompiling(compiled):
    spec, arch = PAIRS[0]
    code = ("import json, fa_gen; k = fa_gen.build(%r, %r); "
            "print(json.dumps({'compiled': k.info.compiled, 'seconds': k.info.seconds}))"
            % (spec.source, arch))
    env = dict(os.environ, FA_GEN_CACHE_DIR=str(compiled))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["compiled"] is False
    print(f"\nwarm load of {spec.name} for {arch} in a fresh process: {report['seconds']:.3f} s")
