"""Render-time policy for a spec's expressions in the CuTe DSL forward templates.

What the kernel needs beyond its fixed arguments, in one place:
  * the extra kernel arguments: every declared input, in the spec's order, after `lse`
    (a tensor as a cute.Tensor, a scalar as Int32/Float32); the runtime passes the
    values bound by `fa_gen.variant.bind.bind_inputs` in the same order;
  * the emitted score-mod and mask code (`emit_cute`), hoisted by loop level: per tile
    (b, h, sizes, inputs), per row (q_idx), per element (kv_idx, score);
  * score-mod transcendentals (tanh, exp, ...) in their fast hardware forms (MUFU, about 2^-11
    relative error, under the bf16/fp16 rounding of P that follows): they run once per score;
  * reads along seqlen_q / seqlen_k clamped to the last row / key: the kernel evaluates
    expressions on the tile tails too (rows past seqlen_q, keys past seqlen_k), whose
    results are discarded, but whose reads must stay inside the tensor.

Under a mask expression the kernel takes per-call scheduling arguments after the inputs
(`schedule`): the forward, the key tiles of every query tile, the order query tiles are handed
out in and whether their lengths are uneven (fa_gen.plan); the backward, the query tiles of
every key tile (fa_gen.backward_plan).

The backward (`backward_expression_context`) emits the same mask, and for a score mod either
its value alone, where its derivative with respect to the score is a constant (ALiBi, biases:
dS is scaled by that constant, or by nothing when it is 1), or its value and derivative
together, sharing their subexpressions (fa_gen.variant.shared), where the derivative varies.
"""

from __future__ import annotations

from ..spec import Spec
from ..variant.derivative import score_derivative
from ..variant.emit_cute import emit_cute
from ..variant.inputs import InputDecl
from ..variant.shared import emit_cute_shared
from ..variant.tree import Const

_ELEMENT_TYPES = {"int32": "cutlass.Int32", "float32": "cutlass.Float32", "float16": "cutlass.Float16",
                  "bfloat16": "cutlass.BFloat16"}
_SCALAR_TYPES = {"int": "Int32", "float": "Float32"}
# Template variable of each name an expression may read (inside the kernel's `step`).
_INDEX_NAMES = {"b": "ops.batch", "h": "ops.head", "q_idx": "q_idx", "kv_idx": "kv_idx",
                "seqlen_q": "ops.seqlen_q", "seqlen_k": "ops.seqlen_k", "heads_q": "ops.heads_q",
                "score": "score"}
# The backward walks every query head of a K/V head's group: the query head is a loop variable.
_BACKWARD_INDEX_NAMES = dict(_INDEX_NAMES, h="head")
_CLAMPED_DIMS = {"seqlen_q": "ops.seqlen_q", "seqlen_k": "ops.seqlen_k"}
# Loop levels of a score tile's expressions: per row (q_idx), per element (kv_idx, score).
_SCORE_LEVELS = [{"q_idx"}, {"kv_idx", "score"}]
_MASK_LEVELS = [{"q_idx"}, {"kv_idx"}]

# Kernel arguments after the inputs under a mask expression: (name, comment, compile-time fake).
_LISTS_FAKE = ("make_fake_compact_tensor(Int32, tuple(cute.sym_int() for _ in range(4)), stride_order=(3, 2, 1, 0), "
               "assumed_align=4)")
_FORWARD_SCHEDULE = (
    {"name": "mTileList", "annotation": "cute.Tensor", "fake": _LISTS_FAKE,
     "comment": "(batch or 1, heads_q or 1, query tiles, 2 + key tiles + 2): the key tiles each query tile visits."},
    {"name": "mTileOrder", "annotation": "cute.Tensor",
     "fake": "make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)",
     "comment": "(batch * heads_q * query tiles,): the order the query tiles are handed out in."},
    {"name": "uneven_rows", "annotation": "Int32", "fake": "Int32(0)",
     "comment": "1 when the query tiles' key-tile counts spread widely (fa_gen.plan.uneven_rows)."},
)
_BACKWARD_SCHEDULE = (
    {"name": "mTileList", "annotation": "cute.Tensor", "fake": _LISTS_FAKE,
     "comment": "(batch or 1, heads_kv or 1, key tiles, 1 + 2 * width): the query tiles each key tile visits."},
)


def argument_name(decl: InputDecl) -> str:
    return f"x_{decl.name}"


def expression_context(spec: Spec) -> dict | None:
    """Template context for the spec's expressions; None when it has none."""
    if not spec.uses_expressions:
        return None
    names, read = _names_and_read(spec, _INDEX_NAMES)
    context = {"inputs": [_argument(d) for d in spec.inputs], "score_mod": None, "mask": None, "sink": None,
               "schedule": _FORWARD_SCHEDULE}
    if spec.score_mod_tree is not None:
        context["score_mod"] = emit_cute(spec.score_mod_tree, names, inputs=spec.inputs, read=read,
                                         levels=_SCORE_LEVELS, temp_prefix="sm_", fastmath=True)
    if spec.mask_tree is not None:
        context["mask"] = emit_cute(spec.mask_tree, names, inputs=spec.inputs, read=read,
                                    levels=_MASK_LEVELS, temp_prefix="mk_")
    if spec.sink_tree is not None:
        # Once per row, in the epilogue: exact transcendentals cost nothing there.
        context["sink"] = emit_cute(spec.sink_tree, names, inputs=spec.inputs, read=read,
                                    levels=[{"q_idx"}], temp_prefix="sk_")
    return context


def backward_expression_context(spec: Spec) -> dict | None:
    """Template context of the backward kernel for the spec's expressions; None when it has none.

    `score_mod`: the mod's value alone, applied in place before the mask as in the forward, when
    its derivative is a constant (`slope`: that constant, or None for 1); `score_grad`: value and
    derivative together (exprs[0], exprs[1]) when the derivative varies. A sink needs no code:
    the forward's LSE holds it, and P = exp(S - LSE) is right as it is.
    """
    if not spec.uses_expressions:
        return None
    names, read = _names_and_read(spec, _BACKWARD_INDEX_NAMES)
    context = {"inputs": [_argument(d) for d in spec.inputs], "score_mod": None, "score_grad": None,
               "slope": None, "mask": None, "schedule": _BACKWARD_SCHEDULE}
    if spec.score_mod_tree is not None:
        slope = score_derivative(spec.score_mod_tree)
        if isinstance(slope, Const):
            context["score_mod"] = emit_cute(spec.score_mod_tree, names, inputs=spec.inputs, read=read,
                                             levels=_SCORE_LEVELS, temp_prefix="sm_", fastmath=True)
            context["slope"] = None if slope.value == 1.0 else f"Float32({slope.value!r})"
        else:
            context["score_grad"] = emit_cute_shared([spec.score_mod_tree, slope], names, inputs=spec.inputs,
                                                     read=read, levels=_SCORE_LEVELS, temp_prefix="sg_",
                                                     fastmath=True)
    if spec.mask_tree is not None:
        context["mask"] = emit_cute(spec.mask_tree, names, inputs=spec.inputs, read=read,
                                    levels=_MASK_LEVELS, temp_prefix="mk_")
    return context


def _names_and_read(spec: Spec, index_names: dict):
    """Template variable of every name the spec's expressions read, and their clamped read."""
    names = dict(index_names, **{d.name: f"ops.{argument_name(d)}" for d in spec.inputs})
    return names, _clamped_read({f"ops.{argument_name(d)}": d for d in spec.inputs})


def _argument(decl: InputDecl) -> dict:
    """One extra kernel argument: its name, annotation, and (tensors) the fake for compiling."""
    if decl.is_scalar:
        kind = _SCALAR_TYPES[decl.dtype]
        return {"name": argument_name(decl), "annotation": kind, "fake": f"{kind}(0)"}
    shape = ", ".join(str(s) for s in decl.shape) + ("," if len(decl.shape) == 1 else "")
    order = ", ".join(str(i) for i in reversed(range(len(decl.shape)))) + ("," if len(decl.shape) == 1 else "")
    elem = _ELEMENT_TYPES[decl.dtype]
    fake = (f"make_fake_compact_tensor({elem}, ({shape}), stride_order=({order}), "
            f"assumed_align={4 if decl.dtype in ('int32', 'float32') else 2})")
    return {"name": argument_name(decl), "annotation": "cute.Tensor", "fake": fake}


def _clamped_read(decls: dict[str, InputDecl]):
    def read(tensor: str, indices: tuple[str, ...]) -> str:
        decl = decls[tensor]
        clamped = [f"cutlass.min({index}, {_CLAMPED_DIMS[size]} - 1)" if size in _CLAMPED_DIMS else index
                   for size, index in zip(decl.shape, indices)]
        return f"{tensor}[{', '.join(clamped)}]"
    return read
