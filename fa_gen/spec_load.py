"""Loading a YAML spec into a validated `Spec`, with errors that point at the file, line and field.

Validation happens here, once: everything downstream trusts a `Spec`. Every
error is a `SpecError` naming the file, the line, the dotted field
(`mask.left`, `archs[1]`), the bad value and what is allowed. Unknown and
duplicate keys are errors, so a typo is never silently ignored.

YAML scalars resolve by the YAML 1.2 core schema, not PyYAML's YAML 1.1 one:
only true/false are booleans (`return_lse: yes` is a string, so an error, and
`mask: off` is not False), `1e-3` is a float, `0128` is 128, and nothing becomes
a date. One spec, one reading, whichever YAML tool a user checks it with.

Expression fields (`inputs`, `mask: {expr}`, `score_mod`, `sink`) are read by
`variant/spec_fields.py`. Until a template family implements expressions, a spec
using them loads only with `check_archs=False` (archs are then taken as listed, or
left empty, without asking the families): enough for the reference and the tests.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Hashable, Mapping
from pathlib import Path

import yaml

from . import archs as archs_mod
from .errors import SpecError
from .spec_text import did_you_mean as _did_you_mean, is_int as _is_int, not_allowed as _not_allowed
from .spec_text import show as _show, show_typed as _show_typed, type_name as _type_name
from .families import REGISTRY
from .spec import FP8_OUT_DTYPES, MLA_HEAD_DIMS, Alignment, DType, MaskKind, Spec
from .variant import spec_fields
from .variant.language import Role

TOP_KEYS = ("name", "dtype", "out_dtype", "head_dim", "mask", "score_mod", "sink", "inputs", "softmax_scale", "archs",
            "return_lse", "tuning")
REQUIRED_KEYS = ("name", "dtype", "head_dim")
HEAD_DIM_KEYS = ("qk", "v")
MASK_KEYS = ("kind", "left", "right", "alignment", "expr")
# Mask kinds written as `kind:` (EXPR is written `mask: {expr: "..."}` instead).
MASK_KINDS = tuple(kind for kind in MaskKind if kind is not MaskKind.EXPR)
NAME_PATTERN = r"[a-z0-9_]+"
HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_MULTIPLE = 8, 256, 8

_HEAD_DIM_ALLOWED = f"a multiple of {HEAD_DIM_MULTIPLE} from {HEAD_DIM_MIN} to {HEAD_DIM_MAX}"
# MLA_HEAD_DIMS (fa_gen.spec): the one pair past HEAD_DIM_MAX, written {qk: 576, v: 512}.


# --- public entry points ---------------------------------------------------------------------

def load_spec(source: str | os.PathLike | Mapping, *, check_archs: bool = True) -> Spec:
    """A validated Spec from a YAML file path or from an already parsed mapping.

    check_archs=False skips asking the families whether they implement the spec: listed
    archs are kept (known names only), omitted archs stay empty. For specs no family serves
    yet (expressions): the reference and the tests can use them, `build` cannot.
    """
    if isinstance(source, Mapping):
        return spec_from_mapping(source, check_archs=check_archs)
    if isinstance(source, (str, os.PathLike)):
        return load_spec_file(source, check_archs=check_archs)
    raise TypeError(f"load_spec takes a path or a mapping, not {type(source).__name__}")


def load_spec_file(path: str | os.PathLike, *, check_archs: bool = True) -> Spec:
    shown = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read spec: {e}", path=shown) from None
    return spec_from_yaml_text(text, path=shown, check_archs=check_archs)


def spec_from_yaml_text(text: str, path: str = "<string>", *, check_archs: bool = True) -> Spec:
    return spec_from_mapping(parse_yaml(text, path), path=path, check_archs=check_archs)


def parse_yaml(text: str, path: str = "<string>"):
    """The YAML document as Python values; mappings and lists remember their lines."""
    try:
        return yaml.load(text, Loader=_LineLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        context = f" ({e.context})" if e.context else ""
        raise SpecError(f"invalid YAML: {e.problem}{context}", path=path,
                        line=mark.line + 1 if mark else None) from None
    except yaml.YAMLError as e:
        raise SpecError(f"invalid YAML: {e}", path=path) from None


def spec_from_mapping(data, path: str | None = None, *, check_archs: bool = True) -> Spec:
    """Validate parsed spec fields (from `parse_yaml` or plain Python) into a Spec."""
    if not isinstance(data, Mapping):
        what = "the spec is empty" if data is None else f"got {_show_typed(data)}"
        raise SpecError(f"{what}; expected a mapping of fields: {', '.join(TOP_KEYS)}", path=path)
    top = _Node(data, path=path)
    top.check_keys(TOP_KEYS, REQUIRED_KEYS)
    # Fields are checked in the order a spec is usually written, so the first error is the topmost.
    name, dtype = _name(top), _enum(top, "dtype", DType)
    out_dtype = _out_dtype(top, dtype)
    head_dim_qk, head_dim_v = _head_dims(top)
    # Inputs before the expressions that read them.
    inputs = spec_fields.read_inputs(top)
    mask, window_left, window_right, alignment, mask_expr = _mask(top, inputs)
    expressions = {
        Role.MASK: mask_expr,
        Role.SCORE_MOD: spec_fields.read_expr_mapping(top, "score_mod", Role.SCORE_MOD, inputs),
        Role.SINK: spec_fields.read_expr_mapping(top, "sink", Role.SINK, inputs),
    }
    spec_fields.check_inputs_used(top, inputs, expressions)
    spec = Spec(
        name=name,
        dtype=dtype,
        out_dtype=out_dtype,
        head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v,
        mask=mask,
        window_left=window_left,
        window_right=window_right,
        alignment=alignment,
        softmax_scale=_softmax_scale(top, head_dim_qk),
        archs=(),
        return_lse=_bool(top, "return_lse", default=True),
        tuning=_tuning(top),
        mask_expr=mask_expr,
        score_mod_expr=expressions[Role.SCORE_MOD],
        sink_expr=expressions[Role.SINK],
        inputs=inputs,
        source=path,
    )
    if check_archs:
        _check_tuning_usable(top, spec)
    return spec.with_archs(_archs(top, spec, check=check_archs))


# --- YAML with lines ---------------------------------------------------------------------------

class _LineDict(dict):
    """A YAML mapping that remembers where it starts, the line of each key and of each value."""

    def __init__(self, start_line: int):
        super().__init__()
        self.start_line = start_line
        self.key_lines: dict = {}
        self.value_lines: dict = {}
        # The YAML node of each value: expression errors map columns through its marks and style.
        self.value_nodes: dict = {}
        # (key, line) of each repeated key: reported by the validator, which knows the dotted field.
        self.duplicates: list = []


class _LineList(list):
    """A YAML sequence that remembers the line of each item."""

    def __init__(self):
        super().__init__()
        self.item_lines: list[int] = []


class _LineLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars and line-recording mappings and sequences."""

    # Replaced, not extended: the YAML 1.1 resolvers (yes/no booleans, sexagesimal ints,
    # timestamps, merge keys) are exactly the surprises a spec must not have.
    yaml_implicit_resolvers: dict = {}


_CORE_SCHEMA = (
    # "" is how PyYAML files the resolvers tried on the empty scalar (a null).
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    ("tag:yaml.org,2002:float",
     r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
     r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", "-+.0123456789"),
)
for _tag, _regexp, _first in _CORE_SCHEMA:
    _LineLoader.add_implicit_resolver(_tag, re.compile(_regexp), list(_first))


def _construct_int(loader, node) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-")
    for prefix, base in (("0o", 8), ("0x", 16)):
        if digits.startswith(prefix):
            return sign * int(digits[2:], base)
    return sign * int(digits, 10)  # decimal even with leading zeros: 0128 is 128, not octal


def _construct_map(loader, node):
    data = _LineDict(start_line=node.start_mark.line + 1)
    yield data
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, Hashable):
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark,
                f"a key must be a plain name, not {_type_name(key)}", key_node.start_mark)
        line = key_node.start_mark.line + 1
        if key in data:
            data.duplicates.append((key, line))
            continue
        data[key] = loader.construct_object(value_node)
        data.key_lines[key] = line
        data.value_lines[key] = value_node.start_mark.line + 1
        data.value_nodes[key] = value_node


def _construct_seq(loader, node):
    data = _LineList()
    yield data
    for item_node in node.value:
        data.append(loader.construct_object(item_node))
        data.item_lines.append(item_node.start_mark.line + 1)


_LineLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_LineLoader.add_constructor("tag:yaml.org,2002:map", _construct_map)
_LineLoader.add_constructor("tag:yaml.org,2002:seq", _construct_seq)


# --- where a value sits, for messages ------------------------------------------------------------

class _Node:
    """A mapping of spec fields with its file, its dotted name and its line, to build errors."""

    def __init__(self, data: Mapping, *, path: str | None, prefix: str = "", line: int | None = None):
        self.data = data
        self.path = path
        self.prefix = prefix  # "" at top level, "mask." for the mask mapping
        self.line = line if line is not None else getattr(data, "start_line", None)

    def field(self, key) -> str:
        return f"{self.prefix}{key}"

    def key_line(self, key) -> int | None:
        """Line of `key`; for a missing key, the line of this mapping (where it should go)."""
        return getattr(self.data, "key_lines", {}).get(key, self.line)

    def error(self, key, message: str, *, line: int | None = None) -> SpecError:
        return SpecError(message, path=self.path, line=line or self.key_line(key), field=self.field(key))

    def child(self, key) -> "_Node":
        return _Node(self.data[key], path=self.path, prefix=f"{self.field(key)}.", line=self.key_line(key))

    def check_keys(self, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
        for key, line in getattr(self.data, "duplicates", ()):
            raise self.error(key, f"duplicate key (first at line {self.key_line(key)}); "
                                  "each key may appear once", line=line)
        for key in self.data:
            if key not in allowed:
                raise self.error(key, f"unknown key {_show(key)}{_did_you_mean(key, allowed)}; "
                                      f"allowed: {', '.join(allowed)}")
        for key in required:
            if key not in self.data:
                raise self.error(key, f"required key is missing (allowed keys: {', '.join(allowed)})")


# --- fields ----------------------------------------------------------------------------------------

def _expect_int(node: _Node, key, what: str) -> int:
    value = node.data[key]
    if not _is_int(value):
        raise node.error(key, f"expected an integer ({what}), got {_show_typed(value)}")
    return value


def _name(top: _Node) -> str:
    value = top.data["name"]
    if not isinstance(value, str) or not re.fullmatch(NAME_PATTERN, value):
        raise top.error("name", f"{_show(value)} is not allowed; allowed: lowercase letters, digits "
                                "and _ (it names a directory), e.g. causal_bf16_d128")
    return value


def _enum(node: _Node, key, enum_cls, members=None):
    value = node.data[key]
    allowed = [member.value for member in (members or enum_cls)]
    if isinstance(value, str) and value in allowed:
        return enum_cls(value)
    raise node.error(key, _not_allowed(value, allowed))


def _out_dtype(top: _Node, dtype: DType) -> DType | None:
    """fp8 specs: the output dtype (bf16 unless `out_dtype` says fp16); 16-bit specs have none."""
    if dtype is not DType.FP8_E4M3:
        if "out_dtype" in top.data:
            raise top.error("out_dtype", f"only fp8 specs name an output dtype; a {dtype.value} spec "
                                         f"writes {dtype.value}")
        return None
    if "out_dtype" not in top.data:
        return DType.BF16
    return _enum(top, "out_dtype", DType, FP8_OUT_DTYPES)


def _bool(node: _Node, key, *, default: bool) -> bool:
    value = node.data.get(key, default)
    if not isinstance(value, bool):
        raise node.error(key, f"expected true or false, got {_show_typed(value)}")
    return value


def _head_dims(top: _Node) -> tuple[int, int]:
    value = top.data["head_dim"]
    if isinstance(value, Mapping):
        node = top.child("head_dim")
        node.check_keys(HEAD_DIM_KEYS, HEAD_DIM_KEYS)
        if (node.data.get("qk"), node.data.get("v")) == MLA_HEAD_DIMS:
            return MLA_HEAD_DIMS
        mla = f", or {{qk: {MLA_HEAD_DIMS[0]}, v: {MLA_HEAD_DIMS[1]}}} (MLA)"
        return (_head_dim_value(node, "qk", also=mla, range_also=mla),
                _head_dim_value(node, "v", also=mla, range_also=mla))
    head_dim = _head_dim_value(top, "head_dim", also=", or a mapping {qk: ..., v: ...}")
    return head_dim, head_dim


def _head_dim_value(node: _Node, key, also: str = "", range_also: str = "") -> int:
    value = _expect_int(node, key, _HEAD_DIM_ALLOWED + also)
    if not (HEAD_DIM_MIN <= value <= HEAD_DIM_MAX and value % HEAD_DIM_MULTIPLE == 0):
        raise node.error(key, f"{value} is not allowed; allowed: {_HEAD_DIM_ALLOWED}{range_also}")
    return value


def _mask(top: _Node, inputs) -> tuple[MaskKind, int | None, int | None, Alignment, str | None]:
    """(kind, window_left, window_right, alignment, expression text or None)."""
    if "mask" not in top.data:
        return MaskKind.NONE, None, None, Alignment.BOTTOM_RIGHT, None
    value = top.data["mask"]
    if isinstance(value, Mapping) and "expr" in value:
        return _mask_expr(top.child("mask"), inputs)
    if isinstance(value, Mapping):
        return (*_mask_mapping(top.child("mask")), None)
    if not isinstance(value, str):
        raise top.error("mask", f"expected none, causal or a mapping {{kind: ..., ...}} or {{expr: ...}}, "
                                f"got {_show_typed(value)}")
    kind = _enum(top, "mask", MaskKind, MASK_KINDS)
    if kind is MaskKind.SLIDING_WINDOW:
        raise top.error("mask", "'sliding_window' needs its window; write "
                                "mask: {kind: sliding_window, left: N, right: N}")
    return (kind, *_fixed_window(kind), Alignment.BOTTOM_RIGHT, None)


def _mask_expr(node: _Node, inputs) -> tuple[MaskKind, None, None, Alignment, str]:
    node.check_keys(MASK_KEYS)
    for key in node.data:
        if key != "expr":
            raise node.error(key, "not allowed with expr: an expression mask states its own window "
                                  "and alignment (e.g. kv_idx <= q_idx + seqlen_k - seqlen_q)")
    text = spec_fields.read_expr(node, Role.MASK, inputs)
    return MaskKind.EXPR, None, None, Alignment.BOTTOM_RIGHT, text


def _fixed_window(kind: MaskKind) -> tuple[int | None, int | None]:
    return (None, 0) if kind is MaskKind.CAUSAL else (None, None)


def _mask_mapping(node: _Node) -> tuple[MaskKind, int | None, int | None, Alignment]:
    node.check_keys(MASK_KEYS, ("kind",))
    kind = _enum(node, "kind", MaskKind, MASK_KINDS)
    if kind is MaskKind.SLIDING_WINDOW:
        left, right = (_window_side(node, side) for side in ("left", "right"))
    else:
        for side in ("left", "right"):
            if side in node.data:
                raise node.error(side, f"{_show(node.data[side])} is not allowed for kind {kind.value}; "
                                       "only kind sliding_window takes left and right")
        left, right = _fixed_window(kind)
    return kind, left, right, _alignment(node, kind)


def _window_side(node: _Node, side: str) -> int:
    what = f"how many keys the window reaches {side} of the diagonal, >= 0"
    if side not in node.data:
        raise node.error(side, f"required for kind sliding_window ({what})")
    value = _expect_int(node, side, what)
    if value < 0:
        raise node.error(side, f"{value} is not allowed; allowed: an integer >= 0 ({what})")
    return value


def _alignment(node: _Node, kind: MaskKind) -> Alignment:
    if "alignment" not in node.data:
        return Alignment.BOTTOM_RIGHT
    if kind is MaskKind.NONE:
        raise node.error("alignment", "not allowed for kind none (there is no diagonal to align)")
    return _enum(node, "alignment", Alignment)


def _softmax_scale(top: _Node, head_dim_qk: int) -> float:
    default = head_dim_qk ** -0.5  # as FlashAttention computes it, so both agree to the last bit
    if "softmax_scale" not in top.data:
        return default
    value = top.data["softmax_scale"]
    allowed = f"a finite number > 0 (omit it for 1/sqrt(head_dim qk) = {default!r})"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise top.error("softmax_scale", f"expected {allowed}, got {_show_typed(value)}")
    if not (math.isfinite(value) and value > 0):
        raise top.error("softmax_scale", f"{_show(value)} is not allowed; allowed: {allowed}")
    return float(value)


# --- archs -------------------------------------------------------------------------------------------

def _archs(top: _Node, spec: Spec, check: bool = True) -> tuple[str, ...]:
    """The listed archs in registry order (one set, one identity), each checked implementable
    (unless `check` is off: then known names only, and no default)."""
    if "archs" not in top.data:
        return _default_archs(top, spec) if check else ()
    value = top.data["archs"]
    if not isinstance(value, (list, tuple)) or not value:
        shown = _show_typed(value) if value else "an empty list"
        raise top.error("archs", f"expected a non-empty list of archs, e.g. [sm_80, sm_90a], got {shown}; "
                                 "omit archs for every arch that can implement the spec")
    for index, arch in enumerate(value):
        _check_listed_arch(top, spec, value, index, arch, check)
    return tuple(arch for arch in archs_mod.ARCHS if arch in value)


def _check_listed_arch(top: _Node, spec: Spec, listed, index: int, arch, check: bool = True) -> None:
    lines = getattr(listed, "item_lines", None)
    line = lines[index] if lines else None
    field = f"archs[{index}]"
    if not isinstance(arch, str) or arch not in archs_mod.ARCHS:
        raise top.error(field, f"unknown arch: {_not_allowed(arch, archs_mod.ARCHS)}", line=line)
    if arch in listed[:index]:
        raise top.error(field, f"{arch} is listed twice", line=line)
    reasons = archs_mod.why_not(spec, arch) if check else []
    if reasons:
        raise top.error(field, f"{arch} cannot implement this spec: {'; '.join(reasons)}", line=line)


def _default_archs(top: _Node, spec: Spec) -> tuple[str, ...]:
    supported = archs_mod.supported_archs(spec)
    if supported:
        return supported
    reasons = _reasons_by_arch(spec)
    field = _blocking_field(spec)
    if field is None or field not in top.data:
        raise SpecError(f"no arch can implement this spec: {reasons}", path=top.path, line=top.line)
    raise top.error(field, f"{_show(top.data[field])} is not supported on any arch: {reasons}")


# What each field is set to when asking "would the spec be implementable without this value?"
_BASELINES = (
    ("head_dim", {"head_dim_qk": 128, "head_dim_v": 128}),
    ("dtype", {"dtype": DType.BF16, "out_dtype": None}),
    ("mask", {"mask": MaskKind.NONE, "window_left": None, "window_right": None,
              "alignment": Alignment.BOTTOM_RIGHT, "mask_expr": None}),
    ("score_mod", {"score_mod_expr": None}),
    ("sink", {"sink_expr": None}),
    ("return_lse", {"return_lse": True}),
    ("tuning", {"tuning": ()}),
)


def _blocking_field(spec: Spec) -> str | None:
    """The first field whose value alone keeps every arch from implementing the spec, if any."""
    for field, baseline in _BASELINES:
        if archs_mod.supported_archs(dataclasses.replace(spec, **baseline)):
            return field
    return None


def _reasons_by_arch(spec: Spec) -> str:
    """why_not for every arch, archs with the same reasons grouped; unserved archs named once."""
    served = {arch for family in REGISTRY for arch in family.archs}
    groups: dict[tuple[str, ...], list[str]] = {}
    for arch in archs_mod.ARCHS:
        if arch in served:
            groups.setdefault(tuple(archs_mod.why_not(spec, arch)), []).append(arch)
    parts = [f"on {', '.join(archs)}, {'; '.join(reasons)}" for reasons, archs in groups.items()]
    unserved = [arch for arch in archs_mod.ARCHS if arch not in served]
    if unserved:
        parts.append(f"no template family serves {', '.join(unserved)} yet")
    return "; ".join(parts)


# --- tuning ----------------------------------------------------------------------------------------

def _tuning(top: _Node) -> tuple:
    """`tuning: {<family>: {<param>: <int>}}`, validated against what each family accepts."""
    if "tuning" not in top.data:
        return ()
    from .families import REGISTRY

    params_of = {family.name: family.tuning_params for family in REGISTRY}
    value = top.data["tuning"]
    if not isinstance(value, Mapping) or not value:
        raise top.error("tuning", f"expected a mapping of family -> parameters, e.g. "
                                  f"{{sm80: {{tile_n: 64}}}}; got {_show_typed(value)}")
    node = top.child("tuning")
    node.check_keys(tuple(params_of))
    return tuple(sorted((family, _tuning_params(node, family, params_of[family])) for family in value))


def _tuning_params(node: _Node, family: str, allowed: tuple[str, ...]) -> tuple:
    value = node.data[family]
    if not isinstance(value, Mapping) or not value:
        raise node.error(family, f"expected a mapping of parameters ({', '.join(allowed)}); "
                                 f"got {_show_typed(value)}")
    params = node.child(family)
    params.check_keys(allowed)
    for key in value:
        if _expect_int(params, key, "a positive integer") <= 0:
            raise params.error(key, f"{value[key]} is not allowed; allowed: a positive integer")
    return tuple(sorted(value.items()))


def _check_tuning_usable(top: _Node, spec: Spec) -> None:
    """Refuse a family's tuning that the family rejects on every arch it could otherwise serve.

    Without this, a bad override would pass silently whenever another family serves the
    same arch: the spec would just fall back to that family.
    """
    from .families import REGISTRY

    untuned = dataclasses.replace(spec, tuning=())
    node = top.child("tuning") if spec.tuning else None
    for family in REGISTRY:
        if not spec.tuning_for(family.name):
            continue
        servable = [arch for arch in family.archs if not family.can_implement(untuned, arch)]
        reasons = {arch: family.can_implement(spec, arch) for arch in servable}
        if servable and all(reasons.values()):
            detail = "; ".join(dict.fromkeys(r for rs in reasons.values() for r in rs))
            raise node.error(family.name, f"{_show(node.data[family.name])} cannot be used on any arch "
                                          f"{family.name} serves ({', '.join(servable)}): {detail}")
