"""The attention-variant spec: one frozen object, the single source of truth.

Everything downstream (rendering, compiling, caching, the reference) is a pure
function of a `Spec`, an arch and the toolchain. Loading and validating YAML
lives in `spec_load.py`; this module holds only the data and what derives
from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from enum import Enum

from .variant.inputs import InputDecl
from .variant.language import Role
from .variant.parse import parse_cached
from .variant.tree import Node

SPEC_VERSION = 1


class DType(str, Enum):
    FP16 = "fp16"
    BF16 = "bf16"
    # Q, K and V in float8 e4m3 (torch.float8_e4m3fn) with per-(batch, kv head) descale factors;
    # the output in Spec.out_dtype (fa_gen.api.fp8).
    FP8_E4M3 = "fp8_e4m3"


# The output dtypes an fp8 spec may name (`out_dtype`); 16-bit specs write their own dtype.
FP8_OUT_DTYPES = (DType.BF16, DType.FP16)


class MaskKind(str, Enum):
    NONE = "none"
    CAUSAL = "causal"
    SLIDING_WINDOW = "sliding_window"
    # Written `mask: {expr: "..."}`, never as a kind: the expression (Spec.mask_expr) is the mask.
    EXPR = "expr"


class Alignment(str, Enum):
    """Where the diagonal of a causal or windowed mask sits when seqlen_q != seqlen_k.

    bottom_right: the last query row sees the last key (FlashAttention >= 2.1).
    top_left: query row i sees keys up to i (PyTorch's `is_causal` convention).
    """

    BOTTOM_RIGHT = "bottom_right"
    TOP_LEFT = "top_left"


# Fields added after version 1 shipped: in the canonical JSON only when set, so that
# every spec written without them keeps its identity (and its cache entries).
_SET_ONLY = ("mask_expr", "score_mod_expr", "sink_expr", "inputs", "out_dtype")


# Every Spec made in this process, by its canonical JSON: the custom ops carry that string (an op
# schema holds no Python objects) and find the Spec again here, also while torch.compile traces.
_BY_KEY: dict[str, "Spec"] = {}


def spec_by_key(key: str) -> "Spec | None":
    """The Spec of this process whose canonical JSON is `key`, or None."""
    return _BY_KEY.get(key)


# Multi-head latent attention (DeepSeek MLA decode, fa_gen.mla): q and k hold 512 latent + 64
# rope columns, v the latent 512 of the same cache.
MLA_HEAD_DIMS = (576, 512)

@dataclass(frozen=True)
class Spec:
    """One attention variant. Construct through `spec_load.load_spec` or `Spec.create`.

    window_left / window_right are the mask in its one general form: query row i
    (shifted by the alignment offset) sees keys j with
    i - window_left <= j <= i + window_right; None means unbounded on that side.
    `none` is (None, None), `causal` is (None, 0).

    Expressions (see fa_gen/variant): `mask_expr` replaces the window (mask is EXPR, windows None);
    `score_mod_expr` rewrites each scaled score, `sink_expr` adds a logit to each row's softmax
    denominator; `inputs` declares the tensors and scalars they read. Each is held as canonical
    text and enters the canonical JSON only when set, so specs without them keep their hashes.
    """

    name: str
    dtype: DType
    head_dim_qk: int
    head_dim_v: int
    mask: MaskKind
    window_left: int | None
    window_right: int | None
    alignment: Alignment
    softmax_scale: float
    archs: tuple[str, ...]
    return_lse: bool = True
    # Per-family overrides of tile shapes and pipeline depth, canonically sorted:
    # ((family, ((param, value), ...)), ...). Families validate their own params.
    tuning: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()
    mask_expr: str | None = None
    score_mod_expr: str | None = None
    sink_expr: str | None = None
    inputs: tuple[InputDecl, ...] = ()
    # fp8 specs: the dtype O is written in (bf16 or fp16); None for 16-bit specs (O in `dtype`).
    out_dtype: DType | None = None
    # Where the spec came from: for messages only, never part of identity.
    source: str | None = field(default=None, compare=False, repr=False)
    # The canonical JSON (identity, cache keys, the custom ops' spec_key), made once at
    # construction: a plain field, so torch.compile reads it as a constant string.
    canonical: str = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "canonical", text)
        _BY_KEY.setdefault(text, self)

    def __setstate__(self, state: dict) -> None:
        # Unpickled (a worker process's copy): reachable by its key there too.
        self.__dict__.update(state)
        _BY_KEY.setdefault(self.canonical, self)

    @property
    def is_fp8(self) -> bool:
        return self.dtype is DType.FP8_E4M3

    @property
    def output_dtype(self) -> DType:
        """The dtype of O: `out_dtype` for fp8 specs, else the inputs' dtype."""
        return self.out_dtype or self.dtype

    @property
    def is_masked(self) -> bool:
        return self.window_left is not None or self.window_right is not None or self.mask_expr is not None

    @property
    def uses_expressions(self) -> bool:
        """Whether the spec has a mask, score-mod or sink expression (families opt in to these)."""
        return any(e is not None for e in (self.mask_expr, self.score_mod_expr, self.sink_expr))

    @property
    def mask_tree(self) -> Node | None:
        return self._tree(self.mask_expr, Role.MASK)

    @property
    def score_mod_tree(self) -> Node | None:
        return self._tree(self.score_mod_expr, Role.SCORE_MOD)

    @property
    def sink_tree(self) -> Node | None:
        return self._tree(self.sink_expr, Role.SINK)

    def _tree(self, text: str | None, role: Role) -> Node | None:
        return None if text is None else parse_cached(text, role, self.inputs)

    @property
    def softmax_scale_log2(self) -> float:
        """The scale folded into exp2: exp(s * scale) == exp2(s * scale * log2(e))."""
        return self.softmax_scale * math.log2(math.e)

    def key_offset(self, seqlen_q: int, seqlen_k: int) -> int:
        """Shift added to a query index before comparing it with key indices."""
        return seqlen_k - seqlen_q if self.alignment is Alignment.BOTTOM_RIGHT else 0

    def to_dict(self) -> dict:
        """Canonical, JSON-ready form: named fields only, enums as their values."""
        out = {"spec_version": SPEC_VERSION}
        for f in dataclasses.fields(self):
            if f.name in ("source", "canonical") or f.name in _SET_ONLY and getattr(self, f.name) == f.default:
                continue
            value = getattr(self, f.name)
            if f.name == "inputs":
                value = {decl.name: decl.to_dict() for decl in value}
            elif isinstance(value, Enum):
                value = value.value
            elif f.name == "tuning":
                value = {family: dict(params) for family, params in value}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def canonical_json(self) -> str:
        return self.canonical

    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def tuning_for(self, family: str) -> dict[str, int]:
        """The spec's tuning overrides for one family ({} when none)."""
        return dict(next((params for name, params in self.tuning if name == family), ()))

    def with_archs(self, archs: tuple[str, ...]) -> "Spec":
        return dataclasses.replace(self, archs=tuple(archs))
