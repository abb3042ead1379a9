"""Turing family: CUDA C++ with CuTe, compiled at run time by NVRTC.

The CuTe DSL starts at sm80, so Turing renders C++ instead: mma.sync m16n8k8 (fp16 in,
fp32 accumulate), ldmatrix, and K/V double-buffered through registers (Turing has no
cp.async). fp16 only: Turing's tensor cores have no bf16.

The same source also compiles for later archs, where it runs the Turing instruction set.
That serves one purpose: testing the Turing kernel on the GPUs we have. So on a later arch
this family is never chosen by default; it serves the arch only when asked for by name
(`fa_gen.build(spec, arch="sm_90a", family="sm75")`) and another family already serves it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..spec import DType, Spec
from .base import Family
from .warp_tiles import smem_atom_cols, tile_reasons

NATIVE_ARCH = "sm_75"
HEAD_DIMS = (64, 96, 128, 256)
# Later archs the Turing kernel can be compiled for, to test it (every one has mma.sync m16n8k8).
LATER_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_120a")

# Turing: 64 K 32-bit registers and 64 KB of shared memory per SM, no per-block reservation.
_REGS_PER_SM = 64 * 1024
_SMEM_PER_SM = 64 * 1024
_MAX_REGS_PER_THREAD = 256  # 255 usable, allocated in whole warps of 256
# S and O accumulators one thread may hold; the rest of the 255 registers hold one staged
# K or V tile, MMA fragments and addresses.
_MAX_ACCUMULATORS = 160


@dataclass(frozen=True)
class TileConfig:
    tile_m: int       # query rows per CTA
    tile_n: int       # key rows per main-loop step
    num_warps: int    # each warp owns tile_m / num_warps query rows

    def smem_bytes(self, head_dim_qk: int, head_dim_v: int, elem_bytes: int = 2) -> int:
        # One buffer each for Q, K and V; the second K/V stage is in registers.
        return (self.tile_m * max(head_dim_qk, head_dim_v) + self.tile_n * (head_dim_qk + head_dim_v)) * elem_bytes

    def blocks_per_sm(self, head_dim_qk: int, head_dim_v: int) -> int:
        """Resident CTAs per Turing SM, bounded by shared memory and by registers at the 255 cap."""
        by_smem = _SMEM_PER_SM // self.smem_bytes(head_dim_qk, head_dim_v)
        by_regs = _REGS_PER_SM // (self.num_warps * 32 * _MAX_REGS_PER_THREAD)
        return min(by_smem, by_regs)


def tile_config(spec: Spec) -> TileConfig:
    """Tile shape of the Turing kernel (the same on every arch it is compiled for).

    Among the usable candidates, the one that keeps the most warps resident on a Turing SM
    (its 64 KB of shared memory are the tight bound); ties go to the earlier, larger tile.
    """
    dqk, dv = spec.head_dim_qk, spec.head_dim_v
    override = spec.tuning_for(Sm75Family.name)
    if override:
        return replace(_candidates(max(dqk, dv))[0], **override)
    usable = [c for c in _candidates(max(dqk, dv)) if not _tile_reasons(c, spec)]
    return max(usable, key=lambda c: c.blocks_per_sm(dqk, dv) * c.num_warps)  # max() keeps the first of ties


def _candidates(head_dim: int) -> list[TileConfig]:
    """Preference-ordered tiles, all of 4 warps. What `tile_config` picks, with shared memory
    per CTA and CTAs per Turing SM: head dim 64: 128 x 64, 32 KB, 2; 96: 64 x 32, 24 KB, 2;
    128: 64 x 32, 32 KB, 2 (128 x 64 would need 64 KB and 192 accumulators); 256: 64 x 32,
    64 KB, 1 (the only one that fits).
    """
    if head_dim <= 64:
        return [TileConfig(128, 64, 4), TileConfig(64, 64, 4)]
    return [TileConfig(128, 64, 4), TileConfig(64, 64, 4), TileConfig(64, 32, 4)]


class Sm75Family(Family):
    name = "sm75"
    archs = (NATIVE_ARCH,)
    backend = "nvrtc"
    forward_template = "forward.cu.j2"
    forward_filename = "forward.cu"
    tuning_params = ("tile_m", "tile_n", "num_warps")

    def verification(self):
        return [(self.archs, "compiled for sm_75; its L1 runs the same source compiled for the H100/H200 "
                             "(no Turing GPU here)")]

    def served_head_dims(self) -> str:
        return f"forward: {', '.join(map(str, HEAD_DIMS))} (qk = v); no backward"

    def can_implement(self, spec: Spec, arch: str) -> list[str]:
        if arch in LATER_ARCHS and _served_by_another(self, spec, arch):
            # The source is the one for Turing: what it implements there, it implements here.
            return super().can_implement(spec, NATIVE_ARCH)
        return super().can_implement(spec, arch)

    def spec_reasons(self, spec: Spec, arch: str) -> list[str]:
        reasons = []
        if spec.dtype is not DType.FP16:
            reasons.append(f"dtype {spec.dtype.value} is not supported (fp16 only: Turing tensor cores "
                           "have no bf16)")
        if spec.head_dim_qk != spec.head_dim_v or spec.head_dim_qk not in HEAD_DIMS:
            allowed = ", ".join(map(str, HEAD_DIMS))
            reasons.append(f"head_dim (qk {spec.head_dim_qk}, v {spec.head_dim_v}) is not supported "
                           f"({allowed}, equal for qk and v)")
        else:
            reasons.extend(_tile_reasons(tile_config(spec), spec))
        return reasons

    def render_context(self, spec: Spec, arch: str) -> dict:
        cfg = tile_config(spec)
        problems = _tile_reasons(cfg, spec)
        assert not problems, problems  # can_implement refuses these first
        return {
            "tile": asdict(cfg),
            "smem_bytes": cfg.smem_bytes(spec.head_dim_qk, spec.head_dim_v),
            "softmax_scale_log2": spec.softmax_scale_log2,
            # Swizzle atoms span 64 columns (128 B) where the head dim allows, else 32 (64 B).
            "smem_atom_cols_qk": smem_atom_cols(spec.head_dim_qk),
            "smem_atom_cols_v": smem_atom_cols(spec.head_dim_v),
            # Causal-like masks: later query tiles see more keys, so launch them first.
            "reverse_m_blocks": spec.window_left is None and spec.window_right is not None,
        }


def _served_by_another(family: Family, spec: Spec, arch: str) -> bool:
    from . import REGISTRY  # the package imports this module first

    return any(other is not family and not other.can_implement(spec, arch) for other in REGISTRY)


def _tile_reasons(cfg: TileConfig, spec: Spec) -> list[str]:
    """As sm80's checks, against Turing's shared memory (the source is the same on every arch)."""
    return tile_reasons(cfg, spec, NATIVE_ARCH, _MAX_ACCUMULATORS)
