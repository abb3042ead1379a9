"""The Spec behind each configuration of the FlashAttention-compatible functions (fa_gen.api.flash_attn).

    config = FlashConfig(dtype="bf16", head_dim_qk=128, head_dim_v=128, causal=True, window=(-1, 0))
    spec = flash_spec(config)            # built once per process (functools cache), by name `fa_bf16_d128_causal`

What changes the kernel's code is the config: dtype, head dims, the mask (causal and window_size,
compile-time: the spec language has a runtime window only as a mask expression, which the varlen and
split-KV kernels do not serve and which costs a per-call tile classification), a non-default
softmax_scale, and whether softcap, ALiBi slopes and a learnable sink are on. Their values are runtime
inputs of the spec (`softcap` a float scalar, `slopes` and `sinks` float32 tensors), so one compiled
kernel serves every softcap value, every set of slopes and every sink.

Masks follow FlashAttention >= 2.1: aligned bottom-right when seqlen_q != seqlen_k; window_size
(left, right) with -1 unbounded; causal is (left, 0). Scores are scaled, then soft-capped
(softcap * tanh(s / softcap)), then ALiBi's -slope * |i + seqlen_k - seqlen_q - j| is added, as
FlashAttention-2's reference orders them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

from ..errors import SpecError, UnsupportedError
from ..spec import Spec
from ..spec_load import spec_from_mapping

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8_e4m3"}
# ALiBi slopes: one per query head, or one per (batch entry, query head).
ALIBI_SHAPES = {"heads": ["heads_q"], "batch_heads": ["batch", "heads_q"]}
_ALIBI_INDEX = {"heads": "slopes[h]", "batch_heads": "slopes[b, h]"}
_ALIBI_DISTANCE = "abs(q_idx + seqlen_k - seqlen_q - kv_idx)"
_SOFTCAP = "softcap * tanh(score / softcap)"
# Which argument of the public functions a spec field comes from (for errors).
_ARGUMENT_OF_FIELD = {"dtype": "q.dtype", "head_dim": "the head dims (q/k .shape[-1], v.shape[-1])",
                      "mask": "causal / window_size", "score_mod": "softcap / alibi_slopes",
                      "sink": "learnable_sink", "softmax_scale": "softmax_scale"}


@dataclass(frozen=True)
class FlashConfig:
    """What a FlashAttention-style call compiles: one per distinct kernel."""

    dtype: str                       # "fp16" | "bf16" | "fp8_e4m3" (output bf16, FlashAttention-3's)
    head_dim_qk: int
    head_dim_v: int
    causal: bool
    window: tuple[int, int]          # (left, right), -1 unbounded; causal already folded into right = 0
    softmax_scale: float | None      # None: 1/sqrt(head_dim_qk)
    softcap: bool = False
    alibi: str | None = None         # None | "heads" | "batch_heads"
    sink: bool = False

    @property
    def name(self) -> str:
        """Readable and unique per config: `fa_bf16_d128_causal_softcap`, `fa_fp16_d64_win255_0_alibi`."""
        dims = f"d{self.head_dim_qk}" if self.head_dim_qk == self.head_dim_v else \
            f"qk{self.head_dim_qk}_v{self.head_dim_v}"
        parts = ["fa", self.dtype, dims, self._mask_name()]
        if self.softmax_scale is not None:
            parts.append("scale" + _number_name(self.softmax_scale))
        alibi = {None: None, "heads": "alibi", "batch_heads": "alibi_bh"}[self.alibi]
        parts += [flag for flag in ("softcap" if self.softcap else None, alibi, "sink" if self.sink else None) if flag]
        return "_".join(parts)

    def _mask_name(self) -> str:
        left, right = self.window
        if left < 0 and right < 0:
            return "full"
        if left < 0 and right == 0:
            return "causal"
        return f"win{left}_{right}"


def _number_name(value: float) -> str:
    """A float as name characters: 0.125 -> 0p125, 1e-05 -> 1em05."""
    text = repr(float(value)).replace(".", "p").replace("-", "m").replace("+", "")
    return re.sub(r"[^a-z0-9_]", "_", text.lower())


def fold_window(causal: bool, window_size) -> tuple[int, int]:
    """window_size checked and folded with causal as FlashAttention does: causal sets right = 0."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2 and
            all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise UnsupportedError(f"window_size={window_size!r}", [
            "expected a pair of ints (left, right), each >= 0 or -1 for unbounded"])
    # guard_scalar: under torch.compile a window that changed between calls (symbolic) is made a
    # constant again (guarded): it is compiled into the spec.
    left, right = (int(guard_scalar(w)) for w in window_size)
    if left < -1 or right < -1:
        raise UnsupportedError(f"window_size={window_size!r}", ["each side must be >= 0, or -1 for unbounded"])
    if causal:
        right = 0
    if (left < 0) != (right < 0) and not (left < 0 and right == 0):
        raise UnsupportedError(f"window_size={(left, right)} (causal={causal})", [
            "a window bounded on one side only (other than causal) has no fa_gen mask yet; "
            "bound both sides, or neither"])
    return left, right


def _mask(config: FlashConfig):
    left, right = config.window
    if left < 0 and right < 0:
        return "none"
    if left < 0:
        return "causal"
    return {"kind": "sliding_window", "left": left, "right": right}


def spec_mapping(config: FlashConfig) -> dict:
    """The spec's fields, as a YAML spec would hold them."""
    fields = {"name": config.name, "dtype": config.dtype,
              "head_dim": config.head_dim_qk if config.head_dim_qk == config.head_dim_v else
              {"qk": config.head_dim_qk, "v": config.head_dim_v},
              "mask": _mask(config)}
    if config.softmax_scale is not None:
        fields["softmax_scale"] = float(config.softmax_scale)
    inputs = {}
    if config.softcap or config.alibi:
        score = _SOFTCAP if config.softcap else "score"
        if config.alibi:
            score = f"{score} - {_ALIBI_INDEX[config.alibi]} * {_ALIBI_DISTANCE}"
            inputs["slopes"] = {"shape": ALIBI_SHAPES[config.alibi], "dtype": "float32"}
        if config.softcap:
            inputs["softcap"] = {"scalar": "float"}
        fields["score_mod"] = {"expr": score}
    if config.sink:
        fields["sink"] = {"expr": "sinks[h]"}
        inputs["sinks"] = {"shape": ["heads_q"], "dtype": "float32"}
    if inputs:
        fields["inputs"] = inputs
    return fields


@functools.cache
def flash_spec(config: FlashConfig) -> Spec:
    """The validated Spec of `config`, built once per process; what no family can serve is an
    UnsupportedError naming the argument it comes from."""
    try:
        return spec_from_mapping(spec_mapping(config), path=f"<{config.name}>")
    except SpecError as e:
        argument = _ARGUMENT_OF_FIELD.get((e.field or "").split(".")[0].split("[")[0], e.field or "the call")
        raise UnsupportedError(f"{argument} ({config.name})", [e.reason]) from None


@torch.compiler.assume_constant_result
def flash_spec_key(dtype: str, head_dim_qk: int, head_dim_v: int, causal: bool, left: int, right: int,
                   softmax_scale: float | None, softcap: bool, alibi: str | None, sink: bool) -> str:
    """The custom ops' key (canonical JSON) of the config's Spec, registered; torch.compile calls
    it once while tracing and keeps the string as a constant (no Spec is built inside a graph)."""
    from ..autograd import register_spec

    config = FlashConfig(dtype, head_dim_qk, head_dim_v, causal, (left, right), softmax_scale, softcap, alibi, sink)
    return register_spec(flash_spec(config))
