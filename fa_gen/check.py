"""Exactness check of a kernel against the float64 reference, with a derived tolerance.

The tolerance is never hand-picked: a kernel may err at most twice as much as
a straightforward PyTorch computation in the same dtype (`attention_same_precision`),
plus a floor of one rounding step of the output's magnitude in that dtype.
Rows that see no key must give exactly 0 and LSE -inf. NaN never passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import _logits, attention_reference, attention_same_precision, visibility
from .spec import Spec


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int

    def __str__(self) -> str:
        return (f"b={self.batch} sq={self.seqlen_q} sk={self.seqlen_k} "
                f"hq={self.heads_q} hkv={self.heads_kv}")


@dataclass(frozen=True)
class CheckResult:
    shape: Shape
    out_err: float
    out_tol: float
    lse_err: float
    lse_tol: float
    empty_rows_ok: bool
    finite: bool

    @property
    def ok(self) -> bool:
        return (self.finite and self.empty_rows_ok and self.out_err <= self.out_tol
                and self.lse_err <= self.lse_tol)

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (f"{verdict} {self.shape}: out err {self.out_err:.2e} (tol {self.out_tol:.2e}), "
                f"lse err {self.lse_err:.2e} (tol {self.lse_tol:.2e}), "
                f"empty rows {'ok' if self.empty_rows_ok else 'WRONG'}, finite {self.finite}")


def random_inputs(spec: Spec, shape: Shape, dtype: torch.dtype, device, generator: torch.Generator):
    """Fresh standard-normal q, k, v (never zeros: they hide unwritten outputs)."""
    def draw(seqlen, heads, dim):
        x = torch.randn(shape.batch, seqlen, heads, dim, generator=generator, device=device)
        return x.to(dtype)
    return (draw(shape.seqlen_q, shape.heads_q, spec.head_dim_qk),
            draw(shape.seqlen_k, shape.heads_kv, spec.head_dim_qk),
            draw(shape.seqlen_k, shape.heads_kv, spec.head_dim_v))


def _rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    # One rounding step in `dtype` at the largest magnitude: eps * |x| bounds the spacing of the
    # representable values around x. (Measuring the rounding of x + 0.3 instead, as this did,
    # can give 0 for a single row whose value happens to round exactly.)
    return float(ref.abs().max().item()) * torch.finfo(dtype).eps if ref.numel() else 0.0


def _masked_max_abs(diff: torch.Tensor) -> float:
    return float(diff.abs().max().item()) if diff.numel() else 0.0


def compare(spec: Spec, q, k, v, out: torch.Tensor, lse: torch.Tensor, inputs=None) -> CheckResult:
    """Compare a kernel's (out, lse) for inputs (q, k, v) with the float64 reference."""
    shape = Shape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])
    ref_out, ref_lse = attention_reference(q, k, v, spec, inputs=inputs)
    pt_out = attention_same_precision(q, k, v, spec, inputs=inputs)
    out_tol = 2 * _masked_max_abs(pt_out.double() - ref_out) + _rounding_floor(ref_out, q.dtype)
    out_err = _masked_max_abs(out.double() - ref_out)

    # (batch or 1, heads_q or 1, seqlen_q): whether the row sees any key.
    has_key = _visible(spec, shape, q.device, inputs).any(dim=-1).expand_as(ref_lse)
    # A sink logit gives every row a finite LSE (the sink alone, where no key is visible).
    rows = torch.ones_like(has_key) if spec.sink_expr is not None else has_key
    pt_lse = _same_precision_lse(q, k, spec, inputs)
    # Floor: a few float32 rounding steps, what the kernel's approximate exp2/log2 cost.
    lse_floor = 4 * _rounding_floor(ref_lse[rows], torch.float32)
    lse_tol = 2 * _masked_max_abs((pt_lse.double() - ref_lse)[rows]) + lse_floor
    lse_err = _masked_max_abs((lse.double() - ref_lse)[rows])

    empty = ~has_key
    empty_ok = bool((out.permute(0, 2, 1, 3)[empty] == 0).all())
    if spec.sink_expr is None:
        empty_ok = empty_ok and bool(torch.isneginf(lse[empty]).all())
    finite = bool(torch.isfinite(out).all()) and not bool(torch.isnan(lse).any())
    return CheckResult(shape, out_err, out_tol, lse_err, lse_tol, empty_ok, finite)


def _visible(spec: Spec, shape: Shape, device, inputs) -> torch.Tensor:
    """Visibility broadcastable to (batch, heads_q, seqlen_q, seqlen_k)."""
    if spec.mask_expr is not None:
        return visibility(spec, shape.seqlen_q, shape.seqlen_k, device=device, batch=shape.batch,
                          heads_q=shape.heads_q, inputs=inputs)
    return visibility(spec, shape.seqlen_q, shape.seqlen_k, device=device).view(1, 1, shape.seqlen_q, -1)


def _same_precision_lse(q, k, spec: Spec, inputs=None) -> torch.Tensor:
    heads_q = q.shape[2]
    kx = k.repeat_interleave(heads_q // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx).float() * spec.softmax_scale
    if spec.uses_expressions:
        logits, sink = _logits(scores, spec, inputs)
        lse = torch.logsumexp(logits, dim=-1)
        return lse if sink is None else torch.logaddexp(lse, sink)
    visible = visibility(spec, q.shape[1], k.shape[1], device=q.device)
    return torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)


def check_kernel(kernel, shape: Shape, seed: int = 0, inputs=None) -> CheckResult:
    """Run `kernel` on fresh random inputs of `shape` and compare it with the reference.

    `inputs`: values for the spec's declared inputs (see `random_aux_inputs`)."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(seed)
    q, k, v = random_inputs(kernel.spec, shape, kernel._dtype, device, generator)
    # Poisoned outputs: an element the kernel fails to write stays NaN and fails.
    out = torch.full((shape.batch, shape.seqlen_q, shape.heads_q, kernel.spec.head_dim_v),
                     float("nan"), dtype=q.dtype, device=device)
    lse = torch.full((shape.batch, shape.heads_q, shape.seqlen_q), float("nan"), device=device)
    kernel.forward(q, k, v, out=out, lse=lse, inputs=inputs)
    return compare(kernel.spec, q, k, v, out, lse, inputs)
