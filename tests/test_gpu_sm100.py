"""L1 of the sm100 family (tcgen05, tensor memory): each shipped spec it claims against the float64
reference, over hypothesis-drawn shapes (odd lengths, GQA ratios, seqlen_q > seqlen_k).

No Blackwell GPU has run this family: the tests skip, saying so, on any other GPU (and without
one). On an sm_100/sm_103 device they run as they are: python -m pytest -m gpu tests/test_gpu_sm100.py
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen.check import Shape, check_kernel

from .test_gpu_variants import random_aux_inputs
from .test_sm100 import CLAIMED

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)")]


def _blackwell_arch() -> str:
    from fa_gen.families.sm100 import Sm100Family
    from fa_gen.runtime import current_arch

    arch = current_arch()
    if arch not in Sm100Family.archs:
        pytest.skip(f"needs a Blackwell datacenter GPU (sm_100a/sm_103a): this one is {arch}; "
                    "the sm100 family has not run on hardware yet")
    return arch


@pytest.fixture(scope="module")
def kernels():
    from fa_gen.runtime import build, resolve_spec

    arch = _blackwell_arch()
    return {name: build(resolve_spec(name), arch, family="sm100") for name in CLAIMED}


def _check(kernel, shape: Shape, seed: int):
    """check_kernel with the spec's inputs (ALiBi slopes, biases, softcap) drawn from `seed` too."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return check_kernel(kernel, shape, seed=seed, inputs=random_aux_inputs(kernel.spec, shape, generator))


shapes = st.builds(
    lambda b, sq, sk, hkv, ratio: Shape(b, sq, sk, hkv * ratio, hkv),
    st.integers(1, 3), st.integers(1, 1500), st.integers(1, 1500), st.integers(1, 3), st.integers(1, 4),
)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_sm100_forward_matches_reference(kernels, data, shape, seed):
    name = data.draw(st.sampled_from(CLAIMED), label="spec")
    result = _check(kernels[name], shape, seed)
    assert result.ok, f"{name}: {result}"


@pytest.mark.parametrize("shape", [Shape(1, 1, 1, 1, 1), Shape(2, 257, 1000, 6, 2), Shape(1, 1000, 257, 8, 1),
                                   Shape(3, 1, 2048, 4, 4), Shape(2, 129, 127, 16, 2)])
def test_sm100_edge_shapes(kernels, shape):
    failures = [f"{name}: {r}" for name in CLAIMED if not (r := _check(kernels[name], shape, 7)).ok]
    assert not failures, "\n".join(failures)
