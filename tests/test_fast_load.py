"""L0 (CPU): the warm-start path (issue 19). By default (FA_GEN_FAST_LOAD unset or 1) a cached object loads as a
shared library through TVM-FFI, without importing the CuTe DSL; anything that goes wrong there
falls back to the DSL's loader. Templates compile once into the cache's Jinja bytecode cache."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from fa_gen.backends import cute_dsl
from fa_gen.render import render_target
from fa_gen.runtime import resolve_spec
from fa_gen.target import resolve_target

pytest.importorskip("tvm_ffi")


@pytest.fixture(scope="module")
def object_path(tmp_path_factory) -> Path:
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_80")
    target = resolve_target(resolve_spec("causal_fp16_d64"), "sm_80", "forward")
    path = tmp_path_factory.mktemp("fast_load") / "object.o"
    cute_dsl.compile_to_object(render_target(target).text, "sm_80", path, label="fast_load")
    return path


def test_fast_load_links_once_and_loads_without_the_dsl(object_path, monkeypatch):
    if cute_dsl.shutil.which("cc") is None:
        pytest.skip("no C compiler to link with")
    monkeypatch.setenv("FA_GEN_FAST_LOAD", "1")
    function = cute_dsl.load_object(object_path)
    library = cute_dsl.shared_library_path(object_path)
    assert library.exists() and type(function).__name__ == "Function"
    # A fresh process: the library loads through TVM-FFI and the DSL is never imported.
    code = ("import sys; from pathlib import Path; from fa_gen.backends.cute_dsl import load_object; "
            f"f = load_object(Path({str(object_path)!r})); "
            "print(type(f).__name__, any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "FA_GEN_FAST_LOAD": "1"})
    assert out.stdout.split()[-2:] == ["Function", "False"]


def test_fast_load_is_the_default_and_zero_turns_it_off(monkeypatch):
    from fa_gen import env

    monkeypatch.delenv("FA_GEN_FAST_LOAD", raising=False)
    assert env.fast_load()
    monkeypatch.setenv("FA_GEN_FAST_LOAD", "0")
    assert not env.fast_load()


def test_library_is_named_by_the_object_bytes(object_path, tmp_path):
    other = tmp_path / "object.o"
    other.write_bytes(object_path.read_bytes() + b"\0")
    assert cute_dsl.shared_library_path(other) != cute_dsl.shared_library_path(object_path)
    assert cute_dsl.shared_library_path(other).parent == tmp_path


def test_a_broken_library_or_no_compiler_falls_back_to_the_dsl(object_path, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FA_GEN_FAST_LOAD", "1")
    copy = tmp_path / "object.o"
    copy.write_bytes(object_path.read_bytes())
    cute_dsl.shared_library_path(copy).write_bytes(b"not an ELF file")
    with caplog.at_level(logging.WARNING):
        assert cute_dsl.load_shared(copy) is None
        function = cute_dsl.load_object(copy)
    assert type(function).__name__ == "Function" and "did not load through TVM-FFI" in caplog.text
    # No compiler: no library is made, the DSL loads the object.
    fresh = tmp_path / "fresh" / "object.o"
    fresh.parent.mkdir()
    fresh.write_bytes(object_path.read_bytes())
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cute_dsl.load_shared(fresh) is None and not cute_dsl.shared_library_path(fresh).exists()
    assert type(cute_dsl.load_object(fresh)).__name__ == "Function"


def test_templates_compile_into_the_cache_bytecode_directory(tmp_path, monkeypatch):
    from fa_gen import render

    monkeypatch.setenv("FA_GEN_CACHE_DIR", str(tmp_path))
    assert Path(render._bytecode_cache().directory) == tmp_path / "jinja"
    monkeypatch.setenv("FA_GEN_DISABLE_CACHE", "1")
    assert render._bytecode_cache() is None
