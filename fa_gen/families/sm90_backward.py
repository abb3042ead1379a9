"""Hopper backward kernel (templates/sm90/backward.py.j2): tile shapes, limits, render context.

FlashAttention-3's data flow: one CTA per key tile; two MMA warpgroups of 64 key rows each
compute S^T = K Q^T and dP^T = dO V^T, so P^T and dS^T land in registers already laid out as
the A operand of dV += P^T dO and dK += dS^T Q (no shared-memory round trip for P). dS goes to
shared memory once, for dQ = dS K. Each warpgroup then holds dK and dV of its 64 keys over the
whole head dim: 64 * (head_dim_qk + head_dim_v) / 128 fp32 registers per thread, which is
what bounds the head dims served (the larger ones need dK/dV split across warpgroups and P
through shared memory, a different data flow: they stay on the sm80 backward for now).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..archs import arch_info
from ..spec import Spec
from .expressions import backward_expression_context

# Key rows per MMA warpgroup (the M of one wgmma) and the warpgroups that share a key tile.
ROWS_PER_WARPGROUP = 64
MMA_WARPGROUPS = 2
TILE_N = ROWS_PER_WARPGROUP * MMA_WARPGROUPS
# setmaxnreg split over the 384 threads: producer warpgroup (TMA warp, dQ warp) and two MMA ones.
MMA_REGISTERS = 240
PRODUCER_REGISTERS = 24
# fp32 registers of one MMA thread at the peak (dK, dV, S^T, dP^T); the rest of the 240 holds
# the 16-bit P^T / dS^T operands, LSE and D of its query columns, and addresses.
_MAX_ACCUMULATORS = 192
# Query-tile rows the runtime pads the workspaces to (fa_gen.backward.ROW_ALIGN): tile_m divides it.
_ROW_ALIGN = 128
_SMEM_OVERHEAD = 1024


@dataclass(frozen=True)
class BackwardTileConfig:
    tile_m: int       # query rows per inner-loop step (the N of S^T; 64 or 128)
    num_stages: int   # shared-memory stages of Q, dO (with their LSE and D rows) and dS

    @property
    def dq_split_rows(self) -> bool:
        """dQ = dS K is split across the two warpgroups by rows (tile_m 128) or else by
        head-dim columns (tile_m 64: each wgmma still has its 64 rows)."""
        return self.tile_m == 2 * ROWS_PER_WARPGROUP

    def smem_bytes(self, head_dim_qk: int, head_dim_v: int) -> int:
        q_do = self.num_stages * self.tile_m * (head_dim_qk + head_dim_v) * 2
        k_v = TILE_N * (head_dim_qk + head_dim_v) * 2
        ds = self.num_stages * self.tile_m * TILE_N * 2
        dq_accum = self.tile_m * head_dim_qk * 4
        lse_dpsum = 2 * self.num_stages * self.tile_m * 4
        return q_do + k_v + ds + dq_accum + lse_dpsum + _SMEM_OVERHEAD

    def accumulators(self, head_dim_qk: int, head_dim_v: int) -> int:
        """fp32 registers per MMA thread: dK, dV of its 64 keys, S^T and dP^T of its 64 x tile_m."""
        return ROWS_PER_WARPGROUP * (head_dim_qk + head_dim_v + 2 * self.tile_m) // 128


# Per max(head dims): 64 query rows per step (FlashAttention-3's choice for d96-d128); d64 has
# registers to spare for 128, which halves the K/V-tile overhead per query row.
_TILES = {64: BackwardTileConfig(128, 2), 96: BackwardTileConfig(64, 2), 128: BackwardTileConfig(64, 2)}


def backward_reasons(spec: Spec, arch: str) -> list[str]:
    """Why this template cannot serve `spec`'s backward on `arch`; empty when it can."""
    dqk, dv = spec.head_dim_qk, spec.head_dim_v
    if dqk != dv or dqk not in _TILES:
        return [f"backward: head dims (qk {dqk}, v {dv}) are not served: each MMA warpgroup keeps dK and dV of "
                f"64 keys in registers, {64 * (dqk + dv) // 128} fp32 per thread (served: equal dims "
                f"{', '.join(map(str, _TILES))}); the sm80 backward serves them"]
    cfg = _TILES[dqk]
    reasons = []
    if cfg.accumulators(dqk, dv) > _MAX_ACCUMULATORS:
        reasons.append(f"backward: {cfg.accumulators(dqk, dv)} fp32 accumulators per thread; at most {_MAX_ACCUMULATORS}")
    if _ROW_ALIGN % cfg.tile_m:
        reasons.append(f"backward: tile_m {cfg.tile_m} must divide {_ROW_ALIGN}")
    smem = arch_info(arch).max_smem_per_block
    if cfg.smem_bytes(dqk, dv) > smem:
        reasons.append(f"backward: tiles need {cfg.smem_bytes(dqk, dv)} bytes of shared memory; {arch} has {smem}")
    return reasons


def kind_context(spec: Spec, arch: str) -> dict:
    """Render context of the backward kind (added to the family's forward context)."""
    problems = backward_reasons(spec, arch)
    assert not problems, problems  # backward_family and kernel_files refuse these first
    cfg = _TILES[spec.head_dim_qk]
    return {
        "bwd": {**asdict(cfg), "tile_n": TILE_N, "dq_split_rows": cfg.dq_split_rows},
        "bwd_mma_registers": MMA_REGISTERS,
        "bwd_producer_registers": PRODUCER_REGISTERS,
        "bwd_smem_bytes": cfg.smem_bytes(spec.head_dim_qk, spec.head_dim_v),
        # Query tiles first to last unless a right window (causal) makes the key tiles' ranges
        # end together: then last to first, so that in deterministic mode the CTAs of a query
        # tile add their dQ in key-tile order after a short skew (as the sm80 backward does).
        "bwd_ascending": spec.window_right is None,
        "bwd_prepare_lanes": _prepare_lanes(spec.head_dim_v),
        # Replaces the forward's: the backward's names and per-call schedule (fa_gen.backward_plan).
        "expr": backward_expression_context(spec),
    }


def _prepare_lanes(head_dim_v: int) -> int:
    """Lanes of the pre-pass that share one row: the largest power of two up to 16 dividing the
    row's 16-byte pieces (16 at d128, 8 at d64, 4 at d96)."""
    pieces = head_dim_v // 8
    return max(lanes for lanes in (1, 2, 4, 8, 16) if pieces % lanes == 0)
