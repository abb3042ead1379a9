"""L1: the backward pass (dQ, dK, dV) of every variant against float64 autograd on a CUDA GPU.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_backward.py
The tolerance is derived as fa_gen.check derives the forward's: a kernel's gradient may err
at most twice as much as autograd through the same computation in PyTorch at the input dtype
(`attention_same_precision`), plus one rounding step of the gradient's magnitude in that
dtype. NaN never passes. Kernels are compiled once per variant (in parallel processes first
when FA_GEN_PRECOMPILE_JOBS > 1); shapes are drawn fresh for every example.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fa_gen.check import Shape, random_inputs
from fa_gen.reference import _logits, attention_reference, attention_same_precision

from .variants import variant_specs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

SPECS = variant_specs()
GRADS = ("dq", "dk", "dv")


def build_pair(spec, arch, family=None):
    """(forward Kernel, Backward) of `family`, by default the family that renders the backward:
    the gradients are checked against a forward known to pair with them (same family)."""
    from fa_gen.backward import backward_family, build_backward
    from fa_gen.runtime import build

    family = family or backward_family(spec, arch)
    return build(spec, arch, family=family), build_backward(spec, arch, family=family)


def _build_pair_name(spec, arch, family):
    build_pair(spec, arch, family)
    return spec.name


# The preferred backward of each variant (sm90 on an H200, where it serves the head dim), and
# the sm80 one forced, so that the Ampere-class backward stays tested on a Hopper machine too.
@pytest.fixture(scope="module", params=[None, "sm80"], ids=["preferred", "sm80"])
def kernels(request):
    """name -> (forward Kernel, Backward) for every variant on this GPU."""
    from fa_gen.runtime import current_arch

    arch, family = current_arch(), request.param
    jobs = int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0"))
    if jobs > 1:
        context = multiprocessing.get_context("spawn")  # no inherited CUDA or DSL state
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            list(pool.map(_build_pair_name, SPECS, [arch] * len(SPECS), [family] * len(SPECS)))
    return {spec.name: build_pair(spec, arch, family) for spec in SPECS}


@dataclass(frozen=True)
class GradCheck:
    shape: Shape
    errors: dict      # grad name -> max abs error against float64
    tolerances: dict  # grad name -> tolerance
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and all(self.errors[g] <= self.tolerances[g] for g in GRADS)

    def __str__(self) -> str:
        parts = ", ".join(f"{g} err {self.errors[g]:.2e} (tol {self.tolerances[g]:.2e})" for g in GRADS)
        return f"{'ok' if self.ok else 'FAIL'} {self.shape}: {parts}, finite {self.finite}"


def _autograd(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    fn(*leaves).backward(dout)
    # A leaf the output does not depend on (q and k under a score mod that ignores the score)
    # gets no grad: its gradient is 0.
    return [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def _rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    # Two rounding steps of values of this magnitude in `dtype`: on the way to every gradient
    # the kernel rounds twice by design (P or dS to `dtype` as an MMA operand, then the result),
    # where the forward rounds once. Tiny shapes (sq=1, sk=2) showed the same-precision PyTorch
    # error can be far below that by luck, which left the one-step floor short by a fraction of an ulp.
    x = ref.to(dtype)
    return 2 * float((x + 0.3 - 0.3 - x).abs().max().item()) if x.numel() else 0.0


def _rounded_o_effect(q, k, v, dout, spec, inputs=None, dropout=None) -> dict:
    """How far the float64 gradients move when D = rowsum(dO * O) uses O rounded to q.dtype.

    FlashAttention's backward (ours too) computes D from the stored output, which is rounded
    to the input dtype; PyTorch's autograd never does, so its error cannot stand for this
    one. Found on the H200: fp16, sq=129, sk=2, causal, where dq/dk erred ~2 ulp by it alone.
    Under a score mod, dS carries its derivative (taken here by autograd through the reference's
    logits); a sink logit enters through the LSE. Under `dropout` (a fa_gen.philox.Dropout) the
    output and dP take the mask's factors (0 or 1 / (1 - p)) and dS the undropped P, as the
    kernel's do; there O = (1 / (1 - p)) V rounds even where P = 1.
    """
    qd, kd, vd, dod = (t.double() for t in (q, k, v, dout))
    group = q.shape[2] // k.shape[2]
    kx, vx = kd.repeat_interleave(group, dim=2), vd.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kx) * spec.softmax_scale
    slope = 1.0
    if spec.score_mod_expr is not None:
        with torch.enable_grad():
            scores.requires_grad_()
            logits, sink = _logits(scores, spec, inputs)
            # d(logit)/d(score) per element: the mod's derivative where visible, 0 where masked
            # (and 0 everywhere for a mod that does not read the score).
            slope = (torch.autograd.grad(logits, scores, torch.ones_like(logits))[0] if logits.requires_grad
                     else torch.zeros_like(scores))
        logits, scores = logits.detach(), scores.detach()
    else:
        logits, sink = _logits(scores, spec, inputs)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    if sink is not None:
        lse = torch.logaddexp(lse, sink.detach().unsqueeze(-1))
    probs = torch.exp(logits - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
    factors = 1.0 if dropout is None or dropout.p == 0 else dropout.scale(*probs.shape, device=probs.device,
                                                                          dtype=probs.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", probs * factors, vx)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", dod, vx) * factors

    def grads(o):
        row_dot = (dod * o).sum(-1).permute(0, 2, 1).unsqueeze(-1)   # D: (b, h, sq, 1)
        dscores = probs * (dprobs - row_dot) * slope * spec.softmax_scale
        dq = torch.einsum("bhqk,bkhd->bqhd", dscores, kx)
        dk = torch.einsum("bhqk,bqhd->bkhd", dscores, qd)
        return dq, dk.unflatten(2, (k.shape[2], group)).sum(3)

    (dq, dk), (dq_r, dk_r) = grads(out), grads(out.to(q.dtype).double())
    # D (the pre-pass, fp32 over O and dO) and dP (an fp32 MMA) are two fp32 sums of the same
    # products in different orders, so even where dS is 0 in exact arithmetic (one visible key:
    # P = 1, dP = D) the kernel's dS is their rounding difference, about 2 u32 sum|dO O| per row;
    # float64 and PyTorch (one fp32 softmax backward) have none. Found on the H200 at 9f3bf8b:
    # fp16 d192, sq=1374, sk=1, 8 query heads on one K/V head: dk 9.9e-5 against a 9.8e-5
    # tolerance. Those per-row errors are independent, so over the rows (dK) or keys (dQ) they
    # add in quadrature; 4 standard deviations cover the largest of a gradient's entries.
    row_abs = (dod.abs() * out.to(q.dtype).double().abs()).sum(-1).permute(0, 2, 1).unsqueeze(-1)
    noise = (probs * (2 * 2.0 ** -24 * spec.softmax_scale) * row_abs * torch.as_tensor(slope).abs()) ** 2
    dq_noise = torch.einsum("bhqk,bkhd->bqhd", noise, kx ** 2).sqrt()
    dk_noise = torch.einsum("bhqk,bqhd->bkhd", noise, qd ** 2).unflatten(2, (k.shape[2], group)).sum(3).sqrt()
    return {"dq": _max_abs(dq_r - dq) + 4 * _max_abs(dq_noise),
            "dk": _max_abs(dk_r - dk) + 4 * _max_abs(dk_noise), "dv": 0.0}


def _max_abs(diff: torch.Tensor) -> float:
    return float(diff.abs().max().item()) if diff.numel() else 0.0


def run_backward(kernels_pair, q, k, v, dout, deterministic=False, inputs=None):
    forward, backward = kernels_pair
    out, lse = forward.forward(q, k, v, inputs=inputs)
    return backward(dout, q, k, v, out, lse, deterministic=deterministic, inputs=inputs)


def check_backward(kernels_pair, shape: Shape, seed: int, deterministic: bool = False, inputs=None,
                   generator: torch.Generator | None = None) -> GradCheck:
    """dq, dk, dv of the pair on fresh random q, k, v, dout (`inputs`: the spec's declared inputs)."""
    spec = kernels_pair[0].spec
    generator = generator or torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = random_inputs(spec, shape, kernels_pair[0]._dtype, "cuda", generator)
    dout = torch.randn(*q.shape[:3], spec.head_dim_v, generator=generator, device="cuda").to(q.dtype)
    grads = run_backward(kernels_pair, q, k, v, dout, deterministic, inputs)
    ref = _autograd(lambda *t: attention_reference(*t, spec, inputs=inputs)[0], (q.double(), k.double(), v.double()),
                    dout.double())
    same = _autograd(lambda *t: attention_same_precision(*t, spec, inputs=inputs), (q, k, v), dout)
    rounded_o = _rounded_o_effect(q, k, v, dout, spec, inputs)
    errors, tolerances = {}, {}
    for name, got, r, pt in zip(GRADS, grads, ref, same):
        errors[name] = _max_abs(got.double() - r)
        tolerances[name] = 2 * _max_abs(pt.double() - r) + _rounding_floor(r, q.dtype) + rounded_o[name]
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    return GradCheck(shape, errors, tolerances, finite)


shapes = st.builds(
    lambda b, sq, sk, hkv, ratio: Shape(b, sq, sk, hkv * ratio, hkv),
    st.integers(1, 4), st.integers(1, 2048), st.integers(1, 2048), st.integers(1, 4), st.integers(1, 8),
)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_BWD_EXAMPLES", "100")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from([s.name for s in SPECS]), shape=shapes, seed=st.integers(0, 2**31 - 1))
# Found by hypothesis on the H200 at ba9455c: with one query and two keys the one-step floor
# was short of the kernel's designed two roundings (see _rounding_floor).
@example(name="v_fp16_d64_none", shape=Shape(1, 1, 2, 1, 1), seed=0)
# Found at 9f3bf8b: one key, 8 query heads on it (see the fp32 D/dP term in _rounded_o_effect).
@example(name="v_fp16_d192_none", shape=Shape(1, 1374, 1, 8, 1), seed=0)
def test_backward_matches_reference(kernels, name, shape, seed):
    result = check_backward(kernels[name], shape, seed)
    assert result.ok, f"{name}: {result}"


# Edges on purpose: a single query / key, seqlen_q > seqlen_k (bottom-right masks leave whole
# rows empty: LSE -inf, no gradient), tails of every size, GQA groups of 3 and 8.
EDGE_SHAPES = [Shape(1, 1, 1, 1, 1), Shape(2, 257, 1000, 6, 2), Shape(1, 1000, 257, 8, 1),
               Shape(3, 1, 2048, 4, 4), Shape(1, 2048, 1, 2, 2), Shape(2, 129, 127, 16, 2)]


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_edge_shapes(kernels, name):
    failures = [str(r) for r in (check_backward(kernels[name], shape, seed=i)
                                 for i, shape in enumerate(EDGE_SHAPES)) if not r.ok]
    assert not failures, f"{name}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", ["v_bf16_d128_causal", "v_fp16_d64_window_100_7", "v_bf16_d96_none",
                                  "v_fp16_d256_causal_top_left"])
def test_deterministic_is_bitwise_stable(kernels, name):
    """Five runs of the deterministic backward agree bit for bit (and pass the reference)."""
    shape = Shape(2, 1500, 1700, 8, 2)
    spec = kernels[name][0].spec
    generator = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = random_inputs(spec, shape, kernels[name][0]._dtype, "cuda", generator)
    dout = torch.randn(*q.shape[:3], spec.head_dim_v, generator=generator, device="cuda").to(q.dtype)
    first = run_backward(kernels[name], q, k, v, dout, deterministic=True)
    for _ in range(4):
        again = run_backward(kernels[name], q, k, v, dout, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), f"{name}: deterministic backward differs"
    assert check_backward(kernels[name], shape, seed=7, deterministic=True).ok


def _poisoned_workspace(real):
    """fa_gen's workspace allocator, the workspaces then filled with what a reused allocation may
    hold: NaN in the fp32 parts, every bit set in the semaphores (a large count, and the sm90
    backward's CLAIMED and ZEROED flags: left there, a tile would be read unzeroed or never
    cleared)."""
    def poisoned(*args):
        parts = real(*args)
        for part in parts[:-1]:
            part.fill_(float("nan"))
        parts[-1].fill_(-1)
        return parts
    return poisoned


@pytest.mark.parametrize("deterministic", [False, True], ids=["any_order", "deterministic"])
@pytest.mark.parametrize("name", ["v_bf16_d128_causal", "v_fp16_d64_window_100_7"])
def test_workspace_contents_are_never_read(kernels, name, deterministic, monkeypatch):
    """The workspaces are allocated uninitialised, and every word the kernels read is written
    first (each row's LSE and D and the semaphores by the pre-pass; the dQ accumulator by the
    main kernel's first CTA at a query tile, or by the pre-pass past CLEAR_IN_MAIN_ROWS query
    rows): workspaces full of NaN give exact, finite gradients, also where whole query tiles see
    no key (bottom-right causal, seqlen_q > seqlen_k; the post-pass writes zeros there), where
    many key tiles add into one query tile, and for a sequence long enough for the pre-pass's
    zeroing (4,200 query rows)."""
    import fa_gen.backward

    monkeypatch.setattr(fa_gen.backward, "_workspace", _poisoned_workspace(fa_gen.backward._workspace))
    shapes = [Shape(1, 1000, 257, 8, 1), Shape(2, 700, 1900, 4, 2), Shape(1, 1, 300, 2, 2), Shape(1, 4200, 600, 2, 1)]
    failures = [str(r) for r in (check_backward(kernels[name], shape, seed=i, deterministic=deterministic)
                                 for i, shape in enumerate(shapes)) if not r.ok]
    assert not failures, f"{name}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", ["v_bf16_d128_causal", "v_fp16_d64_window_100_7"])
def test_attention_autograd_matches_reference(kernels, name):
    """The user path: fa_gen.attention (custom op, the preferred forward family) then autograd."""
    import fa_gen

    spec = kernels[name][0].spec
    shape = Shape(2, 700, 900, 8, 2)
    generator = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = random_inputs(spec, shape, kernels[name][0]._dtype, "cuda", generator)
    dout = torch.randn(*q.shape[:3], spec.head_dim_v, generator=generator, device="cuda").to(q.dtype)
    grads = _autograd(lambda *t: fa_gen.attention(*t, spec=spec)[0], (q, k, v), dout)
    ref = _autograd(lambda *t: attention_reference(*t, spec)[0], (q.double(), k.double(), v.double()), dout.double())
    same = _autograd(lambda *t: attention_same_precision(*t, spec), (q, k, v), dout)
    for grad, got, r, pt in zip(GRADS, grads, ref, same):
        tol = 2 * _max_abs(pt.double() - r) + _rounding_floor(r, q.dtype)
        assert _max_abs(got.double() - r) <= tol, f"{name} {grad}: {_max_abs(got.double() - r):.2e} > {tol:.2e}"


def test_torch_compile_fullgraph_forward_and_backward():
    """A tiny module calling fa_gen.attention compiles with no graph break, and its gradients
    match the eager module's."""
    import fa_gen

    spec = "causal_bf16_d128"

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(0.5, device="cuda"))

        def forward(self, x, kv):
            q = (x * self.scale).to(torch.bfloat16)
            out, _ = fa_gen.attention(q, kv, kv, spec=spec)
            return out.float().square().mean()

    torch.manual_seed(0)
    x = torch.randn(2, 300, 8, 128, device="cuda")
    kv = torch.randn(2, 400, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    module = Tiny()
    eager_loss = module(x, kv)
    eager_grads = torch.autograd.grad(eager_loss, (module.scale, kv))
    compiled = torch.compile(module, fullgraph=True)
    loss = compiled(x, kv)
    grads = torch.autograd.grad(loss, (module.scale, kv))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-6)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4)
