"""How spec errors show the values a user wrote: YAML flow style, the type where the type is
wrong, and the allowed values with a close match. Shared by the loader (fa_gen.spec_load) and
the expression fields (fa_gen.variant.spec_fields)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping


def show(value) -> str:
    """A value much as the user wrote it (YAML flow style), short enough for one line."""
    text = flow(value)
    return text if len(text) <= 60 else text[:57] + "..."


def flow(value, nested: bool = False) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        # Quoted at top level so '128' (a string) reads differently from 128; bare inside {} and [].
        return value if nested else repr(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{flow(k, True)}: {flow(v, True)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(flow(item, True) for item in value) + "]"
    return repr(value)


def type_name(value) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a float"),
                       (str, "a string"), (Mapping, "a mapping"), (list, "a list")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def show_typed(value) -> str:
    """`'128' (a string)`: the type is what is wrong, so say it."""
    return "null" if value is None else f"{show(value)} ({type_name(value)})"


def did_you_mean(value, allowed) -> str:
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, list(allowed), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def not_allowed(value, allowed) -> str:
    return f"{show(value)} is not allowed{did_you_mean(value, allowed)}; allowed: {', '.join(allowed)}"


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # bool is an int in Python
