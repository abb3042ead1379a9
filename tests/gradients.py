"""Judging one training step's parameter gradients of a model against a float32 reference, with a
same-precision yardstick (shared by the CPU and GPU tests).

Per parameter, the relative L2 error ||g - g_ref|| / ||g_ref||: a norm, not a max, so one parameter's
worst element (where bf16 gradients are poor for every implementation) does not decide, while a
gradient that is missing or wrong in part (dK dropped: the k projections' gradients are zero, an
error of 1) is far outside. Each parameter's error must be within twice the yardstick's (another
attention implementation at the same precision) plus a floor of one bf16 rounding step.
"""

from __future__ import annotations

import torch

FLOOR = torch.finfo(torch.bfloat16).eps


def training_gradients(model, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> float32 gradient of one language-model loss on (ids, mask). Only real tokens
    predicted from a real token count: the first real token of a left-padded row would be predicted
    from a padding row's logits, which each implementation defines its own way (fa_gen: zero
    attention output; eager: attention over whatever its mask leaves a fully masked row)."""
    model.train()
    model.zero_grad(set_to_none=True)
    predicted_from_real = torch.cat([mask[:, :1], mask[:, :-1]], dim=1) * mask   # labels shift left by one
    labels = ids.masked_fill(predicted_from_real == 0, -100)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}


def relative_errors(got: dict, reference: dict) -> dict[str, float]:
    assert set(got) == set(reference), set(got) ^ set(reference)
    return {name: float((got[name] - ref).norm() / ref.norm().clamp_min(1e-30)) for name, ref in reference.items()}


def outliers(ours: dict[str, float], yardstick: dict[str, float], floor: float = FLOOR) -> dict:
    """Parameters whose error exceeds twice the yardstick's plus the floor: name -> (ours, yardstick)."""
    return {name: (ours[name], yardstick[name]) for name in ours if ours[name] > 2 * yardstick[name] + floor}


class DropGradient(torch.autograd.Function):
    """Identity whose backward gives zeros: a deliberately wrong backward for negative controls."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)
