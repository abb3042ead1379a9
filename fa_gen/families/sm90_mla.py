"""Hopper MLA decode family (sm_90a): multi-head latent attention, q/k head dim 576 (512 latent +
64 rope), v the latent 512 columns of the same cache (templates/sm90_mla/mla_decode.py.j2).

It serves specs of that head-dim pair alone, and only the per-call decode kinds (fa_gen.mla):
"mla_decode" over a contiguous cache, "mla_decode_paged" over a paged one. A 64-row tile
packs (query, head) pairs of the one latent KV head; its split-KV partials go through the
combine kernel.
"""

from __future__ import annotations

from ..spec import MLA_HEAD_DIMS, Alignment, DType, MaskKind, Spec
from .base import Family, dtype_and_head_dim_reasons, head_dims_text

KINDS = ("mla_decode", "mla_decode_paged")
# K stages of 64 x 576 (72 KB each) beside Q (72 KB) and P (8 KB): 224 KB of the 227 KB.
NUM_STAGES = 2
# Query rows of a tile and keys of a step (fa_gen.mla sizes splits with them).
TILE_M, TILE_N = 64, 64


class Sm90MlaFamily(Family):
    name = "sm90_mla"
    archs = ("sm_90a",)

    def verification(self):
        return [(self.archs, "L1 on H100 (tests/test_gpu_mla.py)")]

    def served_head_dims(self) -> str:
        return f"{head_dims_text([MLA_HEAD_DIMS])} (MLA decode: fa_gen.mla_decode)"

    def kernel_files(self, spec: Spec | None = None) -> dict[str, tuple[str, str]]:
        return {}  # no fixed-length forward or backward: decode kinds only, rendered per call

    def call_kinds(self, spec: Spec) -> dict[str, tuple[str, str]]:
        return {kind: ("mla_decode.py.j2", f"{kind}.py") for kind in KINDS}

    def kind_reasons(self, spec: Spec, kind: str) -> list[str]:
        if kind in KINDS:
            return []
        return [f"renders no {kind} kernel: an MLA spec is served by MLA decode alone (fa_gen.mla_decode)"]

    def spec_reasons(self, spec: Spec, arch: str) -> list[str]:
        reasons = dtype_and_head_dim_reasons(spec, (DType.FP16, DType.BF16), (MLA_HEAD_DIMS,))
        if spec.mask not in (MaskKind.NONE, MaskKind.CAUSAL):
            reasons.append(f"mask {spec.mask.value} is not served by MLA decode (none or causal)")
        elif spec.mask is MaskKind.CAUSAL and spec.alignment is not Alignment.BOTTOM_RIGHT:
            reasons.append("MLA decode's causal mask is bottom-right aligned (the new queries end the sequence)")
        return reasons

    def kind_context(self, spec: Spec, arch: str, kind: str) -> dict:
        return {"paged": kind == "mla_decode_paged"}

    def render_context(self, spec: Spec, arch: str) -> dict:
        return {
            "dtype_name": "BFloat16" if spec.dtype is DType.BF16 else "Float16",
            "softmax_scale_log2": spec.softmax_scale_log2,
            "num_stages": NUM_STAGES,
            "tile": {"tile_m": TILE_M, "tile_n": TILE_N},
        }
