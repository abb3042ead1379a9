"""Hopper family (sm_90a): TMA loads, wgmma, warp specialization, a persistent tile scheduler.

One producer warp streams Q, K and V through shared memory with TMA; two or three consumer
warpgroups (64 query rows each) run the wgmma GEMMs and the softmax. Tile shapes and the
pipeline depth come from the table below, overridable per spec with `tuning: {sm90: {...}}`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..arch_table import arch_info
from ..spec import DType, Spec
from .base import Family, dtype_and_head_dim_reasons, head_dims_text, position_reasons
from .warp_tiles import padded_head_dim
from . import sm90_backward
from .expressions import expression_context

# The (qk, v) head dims whose tiles were measured. The forward takes every pair of multiples of 8
# up to 256: shared memory and the wgmmas hold them rounded up to whole 32-column atoms (TMA
# zero-fills the padding columns on load and leaves them out of the O store).
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128))
HEAD_DIM_STEP, MAX_HEAD_DIM = 8, 256

# Query rows one consumer warpgroup owns (the M of one wgmma instruction).
ROWS_PER_WARPGROUP = 64
# Registers per thread after setmaxnreg, by consumer warpgroup count: (consumers, producer).
# Each split fills the 64K-register file: 2 x 128 x 240 + 128 x 24 = 64512, 3 x 128 x 160 + 128 x 32 = 65536.
REGISTER_SPLIT = {2: (240, 24), 3: (160, 32)}
# Registers a consumer thread needs besides its S, P and O fragments (addresses, softmax state).
_REGISTER_RESERVE = 32
# Multiprocessors of the sm_90a parts (H100 SXM, H200): the persistent grid's size. A part with
# fewer only runs the surplus CTAs in a second wave; correctness does not depend on it.
NUM_SMS = 132
# mbarriers and the 1024-byte alignment of the first buffer.
_SMEM_OVERHEAD = 1024


# How far (log2, in the exponent) a row's max may pass its reference before the reference moves,
# with the stale_max tuning: P then stays below 2^8 (FlashAttention-4's threshold on Blackwell).
STALE_MAX_LOG2 = 8.0
# fp8 P enters the P V wgmma as 2^FP8_P_SHIFT times the probability (e4m3 reaches 448). With
# stale_max, a kept reference lets P grow by 2^STALE_MAX_LOG2_FP8, so the shift shrinks by as much:
# P stays at most 2^8, and probabilities down to 2^-10 of the row's max stay e4m3 normals.
FP8_P_SHIFT = 8
STALE_MAX_LOG2_FP8 = 4.0


# Keys per head up to which the short_l2_kv_mb tuning's L2 groups apply.
SHORT_L2_KEYS = 1024


@dataclass(frozen=True)
class TileConfig:
    tile_m: int       # query rows per CTA tile: 64 per consumer warpgroup
    tile_n: int       # key rows per main-loop step
    num_stages: int   # shared-memory stages of the K and V rings
    # 2: consumer warpgroups take turns issuing their GEMMs (ping-pong, named barriers); 1: they
    # issue freely. (Spec tuning values are positive integers, hence not 0/1.)
    pingpong: int
    # K/V megabytes the CTAs running at one time should share through L2 (50 MB on an H100 or
    # H200): the scheduler groups as many heads as fit and walks their query tiles first.
    l2_kv_mb: int = 32
    # Causal-like masks: query tiles per head up to which the grid is persistent (static snake
    # over one longest-first list); above it, one CTA per tile and the hardware balances.
    persist_m_blocks: int = 64
    # Causal-like masks, persistent grid (heads of more than SHORT_L2_KEYS keys: short_l2_kv_mb
    # decides the others): 1, one longest-first order over every (batch, head);
    # 2, the L2 groups of l2_kv_mb as without a causal mask (l2_kv_mb 1: sequence by sequence,
    # head by head, as the varlen scheduler goes). An experiment: H100, 8 x 2048, h16, d128,
    # causal: 350 TFLOP/s for 1, 549 for the varlen kernel's order (bench/varlen_sweep.py).
    persist_l2_groups: int = 1
    # With persist_l2_groups 2: the persistent causal grid's L2 groups hold this many MB of K/V
    # (0: l2_kv_mb, the groups of the other grids).
    persist_l2_mb: int = 0
    # Heads whose K/V span at most SHORT_L2_KEYS keys: L2 groups of this many MB instead of
    # l2_kv_mb (0: no such rule), causal-like masks too (longest first within each group).
    # H200, bf16 d128 non-causal, 4 MB groups at every length took 512 410 -> 443, 1k 524 -> 546
    # and 2k 593 -> 555 TFLOP/s (bench/results/2026-11-26-c0666eb-ab-tuning-short-h200.json);
    # hence the rule stops at 1k keys. H100, bf16 non-causal, TFLOP/s at 512 / 1k, without / with
    # (bench/results/2026-11-26-fc950b5-ab-tuning-h100.json): d64 301/372 -> 315/384,
    # d128 351/494 -> 430/556, d256 362/547 -> 415/557. Causal (in place of one longest-first
    # order over every head), H100, same-run A/B, 3 rounds, median of fa_gen / best anchor per
    # round at 512 / 1k (bench/results/logs/2026-11-27-s19/c5-ab-causal-l2-h100.json): d64 bf16
    # 0.97/0.87 -> 1.14/1.00, fp16 0.89/0.89 -> 1.00/1.02; d128 bf16 1.00/1.07 -> 1.18/1.10,
    # fp16 1.02/1.14 -> 1.08/1.09; d256 0.98-1.06 both ways (its short tile is one CTA a tile).
    short_l2_kv_mb: int = 4
    # 2: the softmax moves a row's reference max only when the new max exceeds it by more than
    # STALE_MAX_LOG2 in the exponent, and a warp whose rows all kept theirs skips the O rescale
    # (64 FMULs a step at d128); 1: every step takes the new max. For fp8 inputs, whose P
    # enters the GEMM as 2^FP8_P_SHIFT times the probability, the threshold is
    # STALE_MAX_LOG2_FP8 and P's shift shrinks by as much (e4m3 reaches 448).
    stale_max: int = 1
    # Of every 16 score columns a thread holds, how many take a cubic exp2 on the FMA and ALU
    # pipes (common/softmax.j2 exp2_cubic) instead of the MUFU's, in steps without -inf: for
    # kernels whose exponentials (and P's conversions) bound a step, fp8 d128's. 0: none.
    exp2_fma: int = 0

    @property
    def pingpong_on(self) -> bool:
        return self.pingpong == 2

    @property
    def num_consumer_warpgroups(self) -> int:
        return self.tile_m // ROWS_PER_WARPGROUP

    def o_shares_q(self, head_dim_qk: int, head_dim_v: int, smem_limit: int) -> bool:
        """O is staged through Q's buffer when a buffer of its own does not fit."""
        return self._smem_bytes(head_dim_qk, head_dim_v, separate_o=True) > smem_limit

    def smem_bytes(self, head_dim_qk: int, head_dim_v: int, smem_limit: int) -> int:
        return self._smem_bytes(head_dim_qk, head_dim_v,
                                separate_o=not self.o_shares_q(head_dim_qk, head_dim_v, smem_limit))

    def _smem_bytes(self, head_dim_qk: int, head_dim_v: int, separate_o: bool, in_bytes: int = 2) -> int:
        """Q and the K/V ring in the inputs' dtype (`in_bytes`), O in 16 bits."""
        q = self.tile_m * head_dim_qk
        kv = self.num_stages * self.tile_n * (head_dim_qk + head_dim_v)
        o = self.tile_m * head_dim_v * 2 if separate_o else 0
        return (q + kv) * in_bytes + o + _SMEM_OVERHEAD

    def fp8_smem_bytes(self, head_dim_qk: int, head_dim_v: int) -> int:
        """fp8 inputs: O (16-bit) always has a buffer of its own (Q's, 8-bit, is too small)."""
        return self._smem_bytes(head_dim_qk, head_dim_v, separate_o=True, in_bytes=1)


# Per (head_dim_qk, head_dim_v): 128 query rows (two consumer warpgroups) except at head dim 64,
# where three warpgroups (192 rows) amortise the K/V tile over more rows; key tiles shrink as the
# head dim grows so that S + O fit the registers and two K/V stages fit shared memory.
# Chosen with bench/sweep_sm90.py on an H200 (bf16, batch*seqlen = 16k, heads*hdim = 2048,
# TFLOP/s at seqlen 512 / 2k / 8k / 16k, 2026-11-21):
#   d64  192x128 2st pp: 310/468/546/505  beats 128x128 (289/383/412/424), 3 or 4 stages (312/464/508/506,
#        282/-/-/509), no ping-pong (301/445/495/500), 192x96 (269/434/440/483).
#   d128 128x128 2st pp: 429/606/679/608; causal 257/452/629/519 (persistent), 253/449/622/621 (one CTA
#        per tile above 64 query tiles); 128x176, 128x112, 128x96 3st and no ping-pong all lose at <= 8k.
#   d256 128x80 2st, no pp: 412/659/715/687 beats ping-pong (361/564/681/707) and 128x64 (379/618/688/688).
#   d96 192x96 2st pp (three consumer warpgroups, as d64), H100, session 20 (bench/sweep_sm90.py
#        --head-dims 96, logs 2026-11-27-s20/c12): bf16 none 2k/8k/16k 482/596/588 against 128x128
#        468/550/524, causal 349/555/535 against 282/498/498; fp16 none 500/594/557 against
#        494/565/512, causal 373/575/504 against 302/475/470. 192 rows fit only with tile_n <= 96
#        (S, P and O in 128 registers); 192x96 3 stages and without ping-pong, 128x96 all lower.
#   d192 128x112 2st, no pp (as d256) for non-causal: with ping-pong the same or lower in two
#        H100 sweeps (bf16 8k 691/745 against 704/691, 4k 696 against 628; fp16 4k/8k/16k
#        656/708/657 against 647/708/672); causal masks take ping-pong (_CAUSAL_TUNINGS).
#   Both against the previous table, interleaved in one call (bench/ab_sources.py, 2 rounds, H100,
#   logs 2026-11-27-s20/c13): d96 new / old 1.08-1.29 in every cell (2k/8k/16k, both masks, bf16
#   and fp16; the anchors' rows moved 0.98-1.10); d192 causal 8k 1.085 / 1.047, 16k 0.99 / 1.00,
#   2k 0.96 / 1.01 (bf16 / fp16).
# stale_max (H100, bench/sweep_sm90.py, the two alternated three times in one call, medians; logs
# 2026-11-26-4c3d20e-s13c1): d128 non-causal 2k/8k/16k 554/620/625 -> 600/651/669, causal
# 456/622/624 -> 480/669/669 (FA4 559/702/665, 408/629/643); d64 and d256 within the spread or
# lower (d64 none 2k 469 -> 445, d256 causal 8k 699 -> 656), so there it stays off.
_DEFAULT_TILES = {
    (64, 64): TileConfig(192, 128, 2, 2),
    (96, 96): TileConfig(192, 96, 2, 2),
    (128, 128): TileConfig(128, 128, 2, 2, stale_max=2),
    (192, 128): TileConfig(128, 128, 2, 1),
    (192, 192): TileConfig(128, 112, 2, 1),
    (256, 256): TileConfig(128, 80, 2, 1),
}


# A second forward kernel for short causal-like sequences (at most `max_seqlen` queries and
# keys), picked per call by the runtime (fa_gen.runtime.Kernel): where the diagonal tiles are
# a large share of the work, a tile that wastes less of them, or a grid without the
# persistent snake, wins. H200, bf16, causal, TFLOP/s at 512 / 1k / 1.5k / 2k (2026-11-21,
# bench/results/2026-11-21-ef9574e-sweep-short-causal.json; anchors in the same runs):
#   d64  128x128 pp 209/287/333/356 against the long tile 192x128 187/260/351/381 (cuDNN 212/291/312/360);
#   d256 128x80, one CTA per tile, 262/413/-/506 against the persistent 234/340/-/533 (cuDNN 268/384/-/471).
#   At 2k the H100 disagrees (2026-11-27, the two trees alternated in one call, `python
#   bench/ab_sources.py run ... --bench forward -- --seqlens 2048 --head-dims 256`,
#   bench/results/logs/2026-11-27-s19/c8-ab-d256-causal-2k-short-kind-h100.log): one CTA per tile
#   480/478 bf16 and 454/473 fp16 against the persistent 452/419/426 and 401/432 (cuDNN 420-466).
#   Up to 2k it is: at worst 0.95 of the persistent on the H200 (still 1.07x cuDNN there), where
#   the persistent was 0.90-1.04x cuDNN on the H100.
# d128 (128x128) had no short-sequence winner (persistent or not: within run-to-run spread).
# Non-causal has none either (H100, 2026-11-26, `python bench/sweep_sm90.py`, logs
# bench/results/logs/2026-11-26-a7528fd-s14c5 and -s14c6; TFLOP/s at 512 / 1k / 2k):
#   d64  192x128 pp 270/337/440 against 128x128 pp 242/300/405, 128x176 258/329/388 (cuDNN 269/344/392);
#   d256 128x80 314/470/601 against 128x64 303/464/577, 128x48, 128x64 pp (cuDNN 259/454/541, FA4 309/464/597).
# The d64 causal short tile holds: 128x128 pp 150/210 at 512 / 1k against 192x128 144/211, 128x64,
# 128x176, 128x128 one CTA per tile (cuDNN 139/202).
# d192 causal takes one CTA per tile above 1k only (H100, session 20, `python bench/ab_sources.py
# run ... --bench forward -- --head-dims 192 --seqlens 512,1024,2048`, 3 rounds, logs
# 2026-11-27-s20/c17): 128x112 ping-pong one CTA per tile against the persistent grid, bf16 /
# fp16, 2k 502 / 496 against 390 / 389 (cuDNN 458-467); 1k 352 / 352 against 372 / 365, 512
# 217 / 203 against 232 / 223 (there the persistent grid's 4 MB L2 groups win).
@dataclass(frozen=True)
class ShortTiles:
    max_seqlen: int
    tile: TileConfig
    # Calls no longer than this keep the long kernel ("forward"); 0: the short one from length 1.
    longer_than: int = 0


# fp8 (e4m3) inputs, by padded (qk, v); key tiles a multiple of 32 (the K of an fp8 wgmma, and the
# span of the P-register key order, fa_gen.fp8.key_order); O always in a buffer of its own.
# H200, non-causal, TFLOP/s at 2k / 8k / 16k (bench/bench_fp8.py --sweep; logs 2026-11-26-75a22b2-*,
# -e5c33d2-call5):
#   d128 128x128 pp 771/877/854; no pp 786/839/823; 128x192 802/872/858 (equal within runs).
#   d256 128x128 pp 1119/1282/1272; no pp 1041/1279/1186.
# d128 takes 128x224 without ping-pong (FlashAttention-3's fp8 d128 tile): H100, session 22, one
# run (bench/bench_fp8.py --head-dims 128 --tunings ..., logs 2026-11-27-s22/c2, c3), TFLOP/s
# 128x128 pp -> 128x224: non-causal 2k/8k/16k 788/869/855 -> 796/983/939 (891 -> 970 in c2),
# causal 558/843/820 -> 537/894/964, Llama-3.1 h64/8 causal 32k 869 -> 933 (bf16 668-688).
# stale_max 2 on top: +1-3% non-causal and Llama, causal 8k 894 -> 834: not taken.
# A polynomial exp2 on the FMA pipe for 4-8 of 16 columns, or ex2.approx.f16x2 (two exponentials
# per MUFU op), lost 1-16% in every cell, fp8 and bf16 alike (H200, 128x128 ping-pong tiles). The
# first is back as the exp2_fma tuning, to measure on 128x224 (docs/fp8.md: its step's budget).
_FP8_TILES = {
    (64, 64): TileConfig(192, 128, 2, 2),
    (128, 128): TileConfig(128, 224, 2, 1),
    (256, 256): TileConfig(128, 128, 2, 2),
}
FP8_HEAD_DIM_STEP = 16  # 16-byte TMA rows
FP8_KEY_BLOCK = 32


SHORT_KIND = "forward_short"
# The forward of a packed (varlen) batch: rendered per call, not in generated/.
VARLEN_KIND = "forward_varlen"
# The varlen forward against a paged KV cache (num_pages, page_size, heads_kv, d): key tiles
# arrive by TMA boxes of `page_box` rows, each inside one page (sm90/paged_kv.j2). The box is
# gcd(page size, tile_n) and a whole number of 8-row swizzle atoms, so a kind per box size.
PAGED_KIND = "forward_varlen_paged"
# The fixed-length forward over a KV cache's (batch, capacity) rows, of which sequence b uses its
# first seqused_k[b] keys (a runtime tensor): what a contiguous cache's decode step calls with the
# query heads of a KV head as its query rows (fa_gen.inference.forward_cache_rows).
SEQUSED_KIND = "forward_seqused"
# The fixed-length forward with attention dropout (templates/common/dropout.j2), per call.
DROPOUT_KIND = "forward_dropout"
VARLEN_DROPOUT_KIND = "forward_varlen_dropout"
# The fixed-length forward whose diagonal offset is a runtime value (context parallelism: a
# block of queries against a block of keys elsewhere in the sequence), per call.
SHIFTED_KIND = "forward_shifted"
SHIFTED_BACKWARD_KIND = "backward_shifted"
# The backward with attention dropout (the mask regenerated from the forward's draw), per call.
BACKWARD_DROPOUT_KIND = "backward_dropout"
# The backward of a packed (varlen) batch, with and without dropout, per call.
VARLEN_BACKWARD_KIND = "backward_varlen"
VARLEN_BACKWARD_DROPOUT_KIND = "backward_varlen_dropout"
_SHORT_TILES = {
    (64, 64): ShortTiles(1024, TileConfig(128, 128, 2, 2)),
    (192, 192): ShortTiles(2048, TileConfig(128, 112, 2, 2, persist_m_blocks=0), longer_than=1024),
    (256, 256): ShortTiles(2048, TileConfig(128, 80, 2, 1, persist_m_blocks=0)),
}


def padded_dims(spec: Spec) -> tuple[int, int]:
    """(qk, v) as shared memory and the wgmmas hold them (fa_gen.families.warp_tiles.padded_head_dim)."""
    return padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v)


# Causal-like masks at d128: the persistent grid walks L2 groups of 4 MB of K/V (a few heads,
# every query tile of each) instead of one longest-first list over every head. H200, bf16,
# TFLOP/s default -> 4 MB groups (measured as persist_l2_groups 2 with l2_kv_mb 4, which also
# sized the groups of the longer, one-CTA-per-tile grid: 16k 623 -> 614; persist_l2_mb keeps those
# at 32 MB), same run (bench/ab_tuning.py, logs 2026-11-26-c0666eb-s10pq):
# 512 247 -> 279, 1k 347 -> 406 and 334 -> 368, 2k 439 -> 490, 4k 570 -> 601, 8k 631 -> 630.
# At cc7f3e4, this default against persist_l2_groups 1 in one run (logs 2026-11-26-cc7f3e4-s10rs):
# 1k 373/323, 2k 438/383, 4k 535/500, 8k 609/571, and 16k 641/610 where nothing differs (the
# run's spread from measuring order: take the 4k-8k gains as within it). Not taken: d256 causal
# (8k 691 -> 462), d64 causal (512-2k 3-5% slower), non-causal d128 with 4 MB groups (+4-8% at
# <= 1k, -6% at 2-4k).
# Causal-like masks at d192 ping-pong their two consumer warpgroups. H100, two sweeps (session
# 20, logs 2026-11-27-s20/c11-c12), TFLOP/s without -> with: bf16 8k 618 -> 640, 596 -> 643, 4k
# 481 -> 527, 16k 689 -> 695; fp16 4k/8k/16k 512/618/644 -> 500/628/653.
# qk 192 / v 128 as well: H100, two sweeps (bench/sweep_sm90.py --head-dims 192/128 --masks causal,
# logs 2026-11-27-s20/c20 and -s21/c5), TFLOP/s 2k/8k/16k without -> with: 353/617/624 ->
# 361/642/650 and 395/667/643 -> 415/648/674 (FA4 365/636/731 and 381/662/748).
_CAUSAL_TUNINGS = {(128, 128): {"persist_l2_groups": 2, "persist_l2_mb": 4},
                   (192, 192): {"pingpong": 2}, (192, 128): {"pingpong": 2}}


def tile_config(spec: Spec) -> TileConfig:
    dims = padded_dims(spec)
    table = _FP8_TILES if spec.is_fp8 else _DEFAULT_TILES
    default = table.get(dims) or _unmeasured_tile(table, *dims)
    if _longest_first(spec) and not spec.is_fp8 and dims in _CAUSAL_TUNINGS:
        default = replace(default, **_CAUSAL_TUNINGS[dims])
    return replace(default, **spec.tuning_for(Sm90Family.name))


def _unmeasured_tile(table: dict, head_dim_qk: int, head_dim_v: int) -> TileConfig:
    """Tiles of a (padded) pair off the table: those of the measured dims at the next size up."""
    widest = max(head_dim_qk, head_dim_v)
    for dims in sorted(d for d in table if d[0] == d[1]):
        if widest <= dims[0]:
            return table[dims]
    raise ValueError(f"head dims ({head_dim_qk}, {head_dim_v}) exceed {MAX_HEAD_DIM}")


def page_boxes(tile_n: int) -> list[int]:
    """TMA box heights of the paged kinds for key tiles of `tile_n` rows: divisors of the tile
    that are whole 8-row swizzle atoms."""
    return [box for box in range(8, tile_n + 1, 8) if tile_n % box == 0]


def fp8_reasons(spec: Spec, kind: str) -> list[str]:
    """Why an fp8 spec has no `kind` kernel in this family: the fixed-length and varlen forwards only."""
    if not spec.is_fp8 or kind == "forward" or kind == VARLEN_KIND and not varlen_reasons(spec):
        return []
    return [f"fp8 inputs: the fixed-length and varlen forwards only (no {kind} kernel yet)"]


def short_tiles_reasons(spec: Spec) -> list[str]:
    """Why `spec` gets no short-sequence kernel; empty when it does."""
    if spec.is_fp8:
        return fp8_reasons(spec, SHORT_KIND)
    if (spec.head_dim_qk, spec.head_dim_v) not in _SHORT_TILES:
        return [f"no short-sequence tile for head dims ({spec.head_dim_qk}, {spec.head_dim_v})"]
    if not _longest_first(spec):
        return ["short-sequence tiles are measured for causal-like masks only"]
    if spec.mask_expr is not None:
        # A mask expression's call plan classifies key tiles for one tile shape.
        return ["a mask expression's key-tile lists are made for the long kernel's tiles"]
    if spec.tuning_for(Sm90Family.name):
        return ["the spec's tuning pins one tile configuration"]
    return []


def varlen_reasons(spec: Spec) -> list[str]:
    """Why `spec` gets no varlen forward in this family; empty when it does."""
    if spec.mask_expr is not None:
        return ["a mask expression's key-tile lists are classified per call from fixed lengths"]
    if spec.sink_expr is not None:
        return ["sink logits in a varlen batch: not yet (the varlen backward has none either)"]
    return []


def _head_dim_reasons(spec: Spec) -> list[str]:
    """qk and v each a multiple of HEAD_DIM_STEP (fp8: FP8_HEAD_DIM_STEP) up to MAX_HEAD_DIM
    (16-byte rows for TMA)."""
    dims = (spec.head_dim_qk, spec.head_dim_v)
    step = FP8_HEAD_DIM_STEP if spec.is_fp8 else HEAD_DIM_STEP
    if all(d % step == 0 and 0 < d <= MAX_HEAD_DIM for d in dims):
        return []
    return [f"head_dim (qk {dims[0]}, v {dims[1]}) is not supported (qk and v each a multiple of "
            f"{step} from {step} to {MAX_HEAD_DIM}{' with fp8 inputs' if spec.is_fp8 else ''})"]


# The DSL's element types of the spec dtypes.
_DSL_DTYPES = {DType.BF16: "BFloat16", DType.FP16: "Float16", DType.FP8_E4M3: "Float8E4M3FN"}


def _longest_first(spec: Spec) -> bool:
    """Causal-like masks: later query tiles see more keys, so the scheduler hands them out first."""
    return spec.window_left is None and spec.window_right is not None


class Sm90Family(Family):
    name = "sm90"
    archs = ("sm_90a",)

    def verification(self):
        return [(self.archs, "L1 (float64 reference, hypothesis) on H100 and H200")]
    backend = "cute_dsl"
    tuning_params = ("tile_m", "tile_n", "num_stages", "pingpong", "l2_kv_mb", "persist_m_blocks",
                     "persist_l2_groups", "persist_l2_mb", "short_l2_kv_mb", "stale_max",
                     "exp2_fma")
    # The backward kernel (fa_gen/families/sm90_backward.py); head dims it does not fit drop out
    # of kernel_files, and their backward goes to the next family (fa_gen.backward.backward_family).
    # The forward of short causal-like sequences (SHORT_KIND) is the same template with its own tiles.
    extra_kernels = {"backward": ("backward.py.j2", "backward.py"),
                     SHORT_KIND: ("forward.py.j2", "forward_short.py")}

    # Score mods, mask expressions and sink logits in the forward.
    supports_expressions = True

    def call_kinds(self, spec: Spec) -> dict[str, tuple[str, str]]:
        """The varlen forward and backward (templates/common/seqlen.j2); the split-KV and
        GQA-packed decode kinds are the sm80 family's."""
        if spec.is_fp8:
            return {} if varlen_reasons(spec) else {VARLEN_KIND: (self.forward_template, f"{VARLEN_KIND}.py")}
        kinds = {DROPOUT_KIND: (self.forward_template, f"{DROPOUT_KIND}.py")}
        if not sm90_backward.dropout_reasons(spec, self.archs[0]):
            kinds[BACKWARD_DROPOUT_KIND] = ("backward.py.j2", f"{BACKWARD_DROPOUT_KIND}.py")
        if not shifted_reasons(spec):
            kinds[SHIFTED_KIND] = (self.forward_template, f"{SHIFTED_KIND}.py")
            if not sm90_backward.backward_reasons(spec, self.archs[0]):
                kinds[SHIFTED_BACKWARD_KIND] = ("backward.py.j2", f"{SHIFTED_BACKWARD_KIND}.py")
        if not varlen_reasons(spec):
            kinds[VARLEN_KIND] = (self.forward_template, f"{VARLEN_KIND}.py")
            kinds[SEQUSED_KIND] = (self.forward_template, f"{SEQUSED_KIND}.py")
            kinds[VARLEN_DROPOUT_KIND] = (self.forward_template, f"{VARLEN_DROPOUT_KIND}.py")
            for box in page_boxes(tile_config(spec).tile_n):
                kinds[f"{PAGED_KIND}_b{box}"] = (self.forward_template, f"{PAGED_KIND}_b{box}.py")
            if not sm90_backward.backward_reasons(spec, self.archs[0]):
                kinds[VARLEN_BACKWARD_KIND] = ("backward.py.j2", f"{VARLEN_BACKWARD_KIND}.py")
            if not sm90_backward.dropout_reasons(spec, self.archs[0]):
                kinds[VARLEN_BACKWARD_DROPOUT_KIND] = ("backward.py.j2", f"{VARLEN_BACKWARD_DROPOUT_KIND}.py")
        return kinds

    def kind_context(self, spec: Spec, arch: str, kind: str) -> dict:
        if kind == VARLEN_KIND:
            return {"varlen": True}
        if kind == SEQUSED_KIND:
            return {"seqused": True}
        if kind == DROPOUT_KIND:
            return {"dropout": True}
        if kind == SHIFTED_KIND:
            return {"shifted": True}
        if kind == VARLEN_DROPOUT_KIND:
            return {"varlen": True, "dropout": True}
        if kind.startswith(PAGED_KIND + "_b"):
            return {"varlen": True, "page_box": int(kind.removeprefix(PAGED_KIND + "_b"))}
        if kind == SHORT_KIND:
            return self._tile_context(spec, arch, _SHORT_TILES[(spec.head_dim_qk, spec.head_dim_v)].tile)
        if kind == SHIFTED_BACKWARD_KIND:
            return {**sm90_backward.kind_context(spec, arch), "shifted": True}
        if kind == BACKWARD_DROPOUT_KIND:
            return sm90_backward.kind_context(spec, arch, dropout=True)
        # A packed batch keeps the grid's order: the fixed-length backward's L2 groups of heads
        # measured 0.97-0.99x on causal packed batches (bench_varlen_backward, H100,
        # bench/results/2026-11-27-4b8986b-ab-bwd-order-sm80-varlen-h100.json).
        if kind == VARLEN_BACKWARD_KIND:
            return {**sm90_backward.kind_context(spec, arch), "varlen": True, "bwd_l2_heads_mb": 0}
        if kind == VARLEN_BACKWARD_DROPOUT_KIND:
            return {**sm90_backward.kind_context(spec, arch, dropout=True), "varlen": True, "bwd_l2_heads_mb": 0}
        return sm90_backward.kind_context(spec, arch) if kind == "backward" else {}

    def served_head_dims(self) -> str:
        return (f"forward: qk and v each a multiple of {HEAD_DIM_STEP} up to {MAX_HEAD_DIM} (tiles measured at "
                f"{head_dims_text(HEAD_DIMS)}); backward: pairs that pad to "
                f"{head_dims_text(sm90_backward.served_pairs())} (others fall to the sm80 family)")

    def kind_reasons(self, spec: Spec, kind: str) -> list[str]:
        if spec.is_fp8:
            return fp8_reasons(spec, kind)
        if kind in (VARLEN_KIND, SEQUSED_KIND) or kind.startswith(PAGED_KIND + "_b"):
            return varlen_reasons(spec)
        if kind == SHORT_KIND:
            return short_tiles_reasons(spec)
        if kind == SHIFTED_KIND:
            return shifted_reasons(spec)
        if kind == SHIFTED_BACKWARD_KIND:
            return shifted_reasons(spec) + sm90_backward.backward_reasons(spec, self.archs[0])
        if kind == BACKWARD_DROPOUT_KIND:
            return sm90_backward.dropout_reasons(spec, self.archs[0])
        if kind == VARLEN_BACKWARD_KIND:
            return varlen_reasons(spec) + sm90_backward.backward_reasons(spec, self.archs[0])
        if kind == VARLEN_BACKWARD_DROPOUT_KIND:
            return varlen_reasons(spec) + sm90_backward.dropout_reasons(spec, self.archs[0])
        return sm90_backward.backward_reasons(spec, self.archs[0]) if kind == "backward" else []

    def forward_variants(self, spec: Spec, arch: str) -> list[tuple[int, str]]:
        if SHORT_KIND not in self.kernel_files(spec):
            return []
        short = _SHORT_TILES[(spec.head_dim_qk, spec.head_dim_v)]
        below = [(short.longer_than, "forward")] if short.longer_than else []
        return below + [(short.max_seqlen, SHORT_KIND)]

    def spec_reasons(self, spec: Spec, arch: str) -> list[str]:
        dims = _head_dim_reasons(spec)
        reasons = dtype_and_head_dim_reasons(spec, (DType.FP16, DType.BF16, DType.FP8_E4M3), None) + dims
        # Tile checks only mean something for a head dim the kernel takes.
        if not dims:
            reasons.extend(_tile_reasons(tile_config(spec), spec, arch))
        return reasons

    def forward_tiles(self, spec: Spec, arch: str) -> tuple[int, int]:
        cfg = tile_config(spec)
        return cfg.tile_m, cfg.tile_n

    def render_context(self, spec: Spec, arch: str) -> dict:
        dqk, dv = padded_dims(spec)
        return {
            **self._tile_context(spec, arch, tile_config(spec)),
            # Shared-memory / wgmma head dims: the spec's, rounded up to whole atoms where needed.
            "head_dim_qk_pad": dqk,
            "head_dim_v_pad": dv,
            "dtype_name": _DSL_DTYPES[spec.dtype],
            # O's dtype (fp8 specs write bf16 or fp16).
            "out_dtype_name": _DSL_DTYPES[spec.output_dtype],
            "out_dtype_value": spec.output_dtype.value,
            "fp8": spec.is_fp8,
            "softmax_scale_log2": spec.softmax_scale_log2,
            "num_sms": NUM_SMS,
            "longest_first": _longest_first(spec),
            # None unless the spec has expressions (then: their emitted code and extra arguments).
            "expr": expression_context(spec),
            # Call features (kind_context sets them for the per-call kinds).
            "varlen": False,
            # Fixed-length tensors, each sequence's key count from seqused_k (SEQUSED_KIND).
            "seqused": False,
            "dropout": False,
            "shifted": False,
            # TMA box rows of a paged kind's K/V loads; 0: K/V are contiguous.
            "page_box": 0,
        }

    def _tile_context(self, spec: Spec, arch: str, cfg: TileConfig) -> dict:
        """What the template takes from a tile configuration."""
        problems = _tile_reasons(cfg, spec, arch)
        assert not problems, problems  # can_implement refuses these first
        smem = arch_info(arch).max_smem_per_block
        consumer_regs, producer_regs = REGISTER_SPLIT[cfg.num_consumer_warpgroups]
        dqk, dv = padded_dims(spec)
        o_shares_q = not spec.is_fp8 and cfg.o_shares_q(dqk, dv, smem)
        smem_bytes = cfg.fp8_smem_bytes(dqk, dv) if spec.is_fp8 else cfg.smem_bytes(dqk, dv, smem)
        stale = None if cfg.stale_max == 1 else STALE_MAX_LOG2_FP8 if spec.is_fp8 else STALE_MAX_LOG2
        return {
            "tile": asdict(cfg),
            "pingpong": cfg.pingpong_on,
            "num_consumer_warpgroups": cfg.num_consumer_warpgroups,
            "consumer_registers": consumer_regs,
            "producer_registers": producer_regs,
            "o_shares_q": o_shares_q,
            "smem_bytes": smem_bytes,
            "l2_kv_bytes": cfg.l2_kv_mb * 1024 * 1024,
            "short_l2_keys": SHORT_L2_KEYS,
            "stale_max_log2": stale,
            # fp8: P's shift in the exponent (sm90/fp8.j2), less the stale threshold.
            "p_shift": FP8_P_SHIFT - int(stale or 0) if spec.is_fp8 else None,
        }


def _tile_reasons(cfg: TileConfig, spec: Spec, arch: str) -> list[str]:
    """What the template relies on: whole wgmma tiles, TMA boxes of at most 256 rows, the
    fragments fitting the registers setmaxnreg grants, and the buffers fitting shared memory."""
    reasons = []
    if cfg.tile_m % ROWS_PER_WARPGROUP or cfg.num_consumer_warpgroups not in REGISTER_SPLIT:
        reasons.append(f"tuning: tile_m {cfg.tile_m} must be 128 or 192 (64 rows per consumer warpgroup, 2 or 3 of them)")
        return reasons
    if cfg.tile_n % 16 or not 16 <= cfg.tile_n <= 256:
        reasons.append(f"tuning: tile_n {cfg.tile_n} must be a multiple of 16 in [16, 256]")
    if cfg.num_stages < 2:
        reasons.append(f"tuning: num_stages {cfg.num_stages} must be at least 2")
    if cfg.pingpong not in (1, 2):
        reasons.append(f"tuning: pingpong {cfg.pingpong} must be 1 (off) or 2 (on)")
    if cfg.stale_max not in (1, 2):
        reasons.append(f"tuning: stale_max {cfg.stale_max} must be 1 (off) or 2 (on)")
    if not 0 <= cfg.exp2_fma <= 16 or cfg.exp2_fma % 2:
        reasons.append(f"tuning: exp2_fma {cfg.exp2_fma} must be an even count of columns of 16 (2 to 16)")
    if cfg.persist_l2_groups not in (1, 2):
        reasons.append(f"tuning: persist_l2_groups {cfg.persist_l2_groups} must be 1 (off) or 2 (on)")
    if cfg.persist_l2_mb < 0:
        reasons.append(f"tuning: persist_l2_mb {cfg.persist_l2_mb} must be >= 0")
    if spec.is_fp8 and cfg.tile_n % FP8_KEY_BLOCK:
        reasons.append(f"tuning: tile_n {cfg.tile_n} must be a multiple of {FP8_KEY_BLOCK} with fp8 inputs")
    # Per consumer thread: S (fp32), P (16-bit, two per register; fp8, four) and O (fp32) of 64 rows / 128 threads.
    dqk, dv = padded_dims(spec)
    fragments = cfg.tile_n // 2 + cfg.tile_n // (8 if spec.is_fp8 else 4) + dv // 2
    budget = REGISTER_SPLIT[cfg.num_consumer_warpgroups][0] - _REGISTER_RESERVE
    if fragments > budget:
        reasons.append(f"tuning: S, P and O take {fragments} registers per thread; at most {budget} "
                       f"with {cfg.num_consumer_warpgroups} consumer warpgroups (smaller tile_n)")
    smem = arch_info(arch).max_smem_per_block
    need = cfg.fp8_smem_bytes(dqk, dv) if spec.is_fp8 else cfg.smem_bytes(dqk, dv, smem)
    if need > smem:
        reasons.append(f"tuning: tiles need {need} bytes of shared memory; {arch} has {smem} "
                       "(fewer stages or a smaller tile_n)")
    return reasons


def shifted_reasons(spec: Spec) -> list[str]:
    """Why no shifted forward serves `spec` (fa_gen.families.base.position_reasons)."""
    return position_reasons(spec)
