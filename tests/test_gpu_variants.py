"""L1: every shipped expression spec (score mods, mask expressions) against the float64 reference.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_variants.py
Aux inputs are drawn at random for every example: runtime scalars over a range that makes
their masks bite at these sequence lengths, tensors as the variant means them (sorted
document ids, prefix lengths inside the keys, positive slopes, normal biases).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen import generate
from fa_gen.check import Shape, check_kernel
from fa_gen.variant.bind import TORCH_DTYPES

from .variants import cute_dsl_families

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

SPECS = [spec for spec in generate.shipped_specs() if spec.uses_expressions]
# Scalars: (low, high) drawn uniformly; the defaults (window 1024, chunk 8192) would mask little here.
SCALAR_RANGES = {"window": (1, 300), "chunk": (1, 300), "sink_tokens": (0, 8), "softcap": (1.0, 50.0)}


def random_aux_inputs(spec, shape: Shape, generator: torch.Generator) -> dict:
    sizes = {"batch": shape.batch, "heads_q": shape.heads_q, "seqlen_q": shape.seqlen_q, "seqlen_k": shape.seqlen_k}
    values = {}
    for decl in spec.inputs:
        if decl.is_scalar:
            low, high = SCALAR_RANGES.get(decl.name, (decl.min or 0, (decl.min or 0) + 100))
            u = float(torch.rand((), generator=generator, device=generator.device))
            values[decl.name] = low + u * (high - low) if decl.dtype == "float" else int(low + u * (high - low + 1))
            continue
        dims = decl.resolved_shape(sizes)
        device = generator.device
        if decl.name.endswith("_doc"):
            ids = torch.randint(0, 4, dims, generator=generator, device=device)
            values[decl.name] = ids.sort(dim=-1).values.to(torch.int32)
        elif decl.name == "prefix_len":
            values[decl.name] = torch.randint(0, shape.seqlen_k + 1, dims, generator=generator,
                                              device=device).to(torch.int32)
        elif decl.name == "slopes":
            values[decl.name] = torch.rand(dims, generator=generator, device=device)
        else:
            x = torch.randn(dims, generator=generator, device=device)
            values[decl.name] = x.to(TORCH_DTYPES[decl.dtype])
    return values


@pytest.fixture(scope="module")
def kernels():
    """(spec name, family) -> Kernel, for every expression spec and family on this GPU."""
    from fa_gen.runtime import build, current_arch

    arch = current_arch()
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    triples = [(spec, arch, family) for spec in SPECS for family in cute_dsl_families(arch, expressions=True)]
    if jobs > 1:
        from fa_gen.precompile import precompile

        precompile(triples, jobs=jobs)
    return {(spec.name, family): build(spec, arch, family=family) for spec, arch, family in triples}


def _check(kernel, shape: Shape, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed + 1)
    return check_kernel(kernel, shape, seed=seed, inputs=random_aux_inputs(kernel.spec, shape, generator))


shapes = st.builds(
    lambda b, sq, sk, hkv, ratio: Shape(b, sq, sk, hkv * ratio, hkv),
    st.integers(1, 3), st.integers(1, 1200), st.integers(1, 1200), st.integers(1, 3), st.integers(1, 4),
)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_expression_forward_matches_reference(kernels, data, shape, seed):
    key = data.draw(st.sampled_from(sorted(kernels)), label="spec, family")
    result = _check(kernels[key], shape, seed)
    assert result.ok, f"{key}: {result}"


EDGE_SHAPES = [Shape(1, 1, 1, 1, 1), Shape(2, 257, 1000, 6, 2), Shape(1, 1000, 257, 8, 1),
               Shape(1, 2048, 1, 2, 2), Shape(2, 129, 127, 16, 2)]


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_expression_edge_shapes(kernels, name, family):
    if (name, family) not in kernels:
        pytest.skip(f"family {family} does not serve this GPU")
    kernel = kernels[(name, family)]
    failures = [str(r) for r in (_check(kernel, shape, i) for i, shape in enumerate(EDGE_SHAPES)) if not r.ok]
    assert not failures, f"{name} ({family}):\n" + "\n".join(failures)


@pytest.mark.parametrize("name", ["relative_bias", "softcap", "document"])
def test_attention_op_passes_inputs_to_the_kernel(kernels, name):
    """fa_gen.attention (the custom op) with inputs=, and a call with a plan, give the kernel's
    own output, bit for bit."""
    import fa_gen
    from fa_gen.check import random_inputs
    from fa_gen.runtime import current_arch

    family = cute_dsl_families(current_arch(), expressions=True)[0]
    kernel = kernels[(name, family)]
    shape = Shape(2, 300, 257, 4, 2)
    generator = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = random_inputs(kernel.spec, shape, kernel._dtype, torch.device("cuda"), generator)
    values = random_aux_inputs(kernel.spec, shape, generator)
    want, want_lse = kernel.forward(q, k, v, inputs=values)
    got, got_lse = fa_gen.attention(q, k, v, spec=kernel.spec, inputs=values)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    planned, planned_lse = kernel.forward(q, k, v, plan=kernel.plan(q, k, inputs=values))
    assert torch.equal(planned, want) and torch.equal(planned_lse, want_lse)
