"""Tile checks shared by the families whose warps each own 16-row slices of a query tile
(mma.sync on sm80 and sm75): whole MMA and copy tiles, accumulators that fit in registers,
and tiles that fit the arch's shared memory."""

from __future__ import annotations

from ..arch_table import arch_info
from ..spec import Spec


def padded_head_dim(head_dim: int) -> int:
    """The head dim as shared memory and the MMAs hold it: rounded up to whole 32-column swizzle
    atoms (the tensors' own columns past the head dim are zero-filled, never read or written)."""
    return -(-head_dim // 32) * 32


def smem_atom_cols(head_dim: int) -> int:
    """Columns of one swizzle atom: a 128-byte row where the head dim allows, else 64 bytes."""
    return 64 if head_dim % 64 == 0 else 32


def tile_reasons(cfg, spec: Spec, arch: str, max_accumulators: int) -> list[str]:
    """Why `cfg` (tile_m, tile_n, num_warps, smem_bytes()) cannot serve `spec` on `arch`."""
    reasons = []
    threads = cfg.num_warps * 32
    dqk, dv = padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v)
    for head_dim in sorted({dqk, dv}):
        copy_rows = threads // (smem_atom_cols(head_dim) // 8)
        if cfg.tile_m % copy_rows or cfg.tile_n % copy_rows:
            reasons.append(f"tuning: tile_m and tile_n must be multiples of {copy_rows} "
                           f"with {cfg.num_warps} warps at head dim {head_dim}")
    if cfg.tile_m % (16 * cfg.num_warps):
        reasons.append(f"tuning: tile_m {cfg.tile_m} must be a multiple of 16 x num_warps ({16 * cfg.num_warps})")
    if cfg.tile_n % 16:
        reasons.append(f"tuning: tile_n {cfg.tile_n} must be a multiple of 16")
    accumulators = cfg.tile_m * (cfg.tile_n + dv) // threads
    if accumulators > max_accumulators:
        reasons.append(f"tuning: {accumulators} fp32 accumulators per thread (S and O) would spill; "
                       f"at most {max_accumulators} (fewer rows or columns, or more warps)")
    smem = arch_info(arch).max_smem_per_block
    needed = cfg.smem_bytes(dqk, dv)
    if needed > smem:
        reasons.append(f"tuning: tiles need {needed} bytes of shared memory; {arch} has {smem}")
    return reasons
