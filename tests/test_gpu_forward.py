"""L1: every forward variant against the float64 reference on a CUDA GPU.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_forward.py
Kernels are compiled once per variant (in parallel first, by `fa_gen.precompile`,
when FA_GEN_PRECOMPILE_JOBS is set) and shapes are drawn fresh for every example.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen.check import Shape, check_kernel

from .variants import variant_specs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

SPECS = variant_specs()


@pytest.fixture(scope="module")
def kernels():
    from fa_gen.runtime import build, current_arch

    arch = current_arch()
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    if jobs > 1:
        from fa_gen.precompile import precompile

        precompile([(spec, arch) for spec in SPECS], jobs=jobs)
    return {spec.name: build(spec, arch) for spec in SPECS}


shapes = st.builds(
    lambda b, sq, sk, hkv, ratio: Shape(b, sq, sk, hkv * ratio, hkv),
    st.integers(1, 4), st.integers(1, 2048), st.integers(1, 2048), st.integers(1, 4), st.integers(1, 8),
)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from([s.name for s in SPECS]), shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_forward_matches_reference(kernels, name, shape, seed):
    result = check_kernel(kernels[name], shape, seed=seed)
    assert result.ok, f"{name}: {result}"


# Shapes that stress the edges on purpose: tails of every size, seqlen_q > seqlen_k
# (bottom-right masks leave whole rows empty), a single key, a single query.
EDGE_SHAPES = [Shape(1, 1, 1, 1, 1), Shape(2, 257, 1000, 6, 2), Shape(1, 1000, 257, 8, 1),
               Shape(3, 1, 2048, 4, 4), Shape(1, 2048, 1, 2, 2), Shape(2, 129, 127, 16, 2)]


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_edge_shapes(kernels, name):
    failures = [str(r) for r in (check_kernel(kernels[name], shape, seed=i)
                                 for i, shape in enumerate(EDGE_SHAPES)) if not r.ok]
    assert not failures, f"{name}:\n" + "\n".join(failures)
