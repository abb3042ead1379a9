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
    counter = ((kv_idx // 16) * 4 + (kv_idx % 8) // 2, (q_idx // 16) * 4 + (q_idx % 8) // 2,
               batch * heads_q + head, offset low 32 bits)
    word    = output word 2 * (q_idx % 2) + (kv_idx // 8) % 2 of that counter
    value   = byte 2 * (kv_idx % 2) + (q_idx // 8) % 2 of the word (byte 0 the lowest)
    keep    = value >= drop_threshold(p),  drop_threshold(p) = min(floor(256 p + 1/2), 255)
so one Philox call decides sixteen scores: queries (q, q + 1, q + 8, q + 9) of a 16-query group
times keys (k, k + 1, k + 8, k + 9) of a 16-key group, q and k even and below 8 in their group.
In the m16n8 accumulator of mma.sync (the sm80 kernels) and of wgmma (the sm90 kernels) a thread
holds rows r and r + 8 times keys c and c + 1 of each 8-key block, and lane ^ 4 holds rows r ^ 1:
the two lanes hold one call's sixteen scores, eight each (the forwards: rows of one parity, in
two words; the sm90 backward, whose S^T has keys on rows: keys of one parity, in two bytes of
each word). So each lane of the pair makes every other call and hands the other lane its half
with one shuffle (the forward: two words; the sm90 backward: the decisions, as bits): one call
per sixteen of a thread's scores. A word's low and high 16 bits hold keys k and k + 1 of one
query: the two probabilities of one packed 16-bit register of P, which the sm90 forward drops
with one byte permute, one packed compare and one AND (templates/common/dropout.j2). q_idx and
kv_idx are positions inside the sequence (varlen batches: per sequence, as masks see them).

Eight bits a score: Philox-10 is about 40 integer instructions per call (20 of them 64-bit
multiplies), and at one call per eight scores (16-bit values) the multiplies stalled the sm90
forward at dispatch (ncu: tensor pipe 80% -> 43% at p = 0.1, H100, 882ac40). With eight bits p
is resolved to 1/256, as FlashAttention-2's uint8 threshold resolves it; the kept probabilities
are scaled by 1 / (1 - p') with p' = drop_threshold(p) / 256, the drop rate the mask really
has, so the output stays unbiased (FlashAttention-2 rounds its threshold and still scales by
1 / (1 - p)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
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


def drop_threshold(p: float) -> int:
    """Bytes at or above this are kept: floor(256 p + 1/2), at most 255 (so p = 0 keeps all and
    p near 1 keeps 1/256; callers skip the mask entirely at p = 0)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1); got {p!r}")
    return min(int(256.0 * p + 0.5), 255)


def effective_p(p: float) -> float:
    """The drop rate the mask has for dropout probability p: p rounded to a multiple of 1/256."""
    return drop_threshold(p) / 256.0


def rescale(p: float) -> float:
    """What a kept probability is multiplied by: 1 / (1 - effective_p(p))."""
    return 256.0 / (256 - drop_threshold(p))


def dropout_keep(seed: int, offset: int, batch, head, heads_q: int, q_idx, kv_idx, p: float) -> torch.Tensor:
    """Boolean keep-mask of the scores at (batch, head, q_idx, kv_idx) (int64 tensors that
    broadcast together) for dropout probability p, generator state (seed, offset); see the module
    docstring for the mapping."""
    tensors = torch.broadcast_tensors(*(torch.as_tensor(x, dtype=torch.int64) for x in (batch, head, q_idx, kv_idx)))
    batch, head, q_idx, kv_idx = tensors
    query_set = (q_idx // 16) * 4 + (q_idx % 8) // 2
    key_set = (kv_idx // 16) * 4 + (kv_idx % 8) // 2
    counter = torch.stack([key_set, query_set, batch * heads_q + head, torch.full_like(q_idx, offset & MASK32)], -1)
    key = torch.tensor([seed & MASK32, ((seed >> 32) ^ (offset >> 32)) & MASK32], dtype=torch.int64,
                       device=q_idx.device)
    words = philox4x32(counter, key)
    word = torch.gather(words, -1, (2 * (q_idx % 2) + (kv_idx // 8) % 2).unsqueeze(-1)).squeeze(-1)
    value = (word >> (8 * (2 * (kv_idx % 2) + (q_idx // 8) % 2))) & 0xFF
    return value >= drop_threshold(p)


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
        """(batch, heads_q, seqlen_q, seqlen_k): keep / (1 - p') (p' = effective_p(p)), what
        multiplies the softmax probabilities before P @ V (the LSE is the undropped one)."""
        index = [torch.arange(n, device=device).view(*[-1 if i == axis else 1 for i in range(4)])
                 for axis, n in enumerate((batch, heads_q, seqlen_q, seqlen_k))]
        keep = dropout_keep(self.seed, self.offset, index[0] + self.first_batch, index[1], heads_q, index[2],
                            index[3], self.p)
        return keep.to(dtype) * rescale(self.p)
