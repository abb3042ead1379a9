"""L1: the user path of training, `fa_gen.attention` -> autograd, for every shipped spec and for
random expression specs with runtime scalars, eager and under torch.compile(fullgraph=True),
against float64 autograd through the reference (issue 22: every spec with a runtime scalar
crashed in its backward, and no test walked this path for them).

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_attention_autograd.py
Tolerances are test_gpu_backward's: twice the same-precision PyTorch error, two rounding steps,
and the effect of D using the rounded O (for a sink logit's gradient too).
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fa_gen
from fa_gen import autograd, generate
from fa_gen.check import Shape, random_inputs
from fa_gen.reference import attention_reference, attention_same_precision

from .test_gpu_backward import _max_abs, _rounded_o_effect, _rounding_floor
from .test_gpu_random_variants import _spec, shapes as random_shapes, variants as random_variants
from .test_gpu_variant_backward import _sink_rounded_o_effect
from .test_gpu_variants import random_aux_inputs
from .variant_grammar import random_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

# fp8 specs are forward-only (fa_gen.attention_fp8; no backward kernel): they do not train.
SPECS = {spec.name: spec for spec in generate.shipped_specs() if not spec.is_fp8}
# The issue's own shape, and an odd GQA one with seqlen_q > seqlen_k (rows that see no key).
SHAPES = [Shape(2, 300, 300, 4, 4), Shape(3, 259, 131, 6, 2)]


def _grads(fn, leaves, dout):
    """Gradients of fn(*leaves) (its first output) for upstream `dout`, for every leaf (0 if unused)."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dout)
    return [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def check_user_path(spec, shape: Shape, seed: int, compiled: bool, inputs=None):
    """Failures (empty: pass) of dq, dk, dv and any differentiable input's gradient through
    fa_gen.attention, eager or compiled, against the float64 reference."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dtype = torch.float16 if spec.dtype.value == "fp16" else torch.bfloat16
    q, k, v = random_inputs(spec, shape, dtype, "cuda", generator)
    dout = torch.randn(*q.shape[:3], spec.head_dim_v, generator=generator, device="cuda").to(dtype)
    inputs = dict(random_aux_inputs(spec, shape, generator) if inputs is None else inputs)
    wanted = sorted(autograd.differentiable_input_names(autograd.spec_key(spec)))
    fixed = {n: x for n, x in inputs.items() if n not in wanted}

    def with_inputs(fn):
        return lambda q, k, v, *xs: fn(q, k, v, {**fixed, **dict(zip(wanted, xs))})

    def user(q, k, v, x):
        return fa_gen.attention(q, k, v, spec, inputs=x)

    if compiled:
        torch._dynamo.reset()
        user = torch.compile(user, fullgraph=True)
    leaves = (q, k, v, *(inputs[n] for n in wanted))
    got = _grads(with_inputs(user), leaves, dout)
    ref = _grads(with_inputs(lambda q, k, v, x: attention_reference(q, k, v, spec, inputs=x)[0]),
                 [t.double() if i < 3 else t for i, t in enumerate(leaves)], dout.double())
    same = _grads(with_inputs(lambda q, k, v, x: attention_same_precision(q, k, v, spec, inputs=x)), leaves, dout)
    rounded = _rounded_o_effect(q, k, v, dout, spec, inputs)
    extra = [rounded["dq"], rounded["dk"], rounded["dv"]]
    if wanted:
        out, lse = attention_reference(q, k, v, spec, inputs=inputs)
        extra += [_sink_rounded_o_effect(out, dout, lse, inputs[n]) for n in wanted]
    failures = []
    for name, g, r, pt, e in zip(("dq", "dk", "dv", *wanted), got, ref, same, extra):
        tol = 2 * _max_abs(pt.double() - r.double()) + _rounding_floor(r.double(), dtype) + e
        err = _max_abs(g.double() - r.double())
        if g.shape != r.shape or not bool(torch.isfinite(g).all()) or err > tol:
            failures.append(f"{name}: err {err:.2e} > tol {tol:.2e} (shape {tuple(g.shape)}, "
                            f"finite {bool(torch.isfinite(g).all())})")
    return failures


def _build_all(spec, arch):
    """The forward kernels fa_gen.attention may pick (variants too) and the backward, into the cache."""
    from fa_gen.backward import build_backward
    from fa_gen.runtime import build

    build(spec, arch).load_variants()
    build_backward(spec, arch)
    return spec.name


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Every shipped spec's kernels compiled in parallel processes first (FA_GEN_PRECOMPILE_JOBS > 1)."""
    from fa_gen.runtime import current_arch

    arch = current_arch()
    specs = [s for s in SPECS.values() if arch in s.archs]
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    if jobs > 1:
        context = multiprocessing.get_context("spawn")  # no inherited CUDA or DSL state
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            list(pool.map(_build_all, specs, [arch] * len(specs)))


def _served(spec) -> bool:
    from fa_gen.runtime import current_arch

    return current_arch() in spec.archs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_shipped_spec_trains_through_attention(name, compiled):
    spec = SPECS[name]
    if not _served(spec):
        pytest.skip(f"{name} does not target this GPU's arch")
    failures = [f"{shape}: {f}" for i, shape in enumerate(SHAPES)
                for f in check_user_path(spec, shape, seed=100 + i, compiled=compiled)]
    assert not failures, f"{name} ({'compiled' if compiled else 'eager'}):\n" + "\n".join(failures)


def test_issue_snippet_softcap():
    """The report's own snippet, with softcap's default scalar."""
    spec = fa_gen.build("softcap").spec
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    fa_gen.attention(q, k, v, spec)[0].float().sum().backward()
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


@settings(max_examples=int(os.environ.get("FA_GEN_L1_RANDOM_EXPRESSIONS", "8")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(variant=random_variants, dtype=st.sampled_from(["bf16", "fp16"]), shape=random_shapes,
       seed=st.integers(0, 2**31 - 1), compiled=st.booleans(), data=st.data())
def test_random_expression_specs_with_scalars_train_through_attention(variant, dtype, shape, seed, compiled, data):
    spec = _spec(*variant, dtype)
    generator = torch.Generator().manual_seed(seed)
    values = {name: value.cuda() for name, value in random_tensors(
        generator, shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k).items()
        if any(d.name == name for d in spec.inputs)}
    # The runtime scalars take drawn values, not their defaults.
    for decl in spec.inputs:
        if decl.is_scalar and decl.dtype == "int":
            values[decl.name] = data.draw(st.integers(decl.min if decl.min is not None else -5,
                                                      decl.max if decl.max is not None else 40), label=decl.name)
        elif decl.is_scalar:
            values[decl.name] = data.draw(st.floats(-2, 2, allow_nan=False), label=decl.name)
    failures = check_user_path(spec, shape, seed, compiled, inputs=values)
    assert not failures, f"mask={variant[0]} score_mod={variant[1]} {shape}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", ["softcap", "sliding_window_causal", "causal_bf16_d128", "sink_logit"])
def test_opcheck_both_ops(name):
    """torch.library.opcheck: schema, fake and autograd registration of both ops on real tensors."""
    spec = SPECS[name]
    shape = Shape(2, 97, 131, 4, 2)
    generator = torch.Generator(device="cuda").manual_seed(1)
    dtype = torch.float16 if spec.dtype.value == "fp16" else torch.bfloat16
    q, k, v = (t.requires_grad_() for t in random_inputs(spec, shape, dtype, "cuda", generator))
    tensors, scalars = autograd._inputs_as_lists(spec, random_aux_inputs(spec, shape, generator))
    key = autograd.spec_key(spec)
    args = (q, k, v, key, False, tensors, scalars)
    torch.library.opcheck(torch.ops.fa_gen.attention_forward.default, args)
    out, lse = torch.ops.fa_gen.attention_forward(*args)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.fa_gen.attention_backward.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, key, False, tensors, scalars))
