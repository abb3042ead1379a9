"""The library variants the benchmark times, each beside FlexAttention and FlashAttention-4.

One row per shipped expression spec: fa_gen runs exactly that spec (`build(spec_name)`, its
inputs passed as `kernel.forward(q, k, v, inputs=...)`); FlexAttention gets a mask_mod /
score_mod pair written to compute the same function; FlashAttention-4 gets its own arguments
(window_size, softcap, cu_seqlens, learnable_sink) where it has the variant. Inputs are built
deterministically from the shape, and TFLOP/s counts only the visible (query, key) pairs,
counted exactly from the spec's mask (`visible_pairs`).

Shapes are square (seqlen_q == seqlen_k) and tensors are (batch, seqlen, heads, dim), as in
the rest of bench/. This module imports only torch and fa_gen, so CPU tests can read the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fa_gen.check import Shape
from fa_gen.reference import visibility
from fa_gen.spec import Spec

# The bars: fa_gen / FlexAttention and fa_gen / FlashAttention-4 (softcap has its own).
FLEX_MIN = 1.5
FA4_MIN = 1.0
DOCUMENTS = 8          # packed documents per batch entry, equal lengths
WINDOW = 1024          # sliding window and attention-sink window: keys a query sees, itself included
CHUNK = 2048           # chunked causal (Llama 4 uses 8192; 2048 makes the chunks bite from s = 4k)
SINK_TOKENS = 4        # StreamingLLM's first keys every query keeps
SOFTCAP = 30.0         # Gemma 2's attention logit cap
SEED = 0               # learned tensors (relative bias, sink logits) are drawn from this seed


@dataclass(frozen=True)
class FlexMods:
    """A FlexAttention program: mask_mod (None: every key), score_mod, and learnable sink logits
    per head (None: no sink), which Flex has no argument for: applied to out through its LSE."""

    mask_mod: Callable | None = None
    score_mod: Callable | None = None
    sink: torch.Tensor | None = None


@dataclass(frozen=True)
class Variant:
    name: str
    spec: str                                   # a shipped spec: specs/<spec>.yaml
    inputs: Callable[[Shape, object], dict]     # (shape, device) -> the spec's inputs
    flex: Callable[[dict, Shape], FlexMods]
    fa4: Callable[[dict, Shape], dict] | None = None   # FA4 keyword arguments; None: no such variant
    fa4_min: float = FA4_MIN
    notes: str = ""


# ---- inputs -------------------------------------------------------------------------------

def _none(shape: Shape, device) -> dict:
    return {}


def _alibi_slopes(heads: int, device) -> torch.Tensor:
    """The standard ALiBi slopes 2 ** (-8 (h + 1) / heads), float32 (heads a power of two)."""
    return torch.exp2(-8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads).float().to(device)


def _seeded(shape: tuple, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device)


def document_ids(shape: Shape, device) -> torch.Tensor:
    """(batch, seqlen) int32: DOCUMENTS equal documents per batch entry, numbered from 0."""
    length = shape.seqlen_q // DOCUMENTS
    ids = torch.arange(shape.seqlen_q, device=device) // length
    return ids.clamp(max=DOCUMENTS - 1).to(torch.int32).expand(shape.batch, -1).contiguous()


def cu_seqlens_of(doc_ids: torch.Tensor) -> torch.Tensor:
    """int32 (documents + 1,) offsets into the flattened (batch * seqlen) tokens: a document ends
    where its id changes or its batch entry does."""
    batch, seqlen = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    offsets = torch.nonzero(starts.flatten()).flatten()
    end = torch.tensor([batch * seqlen], device=doc_ids.device)
    return torch.cat([offsets, end]).to(torch.int32)


# ---- FlexAttention mask_mods (square shapes: no seqlen_k - seqlen_q offset) ----------------

def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _window(width: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - width)
    return mask_mod


def _flex_softcap(inputs: dict, shape: Shape) -> FlexMods:
    cap = inputs["softcap"]
    return FlexMods(_causal, lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap))


def _flex_alibi(inputs: dict, shape: Shape) -> FlexMods:
    heads = shape.heads_q

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - torch.exp2(-8.0 * (h + 1) / heads) * (q_idx - kv_idx).abs()
    return FlexMods(_causal, score_mod)


def _flex_alibi_supplied(inputs: dict, shape: Shape) -> FlexMods:
    slopes = inputs["slopes"]
    return FlexMods(_causal, lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx).abs())


def _flex_relative_bias(inputs: dict, shape: Shape) -> FlexMods:
    bias = inputs["rel_bias"]

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, (kv_idx - q_idx).clamp(-128, 128) + 128]
    return FlexMods(None, score_mod)


def _flex_chunked(inputs: dict, shape: Shape) -> FlexMods:
    chunk = inputs["chunk"]
    return FlexMods(lambda b, h, q_idx, kv_idx: (q_idx // chunk == kv_idx // chunk) & (kv_idx <= q_idx))


def _flex_sinks(inputs: dict, shape: Shape) -> FlexMods:
    sinks, width = inputs["sink_tokens"], inputs["window"]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < sinks) | (kv_idx > q_idx - width))
    return FlexMods(mask_mod)


def _flex_prefix(inputs: dict, shape: Shape) -> FlexMods:
    prefix = inputs["prefix_len"]
    return FlexMods(lambda b, h, q_idx, kv_idx: (kv_idx < prefix[b]) | (kv_idx <= q_idx))


def _flex_document(inputs: dict, shape: Shape) -> FlexMods:
    q_doc, kv_doc = inputs["q_doc"], inputs["kv_doc"]
    return FlexMods(lambda b, h, q_idx, kv_idx: (q_doc[b, q_idx] == kv_doc[b, kv_idx]) & (kv_idx <= q_idx))


# ---- the table ---------------------------------------------------------------------------

VARIANTS = (
    Variant("softcap", "softcap", lambda shape, device: {"softcap": SOFTCAP}, _flex_softcap,
            fa4=lambda inputs, shape: {"causal": True, "softcap": inputs["softcap"]}, fa4_min=1.3,
            notes=f"causal, softcap {SOFTCAP:g}"),
    Variant("alibi", "alibi", _none, _flex_alibi, notes="causal, slopes computed in the kernel"),
    Variant("alibi_supplied", "alibi_supplied",
            lambda shape, device: {"slopes": _alibi_slopes(shape.heads_q, device)}, _flex_alibi_supplied,
            notes="causal, the standard slopes passed as a tensor"),
    Variant("relative_bias", "relative_bias",
            lambda shape, device: {"rel_bias": _seeded((shape.heads_q, 257), device)}, _flex_relative_bias,
            notes="no mask, bias table (heads, 257), head dim 64"),
    Variant("sliding_window_causal", "sliding_window_causal", lambda shape, device: {"window": WINDOW},
            lambda inputs, shape: FlexMods(_window(inputs["window"])),
            fa4=lambda inputs, shape: {"causal": True, "window_size": (inputs["window"] - 1, 0)},
            notes=f"window {WINDOW}, causal"),
    Variant("chunked_causal", "chunked_causal", lambda shape, device: {"chunk": CHUNK}, _flex_chunked,
            notes=f"chunk {CHUNK}"),
    Variant("attention_sinks", "attention_sinks",
            lambda shape, device: {"sink_tokens": SINK_TOKENS, "window": WINDOW}, _flex_sinks,
            notes=f"{SINK_TOKENS} sink tokens + window {WINDOW}, causal"),
    Variant("prefix_lm", "prefix_lm",
            lambda shape, device: {"prefix_len": torch.full((shape.batch,), shape.seqlen_q // 4,
                                                            dtype=torch.int32, device=device)},
            _flex_prefix, notes="prefix = seqlen / 4 in every batch entry"),
    Variant("document", "document",
            lambda shape, device: dict.fromkeys(("q_doc", "kv_doc"), document_ids(shape, device)),
            _flex_document,
            fa4=lambda inputs, shape: {"causal": True, "cu_seqlens": cu_seqlens_of(inputs["q_doc"]),
                                       "max_seqlen": shape.seqlen_q // DOCUMENTS},
            notes=f"{DOCUMENTS} equal packed documents per batch entry, causal in each (FA4: varlen)"),
    Variant("sink_logit", "sink_logit",
            lambda shape, device: {"sinks": _seeded((shape.heads_q,), device)},
            lambda inputs, shape: FlexMods(_causal, sink=inputs["sinks"]),
            fa4=lambda inputs, shape: {"causal": True, "learnable_sink": inputs["sinks"]},
            notes="causal, learnable sink logit per head (Flex: applied to out through its LSE)"),
)
BY_NAME = {v.name: v for v in VARIANTS}


def load_variant_spec(variant: Variant) -> Spec:
    """The variant's spec, loaded even where no family implements it yet (for the reference)."""
    from fa_gen.paths import specs_dir
    from fa_gen.spec_load import load_spec

    return load_spec(specs_dir() / f"{variant.spec}.yaml", check_archs=False)


def visible_pairs(spec: Spec, shape: Shape, inputs: dict, device=None) -> int:
    """Exactly how many (batch, head, query, key) cells the spec's mask keeps at `shape`."""
    if spec.mask_expr is not None:
        seen = visibility(spec, shape.seqlen_q, shape.seqlen_k, device=device, batch=shape.batch,
                          heads_q=shape.heads_q, inputs=inputs)
    else:
        seen = visibility(spec, shape.seqlen_q, shape.seqlen_k, device=device)
        seen = seen.expand(shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k)
    # Count once along broadcast (stride 0) dimensions, then multiply.
    repeats, index = 1, []
    for size, stride in zip(seen.shape, seen.stride()):
        if stride == 0:
            repeats *= size
            index.append(slice(0, 1))
        else:
            index.append(slice(None))
    return int(seen[tuple(index)].sum().item()) * repeats


def variant_flops(spec: Spec, shape: Shape, pairs: int) -> float:
    """Forward FLOPs over the visible pairs only: two GEMMs, 2 FLOPs per multiply-add."""
    return 2.0 * pairs * (spec.head_dim_qk + spec.head_dim_v)


# ---- callables: fn(q, k, v) -> (out, lse or None), q, k, v and out (batch, seqlen, heads, dim) --

def make_fa_gen(variant: Variant, inputs: dict, family: str | None):
    """Raises fa_gen's own errors (SpecError, UnsupportedError) where no family serves the spec."""
    from fa_gen.runtime import build

    kernel = build(variant.spec, family=family)
    # One plan per shape (inputs checked, mask tiles classified: fa_gen.plan), made on the first
    # call, outside the timed runs, as Flex's block mask and FA4's cu_seqlens are.
    plans = {}

    def run(q, k, v):
        key = (q.shape, k.shape)
        if key not in plans:
            plans[key] = kernel.plan(q, k, inputs=inputs)
        return kernel.forward(q, k, v, plan=plans[key])
    run.meta = {"family": kernel.info.family, "plan": "once per shape"}
    return run


def compiled_flex():
    """flex_attention under torch.compile, one static graph per shape (dynamic=False, as
    FlexAttention's own benchmarks) and dynamo's recompile limits raised, so that no shape or
    mod falls back to the eager (math) path."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # At dynamo's default limit (8) a compiled function silently falls back to eager after 8 graphs.
    torch._dynamo.config.cache_size_limit = 1024
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 1024
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = 8192
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["fn"]


_COMPILED: dict = {}
# FlexAttention's kernel_options, tried in order until Triton's kernel fits (None: Flex's defaults).
FLEX_OPTIONS = (None, {"num_stages": 2}, {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2})


def flex_program(mods: FlexMods, shape: Shape, device, flex=None, lse: bool = False):
    """fn(q, k, v) -> (out, lse or None) running `mods` through `flex` (default: compiled).

    The block mask is built here, once per shape, outside any timed region."""
    from torch.nn.attention.flex_attention import create_block_mask

    flex = flex or compiled_flex()
    block_mask = None
    if mods.mask_mod is not None:
        block_mask = create_block_mask(mods.mask_mod, B=shape.batch, H=None, Q_LEN=shape.seqlen_q,
                                       KV_LEN=shape.seqlen_k, device=device)
    want_lse = lse or mods.sink is not None
    extra = _lse_request() if want_lse else {}
    ladder = list(FLEX_OPTIONS)

    def call(q, k, v):
        # Flex's default config first; where Triton finds it too large for shared memory, the
        # next smaller one (the one that ran is reported in run.meta).
        while True:
            options = {"kernel_options": ladder[0]} if ladder[0] else {}
            try:
                return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=mods.score_mod,
                            block_mask=block_mask, **extra, **options)
            except Exception as exc:
                if "out of resource" not in str(exc) or len(ladder) == 1:
                    raise
                ladder.pop(0)
                run.meta["kernel_options"] = ladder[0]

    def run(q, k, v):
        result = call(q, k, v)
        if not want_lse:
            return result.transpose(1, 2), None
        out, aux = result
        row_lse = getattr(aux, "lse", aux)       # return_aux gives an AuxOutput, return_lse the tensor
        if mods.sink is not None:
            sink = mods.sink.view(1, -1, 1).to(row_lse.dtype)
            out = (out * torch.sigmoid(row_lse - sink).unsqueeze(-1)).to(q.dtype)
            row_lse = torch.logaddexp(row_lse, sink)
        return out.transpose(1, 2), row_lse
    run.meta = {}
    return run


def _lse_request() -> dict:
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch before AuxRequest
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def make_flex(variant: Variant, inputs: dict, shape: Shape, device="cuda", lse: bool = False):
    return flex_program(variant.flex(inputs, shape), shape, device, lse=lse)


def make_fa4(variant: Variant, inputs: dict, shape: Shape, lse: bool = False):
    """FA4's call for the variant; documents go through flash_attn_varlen_func on the flattened
    tokens (the packed layout FA4 is used with)."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    kwargs = dict(variant.fa4(inputs, shape))
    cu_seqlens = kwargs.pop("cu_seqlens", None)
    max_seqlen = kwargs.pop("max_seqlen", None)
    if cu_seqlens is None:
        def run(q, k, v):
            out, row_lse = flash_attn_func(q, k, v, return_lse=lse, **kwargs)
            return out, row_lse
        return run

    def run_varlen(q, k, v):
        batch, seqlen, heads, _ = q.shape
        out, row_lse = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                              cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                              max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                              return_lse=lse, **kwargs)
        if row_lse is not None:   # (heads, total) -> (batch, heads, seqlen)
            row_lse = row_lse.view(heads, batch, seqlen).transpose(0, 1)
        return out.view(batch, seqlen, heads, -1), row_lse
    return run_varlen


# ---- the sanity check: every implementation against fa_gen.reference on a small shape -------

# Small, yet every variant's mask bites: window 1024 < 3072, chunks of 2048, 8 documents of 384,
# prefix 768, two batch entries (per-entry inputs), two heads (per-head slopes and biases).
CHECK_SHAPE = Shape(batch=2, seqlen_q=3072, seqlen_k=3072, heads_q=2, heads_kv=2)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_variant(variant: Variant, spec: Spec, makers: dict, shape: Shape = CHECK_SHAPE,
                  device="cuda") -> dict:
    """name -> verdict of each implementation on one shape, by fa_gen.check.compare (out and LSE
    against the float64 reference, tolerance derived from PyTorch's same-precision error).

    `makers`: name -> make(inputs, shape) returning fn(q, k, v) -> (out, lse)."""
    from fa_gen.check import compare, random_inputs

    inputs = variant.inputs(shape, device)
    generator = torch.Generator(device=device).manual_seed(SEED)
    q, k, v = random_inputs(spec, shape, TORCH_DTYPES[spec.dtype.value], device, generator)
    verdicts = {}
    for name, make in makers.items():
        try:
            out, lse = make(inputs, shape)(q, k, v)
            result = compare(spec, q, k, v, out, lse.float(), inputs)
        except Exception as exc:  # an implementation that cannot run is reported beside the others
            verdicts[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        verdicts[name] = {"ok": result.ok, "out_err": result.out_err, "out_tol": result.out_tol,
                          "lse_err": result.lse_err, "lse_tol": result.lse_tol}
    return verdicts
