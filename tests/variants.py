"""The kernel variants the exactness suites draw from: every feature of spec version 1."""

from __future__ import annotations

import itertools

from fa_gen.spec_load import load_spec

DTYPES = ("fp16", "bf16")
HEAD_DIMS = (64, 96, 128, 192, 256, {"qk": 192, "v": 128})
MASKS = (
    "none",
    "causal",
    {"kind": "causal", "alignment": "top_left"},
    {"kind": "sliding_window", "left": 100, "right": 7},
)


def _mask_name(mask) -> str:
    if isinstance(mask, str):
        return mask
    if mask["kind"] == "causal":
        return f"causal_{mask['alignment']}"
    return f"window_{mask['left']}_{mask['right']}"


def _dim_name(head_dim) -> str:
    return f"d{head_dim}" if isinstance(head_dim, int) else f"qk{head_dim['qk']}_v{head_dim['v']}"


def variant_specs(archs=None):
    """One Spec per (dtype, head dim, mask), named after what it varies."""
    specs = []
    for dtype, head_dim, mask in itertools.product(DTYPES, HEAD_DIMS, MASKS):
        mapping = {"name": f"v_{dtype}_{_dim_name(head_dim)}_{_mask_name(mask)}",
                   "dtype": dtype, "head_dim": head_dim, "mask": mask}
        if archs:
            mapping["archs"] = list(archs)
        specs.append(load_spec(mapping))
    return specs


def variant_library_paths():
    """The expression variants' specs, by name: the shipped specs/ that use expressions."""
    from fa_gen.paths import specs_dir

    shipped = [p for p in specs_dir().glob("*.yaml") if load_spec(p, check_archs=False).uses_expressions]
    return {p.stem: p for p in sorted(shipped, key=lambda p: p.stem)}


def cute_dsl_families(arch: str, expressions: bool = False) -> list[str]:
    """The CuTe DSL families with a fixed-length forward serving `arch` (on an H200: sm90, then
    sm80; not sm90_mla, whose kinds are MLA decode alone), in registry order; with
    `expressions`, only those whose forward takes mask and score expressions."""
    from fa_gen.families import REGISTRY

    return [f.name for f in REGISTRY if arch in f.archs and f.backend == "cute_dsl"
            and "forward" in f.kernel_files() and (f.supports_expressions or not expressions)]
