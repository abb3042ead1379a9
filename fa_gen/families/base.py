"""What every template family declares: the archs it serves and why it cannot serve a spec."""

from __future__ import annotations

from ..spec import Spec

# Causal-like masks: MB of L2 that a group of K/V heads' Q, dO and dQ accumulator rows may take
# in the backward's CTA order (backward_order_context). 24 MB on an H100: d128 causal 2k / 4k /
# 8k 332 / 414 / 481 -> 352 / 455 / 501 TFLOP/s against head by head (sm90, trees alternated,
# bench/results/2026-11-27-5a7513f-ab-bwd-causal-lpt-h100.json).
CAUSAL_L2_HEADS_MB = 24


def backward_order_context(spec: Spec, head_dim_qk: int, head_dim_v: int) -> dict:
    """Render context of the sm90 fixed-length backward grid's order (common/backward.j2
    define_key_tile_of_cta): causal-like masks (no left window, no mask expression) run their
    key tiles longest first in L2-sized groups of heads; others keep the grid's order (0 MB)."""
    causal_like = spec.window_left is None and spec.window_right is not None and spec.mask_expr is None
    return {"bwd_l2_heads_mb": CAUSAL_L2_HEADS_MB if causal_like else 0, "bwd_qk": head_dim_qk, "bwd_v": head_dim_v}


class Family:
    """One template family (one hardware generation). Subclasses override what differs."""

    name: str = ""
    archs: tuple[str, ...] = ()
    backend: str = "cute_dsl"
    forward_template: str = "forward.py.j2"
    forward_filename: str = "forward.py"
    # Names a spec's `tuning: {<family>: {...}}` may set for this family.
    tuning_params: tuple[str, ...] = ()
    # Kernels besides the forward one (e.g. "backward"): kind -> (template, rendered filename).
    extra_kernels: dict[str, tuple[str, str]] = {}
    # Whether the templates implement mask / score-mod / sink expressions (fa_gen/variant).
    supports_expressions: bool = False

    def served_head_dims(self) -> str:
        """The (qk, v) head dims this family's forward and backward take, in words (`fa-gen list`)."""
        return ""

    def verification(self) -> list[tuple[tuple[str, ...], str]]:
        """(archs, how kernels for them were verified) for `fa-gen list` and the README."""
        return [(self.archs, "compiled only")]

    def kernel_files(self, spec: Spec | None = None) -> dict[str, tuple[str, str]]:
        """Every kernel kind this family renders (for `spec`, when given): kind -> (template,
        rendered filename); an extra kind that `kind_reasons` refuses for `spec` is left out."""
        extra = {kind: files for kind, files in self.extra_kernels.items()
                 if spec is None or not self.kind_reasons(spec, kind)}
        return {"forward": (self.forward_template, self.forward_filename), **extra}

    def call_kinds(self, spec: Spec) -> dict[str, tuple[str, str]]:
        """Kernels the runtime picks per call (varlen, split-KV, ...), rendered on first use
        and not written to generated/: kind -> (template, rendered filename)."""
        return {}

    def kind_reasons(self, spec: Spec, kind: str) -> list[str]:
        """Why this family renders no `kind` kernel (one of extra_kernels) for `spec`, which it
        otherwise serves (a head dim its backward cannot fit, say); empty when it does."""
        return []

    def kind_context(self, spec: Spec, arch: str, kind: str) -> dict:
        """Context a non-forward kind adds to `render_context` (its own tiles, say)."""
        return {}

    def forward_variants(self, spec: Spec, arch: str) -> list[tuple[int, str]]:
        """Forward kinds the runtime picks per call instead of "forward": (longest seqlen it
        serves, kind), shortest first; a call whose seqlens exceed them all takes "forward". An
        entry may name "forward" itself, to keep the shortest calls on the long kernel."""
        return []

    def can_implement(self, spec: Spec, arch: str) -> list[str]:
        """Reasons this family cannot implement `spec` on `arch`; empty when it can."""
        if arch not in self.archs:
            return [f"serves {', '.join(self.archs)}, not {arch}"]
        if spec.uses_expressions and not self.supports_expressions:
            return ["expression masks/score mods are not implemented in this family yet"]
        return self.spec_reasons(spec, arch)

    def forward_tiles(self, spec: Spec, arch: str) -> tuple[int, int]:
        """(tile_m, tile_n) of the forward kernel: the runtime classifies key tiles per call with them."""
        raise NotImplementedError

    def spec_reasons(self, spec: Spec, arch: str) -> list[str]:
        return []

    def render_context(self, spec: Spec, arch: str) -> dict:
        raise NotImplementedError


def dtype_and_head_dim_reasons(spec: Spec, dtypes, head_dims) -> list[str]:
    """Reasons `spec`'s dtype or (qk, v) head dims are outside what a family's kernels take
    (`head_dims` None: the family checks head dims by its own rule)."""
    reasons = []
    if spec.dtype not in dtypes:
        reasons.append(f"dtype {spec.dtype.value} is not supported ({', '.join(d.value for d in dtypes)})")
    if head_dims is not None and (spec.head_dim_qk, spec.head_dim_v) not in head_dims:
        allowed = ", ".join(f"{q}" if q == v else f"(qk {q}, v {v})" for q, v in head_dims)
        reasons.append(f"head_dim (qk {spec.head_dim_qk}, v {spec.head_dim_v}) is not supported ({allowed})")
    return reasons


def head_dims_text(pairs) -> str:
    """(qk, v) pairs as `fa-gen list` shows them: 128, or 192/128 where qk and v differ."""
    return ", ".join(f"{q}" if q == v else f"{q}/{v}" for q, v in pairs)


# Names an expression reads that a shifted call (queries and keys elsewhere in a longer sequence) changes.
POSITION_NAMES = frozenset({"q_idx", "kv_idx", "seqlen_q", "seqlen_k"})


def position_reasons(spec: Spec) -> list[str]:
    """Why `spec` has no shifted kinds: those move the window mask's diagonal by a runtime offset
    and nothing else."""
    from ..variant.tree import names_used

    reasons = []
    if spec.mask_expr is not None:
        reasons.append("a mask expression reads positions, which a shifted call does not move")
    for label, tree in (("score mod", spec.score_mod_tree), ("sink", spec.sink_tree)):
        if tree is not None and names_used(tree) & POSITION_NAMES:
            reasons.append(f"the {label} reads positions, which a shifted call does not move")
    return reasons
