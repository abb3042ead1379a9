"""Ampere-class family: mma.sync m16n8k16 + cp.async + ldmatrix.

Serves sm80/86/89 and sm120 natively. It also serves sm_90a (every
instruction it uses exists on Hopper) until a Hopper family takes precedence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

from ..arch_table import BLACKWELL_ARCHS, arch_info
from ..spec import DType, Spec
from .base import Family, dtype_and_head_dim_reasons, head_dims_text, position_reasons
from .warp_tiles import padded_head_dim, smem_atom_cols, tile_reasons
from .expressions import backward_expression_context, expression_context
from ..variant.tree import names_used



class CallKind(NamedTuple):
    """What an inference kind renders (the template context keys of the same names)."""

    varlen: bool         # packed sequences located by cu_seqlens (templates/common/seqlen.j2)
    split: bool          # keys split across CTAs, partials merged by LSE (common/splitkv.j2)
    pack: int            # query heads of one KV head on one tile's rows (1: none)
    paged: bool = False  # K/V in pages through a page table (common/kv_source.j2)
    # How a paged kind finds its rows (templates/common/kv_source.j2), picked by the host from the
    # caches' page size (fa_gen.inference.paged_kind): "tile" where it is a multiple of the key tile
    # (one table entry a tile), "group" where it is a multiple of the rows one thread copies of a
    # tile (`page_group_rows`: one entry a thread a tile), "row" for any other (a page and slot
    # found per copy row). H200,
    # b1 sk128k p16: a third lookup for sizes dividing the tile (a copy row's page within a tile
    # fixed, no division per row) ran no faster (146.9 against 147.0 us) and was dropped.
    page_lookup: str = "row"
    # Wide key tiles (split_tile_config): for grids a split must fill (fa_gen.inference._split_kind).
    wide: bool = False


# Forward kinds for inference calls. A packed kind puts PACK query heads of one KV head on the
# tile's rows (PACK divides the split tile's 64 rows). Paged K/V come only with varlen split kinds
# (one split writes the final output itself), as fa_gen.api.kvcache calls them.
GQA_PACKS = (2, 4, 8, 16, 32, 64)
INFERENCE_KINDS = {"forward_varlen": CallKind(True, False, 1), "forward_split": CallKind(False, True, 1),
                   "forward_varlen_split": CallKind(True, True, 1),
                   "forward_varlen_split_paged": CallKind(True, True, 1, True),
                   "forward_varlen_split_paged_tiles": CallKind(True, True, 1, True, "tile"),
                   "forward_varlen_split_paged_groups": CallKind(True, True, 1, True, "group"),
                   **{f"forward_split_pack{g}": CallKind(False, True, g) for g in GQA_PACKS},
                   **{f"forward_varlen_split_pack{g}": CallKind(True, True, g) for g in GQA_PACKS},
                   **{f"forward_varlen_split_paged_pack{g}": CallKind(True, True, g, True) for g in GQA_PACKS},
                   **{f"forward_varlen_split_paged_tiles_pack{g}": CallKind(True, True, g, True, "tile")
                      for g in GQA_PACKS},
                   **{f"forward_varlen_split_paged_groups_pack{g}": CallKind(True, True, g, True, "group")
                      for g in GQA_PACKS},
                   "forward_split_wide": CallKind(False, True, 1, wide=True),
                   "forward_varlen_split_wide": CallKind(True, True, 1, wide=True),
                   **{f"forward_split_wide_pack{g}": CallKind(False, True, g, wide=True) for g in GQA_PACKS},
                   **{f"forward_varlen_split_wide_pack{g}": CallKind(True, True, g, wide=True) for g in GQA_PACKS}}

# e4m3 inputs (an fp8 spec): the KV-cache call's kinds only, the varlen split ones, contiguous or
# paged (templates/common/fp8_staging.j2: e4m3 tiles staged in shared memory and converted to
# fp16 by the threads that copied them; the MMAs run in fp16), on Hopper beside the sm90
# family's fp8 forward. (The conversion needs sm_89 or later; on Ada and Blackwell this family
# would be an fp8 spec's only one and serve none of its fixed-length calls, so it stays off there.)
FP8_KINDS = tuple(kind for kind, call in INFERENCE_KINDS.items() if call.varlen and call.split and not call.wide)
FP8_ARCHS = frozenset({"sm_90a"})

# Attention dropout (templates/common/dropout.j2): the fixed-length and varlen forwards and
# backwards with the Philox mask, rendered on demand (p, seed and offset are runtime values).
DROPOUT_KINDS = {"forward_dropout": "forward.py.j2", "backward_dropout": "backward.py.j2",
                 "forward_varlen_dropout": "forward.py.j2", "backward_varlen_dropout": "backward.py.j2"}

# Backward kinds: the fixed-length one (in generated/) and the varlen one (rendered on demand).
BACKWARD_KINDS = ("backward", "backward_varlen")

# Fixed-length forward and backward whose diagonal offset is a runtime value (context
# parallelism: a block of queries against a block of keys elsewhere in the sequence), per call.
SHIFTED_KINDS = {"forward_shifted": "forward.py.j2", "backward_shifted": "backward.py.j2"}

# The (qk, v) head dims whose tiles were measured. The forward and the backward take every pair
# of multiples of 8 from 8 to 256 (padded_head_dim: columns up to whole swizzle atoms).
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128))
FORWARD_HEAD_DIM_STEP, FORWARD_MAX_HEAD_DIM = 8, 256

# Registers per SM on every arch this family serves, and what one thread may hold.
_REGS_PER_SM = 64 * 1024
_MAX_REGS_PER_THREAD = 256  # 255 usable, allocated in whole warps of 256
# S and O accumulators one thread may hold without spilling (of 255 registers): at 192 the
# forward spilled 200-264 bytes (ptxas: d64 128x128 and d128 128x64, on sm_80, sm_90a and
# sm_100a); 160 and below spill nothing (tests/test_blackwell.py reads the SASS).
_MAX_ACCUMULATORS = 160
# Registers per thread of the split kinds (ptxas, sm_90a, bf16, d 64 and 128, no expression:
# fa_gen.backends.cute_dsl.ptxas_remarks): three 4-warp CTAs fit an SM by registers, not two.
_SPLIT_REGS_PER_THREAD = 168
# Shared memory the driver reserves per resident block.
_SMEM_RESERVED_PER_BLOCK = 1024


@dataclass(frozen=True)
class TileConfig:
    tile_m: int       # query rows per CTA
    tile_n: int       # key rows per main-loop step
    num_warps: int    # each warp owns tile_m / num_warps query rows
    num_stages: int   # shared-memory stages for K and V

    def smem_bytes(self, head_dim_qk: int, head_dim_v: int, elem_bytes: int = 2) -> int:
        # O reuses Q's buffer at the end, and head_dim_v <= head_dim_qk for every supported pair.
        q = self.tile_m * max(head_dim_qk, head_dim_v)
        kv = self.num_stages * self.tile_n * (head_dim_qk + head_dim_v)
        return (q + kv) * elem_bytes

    def blocks_per_sm(self, head_dim_qk: int, head_dim_v: int, smem_per_block: int,
                      regs_per_thread: int = _MAX_REGS_PER_THREAD) -> int:
        """Resident CTAs per SM, bounded by shared memory and by registers (allocated per
        thread in steps of 8; the 255 cap unless the kernel's count is known)."""
        smem_per_sm = smem_per_block + _SMEM_RESERVED_PER_BLOCK
        by_smem = smem_per_sm // (self.smem_bytes(head_dim_qk, head_dim_v) + _SMEM_RESERVED_PER_BLOCK)
        by_regs = _REGS_PER_SM // (self.num_warps * 32 * -(-regs_per_thread // 8) * 8)
        return min(by_smem, by_regs)


def tile_config(spec: Spec, arch: str) -> TileConfig:
    """Tile shape for the sm80 kernel.

    Among the candidates that fit the arch's shared memory, take the one that keeps the most
    warps resident per SM (latency hiding is what mma.sync kernels live on); ties go to the
    earlier, larger tile (more reuse of each K/V tile loaded).
    """
    smem = arch_info(arch).max_smem_per_block
    dqk, dv = padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v)
    override = spec.tuning_for(Sm80Family.name)
    if override:
        default = TileConfig(128, 64, 4 if max(dqk, dv) <= 128 else 8, 2)
        return replace(default, **override)
    best, best_warps = None, 0
    for cfg in _candidates(dqk, dv):
        if cfg.smem_bytes(dqk, dv) > smem or _tile_reasons(cfg, spec, arch):
            continue
        warps = cfg.blocks_per_sm(dqk, dv, smem) * cfg.num_warps
        if warps > best_warps:
            best, best_warps = cfg, warps
    if best is None:
        raise ValueError(f"no sm80 tile fits {smem} bytes of shared memory for head dims ({dqk}, {dv})")
    return best


def _candidates(head_dim_qk: int, head_dim_v: int) -> list[TileConfig]:
    """Preference-ordered tiles; all use two K/V stages.

    Register budget (fp32 accumulators per thread): S = tile_m*tile_n/threads,
    O = tile_m*head_dim_v/threads; S + O at most 160 (_MAX_ACCUMULATORS) leaves room for
    fragments and addresses under the 255 cap, hence 8 warps from head dim 192 up.
    Head dim 64 on an H200 (bf16, seqlen 4k-16k): 128x64 was 5% faster than 128x128
    without a mask; 128x128 was 2% faster with a causal one, but it spills 256 bytes of
    registers on every arch (192 accumulators), so it is no candidate.
    """
    head_dim = max(head_dim_qk, head_dim_v)
    if head_dim <= 64:
        return [TileConfig(128, 64, 4, 2), TileConfig(64, 64, 4, 2)]
    if head_dim <= 128:
        return [TileConfig(128, 64, 4, 2), TileConfig(128, 32, 4, 2), TileConfig(64, 32, 4, 2)]
    return [TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 2), TileConfig(64, 32, 4, 2)]


class Sm80Family(Family):
    name = "sm80"
    # Blackwell too (every `a` and `f` target): mma.sync, ldmatrix and cp.async run there as on
    # Ampere, the instructions the H200 and H100 verify; tcgen05 is a family of its own to come.
    archs = ("sm_80", "sm_86", "sm_89", "sm_90a", *BLACKWELL_ARCHS)
    tuning_params = ("tile_m", "tile_n", "num_warps")
    extra_kernels = {"backward": ("backward.py.j2", "backward.py")}
    # Score mods, mask expressions and sink logits, in the forward and the backward.
    supports_expressions = True

    def verification(self):
        older = tuple(a for a in self.archs if a not in BLACKWELL_ARCHS)
        return [(older, "L1 on H100 and H200 (sm_90a, family=\"sm80\"); the other archs: the same templates, compiled"),
                (BLACKWELL_ARCHS, "compiled only (CI builds a shipped spec for each); no Blackwell GPU here")]

    def kernel_files(self, spec: Spec | None = None) -> dict[str, tuple[str, str]]:
        """No fixed-length kernel for an fp8 spec: only its KV-cache kinds (call_kinds)."""
        return {} if spec is not None and spec.is_fp8 else super().kernel_files(spec)

    def call_kinds(self, spec: Spec) -> dict[str, tuple[str, str]]:
        """Varlen and split-KV forwards (templates/common/seqlen.j2, splitkv.j2) and the varlen
        backward, for every spec. A mask expression's key tiles are listed per call from fixed
        shapes; these kinds list none and apply the element mask to every tile they visit
        (`listed` false). A sink logit enters split 0's partial only. An fp8 spec: FP8_KINDS."""
        packable = gqa_packable(spec)
        wide = _wide_split_head_dims(spec)
        kinds = {kind: (self.forward_template, f"{kind}.py") for kind, call in INFERENCE_KINDS.items()
                 if (call.pack == 1 or packable) and (wide or not call.wide)}
        if spec.is_fp8:
            return {kind: files for kind, files in kinds.items() if kind in FP8_KINDS}
        dropout = {kind: (template, f"{kind}.py") for kind, template in DROPOUT_KINDS.items()}
        shifted = {} if position_reasons(spec) else {kind: (t, f"{kind}.py") for kind, t in SHIFTED_KINDS.items()}
        return {**kinds, **dropout, **shifted, "backward_varlen": ("backward.py.j2", "backward_varlen.py")}

    def kind_reasons(self, spec: Spec, kind: str) -> list[str]:
        if spec.is_fp8 and kind not in FP8_KINDS:
            return ["fp8 inputs: the KV-cache kinds only (attention_with_kvcache), forward_varlen_split*"]
        return position_reasons(spec) if kind in SHIFTED_KINDS else []

    def kind_context(self, spec: Spec, arch: str, kind: str) -> dict:
        if kind == "forward_dropout":
            return {"dropout": True}
        if kind == "forward_shifted":
            return {"shifted": True}
        if kind == "forward_varlen_dropout":
            whole = INFERENCE_KINDS["forward_varlen"]
            return {**whole._asdict(), **_unlisted(expression_context(spec)), "dropout": True}
        if kind in INFERENCE_KINDS:
            call = INFERENCE_KINDS[kind]
            context = {**call._asdict(), **_unlisted(expression_context(spec))}
            if call.split:
                cfg = split_tile_config(spec, arch, call.wide)
                smem = arch_info(arch).max_smem_per_block
                context["tile"] = asdict(cfg)
                # What the split count aims to fill (fa_gen.inference.num_splits_for).
                context["ctas_per_sm"] = cfg.blocks_per_sm(padded_head_dim(spec.head_dim_qk),
                                                           padded_head_dim(spec.head_dim_v), smem,
                                                           _SPLIT_REGS_PER_THREAD)
                # Key rows of a tile that one thread copies, consecutive in the "group" lookup
                # (COPY_GROUP_ROWS in templates/common/kv_source.j2): 128-bit copies side by side
                # along a swizzle atom's row.
                context["page_group_rows"] = cfg.tile_n * (_atom_cols(spec) // 8) // (cfg.num_warps * 32)
            return context
        if kind not in BACKWARD_KINDS and kind not in ("backward_dropout", "backward_varlen_dropout", "backward_shifted"):
            return {}
        cfg = backward_tile_config(spec, arch)
        # Query tiles first to last where no right window bounds them from below (every key
        # tile's range then starts at tile 0) and the head dim is 128 or more; else last to
        # first (causal-like ranges end together). H200, bf16, no mask: first to last was 6%
        # and 7% faster at d128 (s 4k, 16k) and 1.3% slower at d64 (tile_m 128).
        ascending = spec.window_right is None and max(spec.head_dim_qk, spec.head_dim_v) >= 128
        varlen = kind in ("backward_varlen", "backward_varlen_dropout")
        expr = backward_expression_context(spec)
        return {"bwd": asdict(cfg), "smem_atom_cols_pds": smem_atom_cols(cfg.tile_n),
                "bwd_ascending": ascending, "expr": expr, "listed": bool(expr and expr["mask"]),
                "dq_atomic_width": _dq_atomic_width(arch), "varlen": varlen, "dropout": kind.endswith("_dropout"),
                "shifted": kind == "backward_shifted",
                **(_unlisted(expr) if varlen else {})}

    def forward_tiles(self, spec: Spec, arch: str) -> tuple[int, int]:
        cfg = tile_config(spec, arch)
        return cfg.tile_m, cfg.tile_n

    def spec_reasons(self, spec: Spec, arch: str) -> list[str]:
        dims = _head_dim_reasons(spec)
        fp8 = (DType.FP8_E4M3,) if arch in FP8_ARCHS else ()
        reasons = dtype_and_head_dim_reasons(spec, (DType.FP16, DType.BF16, *fp8), None) + dims
        if spec.is_fp8 and (spec.head_dim_qk % 16 or spec.head_dim_v % 16):
            reasons.append(f"fp8 head dims must each be a multiple of 16 (qk {spec.head_dim_qk}, v {spec.head_dim_v})")
        # Tile checks only mean something for a head dim the kernel takes.
        if not dims and spec.tuning_for(self.name):
            reasons.extend(_tile_reasons(tile_config(spec, arch), spec, arch))
        return reasons

    def served_head_dims(self) -> str:
        return (f"forward and backward: qk and v each a multiple of {FORWARD_HEAD_DIM_STEP} up to "
                f"{FORWARD_MAX_HEAD_DIM} (tiles measured at {head_dims_text(HEAD_DIMS)})")

    def render_context(self, spec: Spec, arch: str) -> dict:
        cfg = tile_config(spec, arch)
        problems = _tile_reasons(cfg, spec, arch)
        assert not problems, problems  # can_implement refuses these first
        return {
            "tile": asdict(cfg),
            # The MMAs' dtype; e4m3 inputs are converted to fp16 (exactly) in shared memory.
            "dtype_name": "BFloat16" if spec.dtype is DType.BF16 else "Float16",
            "fp8": spec.is_fp8,
            "out_dtype_name": "BFloat16" if spec.output_dtype is DType.BF16 else "Float16",
            "softmax_scale_log2": spec.softmax_scale_log2,
            # Swizzle atoms span 64 columns (128 B) where both (padded) head dims allow, else 32
            # (64 B): K and V tiles then share one thread-to-row copy mapping (paged loads need it).
            "smem_atom_cols_qk": _atom_cols(spec),
            "smem_atom_cols_v": _atom_cols(spec),
            # Shared-memory / MMA head dims: the spec's, rounded up to whole atoms where needed.
            "head_dim_qk_pad": padded_head_dim(spec.head_dim_qk),
            "head_dim_v_pad": padded_head_dim(spec.head_dim_v),
            # Causal-like masks: later query tiles see more keys, so launch them first.
            "reverse_m_blocks": _causal_like(spec),
            # None unless the spec has expressions (then: their emitted code and extra arguments).
            "expr": expression_context(spec),
            # A mask expression's tiles come in per-call lists (fa_gen.plan) in fixed-length kinds.
            "listed": spec.mask_expr is not None,
            # Call features (kind_context sets them for the inference and dropout kinds).
            "varlen": False,
            "dropout": False,
            "shifted": False,
            "split": False,
            "pack": 1,
            "paged": False,
            "page_lookup": "row",
        }


def split_tile_config(spec: Spec, arch: str, wide: bool = False) -> TileConfig:
    """Tiles of the split-KV forward, made for few query rows (decode) against many keys: 64 rows
    over 4 warps (a 128-row tile would multiply the wasted MMA work of one query by 2). H200,
    decode (seqlen_q 1, bf16 and fp16, d 64 and 128, GQA packed): 64-key tiles read 0-4% faster
    than 128 at every cell but one (b8 sk32k: 128 4% faster at 1 split, 64 3% at 4 splits; two
    CTAs per SM instead of one at d 128). Head dims up to 64 take 32 rows over 2 warps first:
    six CTAs per SM instead of three keep twice the K/V bytes in flight. H100, b64 sk8k h32/8
    d64, A/B in one call: 2.91 TB/s against 2.80 (cuDNN 2.92); 16x64 on one warp 2.94, 32x128
    2.80; d128 cells unchanged by 32-row tiles (bench/results/logs/2026-11-26-882ac40-s12c1..3).
    fp8 (e4m3) K/V, which the copying threads convert to fp16 (templates/common/fp8_staging.j2),
    take 32 rows on two warps where those fit: the 64-row tiles' idle MMA rows and conversions
    bounded the step. H100, decode d128, GB/s in 16-bit bytes (bench/fp8_decode_sweep.py, logs
    2026-11-27-s21/c3, c11), 64x64 / 32x64: b64 sk8k h32/8 3490 / 4605, b128 sk2k h64/8 3413 /
    4553, MQA 3033 / 4147 (bf16 2803-3068); 16x64 on one warp, once idle warps skip their MMAs,
    2% ahead at b64 and 2-6% behind at b8, b1 and b128 (and its per-row page lookups spill).
    Falls back to the forward's tiles when none fits.

    `wide`: the wide kinds' tiles, 64 x 128 on 4 warps (one CTA an SM at d 128), for head dims
    65-128 in 16 bits (_wide_split_head_dims), which fa_gen.inference takes where the 64 x 64 grid
    is short of a wave and must be split. H200, decode h32/8 bf16 d128 at the split counts each
    tile's heuristic picks (bench/decode_sweep.py, logs 2026-11-27-s27/c2, c3), 64 x 64 -> 64 x 128:
    b8 sk32k 4,423 -> 4,505 GB/s, b1 sk128k 4,250 -> 4,307, MQA b32 sk16k h32/1 3,878 -> 3,904; on
    grids of a wave or more, unsplit, they lose: b64 sk8k 4,526 -> 4,497, b128 sk2k h64/8 4,436 ->
    4,229. Where 64 x 128 does not fit (shared memory), the 64 x 64 tiles."""
    if wide and _wide_split_head_dims(spec):
        if not _tile_reasons(WIDE_SPLIT_TILE, spec, arch):
            return WIDE_SPLIT_TILE
    widest = max(padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v))
    narrow = (TileConfig(32, 64, 2, 2),) if widest <= 64 or spec.is_fp8 else ()
    for cfg in (*narrow, TileConfig(64, 64, 4, 2), TileConfig(64, 128, 4, 2)):
        if not _tile_reasons(cfg, spec, arch):
            return cfg
    return tile_config(spec, arch)


WIDE_SPLIT_TILE = TileConfig(64, 128, 4, 2)


def _wide_split_head_dims(spec: Spec) -> bool:
    """Whether the spec has wide split kinds: 16-bit, widest head dim 65-128 (where they were measured)."""
    return not spec.is_fp8 and 64 < max(padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v)) <= 128


def _atom_cols(spec: Spec) -> int:
    return min(smem_atom_cols(padded_head_dim(spec.head_dim_qk)), smem_atom_cols(padded_head_dim(spec.head_dim_v)))


def _head_dim_reasons(spec: Spec) -> list[str]:
    """The forward's head dims: qk and v each a multiple of FORWARD_HEAD_DIM_STEP up to
    FORWARD_MAX_HEAD_DIM (16-byte rows for cp.async; padded to whole atoms in shared memory)."""
    dims = (spec.head_dim_qk, spec.head_dim_v)
    if all(d % FORWARD_HEAD_DIM_STEP == 0 and 0 < d <= FORWARD_MAX_HEAD_DIM for d in dims):
        return []
    return [f"head_dim (qk {dims[0]}, v {dims[1]}) is not supported (qk and v each a multiple of "
            f"{FORWARD_HEAD_DIM_STEP} from {FORWARD_HEAD_DIM_STEP} to {FORWARD_MAX_HEAD_DIM})"]


def gqa_packable(spec: Spec) -> bool:
    """Whether query heads may share a tile's rows: no expression may tell them apart (one
    reading the head or the query position sees one value per packed row, not per head)."""
    trees = (spec.score_mod_tree, spec.mask_tree, spec.sink_tree)
    return not any({"h", "q_idx"} & names_used(tree) for tree in trees if tree is not None)


def _unlisted(expr: dict | None) -> dict:
    """Context of a kind without per-call tile lists (varlen, split-KV): a mask expression
    takes no scheduling arguments, and every visited tile applies it element by element."""
    if expr is None or expr["mask"] is None:
        return {}
    return {"expr": {**expr, "schedule": ()}, "listed": False}


def _causal_like(spec: Spec) -> bool:
    """Key ranges grow with the query index (causal, or a right window with no left one)."""
    return spec.window_left is None and spec.window_right is not None


def _tile_reasons(cfg: TileConfig, spec: Spec, arch: str) -> list[str]:
    """What the template relies on (see warp_tiles.tile_reasons); empty when `cfg` is usable."""
    reasons = tile_reasons(cfg, spec, arch, _MAX_ACCUMULATORS)
    if cfg.num_stages != 2:
        # The main loop ping-pongs K and V between two stages (a tile loads into 1 - stage).
        # H200, split decode: a third stage (prologue and waits made for it, outputs right) read
        # 0.2-2% slower in every decode cell, beside two stages in one process (bench/decode_sweep.py,
        # bench/results/logs/2026-11-26-1593d5a-s11c5); before that, 3 stages patched in gave
        # wrong outputs. H100, the fp8 KV cache's 16- and 32-row tiles with a third stage (a main
        # loop generalised to it, GPU tests passing): decode 0.90-1.04x two stages, no cell ahead
        # beyond the run's spread (logs 2026-11-27-s21/c6 against c4).
        reasons.append(f"num_stages {cfg.num_stages}: the forward's main loop takes 2 K/V stages")
    return reasons


# ---------------------------------------------------------------------------------------------
# Backward pass: one CTA per key tile walks the query tiles (see templates/sm80/backward.py.j2).

# The runtime pads dQ's fp32 accumulator and the per-row LSE / D buffers to whole multiples
# of this many query rows, so every backward tile_m must divide it.
BACKWARD_ROW_ALIGN = 128


@dataclass(frozen=True)
class BackwardTileConfig:
    tile_m: int        # query rows per step of the inner loop
    tile_n: int        # key rows per CTA (its dK and dV stay in registers)
    num_warps: int
    num_stages: int    # shared-memory stages of Q and dO (2: the next tile loads during this one)
    sdp_warps_m: int   # warps along the query rows of S = Q K^T and dP = dO V^T (rest: keys)
    dkv_warps_n: int   # warps along the key rows of dK and dV (rest: head dim)
    dq_warps_m: int    # warps along the query rows of dQ (rest: head dim)
    # dQ = dS K and its atomics before dK += dS^T Q (FlashAttention-2's order), not after.
    dq_first: bool = False

    def smem_bytes(self, head_dim_qk: int, head_dim_v: int, elem_bytes: int = 2) -> int:
        q_do = self.num_stages * self.tile_m * (head_dim_qk + head_dim_v)
        k_v = self.tile_n * (head_dim_qk + head_dim_v)
        p_ds = 2 * self.tile_m * self.tile_n
        return (q_do + k_v + p_ds) * elem_bytes

    def accumulators(self, head_dim_qk: int, head_dim_v: int) -> int:
        """fp32 accumulators one thread holds at the peak (dK, dV, S and dP)."""
        threads = self.num_warps * 32
        return (self.tile_n * (head_dim_qk + head_dim_v) + 2 * self.tile_m * self.tile_n) // threads


def _bwd(tile_m, tile_n, num_warps, num_stages, sdp_m, dkv_n, dq_m, dq_first=False) -> BackwardTileConfig:
    return BackwardTileConfig(tile_m, tile_n, num_warps, num_stages, sdp_m, dkv_n, dq_m, dq_first)


def _dq_atomic_width(arch: str) -> int:
    """fp32 values per dQ atomic: sm_90 and later add 4 at once (red.global.add.v4.f32)."""
    return 4 if arch_info(arch).compute_capability >= (9, 0) else 1


def _backward_candidates(head_dim: int) -> list[BackwardTileConfig]:
    """Preference-ordered backward tiles per head dim; the first that fits the arch wins.

    The first of each list is FlashAttention-2's sm80 shape for that head dim (8 warps, Q and
    dO double-buffered), sized for 163-227 KB of shared memory; the later ones fit 163 KB (one
    stage) or the 99 KB of sm86/89/120 (narrower tiles). dK + dV accumulators stay at or under
    128 fp32 per thread so that S, dP and the dQ tile fit beside them under 255 registers.
    H200, bf16, s 4k-16k (bench/sweep_sm80_bwd.py): at head dims 192-256 two stages were 6-9%
    faster than one (the next Q and dO load during this tile), and S/dP over 4x2 warps with dK/dV
    over 2x4 (FlashAttention-2's warp grids) 3-7% faster than 2x4 / 4x2 (fewer ldmatrix bytes for
    the 256-column dK and dV); dQ over 4x2 warps no spill, 0-1.5% faster than 2x4. At head dim 64,
    dQ before dK was 0.5-2% faster (its atomics drain under the dK product); at 128, 3-12% slower.
    """
    if head_dim <= 64:
        tiers = [_bwd(128, 128, 8, 2, 2, 4, 4, dq_first=True), _bwd(64, 128, 8, 2, 2, 4, 4)]
    elif head_dim <= 96:
        tiers = [_bwd(64, 128, 8, 2, 2, 4, 4), _bwd(64, 64, 8, 2, 2, 4, 4)]
    elif head_dim <= 128:
        tiers = [_bwd(64, 128, 8, 2, 2, 4, 2), _bwd(64, 64, 8, 1, 2, 4, 2)]
    elif head_dim <= 192:
        tiers = [_bwd(64, 64, 8, 2, 4, 2, 4), _bwd(64, 64, 8, 1, 4, 2, 4), _bwd(32, 64, 8, 1, 2, 4, 2)]
    else:
        tiers = [_bwd(64, 64, 8, 2, 4, 2, 4), _bwd(64, 64, 8, 1, 4, 2, 4)]
    # Unmeasured (qk, v) pairs whose padded columns do not tile over those warp grids (96 / 160:
    # 96 is no multiple of 64 columns over 4 warps): warp grids of two columns, every multiple of 32.
    return tiers + [_bwd(64, 64, 8, 1, 2, 4, 4), _bwd(32, 32, 4, 1, 2, 2, 2)]


def backward_tile_config(spec: Spec, arch: str) -> BackwardTileConfig:
    """The first backward candidate that the template can use on `arch`."""
    dqk, dv = padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v)
    for cfg in _backward_candidates(max(dqk, dv)):
        if not _backward_tile_reasons(cfg, spec, arch):
            return cfg
    smem = arch_info(arch).max_smem_per_block
    raise ValueError(f"no sm80 backward tile fits {smem} bytes of shared memory for head dims ({dqk}, {dv})")


def _backward_tile_reasons(cfg: BackwardTileConfig, spec: Spec, arch: str) -> list[str]:
    """What the backward template relies on: every MMA tiling whole, whole copy passes, and
    the tiles fitting shared memory. Empty when `cfg` is usable."""
    dqk, dv = padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v)
    reasons = []
    # (what, rows, cols, warps along rows): each tiled MMA covers 16 rows and 16 columns per warp.
    mmas = [("S/dP", cfg.tile_m, cfg.tile_n, cfg.sdp_warps_m), ("dK", cfg.tile_n, dqk, cfg.dkv_warps_n),
            ("dV", cfg.tile_n, dv, cfg.dkv_warps_n), ("dQ", cfg.tile_m, dqk, cfg.dq_warps_m)]
    for what, rows, cols, warps_rows in mmas:
        warps_cols = cfg.num_warps // warps_rows
        if cfg.num_warps % warps_rows or rows % (16 * warps_rows) or cols % (16 * warps_cols):
            reasons.append(f"{what}: {rows}x{cols} does not tile over {warps_rows}x{warps_cols} warps of 16x16")
    threads = cfg.num_warps * 32
    for cols in {dqk, dv, cfg.tile_n}:
        copy_rows = threads // (smem_atom_cols(cols) // 8)
        if cfg.tile_m % copy_rows or cfg.tile_n % copy_rows:
            reasons.append(f"tile rows must be multiples of {copy_rows} for {cols}-column copies")
    if BACKWARD_ROW_ALIGN % cfg.tile_m:
        reasons.append(f"tile_m {cfg.tile_m} must divide {BACKWARD_ROW_ALIGN}")
    if cfg.num_stages not in (1, 2):
        reasons.append(f"num_stages {cfg.num_stages} must be 1 or 2")
    smem = arch_info(arch).max_smem_per_block
    if cfg.smem_bytes(dqk, dv) > smem:
        reasons.append(f"backward tiles need {cfg.smem_bytes(dqk, dv)} bytes of shared memory; {arch} has {smem}")
    return reasons
