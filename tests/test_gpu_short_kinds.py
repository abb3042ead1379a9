"""L1: the sm90 family's per-call forward kinds (short-sequence tiles) at head dims no shipped
spec has, each kind pinned, against the float64 reference.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_short_kinds.py
The shipped specs' variants run in test_gpu_forward.py; here causal d192 (whose short kind
serves 1k-2k only) and d256, bf16 and fp16, every kind they pick per call, pinned so that each
meets every drawn shape, and the kernel as users call it (the kind picked by seqlen).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen.check import Shape, check_kernel
from fa_gen.spec_load import load_spec

from .test_gpu_forward import shapes as forward_shapes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

SPECS = [load_spec({"name": f"short_kinds_{dtype}_d{d}", "dtype": dtype, "head_dim": d, "mask": "causal"})
         for d in (192, 256) for dtype in ("bf16", "fp16")]


@pytest.fixture(scope="module")
def kernels():
    from fa_gen.runtime import build, current_arch

    arch = current_arch()
    if not arch.startswith("sm_90"):
        pytest.skip("the short kinds are the sm90 family's (Hopper)")
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    if jobs > 1:
        from fa_gen.precompile import precompile

        precompile([(spec, arch, "sm90") for spec in SPECS], jobs=jobs)
    built = {}
    for spec in SPECS:
        kernel = built[(spec.name, "picked")] = build(spec, arch, family="sm90")
        for kind in ["forward", *kernel.load_variants()]:
            built[(spec.name, kind)] = kernel.pinned(kind)
    return built


def test_every_spec_has_a_short_kind(kernels):
    assert {kind for _, kind in kernels} == {"picked", "forward", "forward_short"}


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), shape=forward_shapes, seed=st.integers(0, 2**31 - 1))
def test_short_kinds_match_reference(kernels, data, shape, seed):
    """test_gpu_forward's shapes (batch 1-4, lengths 1-2048, GQA up to 8) on every (spec, kind)."""
    key = data.draw(st.sampled_from(sorted(kernels)), label="spec, kind")
    checked = check_kernel(kernels[key], shape, seed=seed)
    assert checked.ok, f"{key}: {checked}"


@pytest.mark.parametrize("seqlen", [1000, 1025, 1536, 2048])
def test_around_the_d192_bounds(kernels, seqlen):
    for dtype in ("bf16", "fp16"):
        result = check_kernel(kernels[(f"short_kinds_{dtype}_d192", "picked")], Shape(2, seqlen, seqlen, 6, 2), seed=seqlen)
        assert result.ok, f"{dtype} d192 at {seqlen}: {result}"
