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

Under a mask expression the kernel takes one more argument after the inputs: per (batch,
head, query tile) the key tiles [lo, hi) that `fa_gen.variant.tiles.classify_tiles` finds
not NEVER, computed by the runtime per call (memoised for masks that read no tensor).
Every key tile in that range takes the element mask: exact for every mask.
"""

from __future__ import annotations

from ..spec import Spec
from ..variant.emit_cute import emit_cute
from ..variant.inputs import InputDecl

_ELEMENT_TYPES = {"int32": "cutlass.Int32", "float32": "cutlass.Float32", "float16": "cutlass.Float16",
                  "bfloat16": "cutlass.BFloat16"}
_SCALAR_TYPES = {"int": "Int32", "float": "Float32"}
# Template variable of each name an expression may read (inside the kernel's `step`).
_INDEX_NAMES = {"b": "ops.batch", "h": "ops.head", "q_idx": "q_idx", "kv_idx": "kv_idx",
                "seqlen_q": "ops.seqlen_q", "seqlen_k": "ops.seqlen_k", "heads_q": "ops.heads_q",
                "score": "score"}
_CLAMPED_DIMS = {"seqlen_q": "ops.seqlen_q", "seqlen_k": "ops.seqlen_k"}


def argument_name(decl: InputDecl) -> str:
    return f"x_{decl.name}"


def expression_context(spec: Spec) -> dict | None:
    """Template context for the spec's expressions; None when it has none."""
    if not spec.uses_expressions:
        return None
    names = dict(_INDEX_NAMES, **{d.name: f"ops.{argument_name(d)}" for d in spec.inputs})
    read = _clamped_read({f"ops.{argument_name(d)}": d for d in spec.inputs})
    context = {"inputs": [_argument(d) for d in spec.inputs], "score_mod": None, "mask": None, "sink": None}
    if spec.score_mod_tree is not None:
        context["score_mod"] = emit_cute(spec.score_mod_tree, names, inputs=spec.inputs, read=read,
                                         levels=[{"q_idx"}, {"kv_idx", "score"}], temp_prefix="sm_",
                                         fastmath=True)
    if spec.mask_tree is not None:
        context["mask"] = emit_cute(spec.mask_tree, names, inputs=spec.inputs, read=read,
                                    levels=[{"q_idx"}, {"kv_idx"}], temp_prefix="mk_")
    if spec.sink_tree is not None:
        # Once per row, in the epilogue: exact transcendentals cost nothing there.
        context["sink"] = emit_cute(spec.sink_tree, names, inputs=spec.inputs, read=read,
                                    levels=[{"q_idx"}], temp_prefix="sk_")
    return context


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
