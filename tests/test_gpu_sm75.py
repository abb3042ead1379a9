"""The Turing family (sm75, CUDA C++ through NVRTC): its policy on any machine, its kernels on a GPU.

L1: no Turing GPU is at hand, so the very source rendered for sm_75 is compiled for the GPU
that is there (`build(..., family="sm75")`; every later arch runs the Turing instructions) and
checked against the float64 reference like tests/test_gpu_forward.py does.

    FA_GEN_PRECOMPILE_JOBS=16 python -m pytest -m gpu tests/test_gpu_sm75.py
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen import archs
from fa_gen.check import Shape, check_kernel, compare
from fa_gen.errors import UnsupportedError
from fa_gen.spec_load import load_spec

from .variants import variant_specs

FAMILY = "sm75"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)")
# Every fp16 variant the family implements on Turing: head dims 64, 96, 128 and 256, every mask.
SPECS = [s for s in variant_specs() if not archs.family_named(FAMILY).can_implement(s, "sm_75")]


# --- policy (CPU) ------------------------------------------------------------------------------

def test_bf16_is_refused_with_the_reason():
    spec = load_spec({"name": "t", "dtype": "bf16", "head_dim": 128})
    assert "sm_75" not in spec.archs
    with pytest.raises(UnsupportedError, match="Turing tensor cores have no bf16"):
        archs.family_for(spec, "sm_75", FAMILY)


def test_serves_later_archs_only_by_name():
    spec = load_spec({"name": "t", "dtype": "fp16", "head_dim": 64})
    assert archs.family_for(spec, "sm_75").name == FAMILY
    assert archs.family_for(spec, "sm_90a").name != FAMILY
    assert archs.family_for(spec, "sm_90a", FAMILY).name == FAMILY


def test_supported_variants():
    dims = sorted({s.head_dim_qk for s in SPECS})
    assert dims == [64, 96, 128, 256] and all(s.dtype.value == "fp16" for s in SPECS)


# --- exactness (GPU) ---------------------------------------------------------------------------

def _compile(spec, arch) -> float:
    from fa_gen.runtime import build

    return build(spec, arch, family=FAMILY).info.seconds


@pytest.fixture(scope="module")
def kernels():
    from fa_gen.runtime import build, current_arch

    arch = current_arch()
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    if jobs > 1:  # NVRTC compiles on one core: fill the disk cache in parallel first
        context = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            list(pool.map(_compile, SPECS, [arch] * len(SPECS)))
    return {spec.name: build(spec, arch, family=FAMILY) for spec in SPECS}


shapes = st.builds(
    lambda b, sq, sk, hkv, ratio: Shape(b, sq, sk, hkv * ratio, hkv),
    st.integers(1, 4), st.integers(1, 2048), st.integers(1, 2048), st.integers(1, 4), st.integers(1, 8),
)


@pytest.mark.gpu
@needs_cuda
@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from([s.name for s in SPECS]), shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_forward_matches_reference(kernels, name, shape, seed):
    kernel = kernels[name]
    assert kernel.info.family == FAMILY
    result = check_kernel(kernel, shape, seed=seed)
    assert result.ok, f"{name}: {result}"


# Tails of every size, seqlen_q > seqlen_k (bottom-right masks leave whole rows empty), a single
# key, a single query, and lengths just around the tile sizes (64 and 32 rows).
EDGE_SHAPES = [Shape(1, 1, 1, 1, 1), Shape(2, 257, 1000, 6, 2), Shape(1, 1000, 257, 8, 1),
               Shape(3, 1, 2048, 4, 4), Shape(1, 2048, 1, 2, 2), Shape(2, 129, 127, 16, 2),
               Shape(1, 64, 64, 2, 1), Shape(1, 65, 33, 2, 2), Shape(4, 31, 97, 3, 1)]


@pytest.mark.parametrize("name", [s.name for s in SPECS])
@pytest.mark.gpu
@needs_cuda
def test_edge_shapes(kernels, name):
    failures = [str(r) for r in (check_kernel(kernels[name], shape, seed=i)
                                 for i, shape in enumerate(EDGE_SHAPES)) if not r.ok]
    assert not failures, f"{name}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", [s.name for s in SPECS if s.head_dim_qk == 64])
@pytest.mark.gpu
@needs_cuda
def test_strided_inputs(kernels, name):
    """Batch, seqlen and head strides are kernel arguments: (b, h, s, d) tensors viewed as (b, s, h, d)."""
    kernel = kernels[name]
    generator = torch.Generator(device="cuda").manual_seed(7)

    def bhsd_view(seqlen, heads):
        x = torch.randn(2, heads, seqlen, 64, generator=generator, device="cuda").half()
        return x.transpose(1, 2)

    q, k, v = bhsd_view(300, 4), bhsd_view(170, 2), bhsd_view(170, 2)
    out, lse = kernel.forward(q, k, v)
    result = compare(kernel.spec, q, k, v, out, lse)
    assert result.ok, f"{name}: {result}"
