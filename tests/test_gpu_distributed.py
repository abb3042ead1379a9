"""L1: the ring on one GPU through fa_gen's kernels (issue 21): simulate_ring_attention over 2,
3 and 4 ranks, contiguous and zig-zag, against the float64 reference of the whole sequence
(outputs, LSE, gradients).

    python -m pytest -m gpu tests/test_gpu_distributed.py

Tolerances: twice a same-precision PyTorch computation's error plus one rounding step per block
a row merges (each block's output, and each block's gradient, is rounded to the input dtype
before the ring adds it), and the rounded-output effect of tests/test_gpu_backward.py.
"""

from __future__ import annotations

import pytest
import torch

from fa_gen.distributed import Layout, simulate_ring_attention
from fa_gen.reference import attention_reference, attention_same_precision
from fa_gen.runtime import resolve_spec

from .test_gpu_backward import _autograd, _rounded_o_effect

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]


def _step(x: torch.Tensor, dtype) -> float:
    return float(x.abs().max()) * torch.finfo(dtype).eps if x.numel() else 0.0


@pytest.mark.parametrize("name", ["full_bf16_d128", "causal_bf16_d128", "causal_fp16_d64", "softcap",
                                  "sliding_window_bf16_d128", "causal_topleft_fp16_d96"])
@pytest.mark.parametrize("world,layout", [(2, "contiguous"), (2, "zigzag"), (3, "zigzag"), (4, "zigzag")])
def test_kernel_ring_matches_whole_sequence_reference(name, world, layout):
    spec = resolve_spec(name)
    dtype = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(world * 7 + len(name))
    seqlen = 96 * world * (2 if layout == "zigzag" else 1) + 0
    shape = lambda h, d: (2, seqlen, h, d)  # noqa: E731
    q = torch.randn(*shape(8, spec.head_dim_qk), generator=g, device="cuda").to(dtype)
    k = torch.randn(*shape(2, spec.head_dim_qk), generator=g, device="cuda").to(dtype)
    v = torch.randn(*shape(2, spec.head_dim_v), generator=g, device="cuda").to(dtype)
    inputs = {"softcap": 5.0} if name == "softcap" else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = simulate_ring_attention(*leaves, spec, world, layout, inputs=inputs)
    ref, ref_lse = attention_reference(q, k, v, spec, inputs=inputs)
    same = attention_same_precision(q, k, v, spec, inputs=inputs)
    blocks = len(Layout(layout, world, seqlen).chunks(0)) * world
    tol = 2 * (same.double() - ref).abs().max().item() + (blocks + 1) * _step(ref, dtype)
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"out: {err:.3g} > {tol:.3g}"
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3 * (1 + ref_lse.abs().max().item())
    dout = torch.randn(out.shape, generator=g, device="cuda").to(dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = _autograd(lambda *t: attention_reference(*t, spec, inputs=inputs)[0],
                          [t.double() for t in (q, k, v)], dout.double())
    same_grads = _autograd(lambda *t: attention_same_precision(*t, spec, inputs=inputs), (q, k, v), dout)
    rounded_o = _rounded_o_effect(q, k, v, dout, spec, inputs)
    for label, got, want, yard in zip(("dq", "dk", "dv"), grads, ref_grads, same_grads):
        tol = 2 * (yard.double() - want).abs().max().item() + 2 * (blocks + 1) * _step(want, dtype) + rounded_o[label]
        err = (got.double() - want).abs().max().item()
        assert torch.isfinite(got).all() and err <= tol, f"{label}: {err:.3g} > {tol:.3g}"


def test_deterministic_ring_is_bitwise_stable():
    spec = resolve_spec("causal_bf16_d128")
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 768, h, 128, generator=g, device="cuda").to(torch.bfloat16) for h in (8, 2, 2))
    dout = torch.randn(1, 768, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = simulate_ring_attention(*leaves, spec, 3, "zigzag", deterministic=True)
        runs.append((out, *torch.autograd.grad(out, leaves, dout)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
