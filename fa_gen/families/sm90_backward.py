"""Hopper backward kernel (templates/sm90/backward.py.j2): tile shapes, limits, render context.

FlashAttention-3's data flow, in two layouts of the same template:

narrow (head dims up to 128): one CTA per key tile of 128 keys; each of the two MMA
  warpgroups owns 64 of them and computes S^T = K Q^T and dP^T = dO V^T for them, so P^T and
  dS^T land in registers already laid out as the A operand of dV += P^T dO and dK += dS^T Q
  (no shared-memory round trip for P). Each warpgroup holds dK and dV of its 64 keys over the
  whole head dim: 64 * (head_dim_qk + head_dim_v) / 128 fp32 registers per thread.
wide (head dims 192 and 256, where that is 192-256 registers): key tiles of 64 keys; the
  warpgroups split S^T and dP^T by query columns, and dK, dV (and dQ) by head-dim columns, so
  each thread holds half as many dK/dV values. Every warpgroup's dV and dK then need all of P^T
  and dS^T: both go through shared memory, read back by the wgmma as MN-major operands.
keys on N (wide, `keys_on_n`; head dim 192): S = Q K^T and dP = dO V^T unswapped, each warpgroup
  48 of a 96-key tile on the wgmma N axis; dV^T = dO^T P and dK^T = Q^T dS with the whole head dim
  as M and each warpgroup's keys as N (P and dS through shared memory, one buffer). The key tile
  need not be a multiple of 64: 96 keys per CTA stream Q and dO and reduce dQ 1.5x less often
  than 64 (the wide layout at d192 is L2-bound).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..arch_table import arch_info
from ..spec import Spec
from .base import backward_order_context
from .expressions import backward_expression_context
from .warp_tiles import padded_head_dim

# Rows of one wgmma (its M): the key rows of a narrow warpgroup, every key of a wide tile.
ROWS_PER_WARPGROUP = 64
MMA_WARPGROUPS = 2
# setmaxnreg split over the 384 threads: producer warpgroup (TMA warp, dQ warp) and two MMA ones.
MMA_REGISTERS = 240
PRODUCER_REGISTERS = 24
# fp32 registers of one MMA thread at the peak (dK, dV, and S^T, dP^T or dQ); the rest of the
# 240 holds the 16-bit P^T / dS^T operands, LSE and D of its query columns, and addresses.
_MAX_ACCUMULATORS = 192
# Keys per CTA of the keys-on-N layout: 48 per warpgroup (a wgmma N), dK^T and dV^T of 48 keys
# over the whole head dim per thread group.
KEYS_ON_N_TILE = 96
# Query-tile rows the runtime pads the workspaces to (fa_gen.backward.ROW_ALIGN): tile_m divides it.
_ROW_ALIGN = 128
_SMEM_OVERHEAD = 1024


@dataclass(frozen=True)
class BackwardTileConfig:
    tile_m: int           # query rows per inner-loop step (the N of S^T; 64 or 128)
    num_stages: int       # shared-memory stages of Q (with its LSE rows) and of dS (and P)
    wide: bool = False    # the wide layout (module docstring)
    do_stages: int = 0    # stages of dO (with its D rows); 0: num_stages
    dq_buffers: int = 2   # dQ halves staged in shared memory at once (1: the warpgroups take turns)
    # Narrow only: the register-lean schedule (FlashAttention-3's order). dV is issued once dS
    # is stored rather than before dS is computed, dK once dV has landed, dQ's half is published
    # once dK has landed, and LSE / D are held a few per lane and fetched by shuffle. At tile_m
    # 128 the default schedule has ptxas serialize every wgmma (C7512).
    lean: bool = False
    # Wide only: keys on the wgmma N axis (FlashAttention-3's d192 flow). S = Q K^T and
    # dP = dO V^T unswapped, the warpgroups splitting the keys; dV^T = dO^T P and dK^T = Q^T dS
    # with the head dim as M. Keys then need not come in multiples of 64: 96-key tiles.
    keys_on_n: bool = False
    pds_stages: int = 0   # shared-memory stages of P and dS; 0: num_stages

    def __post_init__(self):
        if self.pds_stages not in (0, self.num_stages) and not (self.keys_on_n and self.pds_stages == 1):
            raise ValueError("BackwardTileConfig: P and dS in fewer stages than Q only with keys on N "
                             "(where each warpgroup reads its own keys' P), and then in one")
        if self.keys_on_n and not self.wide:
            raise ValueError("BackwardTileConfig: keys_on_n is a variant of the wide layout (wide=True)")
        if self.lean and self.wide:
            raise ValueError("BackwardTileConfig: `lean` is a schedule of the narrow layout; the wide "
                             "layout has its own (P and dS through shared memory)")
        if self.lean and self.tile_m % 64:
            raise ValueError(f"BackwardTileConfig: the lean schedule shares LSE / D across lanes in groups "
                             f"of 64 query rows; tile_m {self.tile_m} is not a multiple of 64")

    @property
    def tile_n(self) -> int:
        if self.keys_on_n:
            return KEYS_ON_N_TILE
        return ROWS_PER_WARPGROUP if self.wide else ROWS_PER_WARPGROUP * MMA_WARPGROUPS

    @property
    def PdS_stages(self) -> int:
        return self.pds_stages or self.num_stages

    @property
    def dq_split_rows(self) -> bool:
        """dQ = dS K is split across the two warpgroups by rows (tile_m 128) or else by
        head-dim columns (tile_m 64: each wgmma still has its 64 rows)."""
        return self.tile_m == 2 * ROWS_PER_WARPGROUP

    @property
    def dO_stages(self) -> int:
        return self.do_stages or self.num_stages

    def smem_bytes(self, head_dim_qk: int, head_dim_v: int) -> int:
        q = self.num_stages * self.tile_m * head_dim_qk * 2
        do = self.dO_stages * self.tile_m * head_dim_v * 2
        k_v = self.tile_n * (head_dim_qk + head_dim_v) * 2
        p_ds = (2 if self.wide else 1) * self.PdS_stages * self.tile_m * self.tile_n * 2
        dq_staging = self.dq_buffers * self.tile_m * head_dim_qk * 4 // MMA_WARPGROUPS
        lse_dpsum = (self.num_stages + self.dO_stages) * self.tile_m * 4
        return q + do + k_v + p_ds + dq_staging + lse_dpsum + _SMEM_OVERHEAD

    def accumulators(self, head_dim_qk: int, head_dim_v: int) -> int:
        """fp32 registers per MMA thread at the peak: dK and dV, with S^T and dP^T (narrow:
        while dQ is computed they are 16-bit operands) or, wide, the larger of those and dQ."""
        threads = MMA_WARPGROUPS * 128
        dk_dv = self.tile_n * (head_dim_qk + head_dim_v) // threads
        s_dp = 2 * self.tile_n * self.tile_m // threads
        if not self.wide:
            return dk_dv + s_dp
        return dk_dv + max(s_dp, self.tile_m * head_dim_qk // threads)


# Per (head_dim_qk, head_dim_v), in order of preference: the first whose shared memory fits wins.
# Narrow: 64 query rows per step (FlashAttention-3's choice for d96-d128); d64 has registers to
# spare for 128, which halves the K/V-tile overhead per query row. Wide: 64 x 64 tiles with Q
# double-buffered; d256 fits only with one dO stage and the two dQ halves taking turns.
_WIDE = [BackwardTileConfig(64, 2, wide=True),
         BackwardTileConfig(64, 2, wide=True, do_stages=1),
         BackwardTileConfig(64, 2, wide=True, do_stages=1, dq_buffers=1)]
_TILES = {
    (64, 64): [BackwardTileConfig(128, 2, lean=True)],
    (96, 96): [BackwardTileConfig(64, 2)],
    (128, 128): [BackwardTileConfig(64, 2)],
    (192, 128): [BackwardTileConfig(64, 2, wide=True, keys_on_n=True, pds_stages=1), *_WIDE],
    (192, 192): [BackwardTileConfig(64, 2, wide=True, keys_on_n=True, do_stages=1, pds_stages=1), *_WIDE],
    (256, 256): _WIDE,
}


def padded_dims(spec: Spec) -> tuple[int, int]:
    """(qk, v) as shared memory and the wgmmas hold them: whole 32-column atoms (TMA zero-fills
    the padding columns on load and clips them from every store)."""
    return padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v)


def backward_tile_config(spec: Spec, arch: str) -> BackwardTileConfig | None:
    """The first tile config of the spec's (padded) head dims that fits `arch`; None when none does."""
    dims = padded_dims(spec)
    for cfg in _TILES.get(dims, []):
        if not _tile_reasons(cfg, dims, arch):
            return cfg
    return None


def _tile_reasons(cfg: BackwardTileConfig, dims: tuple[int, int], arch: str) -> list[str]:
    reasons = []
    if cfg.accumulators(*dims) > _MAX_ACCUMULATORS:
        reasons.append(f"backward: {cfg.accumulators(*dims)} fp32 accumulators per thread; at most {_MAX_ACCUMULATORS}")
    if _ROW_ALIGN % cfg.tile_m:
        reasons.append(f"backward: tile_m {cfg.tile_m} must divide {_ROW_ALIGN}")
    smem = arch_info(arch).max_smem_per_block
    if cfg.smem_bytes(*dims) > smem:
        reasons.append(f"backward: tiles need {cfg.smem_bytes(*dims)} bytes of shared memory; {arch} has {smem}")
    return reasons


def served_pairs() -> tuple[tuple[int, int], ...]:
    """The (qk, v) head dims the Hopper backward serves."""
    return tuple(_TILES)


def backward_reasons(spec: Spec, arch: str) -> list[str]:
    """Why this template cannot serve `spec`'s backward on `arch`; empty when it can."""
    dims = padded_dims(spec)
    if dims not in _TILES:
        served = ", ".join(f"{qk}/{v}" for qk, v in _TILES)
        return [f"backward: head dims (qk {spec.head_dim_qk}, v {spec.head_dim_v}), padded to {dims[0]}/{dims[1]}, "
                f"are not served by the Hopper backward (served qk/v, padded: {served}); the sm80 backward serves them"]
    if backward_tile_config(spec, arch) is None:
        return _tile_reasons(_TILES[dims][-1], dims, arch)
    return []


def dropout_reasons(spec: Spec, arch: str) -> list[str]:
    """Why the backward_dropout kind is not this template's for `spec` (the sm80 family's serves
    it): it regenerates the mask in keys-major S^T, in pairs of 16-query groups a warpgroup, or
    with keys on N in queries-major S as the forwards do (16-key groups starting at multiples of
    16: a warpgroup's share of the key tile must be one). dV takes the dropped P (in the narrow
    layout as its 16-bit register operand, in the wide ones on its way to shared memory), dS
    the undropped one, still in registers."""
    reasons = backward_reasons(spec, arch)
    if reasons:
        return reasons
    cfg = backward_tile_config(spec, arch)
    if cfg.keys_on_n and (cfg.tile_n // 2) % 16 or not cfg.keys_on_n and cfg.tile_m % 64:
        return ["backward with dropout: the Hopper kernel's mask needs whole 16-key groups per warpgroup (keys on N) "
                f"or 64-query steps (tiles here: tile_n {cfg.tile_n}, tile_m {cfg.tile_m})"]
    return []


def kind_context(spec: Spec, arch: str, dropout: bool = False) -> dict:
    """Render context of the backward kind (added to the family's forward context); `dropout`:
    the backward_dropout kind (dropout_reasons), on the spec's own tiles and schedule: d128's
    non-lean one measured 1.02-1.06x the lean one with dropout (H100, p = 0.1, s 4k/8k,
    bench/results/logs/2026-11-26-s15c4-nonlean)."""
    problems = dropout_reasons(spec, arch) if dropout else backward_reasons(spec, arch)
    assert not problems, problems  # backward_family and kernel_files refuse these first
    cfg = backward_tile_config(spec, arch)
    return {
        "dropout": dropout,
        "bwd": {**asdict(cfg), "tile_n": cfg.tile_n, "dq_split_rows": cfg.dq_split_rows, "do_stages": cfg.dO_stages,
                "pds_stages": cfg.PdS_stages},
        "bwd_mma_registers": MMA_REGISTERS,
        "bwd_producer_registers": PRODUCER_REGISTERS,
        "bwd_smem_bytes": cfg.smem_bytes(*padded_dims(spec)),
        # Query tiles first to last unless a right window (causal) makes the key tiles' ranges
        # end together: then last to first, so that in deterministic mode the CTAs of a query
        # tile add their dQ in key-tile order after a short skew (as the sm80 backward does).
        "bwd_ascending": spec.window_right is None,
        # The grid's order.
        **backward_order_context(spec, *padded_dims(spec)),
        # Per-row LSE and D read from shared memory before the step's GEMMs are issued rather
        # than after them, where their loads queue behind the wgmmas' operand reads (ncu, d128:
        # the first exp2 waited on LSE for 11% of all stall samples). H200 A/Bs: both early,
        # 1-4% faster in the wide layout (2026-11-21-edd8f38-sm90-bwd.json, variant late_stats).
        # Narrow layout: LSE early and D late, d96 4-9% faster, d128 6-10% at 16k and within
        # noise at 4k; D early too was no better; the lean d64 0-2% slower, so late there
        # (2026-11-21-fcb1c34-stats-sm90-bwd.json, 2026-11-21-0c39e86-latelse-sm90-bwd.json).
        "bwd_early_lse": not cfg.lean,
        "bwd_early_dpsum": cfg.wide,
        "bwd_prepare_lanes": _prepare_lanes(padded_dims(spec)[1]),
        # Replaces the forward's: the backward's names and per-call schedule (fa_gen.backward_plan).
        "expr": backward_expression_context(spec),
    }


def _prepare_lanes(head_dim_v: int) -> int:
    """Lanes of the pre-pass that share one row: the largest power of two up to 16 dividing the
    row's 16-byte pieces (16 at d128, 8 at d64, 4 at d96)."""
    pieces = head_dim_v // 8
    return max(lanes for lanes in (1, 2, 4, 8, 16) if pieces % lanes == 0)
