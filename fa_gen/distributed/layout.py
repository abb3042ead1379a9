"""How a sequence is cut into the ranks' shards, and where each shard's tokens sit in it.

contiguous: rank r holds chunk r of N equal chunks.
zigzag:     the sequence is cut into 2N equal chunks; rank r holds chunks r and 2N - 1 - r, so
            under a causal mask every rank has the same share of visible (query, key) pairs.

A shard is the concatenation of its chunks along the sequence axis (dim 1 of (batch, seqlen,
heads, dim) tensors); `chunks(rank)` names them as (start in the sequence, start in the shard,
length), which is all the ring needs to evaluate masks at global positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Chunk:
    start: int        # first token's position in the whole sequence
    offset: int       # first token's row in the shard
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Layout:
    kind: str
    world: int
    seqlen: int       # of the whole sequence

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise InputError(f"layout must be one of {', '.join(LAYOUTS)}; got {self.kind!r}")
        if self.world < 1:
            raise InputError(f"the ring needs at least one rank; got {self.world}")
        parts = self.world * (2 if self.kind == "zigzag" else 1)
        if self.seqlen % parts:
            raise InputError(f"a {self.kind} layout over {self.world} ranks cuts the sequence into {parts} equal "
                             f"chunks; seqlen {self.seqlen} is not a multiple of {parts}")

    @property
    def shard_len(self) -> int:
        return self.seqlen // self.world

    def chunks(self, rank: int) -> tuple[Chunk, ...]:
        if self.kind == "contiguous":
            return (Chunk(rank * self.shard_len, 0, self.shard_len),)
        half = self.shard_len // 2
        return (Chunk(rank * half, 0, half), Chunk((2 * self.world - 1 - rank) * half, half, half))

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of a whole-sequence tensor x (sequence on dim 1)."""
        return torch.cat([x[:, c.start:c.stop] for c in self.chunks(rank)], dim=1)

    def unshard(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's shard (sequence on `dim`)."""
        pieces = {}
        for rank, part in enumerate(shards):
            for c in self.chunks(rank):
                pieces[c.start] = part.narrow(dim, c.offset, c.length)
        return torch.cat([pieces[start] for start in sorted(pieces)], dim=dim)
