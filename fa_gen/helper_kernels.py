"""Kernels outside the spec families (the split-KV combine, the KV-cache append): rendered from
their own templates, compiled with the CuTe DSL backend, cached like every kernel."""

from __future__ import annotations

from .backends import get_backend
from .cache import CacheKey, default_cache


def load_helper_kernel(source: str, uri: str, kind: str, arch: str):
    """The compiled `source` on `arch` (its cache entry named `uri`), loaded or built."""
    backend = get_backend("cute_dsl")
    key = CacheKey.for_source(uri=uri, arch=arch, kind=kind, source=source,
                              fields={"backend": "cute_dsl", "options": backend.compile_options(arch)})
    return default_cache().get_or_build(
        key, source, build=lambda text, path: backend.compile_to_object(text, arch, path, label=kind),
        load=backend.load_object)
