"""Spec loading and validation (L0, CPU).

Valid specs are generated as a meaning (`Variant`), written out as YAML in
varied layouts, loaded, and compared with the Spec that meaning implies.
Invalid specs are one mutation of a valid one; the tiny YAML writer below
records the line each field lands on, so every error is checked for its exact
file, line and field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fa_gen import archs as archs_mod
from fa_gen.errors import SpecError
from fa_gen.families import REGISTRY
from fa_gen.families.sm80 import HEAD_DIMS as SM80_HEAD_DIMS
from fa_gen.paths import specs_dir
from fa_gen.schema import json_schema
from fa_gen.spec import Alignment, DType, MaskKind, Spec
from fa_gen.spec_load import TOP_KEYS, load_spec, parse_yaml, spec_from_yaml_text

REPO = Path(__file__).resolve().parent.parent
SPEC_PATH = "specs/under_test.yaml"
SHIPPED = ("causal_bf16_d128", "full_bf16_d128", "causal_fp16_d64", "full_fp16_d64", "full_bf16_d256",
           "sliding_window_bf16_d128", "causal_topleft_fp16_d96", "causal_bf16_qk192_v128")

# Each example parses a few lines of YAML; no deadline, so a cold import is not a failure.
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- a YAML writer that knows where each field lands ------------------------------------------

@dataclass(frozen=True)
class Raw:
    """A scalar written verbatim: 128.0, "128", yes, .nan."""
    text: str


@dataclass(frozen=True)
class Map:
    items: tuple  # (key, value) pairs; a repeated key makes a duplicate
    flow: bool = False


@dataclass(frozen=True)
class Seq:
    items: tuple
    flow: bool = False


def scalar(value) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    plain = value.replace("_", "").isalnum() and value[0].isalpha() and value.islower()
    return value if plain and value not in ("true", "false", "null") else json.dumps(value)


def inline(value) -> str:
    if isinstance(value, Map):
        return "{" + ", ".join(f"{k}: {inline(v)}" for k, v in value.items) + "}"
    if isinstance(value, Seq):
        return "[" + ", ".join(inline(v) for v in value.items) + "]"
    return scalar(value)


def write_yaml(entries, preamble: int = 0) -> tuple[str, dict[str, int]]:
    """YAML text and the 1-based line of each field ("mask.left", "archs[1]"; "" = the top mapping).

    A field of a flow mapping or list lands on its parent's line; a repeated key maps to its
    last occurrence (the one the loader reports).
    """
    lines = ["# a spec under test", ""][:preamble] + ["# comment"] * max(0, preamble - 2)
    where: dict[str, int] = {}
    for key, value in entries:
        where.setdefault("", len(lines) + 1)
        where[key] = len(lines) + 1
        if isinstance(value, (Map, Seq)) and not value.flow and value.items:
            lines.append(f"{key}:")
            _write_block(lines, where, key, value)
        else:
            lines.append(f"{key}: {inline(value)}")
            _same_line(where, key, value, len(lines))
    return "\n".join(lines) + "\n", where


def _write_block(lines, where, key, value) -> None:
    if isinstance(value, Map):
        for sub, sub_value in value.items:
            where[f"{key}.{sub}"] = len(lines) + 1
            lines.append(f"  {sub}: {inline(sub_value)}")
    else:
        for index, item in enumerate(value.items):
            where[f"{key}[{index}]"] = len(lines) + 1
            lines.append(f"  - {inline(item)}")


def _same_line(where, key, value, line) -> None:
    if isinstance(value, Map):
        for sub, _ in value.items:
            where[f"{key}.{sub}"] = line
    elif isinstance(value, Seq):
        for index in range(len(value.items)):
            where[f"{key}[{index}]"] = line


# --- what a valid spec means, and how it may be written ------------------------------------------

@dataclass(frozen=True)
class Variant:
    name: str
    dtype: str
    head_dims: tuple[int, int]
    mask: str                     # none | causal | sliding_window
    window: tuple[int, int] | None
    alignment: str | None         # None: not written (bottom_right)
    scale: float | None           # None: not written (1/sqrt(head_dim qk))
    archs: tuple[str, ...] | None  # None: not written (every arch that can)
    return_lse: bool | None


def expected_spec(v: Variant) -> Spec:
    """The Spec a variant means, derived here independently of the loader."""
    window = {"none": (None, None), "causal": (None, 0)}.get(v.mask, v.window)
    spec = Spec(name=v.name, dtype=DType(v.dtype), head_dim_qk=v.head_dims[0], head_dim_v=v.head_dims[1],
                mask=MaskKind(v.mask), window_left=window[0], window_right=window[1],
                alignment=Alignment(v.alignment or "bottom_right"),
                softmax_scale=float(v.scale) if v.scale is not None else v.head_dims[0] ** -0.5,
                archs=(), return_lse=v.return_lse if v.return_lse is not None else True)
    listed = v.archs or archs_mod.supported_archs(spec)
    return spec.with_archs(tuple(a for a in archs_mod.ARCHS if a in listed))


# Head dims from the sm80 family's list: a valid spec must be implementable somewhere.
names = st.from_regex(r"[a-z0-9_]{1,24}", fullmatch=True)
scales = st.none() | st.floats(1e-6, 10.0, allow_nan=False) | st.integers(1, 4)


@st.composite
def masks(draw):
    kind = draw(st.sampled_from(["none", "causal", "sliding_window"]))
    window = (draw(st.integers(0, 100_000)), draw(st.integers(0, 100_000))) if kind == "sliding_window" else None
    alignment = None if kind == "none" else draw(st.sampled_from([None, "bottom_right", "top_left"]))
    return kind, window, alignment


@st.composite
def variants(draw):
    kind, window, alignment = draw(masks())
    v = Variant(name=draw(names), dtype=draw(st.sampled_from(["fp16", "bf16"])),
                head_dims=draw(st.sampled_from(SM80_HEAD_DIMS)), mask=kind, window=window,
                alignment=alignment, scale=draw(scales), archs=None,
                return_lse=draw(st.sampled_from([None, True, False])))
    if draw(st.booleans()):
        supported = archs_mod.supported_archs(expected_spec(v))
        v = dataclasses.replace(v, archs=tuple(draw(st.lists(st.sampled_from(supported), min_size=1,
                                                               unique=True))))
    return v


@st.composite
def layouts(draw, v: Variant):
    """One way to write `v`: key order, flow or block style, shorthand or mapping, leading comments."""
    values = {
        "name": v.name,
        "dtype": v.dtype,
        "head_dim": _write_head_dim(draw, v),
        "mask": _write_mask(draw, v),
        "softmax_scale": v.scale,
        "archs": v.archs and Seq(v.archs, flow=draw(st.booleans())),
        "return_lse": v.return_lse,
    }
    entries = [(key, value) for key, value in values.items() if value is not None]  # None: left out
    return draw(st.permutations(entries)), draw(st.integers(0, 4))


def _write_head_dim(draw, v: Variant):
    qk, dv = v.head_dims
    if qk == dv and draw(st.booleans()):
        return qk
    return Map(tuple(draw(st.permutations([("qk", qk), ("v", dv)]))), flow=draw(st.booleans()))


def _write_mask(draw, v: Variant):
    """A shorthand string, a mapping, or (for no mask) nothing at all."""
    if v.alignment is None and v.mask != "sliding_window":
        shorthand = draw(st.sampled_from([None, v.mask] if v.mask == "none" else [v.mask]))
        if draw(st.booleans()):
            return shorthand
    items = [("kind", v.mask)]
    if v.window:
        items += [("left", v.window[0]), ("right", v.window[1])]
    if v.alignment:
        items.append(("alignment", v.alignment))
    return Map((items[0], *draw(st.permutations(items[1:]))), flow=draw(st.booleans()))


@st.composite
def written_variants(draw):
    v = draw(variants())
    entries, preamble = draw(layouts(v))
    return v, entries, preamble


# --- valid specs ---------------------------------------------------------------------------------

@FAST
@given(written_variants())
def test_valid_spec_loads_to_what_it_means(case):
    v, entries, preamble = case
    text, _ = write_yaml(entries, preamble)
    spec = spec_from_yaml_text(text, path=SPEC_PATH)
    assert spec == expected_spec(v), text
    assert spec.source == SPEC_PATH


@FAST
@given(written_variants())
def test_mapping_source_gives_the_same_spec_as_yaml(case):
    _, entries, preamble = case
    text, _ = write_yaml(entries, preamble)
    plain = json.loads(json.dumps(parse_yaml(text)))  # no line information left
    assert load_spec(plain) == spec_from_yaml_text(text)


@FAST
@given(st.data())
def test_identity_ignores_layout_and_source(data):
    v = data.draw(variants())
    first, second = (spec_from_yaml_text(write_yaml(*data.draw(layouts(v)))[0], path=p) for p in ("a.yaml", "b.yaml"))
    assert first.canonical_json() == second.canonical_json()
    assert first.sha256() == second.sha256()
    assert json.loads(first.canonical_json()) == first.to_dict()


@FAST
@given(st.data())
def test_sha256_changes_with_any_identity_field(data):
    v = data.draw(variants())
    field = data.draw(st.sampled_from(["name", "dtype", "head_dims", "mask", "scale", "archs", "return_lse"]))
    changed = _change(data, v, field)
    assume(expected_spec(changed) != expected_spec(v))  # e.g. a scale equal to the default
    before, after = (spec_from_yaml_text(write_yaml(*data.draw(layouts(x)))[0]) for x in (v, changed))
    assert before.sha256() != after.sha256()
    assert before.canonical_json() != after.canonical_json()


def _change(data, v: Variant, field: str) -> Variant:
    other = data.draw(variants())
    if field == "mask":
        return dataclasses.replace(v, mask=other.mask, window=other.window, alignment=other.alignment)
    if field == "archs":
        return dataclasses.replace(v, archs=_other_archs(data, v))
    # Archs drop back to the default: the new value need not be implementable on the old list.
    return dataclasses.replace(v, archs=None, **{field: getattr(other, field)})


def _other_archs(data, v: Variant):
    supported = archs_mod.supported_archs(expected_spec(dataclasses.replace(v, archs=None)))
    return tuple(data.draw(st.lists(st.sampled_from(supported), min_size=1, unique=True)))


# --- invalid specs: one mutation each -------------------------------------------------------------

@dataclass(frozen=True)
class Broken:
    entries: list
    field: str      # the dotted field the error must name
    line_of: str    # the key in write_yaml's map whose line the error must name
    fragment: str   # a piece of the message saying what is wrong or allowed


def M(*items) -> Map:  # noqa: N802 (short, to keep the table below readable)
    return Map(tuple(items))


def S(*items) -> Seq:  # noqa: N802
    return Seq(tuple(items))


ALLOWED_TOP = "allowed: " + ", ".join(TOP_KEYS)

# (key, value written there, field named in the error, where its line is, message fragment)
BAD_VALUES = [
    ("name", Raw("123"), "name", "name", "123 is not allowed; allowed: lowercase letters"),
    ("name", Raw("Causal-Fp16"), "name", "name", "'Causal-Fp16' is not allowed"),
    ("name", Raw("true"), "name", "name", "true is not allowed"),
    ("dtype", Raw("fp32"), "dtype", "dtype", "'fp32' is not allowed; allowed: fp16, bf16"),
    ("dtype", Raw("16"), "dtype", "dtype", "16 is not allowed; allowed: fp16, bf16"),
    ("dtype", Raw("bf61"), "dtype", "dtype", "did you mean 'bf16'?"),
    ("head_dim", Raw("128.0"), "head_dim", "head_dim", "got 128.0 (a float)"),
    ("head_dim", Raw('"128"'), "head_dim", "head_dim", "got '128' (a string)"),
    ("head_dim", Raw("true"), "head_dim", "head_dim", "got true (a boolean)"),
    ("head_dim", Raw("[128]"), "head_dim", "head_dim", "got [128] (a list)"),
    ("head_dim", Raw("300"), "head_dim", "head_dim", "300 is not allowed; allowed: a multiple of 8 from 8 to 256"),
    ("head_dim", Raw("100"), "head_dim", "head_dim", "100 is not allowed"),
    ("head_dim", Raw("0"), "head_dim", "head_dim", "0 is not allowed"),
    ("head_dim", Raw("-64"), "head_dim", "head_dim", "-64 is not allowed"),
    ("head_dim", M(("qk", 64), ("v", Raw("12"))), "head_dim.v", "head_dim.v", "12 is not allowed"),
    ("head_dim", M(("qk", Raw('"64"')), ("v", 64)), "head_dim.qk", "head_dim.qk", "(a string)"),
    ("head_dim", M(("qk", 64)), "head_dim.v", "head_dim", "required key is missing"),
    ("head_dim", M(("qk", 64), ("v", 64), ("vv", 64)), "head_dim.vv", "head_dim.vv", "unknown key 'vv'"),
    ("mask", Raw("causual"), "mask", "mask", "did you mean 'causal'?"),
    ("mask", Raw("5"), "mask", "mask", "got 5 (an integer)"),
    ("mask", Raw("false"), "mask", "mask", "got false (a boolean)"),
    ("mask", Raw("sliding_window"), "mask", "mask", "needs its window"),
    ("mask", M(("kind", "causal"), ("left", 3)), "mask.left", "mask.left", "3 is not allowed for kind causal"),
    ("mask", M(("kind", "none"), ("right", 0)), "mask.right", "mask.right", "not allowed for kind none"),
    ("mask", M(("kind", "sliding_window"), ("right", 0)), "mask.left", "mask", "required for kind sliding_window"),
    ("mask", M(("kind", "sliding_window"), ("left", 8)), "mask.right", "mask", "required for kind sliding_window"),
    ("mask", M(("kind", "sliding_window"), ("left", -1), ("right", 0)), "mask.left", "mask.left",
     "-1 is not allowed; allowed: an integer >= 0"),
    ("mask", M(("kind", "sliding_window"), ("left", Raw("1.5")), ("right", 0)), "mask.left", "mask.left",
     "(a float)"),
    ("mask", M(("kind", "window")), "mask.kind", "mask.kind", "allowed: none, causal, sliding_window"),
    ("mask", M(("kind", "causal"), ("alignment", "top-left")), "mask.alignment", "mask.alignment",
     "did you mean 'top_left'?"),
    ("mask", M(("kind", "none"), ("alignment", "top_left")), "mask.alignment", "mask.alignment",
     "not allowed for kind none"),
    ("mask", M(("alignment", "top_left")), "mask.kind", "mask", "required key is missing"),
    ("mask", M(("kind", "causal"), ("kind", "none")), "mask.kind", "mask.kind", "duplicate key"),
    ("mask", M(("kind", "causal"), ("lfet", 3)), "mask.lfet", "mask.lfet", "did you mean 'left'?"),
    ("softmax_scale", Raw("-0.1"), "softmax_scale", "softmax_scale", "allowed: a finite number > 0"),
    ("softmax_scale", Raw("0"), "softmax_scale", "softmax_scale", "0 is not allowed"),
    ("softmax_scale", Raw(".nan"), "softmax_scale", "softmax_scale", "nan is not allowed"),
    ("softmax_scale", Raw(".inf"), "softmax_scale", "softmax_scale", "inf is not allowed"),
    ("softmax_scale", Raw('"0.1"'), "softmax_scale", "softmax_scale", "(a string)"),
    ("softmax_scale", Raw("true"), "softmax_scale", "softmax_scale", "(a boolean)"),
    ("return_lse", Raw("yes"), "return_lse", "return_lse", "expected true or false, got 'yes'"),
    ("return_lse", Raw("on"), "return_lse", "return_lse", "got 'on'"),
    ("return_lse", Raw("1"), "return_lse", "return_lse", "got 1 (an integer)"),
    ("return_lse", Raw('"true"'), "return_lse", "return_lse", "got 'true' (a string)"),
    ("archs", S("hopper"), "archs[0]", "archs[0]", "unknown arch: 'hopper' is not allowed; allowed: sm_75"),
    ("archs", S("sm_80", "sm90a"), "archs[1]", "archs[1]", "did you mean 'sm_90a'?"),
    ("archs", S("sm_80", "sm_80"), "archs[1]", "archs[1]", "sm_80 is listed twice"),
    ("archs", Raw("[]"), "archs", "archs", "got an empty list"),
    ("archs", Raw("sm_80"), "archs", "archs", "got 'sm_80' (a string)"),
]


def _put(draw, entries, key, value):
    """`entries` with `key` set to `value`: in place if present, else at a drawn position."""
    keys = [k for k, _ in entries]
    if key in keys:
        return [(k, value if k == key else v) for k, v in entries]
    at = draw(st.integers(0, len(entries)))
    return [*entries[:at], (key, value), *entries[at:]]


@st.composite
def unknown_key(draw, entries):
    key = draw(st.sampled_from(["batch_size", "num_heads", "dropout", "flavour", "window", "version"]))
    return Broken(_put(draw, entries, key, 1), key, key, f"unknown key '{key}'")


@st.composite
def typo_key(draw, entries):
    key = draw(st.sampled_from([k for k, _ in entries]))
    typo = draw(_typos(key).filter(lambda t: t not in TOP_KEYS))
    renamed = [(typo if k == key else k, v) for k, v in entries]
    return Broken(renamed, typo, typo, f"unknown key '{typo}' (did you mean '{key}'?); {ALLOWED_TOP}")


def _typos(word: str):
    """One slip of the finger: two letters swapped, one dropped, one doubled."""
    at = st.integers(0, len(word) - 2)
    return st.one_of(
        at.map(lambda i: word[:i] + word[i + 1] + word[i] + word[i + 2:]),
        at.map(lambda i: word[:i] + word[i + 1:]),
        at.map(lambda i: word[:i] + word[i] + word[i:]),
    )


@st.composite
def duplicate_key(draw, entries):
    at = draw(st.integers(0, len(entries) - 1))
    key, value = entries[at]
    later = draw(st.integers(at + 1, len(entries)))
    return Broken([*entries[:later], (key, value), *entries[later:]], key, key, "duplicate key (first at line")


@st.composite
def missing_key(draw, entries):
    key = draw(st.sampled_from(["name", "dtype", "head_dim"]))
    kept = [(k, v) for k, v in entries if k != key]
    return Broken(kept, key, "", f"required key is missing (allowed keys: {', '.join(TOP_KEYS)})")


@st.composite
def unimplementable_arch(draw, entries, spec: Spec):
    """An arch that exists but cannot implement this spec (found at run time, not hard-coded)."""
    cannot = [a for a in archs_mod.ARCHS if archs_mod.why_not(spec, a)]
    assume(cannot)
    arch = draw(st.sampled_from(cannot))
    listed = Seq((*spec.archs[:1], arch), flow=draw(st.booleans()))
    field = f"archs[{len(listed.items) - 1}]"
    reasons = "; ".join(archs_mod.why_not(spec, arch))
    return Broken(_put(draw, entries, "archs", listed), field, field, f"{arch} cannot implement this spec: {reasons}")


@st.composite
def broken_specs(draw):
    v, entries, preamble = draw(written_variants())
    mutation = draw(st.sampled_from([unknown_key, typo_key, duplicate_key, missing_key, "arch"]))
    if mutation == "arch":
        return draw(unimplementable_arch(entries, expected_spec(v))), preamble
    return draw(mutation(entries)), preamble


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broken_specs())
def test_invalid_key_error_names_file_line_and_field(case):
    broken, preamble = case
    check_error(broken, preamble)


# Every bad value is tried (not left to chance), each in a few drawn layouts around it.
@pytest.mark.parametrize("key, value, field, line_of, fragment", BAD_VALUES,
                         ids=[f"{field}={inline(value)}" for _, value, field, _, _ in BAD_VALUES])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=written_variants(), data=st.data())
def test_invalid_value_error_names_file_line_and_field(key, value, field, line_of, fragment, case, data):
    _, entries, preamble = case
    if isinstance(value, (Map, Seq)):
        value = dataclasses.replace(value, flow=data.draw(st.booleans()))
    check_error(Broken(_put(data.draw, entries, key, value), field, line_of, fragment), preamble)


def check_error(broken: Broken, preamble: int) -> None:
    text, where = write_yaml(broken.entries, preamble)
    with pytest.raises(SpecError) as caught:
        spec_from_yaml_text(text, path=SPEC_PATH)
    error = caught.value
    line = where[broken.line_of]
    assert (error.path, error.line, error.field) == (SPEC_PATH, line, broken.field), f"{error}\n{text}"
    assert str(error).startswith(f"{SPEC_PATH}:{line}: {broken.field}: "), str(error)
    assert broken.fragment in str(error), f"{error}\n{text}"


# --- explicit messages ---------------------------------------------------------------------------

def error_message(text: str, path: str = "specs/foo.yaml") -> str:
    with pytest.raises(SpecError) as caught:
        spec_from_yaml_text(text, path=path)
    return str(caught.value)


def test_message_head_dim_out_of_range():
    text = "# a spec\nname: foo\nhead_dim: 300\ndtype: bf16\n"
    assert error_message(text) == "specs/foo.yaml:3: head_dim: 300 is not allowed; allowed: a multiple of 8 from 8 to 256"


def test_message_typo_suggests_the_key():
    text = "name: foo\ndtpye: bf16\nhead_dim: 128\n"
    assert error_message(text) == f"specs/foo.yaml:2: dtpye: unknown key 'dtpye' (did you mean 'dtype'?); {ALLOWED_TOP}"


def test_message_duplicate_key_names_both_lines():
    text = "name: foo\ndtype: bf16\nhead_dim: 128\ndtype: fp16\n"
    assert error_message(text) == "specs/foo.yaml:4: dtype: duplicate key (first at line 2); each key may appear once"


def test_message_unknown_arch_lists_known_ones():
    text = "name: foo\ndtype: bf16\nhead_dim: 128\narchs:\n  - sm_80\n  - sm_99\n"
    known = ", ".join(archs_mod.ARCHS)
    assert error_message(text) == ("specs/foo.yaml:6: archs[1]: unknown arch: 'sm_99' is not allowed "
                                   f"(did you mean 'sm_89'?); allowed: {known}")


def test_message_no_arch_can_implement_points_at_head_dim(monkeypatch):
    # Every legal head dim has a family now (test_every_legal_head_dim_has_a_family); narrow the
    # sm80 and sm90 forwards to 128 so that 136 has none, and the message path runs.
    import fa_gen.families.sm80 as sm80
    import fa_gen.families.sm90 as sm90

    monkeypatch.setattr(sm80, "FORWARD_MAX_HEAD_DIM", 128)
    monkeypatch.setattr(sm90, "MAX_HEAD_DIM", 128)
    head_dim = _head_dim_no_arch_implements()
    message = error_message(f"name: foo\ndtype: bf16\nmask: causal\nhead_dim: {head_dim}\n")
    assert message.startswith(f"specs/foo.yaml:4: head_dim: {head_dim} is not supported on any arch: ")
    served = {arch for family in REGISTRY for arch in family.archs}
    spec = _bf16_spec(head_dim)
    for arch in archs_mod.ARCHS:
        quoted = archs_mod.why_not(spec, arch) if arch in served else [arch]
        assert all(reason in message for reason in quoted), (arch, message)


def test_every_legal_head_dim_has_a_family():
    assert all(archs_mod.supported_archs(_bf16_spec(d)) for d in range(8, 257, 8))


def _bf16_spec(head_dim: int) -> Spec:
    return Spec(name="probe", dtype=DType.BF16, head_dim_qk=head_dim, head_dim_v=head_dim,
                mask=MaskKind.CAUSAL, window_left=None, window_right=0,
                alignment=Alignment.BOTTOM_RIGHT, softmax_scale=1.0, archs=())


def _head_dim_no_arch_implements() -> int:
    for head_dim in range(8, 257, 8):
        if not archs_mod.supported_archs(_bf16_spec(head_dim)):
            return head_dim
    pytest.fail("every legal head dim is implementable somewhere now: pick another impossible spec")


def test_message_yaml_syntax_error_has_line():
    message = error_message("name: foo\ndtype: bf16\nhead_dim: [128\n")
    assert message.startswith("specs/foo.yaml:4: invalid YAML: ")


def test_message_missing_file(tmp_path):
    with pytest.raises(SpecError, match=r"nope\.yaml: cannot read spec"):
        load_spec(tmp_path / "nope.yaml")


def test_message_from_mapping_names_field_without_location():
    with pytest.raises(SpecError) as caught:
        load_spec({"name": "foo", "dtype": "bf16", "head_dim": 128, "mask": {"kind": "causal", "left": 1}})
    assert str(caught.value) == "mask.left: 1 is not allowed for kind causal; only kind sliding_window takes left and right"


def test_yaml_1_2_scalars():
    """Only true/false are booleans, 1e-3 is a float, and words like `no` stay strings."""
    spec = spec_from_yaml_text("name: no\ndtype: bf16\nhead_dim: 0128\nsoftmax_scale: 1e-3\n")
    assert (spec.name, spec.head_dim_qk, spec.softmax_scale) == ("no", 128, 1e-3)
    assert "got 'off' (a string)" in error_message("name: a\ndtype: bf16\nhead_dim: 128\nreturn_lse: off\n")


def test_listed_archs_are_stored_in_registry_order(tmp_path):
    supported = archs_mod.supported_archs(load_spec({"name": "a", "dtype": "bf16", "head_dim": 128}))
    assert len(supported) >= 2, "needs two archs to say anything about order"
    path = tmp_path / "a.yaml"
    path.write_text(f"name: a\ndtype: bf16\nhead_dim: 128\narchs: [{supported[-1]}, {supported[0]}]\n")
    assert load_spec(path).archs == (supported[0], supported[-1])
    assert load_spec(str(path)).source == str(path)


# --- shipped specs and the schema -----------------------------------------------------------------

SHIPPED_PATHS = sorted(specs_dir().glob("*.yaml"))


def test_every_named_spec_is_shipped():
    assert set(SHIPPED) <= {p.stem for p in SHIPPED_PATHS}


@pytest.mark.parametrize("path", SHIPPED_PATHS, ids=[p.stem for p in SHIPPED_PATHS])
def test_shipped_spec_loads_and_fits_the_schema(path):
    spec = load_spec(path)
    assert spec.name == path.stem
    assert spec.archs, "a shipped spec must build somewhere"
    assert path.read_text().startswith("# "), "each shipped spec opens with a one-line comment"
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(json_schema()).validate(parse_yaml(path.read_text()))


def test_schema_is_a_valid_2020_12_schema_over_the_loader_keys():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert tuple(schema["properties"]) == TOP_KEYS


@FAST
@given(written_variants())
def test_schema_accepts_every_valid_spec(case):
    jsonschema = pytest.importorskip("jsonschema")
    _, entries, preamble = case
    jsonschema.Draft202012Validator(json_schema()).validate(parse_yaml(write_yaml(entries, preamble)[0]))


@pytest.mark.parametrize("mapping", [
    {"name": "a", "dtype": "bf16", "head_dim": 128, "mask": {"kind": "causal", "left": 3}},
    {"name": "a", "dtype": "bf16", "head_dim": 128, "mask": {"kind": "sliding_window", "left": 3}},
    {"name": "a", "dtype": "bf16", "head_dim": 128, "mask": {"kind": "none", "alignment": "top_left"}},
    {"name": "a", "dtype": "bf16", "head_dim": 130},
    {"name": "a", "dtype": "bf16", "head_dim": 128, "dtpye": "bf16"},
], ids=["left_on_causal", "window_without_right", "alignment_on_none", "head_dim_130", "typo"])
def test_schema_rejects_what_the_loader_rejects(mapping):
    jsonschema = pytest.importorskip("jsonschema")
    with pytest.raises(SpecError):
        load_spec(mapping)
    assert not jsonschema.Draft202012Validator(json_schema()).is_valid(mapping)


def test_committed_schema_matches_json_schema():
    committed = json.loads((REPO / "docs" / "spec.schema.json").read_text())
    assert committed == json_schema(), "regenerate: python -m fa_gen.schema docs/spec.schema.json"
