"""JSON Schema (draft 2020-12) of the YAML spec, for editors and external tools.

The loader (`spec_load.py`) is the authority: it also checks what a schema
cannot say (that some arch can implement the spec, duplicate keys, YAML 1.2
scalars). The schema is built from the loader's own constants and the spec
enums, so the two cannot drift apart; docs/spec.schema.json is its committed
output, regenerated with `python -m fa_gen.schema docs/spec.schema.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import spec_load
from .archs import ARCHS
from .spec import FP8_OUT_DTYPES, SPEC_VERSION, Alignment, DType, MaskKind
from .variant import language, spec_fields
from .variant.inputs import SCALAR_TYPES, TENSOR_DTYPES


def json_schema() -> dict:
    properties = {
        "name": _name(),
        "dtype": _enum(DType, "Element type of q, k, v (and of the output, except for fp8_e4m3)."),
        "out_dtype": {"enum": [d.value for d in FP8_OUT_DTYPES],
                      "description": "fp8_e4m3 specs only: the output's element type (default bf16)."},
        "head_dim": _head_dim(),
        "mask": _mask(),
        "score_mod": _expression(
            "A float expression: the new logit of each (query, key) pair, given score = softmax_scale * q.k; "
            f"names: {', '.join(language.builtin_names(language.Role.SCORE_MOD))} and the inputs."),
        "sink": _expression(
            "A float expression: one extra logit per query row in the softmax denominator (it takes "
            f"probability mass and gives no value); names: {', '.join(language.builtin_names(language.Role.SINK))} "
            "and the inputs."),
        "inputs": _inputs(),
        "softmax_scale": {
            "type": "number",
            "exclusiveMinimum": 0,
            "description": "Multiplies q.k before the softmax; a finite number > 0. "
                           "Default: 1/sqrt(head_dim qk).",
        },
        "archs": _archs(),
        "return_lse": {
            "type": "boolean",
            "default": True,
            "description": "Also return the log-sum-exp of each query row (needed for backward).",
        },
        "tuning": _tuning(),
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"fa_gen attention spec (version {SPEC_VERSION})",
        "description": "One attention variant, compiled by fa_gen into FlashAttention-class kernels.",
        "type": "object",
        "required": list(spec_load.REQUIRED_KEYS),
        "additionalProperties": False,
        "properties": properties,
        "$defs": {"head_dim_value": _head_dim_value()},
    }


def _tuning() -> dict:
    from .families import REGISTRY

    return {
        "type": "object",
        "description": "Per-family overrides of tile shapes and pipeline depth, e.g. {sm80: {tile_n: 32}}. "
                       "A family refuses values its template cannot use.",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": {
            family.name: {
                "type": "object",
                "additionalProperties": False,
                "minProperties": 1,
                "properties": {p: {"type": "integer", "minimum": 1} for p in family.tuning_params},
            }
            for family in REGISTRY
        },
    }


def write_schema(path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(json_schema(), indent=2) + "\n", encoding="utf-8")


def _enum(enum_cls, description: str) -> dict:
    return {"enum": [member.value for member in enum_cls], "description": description}


def _name() -> dict:
    return {
        "type": "string",
        "pattern": f"^{spec_load.NAME_PATTERN}$",
        "description": "Unique identifier of the variant; it names a directory, so lowercase "
                       "letters, digits and _ only.",
    }


def _head_dim_value() -> dict:
    return {
        "type": "integer",
        "minimum": spec_load.HEAD_DIM_MIN,
        "maximum": spec_load.HEAD_DIM_MAX,
        "multipleOf": spec_load.HEAD_DIM_MULTIPLE,
    }


def _head_dim() -> dict:
    both = {"$ref": "#/$defs/head_dim_value", "description": "Head dimension of q and k, and of v."}
    split = {
        "type": "object",
        "required": list(spec_load.HEAD_DIM_KEYS),
        "additionalProperties": False,
        "properties": {
            "qk": {"$ref": "#/$defs/head_dim_value", "description": "Head dimension of q and k."},
            "v": {"$ref": "#/$defs/head_dim_value", "description": "Head dimension of v and the output."},
        },
    }
    qk, v = spec_load.MLA_HEAD_DIMS
    mla = {
        "type": "object",
        "required": list(spec_load.HEAD_DIM_KEYS),
        "additionalProperties": False,
        "properties": {"qk": {"const": qk}, "v": {"const": v}},
        "description": "Multi-head latent attention (MLA decode): 512 latent + 64 rope columns, v the latent.",
    }
    return {"oneOf": [both, split, mla],
            "description": "One head dimension for q, k and v, or {qk: ..., v: ...} when v differs."}


def _mask() -> dict:
    short = {"enum": [MaskKind.NONE.value, MaskKind.CAUSAL.value],
             "description": "Shorthand for {kind: none} or {kind: causal}."}
    expr = _expression(
        "A condition: key kv_idx is visible to query q_idx; integer arithmetic only. Names: "
        f"{', '.join(language.builtin_names(language.Role.MASK))} and the inputs.")
    return {"oneOf": [short, _mask_mapping(), expr], "default": MaskKind.NONE.value,
            "description": "Which keys each query row may attend to."}


def _expression(description: str) -> dict:
    return {
        "type": "object",
        "required": ["expr"],
        "additionalProperties": False,
        "properties": {"expr": {
            "type": "string",
            "minLength": 1,
            "description": "Python expression syntax over the names; + - * / // % **, comparisons, and/or/not, "
                           f"{', '.join(language.FUNCTIONS)}.",
        }},
        "description": description,
    }


def _inputs() -> dict:
    bounds = {"min": {"type": "number", "description": "Least value (inclusive) any element may hold."},
              "max": {"type": "number", "description": "Greatest value (inclusive) any element may hold."}}
    size = {"oneOf": [{"enum": list(language.SHAPE_SYMBOLS)}, {"type": "integer", "minimum": 1}]}
    tensor = {
        "type": "object",
        "required": ["shape", "dtype"],
        "additionalProperties": False,
        "properties": {
            "shape": {"type": "array", "minItems": 1, "items": size,
                      "description": "Sizes: batch, heads_q, seqlen_q, seqlen_k (read with b, h, q_idx, kv_idx) "
                                     "or fixed integers."},
            "dtype": {"enum": list(TENSOR_DTYPES)},
            **bounds,
        },
    }
    scalar = {
        "type": "object",
        "required": ["scalar"],
        "additionalProperties": False,
        "properties": {"scalar": {"enum": list(SCALAR_TYPES)},
                       "default": {"type": "number", "description": "Used when a call passes no value."},
                       **bounds},
    }
    return {
        "type": "object",
        "minProperties": 1,
        "propertyNames": {"pattern": f"^{spec_fields.INPUT_NAME_PATTERN}$"},
        "additionalProperties": {"oneOf": [tensor, scalar]},
        "description": "Tensors and scalars the expressions read, passed with each call.",
    }


def _mask_mapping() -> dict:
    side = "Keys visible {} of the (aligned) diagonal; an integer >= 0. Only for sliding_window."
    return {
        "type": "object",
        "required": ["kind"],
        "additionalProperties": False,
        "properties": {
            "kind": {"enum": [kind.value for kind in spec_load.MASK_KINDS],
                     "description": "none: every key; causal: keys up to the diagonal; "
                                    "sliding_window: keys within left/right of it."},
            "left": {"type": "integer", "minimum": 0, "description": side.format("left")},
            "right": {"type": "integer", "minimum": 0, "description": side.format("right")},
            "alignment": {
                **_enum(Alignment, "Where the diagonal sits when seqlen_q != seqlen_k: bottom_right "
                                   "(FlashAttention >= 2.1) or top_left (PyTorch is_causal). "
                                   "Not allowed for kind none."),
                "default": Alignment.BOTTOM_RIGHT.value,
            },
        },
        "allOf": [
            {"if": {"properties": {"kind": {"const": MaskKind.SLIDING_WINDOW.value}}},
             "then": {"required": ["left", "right"]},
             "else": {"properties": {"left": False, "right": False}}},
            {"if": {"properties": {"kind": {"const": MaskKind.NONE.value}}},
             "then": {"properties": {"alignment": False}}},
        ],
    }


def _archs() -> dict:
    return {
        "type": "array",
        "items": {"enum": list(ARCHS)},
        "minItems": 1,
        "uniqueItems": True,
        "description": "Targets to build for; each must be able to implement the spec. "
                       "Default: every known arch that can.",
    }


if __name__ == "__main__":
    write_schema(sys.argv[1] if len(sys.argv) > 1 else "docs/spec.schema.json")
