"""L0: every shipped spec compiles to an object (embedded cubin) for every arch it names.

Compiling needs no GPU. The kernels are built in parallel into a cache shared
by this test session, and a second process then loads one without recompiling.
"""

import json
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


def _object_for(cache_dir, spec, arch):
    matches = [p for p in cache_dir.rglob("meta.json")
               if p.parent.parent.name == arch and p.parent.name.startswith(f"{spec.name}_forward_")]
    assert len(matches) == 1, f"expected one cache entry for {spec.name} {arch}, found {matches}"
    return next(p for p in matches[0].parent.iterdir() if p.suffix == ".o")


@pytest.mark.parametrize("spec,arch", PAIRS, ids=[f"{s.name}-{a}" for s, a in PAIRS])
def test_compiles_to_cubin(compiled, spec, arch):
    data = _object_for(compiled, spec, arch).read_bytes()
    # The object embeds the cubin; ptxas records the target it assembled for.
    assert f"-arch {arch}".encode() in data, f"no {arch} cubin in the object"


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
