"""Backends turn rendered source into a loaded, callable kernel for one arch.

A backend is a module with:
    compile_options(arch) -> str                       part of the cache key
    compile_to_object(source, arch, path, label) -> float   writes the object, returns seconds
    load_object(path) -> callable(q, k, v, out, lse)   launches on PyTorch's current stream
Families name theirs (`Family.backend`); modules are imported on first use.
"""

from __future__ import annotations

import importlib

_BACKENDS = {"cute_dsl": ".cute_dsl", "nvrtc": ".nvrtc"}


def register(name: str, module: str) -> None:
    _BACKENDS[name] = module


def get_backend(name: str):
    try:
        module = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_BACKENDS)}") from None
    return importlib.import_module(module, __name__)
