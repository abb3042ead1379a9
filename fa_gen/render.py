"""Rendering: (spec, arch) -> kernel source text, through one Jinja2 environment.

The environment is strict (an undefined name is an error, never an empty
string) and keeps whitespace predictable so rendered sources diff cleanly.
Everything the templates need is computed here in Python and passed in the
context; templates hold no policy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jinja2

from . import archs as archs_mod
from .errors import UnsupportedError
from .paths import templates_dir
from .spec import Spec
from .version import __version__


@dataclass(frozen=True)
class RenderedSource:
    family: str
    arch: str
    filename: str
    text: str


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(spec: Spec, arch: str, family_name: str | None = None, kind: str = "forward") -> RenderedSource:
    """Render the `kind` kernel of `spec` for `arch` with the family that serves it
    (or with the family named `family_name`)."""
    family = archs_mod.family_for(spec, arch, family_name)
    files = {**family.kernel_files(spec), **family.call_kinds(spec)}
    if kind not in files:
        raise UnsupportedError(f"{kind} kernel of spec {spec.name!r} on {arch}",
                                         [f"family {family.name} renders only {', '.join(files)}"])
    template_name, filename = files[kind]
    context = family.render_context(spec, arch)
    context.update(family.kind_context(spec, arch, kind))
    context.update(spec=spec, arch=arch, family=family.name, kind=kind, fa_gen_version=__version__)
    template = environment().get_template(f"{family.name}/{template_name}")
    return RenderedSource(family.name, arch, filename, template.render(**context))
