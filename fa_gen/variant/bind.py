"""Checking the values a caller passes for a spec's inputs, once per call.

Shared by the reference and (later) the runtime: a tensor input must have the
declared dtype and the shape its symbols resolve to for this call; a scalar is a
number of the declared kind, or its default; every value respects the declared
bounds (the loader's proofs about reads and divisors rely on them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..errors import InputError
from .inputs import InputDecl

TORCH_DTYPES = {"int32": torch.int32, "float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}


def bind_inputs(decls: tuple[InputDecl, ...], values: Mapping | None, sizes: Mapping[str, int]) -> dict:
    """name -> checked value for every declared input (scalars' defaults filled in).

    `sizes` gives this call's batch, heads_q, seqlen_q and seqlen_k.
    """
    values = dict(values or {})
    unknown = sorted(set(values) - {d.name for d in decls})
    if unknown:
        declared = ", ".join(d.name for d in decls) or "none"
        raise InputError(f"unknown input(s) {', '.join(unknown)}; the spec declares: {declared}")
    return {d.name: _bind_scalar(d, values) if d.is_scalar else _bind_tensor(d, values, sizes) for d in decls}


def _bind_scalar(decl: InputDecl, values: Mapping):
    if decl.name not in values:
        if decl.default is None:
            raise InputError(f"scalar input {decl.name!r} has no default; pass a value")
        return decl.default
    value = values[decl.name]
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    allowed = (int,) if decl.dtype == "int" else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed) or not math.isfinite(value):
        raise InputError(f"scalar input {decl.name!r} must be a finite {decl.dtype}, got {value!r}")
    _check_bounds(decl, value, value)
    return float(value) if decl.dtype == "float" else value


def _bind_tensor(decl: InputDecl, values: Mapping, sizes: Mapping[str, int]) -> torch.Tensor:
    if decl.name not in values:
        raise InputError(f"tensor input {decl.name!r} is missing; expected shape {_shape_text(decl)}")
    tensor = values[decl.name]
    if not isinstance(tensor, torch.Tensor):
        raise InputError(f"input {decl.name!r} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != TORCH_DTYPES[decl.dtype]:
        raise InputError(f"input {decl.name!r} has dtype {tensor.dtype}; the spec declares {decl.dtype}")
    want = decl.resolved_shape(dict(sizes))
    if tuple(tensor.shape) != want:
        raise InputError(f"input {decl.name!r} has shape {tuple(tensor.shape)}; expected {want} "
                         f"({_shape_text(decl)})")
    if tensor.numel() and (decl.min is not None or decl.max is not None):
        _check_bounds(decl, tensor.min().item(), tensor.max().item())
    return tensor


def _check_bounds(decl: InputDecl, lo, hi) -> None:
    if decl.min is not None and lo < decl.min:
        raise InputError(f"input {decl.name!r} holds {lo}, below its declared min {decl.min}")
    if decl.max is not None and hi > decl.max:
        raise InputError(f"input {decl.name!r} holds {hi}, above its declared max {decl.max}")


def _shape_text(decl: InputDecl) -> str:
    return "[" + ", ".join(map(str, decl.shape)) + "]"
