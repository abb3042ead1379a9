"""Decode and varlen-prefill benchmarks: fa_gen beside FlashAttention-4, cuDNN and FA2 (SDPA).

    python bench/bench_decode.py --commit $(git rev-parse --short HEAD) --out DIR --plot
    python bench/bench_decode.py --parts decode --cells b1_sk128k_h32/8 --impls fa_gen_raw,fa4
    python bench/bench_decode.py --parts paged       # paged KV cache cells (bench/bench_paged.py)

Decode (seqlen_q = 1): one query token per sequence against a long K/V cache; the kernel is
memory-bound, so the metric is GB/s of K and V read = (bytes of K + bytes of V) / time, Q and
the output left out. Only the true K/V bytes count: an anchor called with K/V heads expanded
to the query heads reads more, and is charged for it (its "call" in the JSON says so). The
same run times a device-to-device copy of COPY_BYTES (`dst.copy_(src)`) and reports its
bandwidth as (bytes read + bytes written) / time; "fraction of copy" = decode GB/s / copy GB/s.

Varlen prefill: DOCUMENTS packed documents of mixed, seeded lengths summing to 16k tokens,
causal, in (total, heads, dim) tensors with int32 cu_seqlens. TFLOP/s counts the useful causal
FLOPs of each document only, 4 * sum_i(L_i^2 / 2) * heads * d, and every implementation is
also given as a ratio to FlashAttention-4's varlen. SDPA (cuDNN, FA2) has no varlen entry:
it runs the padded (DOCUMENTS, max_len) batch with is_causal=True, labelled "padded", and is
still credited with the useful FLOPs only (the padding is its cost).

Timing: median of REPEATS CUDA-event timings after WARMUP calls; before every timed call L2
is flushed by reading a FLUSH_BYTES buffer (Timer.evict). A read, not a write: a buffer zeroed
instead leaves the L2 full of dirty lines, whose write-backs then share the HBM with the timed
call's first reads (H100: the MQA cell's 268 MB read 0.85 of the copy bandwidth after a zeroing,
0.92 after a read; b64's 2 GB 1.00 and 1.01; bench/flush_probe.py). Two numbers per implementation:
  ms       device time: a ~SLEEP_CYCLES spin kernel is queued after the flush and before the
           start event, so the host's per-call work (argument checks, allocations, launches)
           hides behind it, as it does when a decode step is replayed from a CUDA graph;
  ms_host  one call from an idle GPU: synchronize after the flush, then start event, call,
           end event; per-call host time counts (as in fa_gen.timing.median_ms).
GB/s and TFLOP/s come from `ms`; the *_host fields from `ms_host`. fa_gen runs two ways,
`fa_gen.attention` (custom op) and `fa_gen.build(spec)(q, k, v)` (the raw kernel path); the
faster by `ms` is reported as fa_gen, both are kept. Each implementation's output is checked
against fa_gen.reference in float32 on one slice (batch entry 0; the shortest document).

Writes <out>/<date>-<commit>-decode.json (and .png with --plot); prints per decode cell fa_gen
GB/s, each anchor, fa_gen / best anchor and fa_gen / copy, and per varlen cell TFLOP/s and
the ratios to FA4 varlen. An implementation that fails records its error; the run goes on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import platform
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_rounds  # noqa: E402

from fa_gen.timing import attention_flops  # noqa: E402

WARMUP = 5
REPEATS = 30
FLUSH_BYTES = 256 << 20       # > 5x the H100/H200 L2 (50 MB)
SLEEP_CYCLES = 1_000_000      # ~500 us at 2 GHz: covers every path's per-call host time (FA4 ~100 us,
                              # the KV-cache call 130-230 us; at 150 us its eager rows swung 5-7%)
COPY_BYTES = 2 << 30          # the copy reads 2 GiB and writes 2 GiB

DOCUMENTS = 8
VARLEN_TOKENS = 16 * 1024
MIN_DOCUMENT = 256
SEED = 0                      # document lengths: document_lengths(SEED)

CHECK_TOLERANCE = 2e-2        # max |out - reference| on the checked slice (a sanity bound)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ELEMENT_BYTES = {"bf16": 2, "fp16": 2}


# ---- cells --------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeCell:
    name: str
    batch: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int = 128
    dtype: str = "bf16"

    @property
    def kv_bytes(self) -> int:
        """Bytes of K plus V: what one decode step must read."""
        return 2 * self.batch * self.seqlen_k * self.heads_kv * self.head_dim * ELEMENT_BYTES[self.dtype]


def _decode_cell(batch: int, seqlen_k: int, heads_q: int, heads_kv: int, head_dim: int = 128,
                 dtype: str = "bf16") -> DecodeCell:
    tail = (f"_d{head_dim}" if head_dim != 128 else "") + (f"_{dtype}" if dtype != "bf16" else "")
    name = f"b{batch}_sk{seqlen_k // 1024}k_h{heads_q}/{heads_kv}{tail}"
    return DecodeCell(name, batch, seqlen_k, heads_q, heads_kv, head_dim, dtype)


DECODE_CELLS = (
    _decode_cell(64, 8 * 1024, 32, 8),
    _decode_cell(8, 32 * 1024, 32, 8),
    _decode_cell(1, 128 * 1024, 32, 8),
    _decode_cell(128, 2 * 1024, 64, 8),
    _decode_cell(32, 16 * 1024, 32, 1),              # MQA
    _decode_cell(64, 8 * 1024, 32, 8, head_dim=64),
    _decode_cell(64, 8 * 1024, 32, 8, dtype="fp16"),
)


@dataclass(frozen=True)
class VarlenCell:
    name: str
    heads_q: int
    heads_kv: int
    head_dim: int = 128
    dtype: str = "bf16"


VARLEN_CELLS = (VarlenCell("h16", 16, 16), VarlenCell("h16/4", 16, 4))


def document_lengths(seed: int = SEED, count: int = DOCUMENTS, total: int = VARLEN_TOKENS,
                     minimum: int = MIN_DOCUMENT) -> list[int]:
    """`count` mixed lengths, each >= `minimum`, summing to `total`: the free tokens split at
    count - 1 cut points drawn uniformly by random.Random(seed)."""
    free = total - count * minimum
    rng = random.Random(seed)
    bounds = [0] + sorted(rng.randint(0, free) for _ in range(count - 1)) + [free]
    return [minimum + hi - lo for lo, hi in zip(bounds, bounds[1:])]


def cu_seqlens(lengths: list[int], device=None) -> torch.Tensor:
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


# ---- arithmetic ---------------------------------------------------------------------------

def useful_causal_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention within each document: 4 * sum_i(L_i^2 / 2) * heads * d."""
    return sum(attention_flops(1, heads, n, n, head_dim, head_dim, causal=True) for n in lengths)


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / ms / 1e6


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


# ---- timing -------------------------------------------------------------------------------

class Timer:
    """CUDA-event medians with L2 flushed before every timed call (see the module docstring)."""

    def __init__(self, flush_bytes: int = FLUSH_BYTES):
        self.flush = torch.zeros(flush_bytes // 4, dtype=torch.float32, device="cuda")
        self.sleep = getattr(torch.cuda, "_sleep", None)

    def evict(self) -> None:
        """Fill the L2 with clean lines of the flush buffer (a read sweep): whatever a timed call
        reads then comes from HBM, and no write-back of an earlier call's lines is left to it."""
        self.flush.sum()

    def median_ms(self, fn: Callable[[], object], hide_host: bool = True) -> float:
        for _ in range(WARMUP):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.evict()
            if hide_host and self.sleep is not None:
                self.sleep(SLEEP_CYCLES)
            else:
                torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


class Unavailable(Exception):
    """The implementation does not exist in this environment (not an error of the run)."""


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def time_impl(name: str, make: Callable[[], Callable], timer: Timer | None,
              work: Callable[[float], dict], check: Callable[[Callable], dict] | None = None) -> dict:
    """{"impl", its meta, "check", "ms", "ms_host", work(ms), work(ms_host) as *_host}, or
    {"impl", "unavailable"} / {"impl", "error"}: never raises."""
    try:
        fn = make()
    except Unavailable as exc:
        return {"impl": name, "unavailable": str(exc)}
    except Exception as exc:
        return {"impl": name, "error": _error(exc)}
    result = {"impl": name, **getattr(fn, "meta", {})}
    try:
        if check is not None:
            result["check"] = check(fn)
        ms = timer.median_ms(fn)
        ms_host = timer.median_ms(fn, hide_host=False)
    except Exception as exc:
        return {**result, "error": _error(exc)}
    return {**result, "ms": ms, "ms_host": ms_host, **work(ms),
            **{f"{key}_host": value for key, value in work(ms_host).items()}}


def time_rounds(impls: list[str], time_one: Callable[[str, bool], dict], rounds: int = 1) -> list[dict]:
    """Each implementation timed `rounds` times in rotated orders (bench_rounds); time_one(name,
    check) checks the output in the first round only. Per implementation, the median of each
    timing and of its rates (merge_rounds), in the order of `impls`."""
    timed = bench_rounds.timed_rounds(impls, lambda name, r: time_one(name, r == 0), rounds)
    return [merge_rounds(timed[name]) for name in impls]


ROUND_KEYS = ("ms", "ms_host", "gbps", "gbps_host", "tflops", "tflops_host")


def merge_rounds(results: list[dict]) -> dict:
    """One implementation's rounds as one result: the median of each of ROUND_KEYS, the rounds'
    ms under "ms_rounds", the first round's check; a round that failed makes the result its error."""
    return bench_rounds.merge_rounds(results, ROUND_KEYS, "ms")


def copy_bandwidth(timer: Timer, nbytes: int = COPY_BYTES) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer.median_ms(lambda: dst.copy_(src))
    return {"bytes_read": nbytes, "bytes_written": nbytes, "ms": ms, "gbps": gbps(2 * nbytes, ms),
            "definition": "dst.copy_(src) of two uint8 buffers; GB/s = (bytes read + bytes written) / time"}


# ---- implementations ------------------------------------------------------------------------

def _with_meta(fn: Callable, **meta) -> Callable:
    fn.meta = meta
    return fn


def _first(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def fa_gen_spec(causal: bool, dtype: str, head_dim: int):
    """The shipped spec `{full|causal}_{dtype}_d{head_dim}` by name when fa_gen ships it, else
    the same spec built from its fields (named bench_...)."""
    from fa_gen.paths import specs_dir
    from fa_gen.spec_load import load_spec

    name = f"{'causal' if causal else 'full'}_{dtype}_d{head_dim}"
    if (specs_dir() / f"{name}.yaml").exists():
        return name
    return load_spec({"name": f"bench_{name}", "dtype": dtype, "head_dim": head_dim,
                      "mask": "causal" if causal else "none"})


def _spec_label(spec) -> str:
    return spec if isinstance(spec, str) else f"{spec.name} (built from dtype, head_dim, mask; not shipped)"


def fa_gen_attention(spec, q, k, v):
    import fa_gen

    return _with_meta(lambda: fa_gen.attention(q, k, v, spec),
                      call=f"fa_gen.attention(q, k, v, {_spec_label(spec)!r})")


def fa_gen_raw(spec, q, k, v):
    import fa_gen

    kernel = fa_gen.build(spec)
    return _with_meta(lambda: kernel(q, k, v), call=f"fa_gen.build({_spec_label(spec)!r})(q, k, v)",
                      family=kernel.info.family)


def fa_gen_split(spec, q, k, v):
    """The inference path: split-KV with GQA packing, both chosen from the shapes."""
    from fa_gen.inference import forward_split
    from fa_gen.runtime import resolve_spec

    resolved = resolve_spec(spec)
    return _with_meta(lambda: forward_split(resolved, q, k, v),
                      call=f"fa_gen.inference.forward_split({_spec_label(spec)!r}, q, k, v)")


def fa_gen_split_kinds(spec, q, k, v):
    """The split kinds alone (fa_gen.inference.WHOLE_DECODE off): the route before one-query
    calls that fill the GPU took the fixed-length forward with heads as rows."""
    import fa_gen.inference as inference
    from fa_gen.runtime import resolve_spec

    resolved = resolve_spec(spec)

    def call():
        inference.WHOLE_DECODE = False
        try:
            return inference.forward_split(resolved, q, k, v)
        finally:
            inference.WHOLE_DECODE = True

    return _with_meta(call, call=f"fa_gen.inference.forward_split({_spec_label(spec)!r}, q, k, v), WHOLE_DECODE off")


def fa_gen_fp8(cell, q, k, v):
    """The KV-cache call on e4m3 copies of q, k, v (descales 1). GB/s still
    counts the cell's 16-bit K/V bytes, so this row reads half the bytes it is credited with: its
    ratio to the 16-bit rows is the decode speed-up fp8 caches give. Its check compares with the
    16-bit inputs' reference, so it includes e4m3's rounding of the inputs."""
    import fa_gen
    from fa_gen.fp8 import E4M3

    if cell.head_dim != 128:
        raise Unavailable("the shipped fp8 spec is d128")
    q8, k8, v8 = (x.to(E4M3) for x in (q, k, v))
    lengths = torch.full((cell.batch,), cell.seqlen_k, dtype=torch.int32, device=q.device)
    return _with_meta(lambda: fa_gen.attention_with_kvcache(q8, k8, v8, lengths, "fp8_e4m3_d128")[0],
                      call="fa_gen.attention_with_kvcache(q8, k8, v8, seqlens, 'fp8_e4m3_d128')",
                      reads_bytes="half of kv_bytes (e4m3)")


def _fa4_defaults(function) -> dict:
    """The defaults of FA4's options that decide decode performance, as this install has them."""
    parameters = inspect.signature(function).parameters
    return {name: repr(parameters[name].default) for name in ("num_splits", "pack_gqa") if name in parameters}


def fa4_decode(q, k, v, **options):
    from flash_attn.cute import flash_attn_func

    described = ", ".join(f"{key}={value!r}" for key, value in options.items())
    return _with_meta(lambda: flash_attn_func(q, k, v, **options),
                      call=f"flash_attn.cute.flash_attn_func(q, k, v{', ' + described if described else ''})",
                      defaults=_fa4_defaults(flash_attn_func))


def sdpa(backend_name: str, q, k, v, causal: bool = False):
    """fn() -> out (batch, seqlen, heads, dim): SDPA under one backend on (b, h, s, d) views.
    GQA: enable_gqa=True, or where the backend refuses it, K/V heads expanded to the query
    heads (materialized here, outside the timing; the call then reads group x the K/V bytes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]

    def call(keys, values, **options):
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(qt, keys, values, is_causal=causal, **options)
        return out.transpose(1, 2)

    where = f"scaled_dot_product_attention under sdpa_kernel(SDPBackend.{backend_name}) on (b, h, s, d) views"
    if group == 1:
        return _with_meta(lambda: call(kt, vt), call=where)
    try:
        call(kt, vt, enable_gqa=True)
        if q.is_cuda:
            torch.cuda.synchronize()
        return _with_meta(lambda: call(kt, vt, enable_gqa=True), call=where + ", enable_gqa=True")
    except Exception as exc:
        refused = _error(exc)
    keys, values = (t.repeat_interleave(group, dim=1) for t in (kt, vt))
    return _with_meta(lambda: call(keys, values), kv_expanded=group, gqa_refused=refused,
                      call=where + f", K/V heads expanded x{group} by repeat_interleave outside the timing "
                                   f"(enable_gqa=True refused): reads {group}x the true K/V bytes")


# make(cell, q, k, v) -> fn(); q (batch, 1, heads_q, d), k and v (batch, seqlen_k, heads_kv, d).
DECODE_IMPLS = {
    "fa_gen_attention": lambda cell, q, k, v: fa_gen_attention(fa_gen_spec(False, cell.dtype, cell.head_dim), q, k, v),
    "fa_gen_raw": lambda cell, q, k, v: fa_gen_raw(fa_gen_spec(False, cell.dtype, cell.head_dim), q, k, v),
    "fa_gen_split": lambda cell, q, k, v: fa_gen_split(fa_gen_spec(False, cell.dtype, cell.head_dim), q, k, v),
    # Not run by default: the split kinds where heads-as-rows would serve the call.
    "fa_gen_split_kinds": lambda cell, q, k, v: fa_gen_split_kinds(fa_gen_spec(False, cell.dtype, cell.head_dim),
                                                                   q, k, v),
    # Not run by default: e4m3 K/V (its GB/s counts 16-bit bytes; see fa_gen_fp8).
    "fa_gen_fp8": fa_gen_fp8,
    "fa4": lambda cell, q, k, v: fa4_decode(q, k, v),
    "sdpa_cudnn": lambda cell, q, k, v: sdpa("CUDNN_ATTENTION", q, k, v),
    "sdpa_flash": lambda cell, q, k, v: sdpa("FLASH_ATTENTION", q, k, v),
    # Not run by default: FA4 with its split-KV heuristic on (num_splits < 1), for comparison.
    "fa4_splits": lambda cell, q, k, v: fa4_decode(q, k, v, num_splits=0),
}
DECODE_DEFAULT = ("fa_gen_attention", "fa_gen_raw", "fa_gen_split", "fa4", "sdpa_cudnn", "sdpa_flash")
FA_GEN_PATHS = ("fa_gen_attention", "fa_gen_raw", "fa_gen_split")
DECODE_ANCHORS = ("fa4", "fa4_splits", "sdpa_cudnn", "sdpa_flash")


@dataclass
class VarlenInputs:
    q: torch.Tensor               # (total, heads_q, d), documents packed
    k: torch.Tensor               # (total, heads_kv, d)
    v: torch.Tensor
    cu_seqlens: torch.Tensor      # (documents + 1,) int32
    max_seqlen: int
    padded: tuple                 # (q, k, v) as (documents, max_seqlen, heads, d), zeros past each end


def fa_gen_varlen(cell: VarlenCell, inputs: VarlenInputs):
    import fa_gen

    attention_varlen = getattr(fa_gen, "attention_varlen", None)
    if attention_varlen is None:
        raise Unavailable("fa_gen.attention_varlen does not exist at this commit")
    spec = fa_gen_spec(True, cell.dtype, cell.head_dim)
    x = inputs
    return _with_meta(lambda: attention_varlen(x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens, x.max_seqlen,
                                               x.max_seqlen, spec),
                      call=f"fa_gen.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, "
                           f"{_spec_label(spec)!r})", layout="packed")


def fa4_varlen(cell: VarlenCell, inputs: VarlenInputs):
    from flash_attn.cute import flash_attn_varlen_func

    x = inputs
    # Keywords: newer FA4 versions put `qv` fourth among the positional parameters.
    return _with_meta(lambda: flash_attn_varlen_func(x.q, x.k, x.v, cu_seqlens_q=x.cu_seqlens,
                                                     cu_seqlens_k=x.cu_seqlens, max_seqlen_q=x.max_seqlen,
                                                     max_seqlen_k=x.max_seqlen, causal=True),
                      call="flash_attn.cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=, cu_seqlens_k=, "
                           "max_seqlen_q=, max_seqlen_k=, causal=True)",
                      layout="packed", defaults=_fa4_defaults(flash_attn_varlen_func))


def sdpa_padded(backend_name: str):
    def make(cell: VarlenCell, inputs: VarlenInputs):
        fn = sdpa(backend_name, *inputs.padded, causal=True)
        fn.meta = {**fn.meta, "layout": "padded",
                   "note": f"not varlen: the padded ({DOCUMENTS}, max_seqlen) batch, is_causal=True; "
                           "TFLOP/s counts the useful FLOPs of the documents only"}
        return fn
    return make


VARLEN_IMPLS = {
    "fa_gen": fa_gen_varlen,
    "fa4_varlen": fa4_varlen,
    "sdpa_cudnn_padded": sdpa_padded("CUDNN_ATTENTION"),
    "sdpa_flash_padded": sdpa_padded("FLASH_ATTENTION"),
}


# ---- checks ---------------------------------------------------------------------------------

def _check(out: torch.Tensor, reference: torch.Tensor) -> dict:
    err = float((out.float() - reference).abs().max())
    return {"max_abs_err": err, "ok": err <= CHECK_TOLERANCE}


def decode_check(spec, q, k, v) -> Callable[[Callable], dict]:
    """Batch entry 0 of an implementation's output against the float32 reference."""
    from fa_gen.reference import attention_reference
    from fa_gen.runtime import resolve_spec

    reference, _ = attention_reference(q[:1], k[:1], v[:1], resolve_spec(spec), torch.float32)
    return lambda fn: _check(_first(fn())[:1], reference)


def varlen_check(cell: VarlenCell, inputs: VarlenInputs, lengths: list[int]) -> Callable[[Callable], dict]:
    """The shortest document of an implementation's output (packed or padded) against the
    float32 reference."""
    from fa_gen.reference import attention_reference
    from fa_gen.runtime import resolve_spec

    doc = min(range(len(lengths)), key=lengths.__getitem__)
    lo, hi = sum(lengths[:doc]), sum(lengths[:doc + 1])
    spec = resolve_spec(fa_gen_spec(True, cell.dtype, cell.head_dim))
    reference, _ = attention_reference(*(t[lo:hi].unsqueeze(0) for t in (inputs.q, inputs.k, inputs.v)), spec,
                                       torch.float32)

    def check(fn):
        out = _first(fn())
        out = out[doc, :hi - lo] if out.dim() == 4 else out[lo:hi]
        return {**_check(out.unsqueeze(0), reference), "document": doc}
    return check


# ---- cells run ------------------------------------------------------------------------------

def seeded_decode_inputs(cell: DecodeCell, seed: int = 0):
    """(resolved fa_gen spec, q, k, v) of a decode cell from a seeded generator (the sweeps)."""
    from fa_gen.runtime import resolve_spec

    dtype = TORCH_DTYPES[cell.dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(cell.batch, 1, cell.heads_q, cell.head_dim, generator=g, device="cuda").to(dtype)
    k = torch.randn(cell.batch, cell.seqlen_k, cell.heads_kv, cell.head_dim, generator=g, device="cuda").to(dtype)
    return resolve_spec(fa_gen_spec(False, cell.dtype, cell.head_dim)), q, k, torch.randn_like(k)


def run_decode_cell(cell: DecodeCell, impls: list[str], timer: Timer, copy_gbps: float, device="cuda",
                    rounds: int = 1) -> dict:
    dtype = TORCH_DTYPES[cell.dtype]

    def draw(seqlen, heads):
        return torch.randn(cell.batch, seqlen, heads, cell.head_dim, device=device, dtype=dtype)

    q, k, v = draw(1, cell.heads_q), draw(cell.seqlen_k, cell.heads_kv), draw(cell.seqlen_k, cell.heads_kv)
    check = decode_check(fa_gen_spec(False, cell.dtype, cell.head_dim), q, k, v)
    work = lambda ms: {"gbps": gbps(cell.kv_bytes, ms)}   # noqa: E731
    results = time_rounds(impls, lambda name, first: time_impl(
        name, lambda: DECODE_IMPLS[name](cell, q, k, v), timer, work, check if first else None), rounds)
    del q, k, v
    torch.cuda.empty_cache()
    return summarize_decode({**asdict(cell), "kv_bytes": cell.kv_bytes, "results": results}, copy_gbps)


def summarize_decode(cell: dict, copy_gbps: float) -> dict:
    """Adds each result's fraction of copy, and the cell's fa_gen (the faster path), best anchor,
    fa_gen / best anchor and fa_gen / copy."""
    timed = {r["impl"]: r for r in cell["results"] if "gbps" in r}
    for r in timed.values():
        r["fraction_of_copy"] = r["gbps"] / copy_gbps
    paths = [timed[name] for name in FA_GEN_PATHS if name in timed]
    fa_gen = max(paths, key=lambda r: r["gbps"], default=None)
    anchors = {name: r["gbps"] for name, r in timed.items() if name in DECODE_ANCHORS}
    best = max(anchors, key=anchors.get, default=None)
    cell["fa_gen"] = {"impl": fa_gen["impl"], "gbps": fa_gen["gbps"]} if fa_gen else None
    cell["best_anchor"] = best
    cell["fa_gen_over_best_anchor"] = fa_gen["gbps"] / anchors[best] if fa_gen and best else None
    cell["fa_gen_over_copy"] = fa_gen["gbps"] / copy_gbps if fa_gen else None
    return cell


def varlen_inputs(cell: VarlenCell, lengths: list[int], device="cuda") -> VarlenInputs:
    dtype = TORCH_DTYPES[cell.dtype]
    total, longest = sum(lengths), max(lengths)
    packed = [torch.randn(total, heads, cell.head_dim, device=device, dtype=dtype)
              for heads in (cell.heads_q, cell.heads_kv, cell.heads_kv)]
    padded = []
    for t in packed:
        batch = t.new_zeros(len(lengths), longest, *t.shape[1:])
        for i, piece in enumerate(torch.split(t, lengths)):
            batch[i, :len(piece)] = piece
        padded.append(batch)
    return VarlenInputs(*packed, cu_seqlens(lengths, device), longest, tuple(padded))


def run_varlen_cell(cell: VarlenCell, lengths: list[int], impls: list[str], timer: Timer, device="cuda",
                    rounds: int = 1) -> dict:
    inputs = varlen_inputs(cell, lengths, device)
    flops = useful_causal_flops(lengths, cell.heads_q, cell.head_dim)
    work = lambda ms: {"tflops": tflops(flops, ms)}   # noqa: E731
    check = varlen_check(cell, inputs, lengths)
    results = time_rounds(impls, lambda name, first: time_impl(
        name, lambda: VARLEN_IMPLS[name](cell, inputs), timer, work, check if first else None), rounds)
    del inputs
    torch.cuda.empty_cache()
    return summarize_varlen({**asdict(cell), "useful_flops": flops, "results": results})


def summarize_varlen(cell: dict) -> dict:
    """Adds each result's ratio to FA4 varlen ("over_fa4_varlen") and the cell's fa_gen / FA4."""
    timed = {r["impl"]: r for r in cell["results"] if "tflops" in r}
    fa4 = timed.get("fa4_varlen", {}).get("tflops")
    for r in timed.values():
        r["over_fa4_varlen"] = r["tflops"] / fa4 if fa4 else None
    cell["fa_gen_over_fa4_varlen"] = timed["fa_gen"]["over_fa4_varlen"] if "fa_gen" in timed else None
    return cell


# ---- the printed table ----------------------------------------------------------------------

def _value(r: dict | None, key: str) -> str:
    if r is None:
        return "-"
    if key in r:
        text = f"{r[key]:.0f}"
        return text + (" (check failed)" if not r.get("check", {}).get("ok", True) else "")
    return "unavailable" if "unavailable" in r else "ERR"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def decode_table(cells: list[dict], copy: dict, anchors: list[str]) -> str:
    fp8 = any(r["impl"] == "fa_gen_fp8" for cell in cells for r in cell["results"])
    extra = " fp8 K/V (16-bit GB/s equivalent) | fp8 / fa_gen |" if fp8 else ""
    lines = [f"decode, GB/s of K+V read; D2D copy {copy['gbps']:.0f} GB/s (read + write)",
             "| cell | fa_gen | " + " | ".join(anchors) + " | fa_gen/best anchor | fa_gen/copy |" + extra,
             "|---" * (len(anchors) + 4 + 2 * fp8) + "|"]
    for cell in cells:
        by = {r["impl"]: r for r in cell["results"]}
        if fp8:
            fp8_gbps = by.get("fa_gen_fp8", {}).get("gbps")
            speedup = fp8_gbps / cell["fa_gen"]["gbps"] if fp8_gbps and cell["fa_gen"] else None
            extra = f" {_value(by.get('fa_gen_fp8'), 'gbps')} | {_ratio(speedup)} |"
        fa_gen = cell["fa_gen"]
        fa_gen_text = (f"{_value(by[fa_gen['impl']], 'gbps')} ({fa_gen['impl'].removeprefix('fa_gen_')})"
                       if fa_gen else "ERR")
        best = f" ({cell['best_anchor']})" if cell["best_anchor"] else ""
        lines.append(f"| {cell['name']} | {fa_gen_text} | " + " | ".join(_value(by.get(a), "gbps") for a in anchors)
                     + f" | {_ratio(cell['fa_gen_over_best_anchor'])}{best} | {_ratio(cell['fa_gen_over_copy'])} |"
                     + extra)
    return "\n".join(lines)


def varlen_table(cells: list[dict], impls: list[str], lengths: list[int]) -> str:
    lines = [f"varlen prefill, causal, TFLOP/s of useful FLOPs; documents {lengths}",
             "| cell | " + " | ".join(impls) + " | fa_gen/fa4_varlen |", "|---" * (len(impls) + 2) + "|"]
    for cell in cells:
        by = {r["impl"]: r for r in cell["results"]}
        lines.append(f"| {cell['name']} | " + " | ".join(_value(by.get(n), "tflops") for n in impls)
                     + f" | {_ratio(cell['fa_gen_over_fa4_varlen'])} |")
    return "\n".join(lines)


# ---- report ---------------------------------------------------------------------------------

METHOD = {
    "timing": f"median of {REPEATS} CUDA-event timings after {WARMUP} warm-ups; L2 flushed before every "
              f"timed call ({FLUSH_BYTES >> 20} MiB read: the L2 left clean); ms: a {SLEEP_CYCLES}-cycle spin kernel between the "
              "flush and the start event hides per-call host time (device time, as under CUDA graphs); "
              "ms_host: synchronize, then start event, call, end event (per-call host time counts); with --rounds N, "
              "each cell's implementations timed N times in rotated orders and each value the median of its rounds",
    "decode": "seqlen_q = 1, no mask; GB/s = (bytes of K + bytes of V) / ms (true K/V bytes, also for an anchor "
              "called with expanded K/V heads); fraction_of_copy = GB/s / copy GB/s; fa_gen = the faster of "
              "fa_gen_attention and fa_gen_raw by ms",
    "varlen": f"{DOCUMENTS} packed documents, causal; TFLOP/s = 4 * sum_i(L_i^2 / 2) * heads * d / ms (useful "
              "FLOPs only, padded anchors included); over_fa4_varlen = TFLOP/s / FA4 varlen TFLOP/s",
    "check": f"each output on one slice (decode: batch entry 0; varlen: the shortest document) against "
             f"fa_gen.reference in float32; ok if max |err| <= {CHECK_TOLERANCE}",
}


def _flash_attn_version() -> str:
    """The installed distributions that provide `flash_attn`, with their versions."""
    from importlib import metadata

    names = metadata.packages_distributions().get("flash_attn", [])
    found = ", ".join(f"{name} {metadata.version(name)}" for name in sorted(set(names)))
    return found or "no distribution provides flash_attn"


def make_report(commit: str, device: str, copy: dict, decode: list, varlen: list, lengths: list[int],
                argv: list[str]) -> dict:
    import fa_gen

    return {
        "commit": commit,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "fa_gen": fa_gen.__version__,
        "flash_attn": _flash_attn_version(),
        "mode": "decode",
        "command": "python bench/bench_decode.py " + " ".join(argv),
        "method": METHOD,
        "copy": copy,
        "decode": decode,
        "varlen": {"seed": SEED, "lengths": lengths, "total_tokens": sum(lengths), "cells": varlen},
    }


def write_report(report: dict, out_dir: Path, plot: bool = False) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{report['date'][:10]}-{report['commit']}-decode"
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    if plot:
        print(f"wrote {plot_report(report, out_dir / f'{stem}.png')}")
    return path


def _bars(ax, cells: list[dict], key: str, line: float = 0.0) -> None:
    """Grouped bars, one group a cell; `line`: a level the y axis must show too."""
    impls = list(dict.fromkeys(r["impl"] for c in cells for r in c["results"] if key in r))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        points = [(x, r[key]) for x, c in enumerate(cells) for r in c["results"] if r["impl"] == impl and key in r]
        if points:
            xs, ys = zip(*points)
            ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], ys, width, label=impl,
                   edgecolor="black" if impl.startswith("fa_gen") else None)
    labels = []
    for c in cells:
        missing = [r["impl"] for r in c["results"] if key not in r]
        labels.append(c["name"] + (f"\nno number: {', '.join(missing)}" if missing else ""))
    ax.set_xticks(range(len(cells)), labels, fontsize=7)
    ax.set_ylim(0, 1.3 * max([r[key] for c in cells for r in c["results"] if key in r] + [line, 1.0]))
    ax.grid(axis="y", alpha=0.3)


def plot_report(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 9))
    _bars(top, report["decode"], "gbps", line=report["copy"]["gbps"])
    top.axhline(report["copy"]["gbps"], color="black", linestyle="--",
                label=f"D2D copy, read + write ({report['copy']['gbps']:.0f})")
    top.set_ylabel("GB/s of K + V read")
    top.set_title("decode (seqlen_q = 1)")
    top.legend(fontsize=7, ncol=6, loc="upper left")
    varlen = report["varlen"]
    _bars(bottom, varlen["cells"], "tflops")
    bottom.set_ylabel("TFLOP/s (useful causal FLOPs)")
    bottom.set_title(f"varlen prefill, causal, documents {varlen['lengths']} (sdpa_*_padded: padded batch)")
    bottom.legend(fontsize=7, ncol=6, loc="upper left")
    fig.suptitle(f"{report['device']}, commit {report['commit']}, {report['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---- the command ----------------------------------------------------------------------------

def _paged():
    """bench_paged's cells, implementations and runners (a module of its own: it imports this one)."""
    import bench_paged

    return bench_paged


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    parser.add_argument("--parts", default="decode,varlen", help="decode, varlen or both")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time each cell's implementations this many times, the order rotated each "
                             "round; report the medians (the rounds' ms kept as ms_rounds)")
    parser.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    parser.add_argument("--impls", default=",".join(DECODE_DEFAULT),
                        help="decode implementations, of " + ",".join(DECODE_IMPLS))
    parser.add_argument("--varlen-impls", default=",".join(VARLEN_IMPLS))
    paged = _paged()
    parser.add_argument("--paged-impls", default=",".join(paged.PAGED_IMPLS))
    args = parser.parse_args(argv)
    known = {c.name for c in DECODE_CELLS + VARLEN_CELLS + paged.PAGED_CELLS}
    for option, chosen, allowed in (("--cells", args.cells, known), ("--impls", args.impls, DECODE_IMPLS),
                                    ("--varlen-impls", args.varlen_impls, VARLEN_IMPLS),
                                    ("--paged-impls", args.paged_impls, paged.PAGED_IMPLS),
                                    ("--parts", args.parts, {"decode", "varlen", "paged"})):
        unknown = set((chosen or "").split(",")) - set(allowed) - {""}
        if unknown:
            parser.error(f"{option}: unknown {sorted(unknown)}; known: {', '.join(sorted(allowed))}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    chosen = set(args.cells.split(",")) if args.cells else None
    parts = args.parts.split(",")
    impls = args.impls.split(",")
    varlen_impls = args.varlen_impls.split(",")
    lengths = document_lengths()
    timer = Timer()
    torch.set_grad_enabled(False)
    copy = copy_bandwidth(timer)
    print(f"D2D copy: {copy['gbps']:.0f} GB/s (read + write), {copy['ms']:.3f} ms for 2 x {COPY_BYTES >> 30} GiB",
          flush=True)
    decode, varlen = [], []
    for cell in DECODE_CELLS if "decode" in parts else ():
        if chosen is None or cell.name in chosen:
            decode.append(run_decode_cell(cell, impls, timer, copy["gbps"], rounds=args.rounds))
            print(decode_table(decode[-1:], copy, [n for n in impls if n in DECODE_ANCHORS]).splitlines()[-1],
                  flush=True)
    for cell in VARLEN_CELLS if "varlen" in parts else ():
        if chosen is None or cell.name in chosen:
            varlen.append(run_varlen_cell(cell, lengths, varlen_impls, timer, rounds=args.rounds))
            print(varlen_table(varlen[-1:], varlen_impls, lengths).splitlines()[-1], flush=True)
    paged, paged_impls, bench_paged = [], args.paged_impls.split(","), _paged()
    for cell in bench_paged.PAGED_CELLS if "paged" in parts else ():
        if chosen is None or cell.name in chosen:
            paged.append(bench_paged.run_paged_cell(cell, paged_impls, timer, copy["gbps"], rounds=args.rounds))
            print(bench_paged.paged_table(paged[-1:], paged_impls).splitlines()[-1], flush=True)
    copy["gbps_after"] = copy_bandwidth(timer)["gbps"]   # drift check; fractions use the first
    report = make_report(args.commit, torch.cuda.get_device_name(), copy, decode, varlen, lengths, argv)
    if paged:
        report["paged"] = paged
    write_report(report, Path(args.out), args.plot)
    print()
    if decode:
        print(decode_table(decode, copy, [n for n in impls if n in DECODE_ANCHORS]))
    if varlen:
        print(varlen_table(varlen, varlen_impls, lengths))
    if paged:
        print(bench_paged.paged_table(paged, paged_impls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
