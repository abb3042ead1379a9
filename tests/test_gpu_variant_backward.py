"""L1: the backward of expression specs (score mods, mask expressions, sink logits) against float64
autograd through the reference, on a CUDA GPU.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_variant_backward.py
Every shipped expression spec, in every CuTe DSL family whose kernels take expressions on this
GPU (on an H200: sm90, and sm80 forced), gets dQ, dK and dV checked on hypothesis-drawn shapes
(odd sequence lengths, GQA) and random input values, with the tolerance test_gpu_backward
derives (twice the same-precision PyTorch error, two rounding steps, the effect of D using the
rounded O). Then random mask and score-mod expressions (the grammar of
test_gpu_random_variants), and the sink logits' own gradient through fa_gen.attention.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen import generate
from fa_gen.check import Shape, random_inputs
from fa_gen.reference import attention_reference, attention_same_precision

from .test_gpu_backward import _autograd, _build_pair_name, _max_abs, _rounding_floor, build_pair, check_backward
from .test_gpu_random_variants import _spec, shapes as random_shapes, variants as random_variants
from .test_gpu_variants import EDGE_SHAPES, random_aux_inputs, shapes
from .variant_grammar import random_tensors
from .variants import cute_dsl_families

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

SPECS = [spec for spec in generate.shipped_specs() if spec.uses_expressions]


@pytest.fixture(scope="module")
def pairs():
    """(spec name, family) -> (forward Kernel, Backward) of that family, for every expression spec."""
    from fa_gen.runtime import current_arch

    arch = current_arch()
    keys = [(spec, family) for spec in SPECS for family in cute_dsl_families(arch, expressions=True)]
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    if jobs > 1:
        context = multiprocessing.get_context("spawn")  # no inherited CUDA or DSL state
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            list(pool.map(_build_pair_name, *zip(*[(spec, arch, family) for spec, family in keys])))
    return {(spec.name, family): build_pair(spec, arch, family) for spec, family in keys}


def _check(pair, shape: Shape, seed: int, deterministic: bool = False):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    inputs = random_aux_inputs(pair[0].spec, shape, generator)
    return check_backward(pair, shape, seed, deterministic, inputs=inputs, generator=generator)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_BWD_EXAMPLES", "100")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_expression_backward_matches_reference(pairs, data, shape, seed):
    key = data.draw(st.sampled_from(sorted(pairs)), label="spec, family")
    result = _check(pairs[key], shape, seed)
    assert result.ok, f"{key}: {result}"


# The forward's edge shapes: a single query / key, rows that see no key (seqlen_q > seqlen_k under
# bottom-right masks: LSE -inf, or the sink), tails of every size, GQA groups of 3 and 8.
@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_expression_backward_edge_shapes(pairs, name, family):
    if (name, family) not in pairs:
        pytest.skip(f"family {family} does not serve this GPU")
    failures = [str(r) for r in (_check(pairs[(name, family)], shape, i) for i, shape in enumerate(EDGE_SHAPES))
                if not r.ok]
    assert not failures, f"{name} ({family}):\n" + "\n".join(failures)


@pytest.mark.parametrize("name", ["document", "softcap", "chunked_causal"])
def test_deterministic_expression_backward_is_bitwise_stable(pairs, name):
    """Under a mask expression the CTAs of a query tile wait for the turn its list gives them."""
    from fa_gen.runtime import current_arch

    pair = pairs[(name, cute_dsl_families(current_arch(), expressions=True)[0])]
    shape = Shape(2, 1500, 1700, 8, 2)
    generator = torch.Generator(device="cuda").manual_seed(11)
    inputs = random_aux_inputs(pair[0].spec, shape, generator)
    q, k, v = random_inputs(pair[0].spec, shape, pair[0]._dtype, "cuda", generator)
    dout = torch.randn(*q.shape[:3], pair[0].spec.head_dim_v, generator=generator, device="cuda").to(q.dtype)
    out, lse = pair[0].forward(q, k, v, inputs=inputs)
    first = pair[1](dout, q, k, v, out, lse, deterministic=True, inputs=inputs)
    for _ in range(4):
        again = pair[1](dout, q, k, v, out, lse, deterministic=True, inputs=inputs)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), f"{name}: deterministic backward differs"
    planned = pair[1](dout, q, k, v, out, lse, deterministic=True, plan=pair[1].plan(q, k, inputs))
    assert all(torch.equal(a, b) for a, b in zip(first, planned)), f"{name}: a plan gives other gradients"
    assert _check(pair, shape, 12, deterministic=True).ok


def test_sink_logit_gradient_through_attention():
    """fa_gen.attention with sink logits that require grad: dq, dk, dv and d sinks against float64
    autograd; seqlen_q > seqlen_k leaves rows that see no key (O = 0, LSE = their sink)."""
    import fa_gen

    spec = next(s for s in SPECS if s.name == "sink_logit")
    shape = Shape(2, 300, 257, 8, 2)
    generator = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = random_inputs(spec, shape, torch.bfloat16, "cuda", generator)
    dout = torch.randn(*q.shape[:3], spec.head_dim_v, generator=generator, device="cuda").to(q.dtype)
    sinks = torch.randn(shape.heads_q, generator=generator, device="cuda")

    def grads(fn, dtype=None):
        leaves = [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
        leaf_sinks = sinks.detach().clone().requires_grad_()
        fn(*leaves, {"sinks": leaf_sinks}).backward(dout.to(dtype or dout.dtype))
        return [t.grad for t in leaves] + [leaf_sinks.grad]

    got = grads(lambda q, k, v, x: fa_gen.attention(q, k, v, spec=spec, inputs=x)[0])
    ref = grads(lambda q, k, v, x: attention_reference(q, k, v, spec, inputs=x)[0], torch.float64)
    same = grads(lambda q, k, v, x: attention_same_precision(q, k, v, spec, inputs=x))
    out, lse = attention_reference(q, k, v, spec, inputs={"sinks": sinks})
    rounded_o = _sink_rounded_o_effect(out, dout, lse, sinks)
    for name, g, r, pt, extra in zip(("dq", "dk", "dv", "dsinks"), got, ref, same, (0, 0, 0, rounded_o)):
        tol = 2 * _max_abs(pt.double() - r.double()) + _rounding_floor(r.double(), q.dtype) + extra
        assert g.shape == r.shape and bool(torch.isfinite(g).all()), name
        assert _max_abs(g.double() - r.double()) <= tol, f"{name}: {_max_abs(g.double() - r.double()):.2e} > {tol:.2e}"


def _sink_rounded_o_effect(out, dout, lse, sinks) -> float:
    """How far d sinks moves when D = rowsum(dO * O) uses O rounded to dO's dtype (as the kernel's does)."""
    d_exact = (dout.double() * out).sum(-1)
    d_rounded = (dout.double() * out.to(dout.dtype).double()).sum(-1)
    weight = torch.exp(sinks.double()[None, :, None] - lse).permute(0, 2, 1)   # (b, seqlen_q, heads_q)
    return _max_abs((weight * (d_rounded - d_exact)).sum(dim=(0, 1)))


@settings(max_examples=int(os.environ.get("FA_GEN_L1_RANDOM_EXPRESSIONS", "8")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(variant=random_variants, dtype=st.sampled_from(["bf16", "fp16"]), shape=random_shapes,
       seed=st.integers(0, 2**31 - 1), data=st.data())
def test_random_expression_backward_matches_reference(variant, dtype, shape, seed, data):
    from fa_gen.runtime import current_arch

    arch = current_arch()
    family = data.draw(st.sampled_from(cute_dsl_families(arch, expressions=True)), label="family")
    spec = _spec(*variant, dtype)
    generator = torch.Generator().manual_seed(seed)
    values = {name: value.cuda() for name, value in random_tensors(
        generator, shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k).items()
        if any(d.name == name for d in spec.inputs)}
    result = check_backward(build_pair(spec, arch, family), shape, seed, inputs=values)
    assert result.ok, f"{family} mask={variant[0]} score_mod={variant[1]}: {result}"
