"""L1: every forward variant, in every CuTe DSL family serving the GPU, against the float64 reference.

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

from .variants import cute_dsl_families, variant_specs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

SPECS = variant_specs()


@pytest.fixture(scope="module")
def kernels():
    """(variant name, label) -> Kernel; on an H200 both the Hopper and the Ampere-class family.
    The label is the family (the kernel as users call it, picking its forward kind per call by
    seqlen), or "<family>/<kind>" for each kind of a family with per-call variants, pinned, so
    that every kind meets every shape."""
    from fa_gen.runtime import build, current_arch

    arch = current_arch()
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    from fa_gen.archs import family_named

    # On a Blackwell GPU the opt-in sm100 family joins for the variants it serves.
    triples = [(spec, arch, family) for spec in SPECS for family in cute_dsl_families(arch)
               if not family_named(family).can_implement(spec, arch)]
    if jobs > 1:
        from fa_gen.precompile import precompile

        precompile(triples, jobs=jobs)
    built = {}
    for spec, arch, family in triples:
        kernel = built[(spec.name, family)] = build(spec, arch, family=family)
        variants = kernel.load_variants()
        for kind in ["forward", *variants] if variants else []:
            built[(spec.name, f"{family}/{kind}")] = kernel.pinned(kind)
    return built


shapes = st.builds(
    lambda b, sq, sk, hkv, ratio: Shape(b, sq, sk, hkv * ratio, hkv),
    st.integers(1, 4), st.integers(1, 2048), st.integers(1, 2048), st.integers(1, 4), st.integers(1, 8),
)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_forward_matches_reference(kernels, data, shape, seed):
    key = data.draw(st.sampled_from(sorted(kernels)), label="variant, family")
    result = check_kernel(kernels[key], shape, seed=seed)
    assert result.ok, f"{key}: {result}"


# Shapes that stress the edges on purpose: tails of every size, seqlen_q > seqlen_k
# (bottom-right masks leave whole rows empty), a single key, a single query; and heads of at
# most 1k keys in more (batch, head) pairs than one L2 group of the sm90 scheduler holds
# (short_l2_kv_mb: 4 MB of K/V, 8 heads at d128, 16 at d64), the last group partial.
EDGE_SHAPES = [Shape(1, 1, 1, 1, 1), Shape(2, 257, 1000, 6, 2), Shape(1, 1000, 257, 8, 1),
               Shape(3, 1, 2048, 4, 4), Shape(1, 2048, 1, 2, 2), Shape(2, 129, 127, 16, 2),
               Shape(3, 1000, 1000, 11, 11), Shape(2, 700, 1024, 12, 4)]


@pytest.mark.parametrize("family", ["sm90", "sm80", "sm100"])
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_edge_shapes(kernels, name, family):
    if (name, family) not in kernels:
        pytest.skip(f"family {family} does not serve this GPU")
    labels = [label for n, label in kernels if n == name and label.split("/")[0] == family]
    failures = [f"{label}: {r}" for label in labels
                for r in (check_kernel(kernels[(name, label)], shape, seed=i) for i, shape in enumerate(EDGE_SHAPES))
                if not r.ok]
    assert not failures, f"{name} ({family}):\n" + "\n".join(failures)


# The sm90 softmax's stale_max (d128's default): a row keeps its reference max until a new one
# passes it by 2^8 in the exponent, and a warp skips the O rescale when all its rows kept theirs.
# Standard-normal inputs never move a max that far after the first key tile, so these inputs
# do: keys grow along the sequence and each query row has its own scale (0.25 to 16), so within
# a warp some rows creep up by less than the threshold each tile (kept), some jump past it
# (moved), and some stay flat. Off and on, each against the float64 reference.
@pytest.mark.parametrize("stale_max", [1, 2])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_stale_max_with_rows_whose_max_moves_by_every_amount(mask, stale_max):
    from fa_gen.check import compare
    from fa_gen.runtime import build, current_arch
    from fa_gen.spec_load import load_spec

    if current_arch() not in ("sm_90", "sm_90a"):
        pytest.skip("the sm90 family's softmax")
    spec = load_spec({"name": f"stale_{mask}_{stale_max}", "dtype": "bf16", "head_dim": 128, "mask": mask,
                      "tuning": {"sm90": {"stale_max": stale_max}}})
    kernel = build(spec, current_arch(), family="sm90")
    for seed, (batch, seqlen_q, seqlen_k, heads) in enumerate([(2, 777, 1531, 4), (1, 130, 4099, 2), (3, 1025, 640, 3)]):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        row_scale = torch.tensor([0.25, 1.0, 4.0, 16.0], device="cuda")[torch.randint(0, 4, (seqlen_q,), generator=gen, device="cuda")]
        key_growth = 1 + 3 * torch.arange(seqlen_k, device="cuda") / seqlen_k
        q = (torch.randn(batch, seqlen_q, heads, 128, generator=gen, device="cuda") * row_scale[:, None, None]).bfloat16()
        k = (torch.randn(batch, seqlen_k, heads, 128, generator=gen, device="cuda") * key_growth[:, None, None]).bfloat16()
        v = torch.randn(batch, seqlen_k, heads, 128, generator=gen, device="cuda").bfloat16()
        out = torch.full_like(q, float("nan"))
        lse = torch.full((batch, heads, seqlen_q), float("nan"), device="cuda")
        kernel.forward(q, k, v, out=out, lse=lse)
        result = compare(spec, q, k, v, out, lse)
        assert result.ok, f"{spec.name} {(batch, seqlen_q, seqlen_k, heads)}: {result}"
