"""Padded batches as packed (varlen) ones and back, in plain torch (no GPU needed).

    packing = unpad_mask(mask, seqlen_q)            # mask (batch, seqlen_k): True where a token is real
    q_packed = gather(q, packing.indices_q, packing.seqlen_q)     # (total_q, heads, d)
    out = scatter(out_packed, packing.indices_q, batch, seqlen_q)  # zeros at the padding

A padded row's real tokens form its sequence, in order; its query rows are the last `seqlen_q`
positions of the mask (a decode step's new token, a prefill chunk), so a bottom-right causal mask
per sequence sees exactly the keys the padded batch's causal mask would (left or right padding at
prefill; left padding when decoding, as generate() pads). Everything is computed on the device;
the lengths the kernel's grid needs (max_seqlen_*) cost one device-to-host copy, and `LastResult`
keeps one result per mask so a model's layers share it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded batch are, and the varlen arguments that describe them."""

    indices_q: torch.Tensor      # (total_q,) int64: flat positions in (batch, seqlen_q)
    indices_k: torch.Tensor      # (total_k,) int64: flat positions in (batch, seqlen_k)
    cu_seqlens_q: torch.Tensor   # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor   # (batch + 1,) int32
    max_seqlen_q: int
    max_seqlen_k: int
    seqlen_q: int
    seqlen_k: int


def _real_tokens(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat indices of the real tokens, per-row counts int32, cumulative counts with a leading 0)."""
    counts = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.reshape(-1), as_tuple=False).reshape(-1)
    cumulative = torch.nn.functional.pad(torch.cumsum(counts, dim=0, dtype=torch.int32), (1, 0))
    return indices, counts, cumulative


def unpad_mask(mask: torch.Tensor, seqlen_q: int) -> Packing:
    """The packing of a (batch, seqlen_k) padding mask whose last `seqlen_q` columns are the queries."""
    mask = mask.bool()
    seqlen_k = mask.shape[-1]
    if not 0 < seqlen_q <= seqlen_k:
        raise ValueError(f"seqlen_q {seqlen_q} must be in [1, {seqlen_k}] (the mask's width)")
    indices_k, counts_k, cu_k = _real_tokens(mask)
    if seqlen_q == seqlen_k:
        indices_q, counts_q, cu_q = indices_k, counts_k, cu_k
    else:
        indices_q, counts_q, cu_q = _real_tokens(mask[:, -seqlen_q:])
    longest = torch.stack([counts_q.max(), counts_k.max()]).tolist()  # the one device-to-host copy
    return Packing(indices_q, indices_k, cu_q, cu_k, longest[0], longest[1], seqlen_q, seqlen_k)


def gather(x: torch.Tensor, indices: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Rows `indices` (flat in (batch, seqlen)) of x (batch, seqlen, ...), without copying x whole
    (x may be a transposed view)."""
    return x[torch.div(indices, seqlen, rounding_mode="floor"), indices % seqlen]


def scatter(rows: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """(batch, seqlen, ...) holding `rows` at flat positions `indices` and zeros elsewhere; differentiable."""
    out = rows.new_zeros((batch, seqlen, *rows.shape[1:]))
    return out.index_put((torch.div(indices, seqlen, rounding_mode="floor"), indices % seqlen), rows)


def packed_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(cu_seqlens int32, longest) of the sequences packed into one row of position ids, a new one
    starting wherever a position does not continue the previous by one; None for a single sequence."""
    positions = position_ids.reshape(-1)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] != positions[:-1] + 1
    first = torch.nonzero(starts, as_tuple=False).reshape(-1)
    if first.numel() <= 1:
        return None
    end = torch.tensor([positions.numel()], dtype=first.dtype, device=first.device)
    cu_seqlens = torch.cat([first, end]).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())


class LastResult:
    """`compute(tensor, *extra)` remembered for the last tensor seen (by identity and version):
    every layer of a forward receives the same mask and position ids, so they are unpadded once."""

    def __init__(self, compute):
        self._compute = compute
        self._ref = None
        self._key = None
        self._value = None

    def __call__(self, tensor: torch.Tensor, *extra):
        key = (tensor._version, tensor.device, extra)
        if self._ref is not None and self._ref() is tensor and self._key == key:
            return self._value
        value = self._compute(tensor, *extra)
        self._ref, self._key, self._value = weakref.ref(tensor), key, value
        return value
