"""Blackwell datacenter family (sm_100a, sm_103a): TMA loads, tcgen05 MMAs with S and O
accumulated in tensor memory, warp-specialized softmax and correction warpgroups.

Opt-in (`family="sm100"`): it compiles for every spec it claims and its SASS is checked on the
CPU (tests/test_sm100.py), but no Blackwell GPU has run it, so the Ampere-class sm80 family stays
the default on these archs until one has. Its L1 exactness suite is parametrised for it and skips
with that reason until a Blackwell device is present.

One CTA works on 128 query rows of one (batch, head) at a time, walking key tiles of 128 (64 or
32 for expression specs):
  warp 0        TMA: Q once per tile, K and V of each visited key tile into a NUM_STAGES-deep ring;
  warp 1        MMA: one thread issues S = Q K^T into one of two TMEM S buffers, then
                O += P V into the TMEM O accumulator, P read from shared memory;
  warpgroup 1   softmax: thread r owns query row r (TMEM lane r): loads its S row, masks it,
                keeps the running max, writes P (16-bit) to shared memory and the row's rescale
                factor for the correction warpgroup; the max moves only when it grows by more
                than RESCALE_THRESHOLD (log2 units), so most steps rescale nothing;
  warpgroup 2   correction: rescales the rows of O whose max moved, between two P V MMAs, and
                writes the normalised O at the end of a tile.
The persistent grid, its tile order and the key-tile ranges are the sm90 forward's
(common/tile_scheduler.j2, common/block_info.j2); masks and expressions common/mask.j2 and
common/variant.j2. docs/blackwell.md has the design and what is checked without hardware.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..arch_table import arch_info
from ..spec import DType, Spec
from .base import Family, dtype_and_head_dim_reasons, head_dims_text
from .expressions import expression_context

HEAD_DIMS = ((64, 64), (96, 96), (128, 128))
# Multiprocessors of a B200: the persistent grid's size (a part with fewer runs the surplus CTAs
# in a second wave).
NUM_SMS = 148
# Tensor memory: 512 columns of 128 lanes x 32 bits per SM.
TMEM_COLUMNS = 512
# mbarriers, the rescale-factor exchange and the 1024-byte alignment of the first buffer.
_SMEM_OVERHEAD = 2048
# P buffers (the softmax writes P_(i+1) while P_i V runs).
P_STAGES = 2
_DSL_DTYPES = {DType.BF16: "BFloat16", DType.FP16: "Float16"}


@dataclass(frozen=True)
class TileConfig:
    tile_m: int = 128      # query rows per CTA tile: the M of one tcgen05 MMA, one TMEM lane each
    tile_n: int = 128      # keys per main-loop step: the N of S, the K of P V
    num_stages: int = 2    # shared-memory stages of the K and V rings
    # The tile scheduler's knobs (common/tile_scheduler.j2), as in the sm90 family.
    l2_kv_mb: int = 32
    persist_m_blocks: int = 64
    persist_l2_groups: int = 1

    def smem_bytes(self, head_dim: int, in_bytes: int = 2) -> int:
        """Q, the K and V rings and the P buffers (16-bit), in bytes."""
        q = self.tile_m * head_dim
        kv = 2 * self.num_stages * self.tile_n * head_dim
        p = P_STAGES * self.tile_m * self.tile_n
        return (q + kv + p) * in_bytes + _SMEM_OVERHEAD

    def tmem_columns(self, head_dim: int) -> int:
        """Two S buffers (fp32, tile_n columns each) and O (head_dim columns)."""
        return 2 * self.tile_n + head_dim


# Per head dim: three K/V stages where they fit beside Q and two P buffers (d 64: 176 KB), two
# otherwise (d 128: 224 KB). Not measured: no Blackwell GPU has run this family.
_DEFAULT_TILES = {64: TileConfig(num_stages=3), 96: TileConfig(), 128: TileConfig()}


# An expression's per-key temporaries (and its reads of the spec's inputs) sit beside a softmax
# thread's row of S: with 128 keys, alibi and relative_bias spilled at the softmax warpgroup's
# 256 registers; 64-key tiles leave room for them (softcap fitted either way).
EXPRESSION_TILE_N = 64
# An input with a seqlen_k axis is read once per key (document ids): 32-key tiles (at 64 keys,
# `document` spilled).
PER_KEY_INPUT_TILE_N = 32


def tile_config(spec: Spec) -> TileConfig:
    default = _DEFAULT_TILES[spec.head_dim_qk]
    if spec.uses_expressions:
        # Fewer keys a step: a third K/V stage fits (d 128: 162 KB).
        per_key = any(not d.is_scalar and "seqlen_k" in d.shape for d in spec.inputs)
        default = replace(default, tile_n=PER_KEY_INPUT_TILE_N if per_key else EXPRESSION_TILE_N, num_stages=3)
    return replace(default, **spec.tuning_for(Sm100Family.name))


def _longest_first(spec: Spec) -> bool:
    return spec.window_left is None and spec.window_right is not None


class Sm100Family(Family):
    name = "sm100"
    archs = ("sm_100a", "sm_103a", "sm_100f", "sm_103f")
    backend = "cute_dsl"
    tuning_params = ("tile_n", "num_stages", "l2_kv_mb", "persist_m_blocks", "persist_l2_groups")
    # Score mods, mask expressions (per-call key-tile lists) and sink logits in the forward.
    supports_expressions = True

    def verification(self):
        return [(self.archs, "compiled and SASS-checked on the CPU only; never run on hardware "
                             "(opt-in: family=\"sm100\")")]

    def served_head_dims(self) -> str:
        return f"forward only: {head_dims_text(HEAD_DIMS)} (opt-in, not run on hardware)"

    def kernel_files(self, spec: Spec | None = None) -> dict[str, tuple[str, str]]:
        return {"forward": (self.forward_template, self.forward_filename)}

    def kind_reasons(self, spec: Spec, kind: str) -> list[str]:
        return [] if kind == "forward" else [f"renders the fixed-length forward only (no {kind} kernel yet)"]

    def spec_reasons(self, spec: Spec, arch: str) -> list[str]:
        reasons = dtype_and_head_dim_reasons(spec, tuple(_DSL_DTYPES), HEAD_DIMS)
        if not reasons:
            reasons.extend(_tile_reasons(tile_config(spec), spec, arch))
        return reasons

    def forward_tiles(self, spec: Spec, arch: str) -> tuple[int, int]:
        cfg = tile_config(spec)
        return cfg.tile_m, cfg.tile_n

    def render_context(self, spec: Spec, arch: str) -> dict:
        cfg = tile_config(spec)
        return {
            "tile": asdict(cfg),
            "head_dim": spec.head_dim_qk,
            "dtype_name": _DSL_DTYPES[spec.dtype],
            "softmax_scale_log2": spec.softmax_scale_log2,
            "num_sms": NUM_SMS,
            "l2_kv_bytes": cfg.l2_kv_mb * 1024 * 1024,
            "smem_bytes": cfg.smem_bytes(spec.head_dim_qk),
            "tmem_columns": TMEM_COLUMNS,
            "longest_first": _longest_first(spec),
            "expr": expression_context(spec),
            # The shared modules' call features: none of them in this family yet.
            "varlen": False,
            "dropout": False,
            "shifted": False,
            "fp8": False,
        }


def _tile_reasons(cfg: TileConfig, spec: Spec, arch: str) -> list[str]:
    """What the template relies on: 128-row tiles (one TMEM lane per row), key tiles a whole
    number of MMA K steps, S and O fitting tensor memory, the buffers fitting shared memory."""
    reasons = []
    if cfg.tile_m != 128:
        reasons.append(f"tuning: tile_m {cfg.tile_m} must be 128 (one TMEM lane per query row)")
    if cfg.tile_n % 32 or not 32 <= cfg.tile_n <= 128:
        reasons.append(f"tuning: tile_n {cfg.tile_n} must be a multiple of 32 in [32, 128]")
    if cfg.num_stages < 2:
        reasons.append(f"tuning: num_stages {cfg.num_stages} must be at least 2")
    if cfg.tmem_columns(spec.head_dim_qk) > TMEM_COLUMNS:
        reasons.append(f"tuning: S and O take {cfg.tmem_columns(spec.head_dim_qk)} TMEM columns; {TMEM_COLUMNS} exist")
    smem = arch_info(arch).max_smem_per_block
    if cfg.smem_bytes(spec.head_dim_qk) > smem:
        reasons.append(f"tuning: tiles need {cfg.smem_bytes(spec.head_dim_qk)} bytes of shared memory; "
                       f"{arch} has {smem} (fewer stages or a smaller tile_n)")
    return reasons
