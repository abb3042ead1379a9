"""Philox4x32-10 in PyTorch, and the dropout keep-mask fa_gen's kernels will regenerate from it.

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) is the
counter-based generator PyTorch's CUDA generator and FlashAttention use: a 128-bit counter and
a 64-bit key give four 32-bit words, with no state between calls, so a backward regenerates the
forward's dropout mask from the same (seed, offset, indices) instead of storing it.

    words = philox4x32(counter, key)        # counter (..., 4), key (..., 2): uint32 in int64
    keep = dropout_keep(seed, offset, batch, head, heads_q, q_idx, kv_idx, p)

Everything is exact integer arithmetic in int64 tensors (a 32 x 32-bit product is split into
16-bit halves so that no intermediate leaves int64), on any device: the float64 reference and
the tests reproduce a kernel's mask bit for bit.

The mask's index mapping (what a kernel must compute the same way):
    key     = (seed low 32 bits, seed high 32 bits XOR offset high 32 bits)
    counter = ((kv_idx // 16) * 4 + (kv_idx % 8) // 2, (q_idx // 16) * 8 + q_idx % 8,
               batch * heads_q + head, offset low 32 bits)
    word    = output word 2 * ((q_idx // 8) % 2) + (kv_idx % 16) // 8 of that counter
    value   = 16-bit half kv_idx % 2 of the word (the low half for even keys)
    keep    = value < threshold(p),  threshold(p) = floor((1 - p) * 2^16), at most 2^16 - 1
so one Philox call decides eight scores: rows (r, r + 8) of a 16-row group times keys
(c, c + 1, c + 8, c + 9) of a 16-key group, c even and below 8. Those are the eight scores one
thread holds in two neighbouring 16 x 8 accumulator blocks of mma.sync m16n8 (the sm80 forward)
and of wgmma (the sm90 forward), whose query and key tiles start at multiples of 16. A kernel
whose thread holds one block of the pair (the sm80 backward: keys c and c + 32) makes the call
per block and uses half of it. q_idx / kv_idx are positions inside the sequence (varlen
batches: per sequence, as masks see them).

Sixteen bits a score, not 32: Philox-10 is about 40 integer instructions per call, and at one
call per four scores it cost the sm90 forward two thirds of its speed (H100, 391b14f,
bench/bench_dropout.py); p is then resolved to 2^-16, finer than FlashAttention-2's 2^-8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
MASK16 = 0xFFFF
# Multipliers and key increments of Philox4x32 (Random123's PHILOX_M4x32_0/1, PHILOX_W32_0/1).
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product a * b (a a constant, b uint32 in int64)."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    low_part = b * a_lo                 # < 2^48
    high_part = b * a_hi                # < 2^48; the product is low_part + high_part * 2^16
    mid = low_part + ((high_part & 0xFFFF) << 16)   # < 2^49
    low = mid & MASK32
    high = (high_part >> 16) + (mid >> 32)
    return high & MASK32, low


def philox4x32(counter: torch.Tensor, key: torch.Tensor, rounds: int = ROUNDS) -> torch.Tensor:
    """Philox4x32 of `counter` (..., 4) under `key` (..., 2), both uint32 values in int64
    tensors (broadcast together): the (..., 4) output words."""
    if counter.dtype != torch.int64 or key.dtype != torch.int64:
        raise TypeError("philox4x32 takes int64 tensors holding uint32 values")
    c = [counter[..., i] & MASK32 for i in range(4)]
    k0, k1 = key[..., 0] & MASK32, key[..., 1] & MASK32
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        hi0, lo0 = _mulhilo(M0, c[0])
        hi1, lo1 = _mulhilo(M1, c[2])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return torch.stack(torch.broadcast_tensors(*c), dim=-1)


def keep_threshold(p: float) -> int:
    """16-bit values below this are kept: floor((1 - p) * 2^16), at most 2^16 - 1 (p = 0 keeps
    all but a 2^-16 sliver; callers skip the mask entirely at p = 0)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1); got {p!r}")
    return min(int((1.0 - p) * 2.0 ** 16), MASK16)


def dropout_keep(seed: int, offset: int, batch, head, heads_q: int, q_idx, kv_idx, p: float) -> torch.Tensor:
    """Boolean keep-mask of the scores at (batch, head, q_idx, kv_idx) (int64 tensors that
    broadcast together) for dropout probability p, generator state (seed, offset); see the module
    docstring for the mapping."""
    tensors = torch.broadcast_tensors(*(torch.as_tensor(x, dtype=torch.int64) for x in (batch, head, q_idx, kv_idx)))
    batch, head, q_idx, kv_idx = tensors
    row_group = (q_idx // 16) * 8 + q_idx % 8
    key_group = (kv_idx // 16) * 4 + (kv_idx % 8) // 2
    counter = torch.stack([key_group, row_group, batch * heads_q + head, torch.full_like(q_idx, offset & MASK32)], -1)
    key = torch.tensor([seed & MASK32, ((seed >> 32) ^ (offset >> 32)) & MASK32], dtype=torch.int64,
                       device=q_idx.device)
    words = philox4x32(counter, key)
    word = torch.gather(words, -1, (2 * ((q_idx // 8) % 2) + (kv_idx % 16) // 8).unsqueeze(-1)).squeeze(-1)
    value = (word >> (16 * (kv_idx % 2))) & MASK16
    return value < keep_threshold(p)


@dataclass(frozen=True)
class Dropout:
    """One dropout draw: probability p and the generator state (seed, offset) it comes from;
    `first_batch`: the batch index of the tensors' first entry (sequence b of a packed batch,
    judged alone, is batch entry b of the kernel's mask)."""

    p: float
    seed: int
    offset: int
    first_batch: int = 0

    def scale(self, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, device=None,
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """(batch, heads_q, seqlen_q, seqlen_k): keep / (1 - p), what multiplies the softmax
        probabilities before P @ V (the LSE is the undropped one)."""
        index = [torch.arange(n, device=device).view(*[-1 if i == axis else 1 for i in range(4)])
                 for axis, n in enumerate((batch, heads_q, seqlen_q, seqlen_k))]
        keep = dropout_keep(self.seed, self.offset, index[0] + self.first_batch, index[1], heads_q, index[2],
                            index[3], self.p)
        return keep.to(dtype) / (1.0 - self.p)
