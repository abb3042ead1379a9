"""The whitelist: which names each kind of expression may read, and which functions exist.

Three roles share one grammar:
  mask       a condition on (b, h, q_idx, kv_idx): key kv_idx is visible to query q_idx.
             Integer-only, so every device decides it exactly as the reference does.
  score_mod  a float: the new logit of one (query, key) pair, given `score`
             (= softmax_scale * q.k, natural-log domain).
  sink       a float per query row: an extra logit in the softmax denominator that takes
             probability mass and gives no value (gpt-oss's learnable sinks).
"""

from __future__ import annotations

import keyword
import math
from enum import Enum

from .tree import Type


class Role(str, Enum):
    MASK = "mask"
    SCORE_MOD = "score_mod"
    SINK = "sink"


# Indices of one score element; b and h are the batch entry and the query head.
INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
# Problem sizes, known per call.
SIZE_NAMES = ("seqlen_q", "seqlen_k", "heads_q")
SCORE = "score"

# Shape symbols an input tensor's dimensions may use, and the one index each must be read with:
# a dimension of size seqlen_q is only ever indexed by q_idx, so the read is in bounds by construction.
SHAPE_SYMBOLS = {"batch": "b", "heads_q": "h", "seqlen_q": "q_idx", "seqlen_k": "kv_idx"}

# What any call may pass for a built-in name, before anything is known about the call.
STATIC_BOUNDS = {
    "b": (0, math.inf), "h": (0, math.inf), "q_idx": (0, math.inf), "kv_idx": (0, math.inf),
    "seqlen_q": (1, math.inf), "seqlen_k": (1, math.inf), "heads_q": (1, math.inf),
    "score": (-math.inf, math.inf),
}

# name -> (min args, max args or None for any number)
FUNCTIONS = {
    "where": (3, 3),
    "abs": (1, 1),
    "min": (2, None),
    "max": (2, None),
    "tanh": (1, 1),
    "exp": (1, 1),
    "exp2": (1, 1),
    "log": (1, 1),
    "sqrt": (1, 1),
}
TRANSCENDENTAL = ("tanh", "exp", "exp2", "log", "sqrt")

# The largest integer exponent `x ** n` accepts (it becomes n - 1 multiplications).
MAX_INT_EXPONENT = 8
# Size limits of one expression (parse.py checks them before any pass walks the tree, every one of
# which recurses over it): syntax-tree nodes in all, and nesting depth (operators, calls and
# parentheses inside one another). Far above any attention variant; far below Python's recursion limit.
MAX_EXPR_NODES = 2000
MAX_EXPR_DEPTH = 64
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
# The largest finite float32: float constants past it would be inf in a kernel.
FLOAT32_MAX = 3.4028234663852886e38


def builtin_names(role: Role) -> tuple[str, ...]:
    """Built-in names an expression of `role` may read, in the order messages list them."""
    if role is Role.MASK:
        return (*INDEX_NAMES, *SIZE_NAMES)
    if role is Role.SCORE_MOD:
        return (SCORE, *INDEX_NAMES, *SIZE_NAMES)
    return ("b", "h", "q_idx", *SIZE_NAMES)


def builtin_type(name: str) -> Type:
    return Type.FLOAT if name == SCORE else Type.INT


def why_builtin_unavailable(name: str, role: Role) -> str | None:
    """Why a name that exists in some role cannot be read in `role` (None: it can, or never exists)."""
    if name in builtin_names(role) or name not in (SCORE, *INDEX_NAMES, *SIZE_NAMES):
        return None
    if name == SCORE:
        return "'score' is only defined in score_mod (a mask decides visibility from indices alone)"
    return f"'{name}' is not defined in a sink expression (the sink logit is one per query row)"


def reserved_names() -> frozenset[str]:
    """Names an input may not take: built-ins, functions, shape symbols and Python keywords."""
    return frozenset((SCORE, *INDEX_NAMES, *SIZE_NAMES, *FUNCTIONS, *SHAPE_SYMBOLS, *keyword.kwlist))
