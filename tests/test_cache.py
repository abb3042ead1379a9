"""L0 tests of the kernel cache, the toolchain fingerprint and the env knobs (CPU only).

Cross-process behaviour runs real subprocesses (tests/_cache_worker.py) that
share a cache root through FA_GEN_CACHE_DIR and count their compiles in a
file, so "built exactly once" is observed, not assumed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fa_gen import env, paths, toolchain
from fa_gen.cache import META_NAME, OBJECT_NAME, CacheKey, KernelCache, default_cache
from fa_gen.errors import FaGenError

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_cache_worker.py"
SOURCE = "OBJ: kernel source v1\n"
TOOLCHAIN = "ab" * 32  # a fixed fingerprint hash: these tests are about the cache, not the toolchain


class Builder:
    """build/load pair that counts builds; load rejects objects not starting with OBJ:."""

    def __init__(self):
        self.builds = 0
        self.loads = 0

    def build(self, source: str, object_path: Path) -> None:
        self.builds += 1
        object_path.write_text(source)

    def load(self, object_path: Path) -> str:
        self.loads += 1
        text = object_path.read_text()
        if not text.startswith("OBJ:"):
            raise ValueError("loader rejects this object")
        return text


def make_key(source: str = SOURCE, **overrides) -> CacheKey:
    args = dict(uri="causal_bf16_d128", arch="sm_90a", kind="forward", source=source,
                fields={"spec": '{"head_dim":128}', "options": "--enable-tvm-ffi"},
                toolchain=TOOLCHAIN)
    args.update(overrides)
    return CacheKey.for_source(**args)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in (env.CACHE_DIR, env.DISABLE_CACHE, env.FORCE_RECOMPILE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path / "cache"))


def fill(root: Path, source: str = SOURCE) -> tuple[CacheKey, Path]:
    """A committed entry under `root`, built by a cache that is then thrown away."""
    key = make_key(source)
    cache = KernelCache(root)
    cache.get_or_build(key, source, Builder().build, Builder().load)
    return key, cache.entry_dir(key)


# --- in one process -----------------------------------------------------------------------------

def test_memory_hit_builds_and_loads_once(tmp_path):
    cache, builder, key = KernelCache(tmp_path), Builder(), make_key()
    first = cache.get_or_build(key, SOURCE, builder.build, builder.load)
    second = cache.get_or_build(key, SOURCE, builder.build, builder.load)
    assert first == second == SOURCE
    assert (builder.builds, builder.loads) == (1, 1)
    assert (cache.stats.builds, cache.stats.hits_memory, cache.stats.hits_disk) == (1, 1, 0)


def test_entry_layout_and_meta(tmp_path):
    key, entry = fill(tmp_path)
    assert entry == tmp_path / TOOLCHAIN[:16] / "sm_90a" / f"causal_bf16_d128_{key.digest[:12]}"
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "object.o", "source.py"]
    assert (entry / "source.py").read_text() == SOURCE
    meta = json.loads((entry / META_NAME).read_text())
    assert meta["key"] == key.digest and meta["key_fields"] == key.named_fields()
    assert meta["source_sha256"] == key.source_sha256
    assert {"object_sha256", "compile_seconds", "created", "fa_gen_version"} <= meta.keys()
    assert KernelCache(tmp_path).entries() == [(entry, meta)]


def test_disk_hit_in_new_cache_does_not_build(tmp_path):
    key, entry = fill(tmp_path)
    cache, builder = KernelCache(tmp_path), Builder()
    assert cache.get_or_build(key, SOURCE, builder.build, builder.load) == SOURCE
    assert (builder.builds, cache.stats.hits_disk, cache.stats.last_entry) == (0, 1, entry)


def test_threads_racing_for_one_key_build_once(tmp_path):
    cache, builder, key = KernelCache(tmp_path), Builder(), make_key()

    def slow_build(source, path):
        time.sleep(0.2)  # long enough that every thread arrives while the first builds
        builder.build(source, path)

    threads = [threading.Thread(target=cache.get_or_build, args=(key, SOURCE, slow_build, builder.load))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (builder.builds, builder.loads, cache.stats.hits_memory) == (1, 1, 7)


def test_source_that_does_not_match_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not match"):
        KernelCache(tmp_path).get_or_build(make_key(), "OBJ: other\n", Builder().build, Builder().load)


def test_failed_build_leaves_no_entry_and_is_retried(tmp_path):
    cache, key = KernelCache(tmp_path), make_key()

    def failing_build(source, path):
        path.write_text("half")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.get_or_build(key, SOURCE, failing_build, Builder().load)
    assert not cache.entry_dir(key).exists()
    assert cache.get_or_build(key, SOURCE, Builder().build, Builder().load) == SOURCE


# --- corrupt entries ----------------------------------------------------------------------------

def truncated_object(entry: Path) -> None:
    data = (entry / OBJECT_NAME).read_bytes()
    (entry / OBJECT_NAME).write_bytes(data[: len(data) // 2])


def garbage_meta(entry: Path) -> None:
    (entry / META_NAME).write_text("{not json")


def meta_without_object(entry: Path) -> None:
    (entry / OBJECT_NAME).unlink()


def object_sha_mismatch(entry: Path) -> None:
    # Same length, other bytes: only the sha256 can tell.
    data = (entry / OBJECT_NAME).read_bytes()
    (entry / OBJECT_NAME).write_bytes(data[:-2] + b"X\n")


def meta_of_another_key(entry: Path) -> None:
    meta = json.loads((entry / META_NAME).read_text())
    (entry / META_NAME).write_text(json.dumps(dict(meta, key="0" * 64)))


def loader_raises(entry: Path) -> None:
    # A consistent entry (sha matches) whose object the loader rejects.
    (entry / OBJECT_NAME).write_text("not an object the loader accepts")
    meta = json.loads((entry / META_NAME).read_text())
    meta["object_sha256"] = toolchain.sha256_text((entry / OBJECT_NAME).read_text())
    (entry / META_NAME).write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt", [truncated_object, garbage_meta, meta_without_object,
                                     object_sha_mismatch, meta_of_another_key, loader_raises],
                         ids=lambda corrupt: corrupt.__name__)
def test_corrupt_entry_is_deleted_and_rebuilt(tmp_path, corrupt):
    key, entry = fill(tmp_path)
    corrupt(entry)
    (entry / "stale_marker").write_text("only in the corrupt entry")
    cache, builder = KernelCache(tmp_path), Builder()
    assert cache.get_or_build(key, SOURCE, builder.build, builder.load) == SOURCE
    assert (builder.builds, cache.stats.repaired, cache.stats.hits_disk) == (1, 1, 0)
    assert not (entry / "stale_marker").exists()  # the directory was replaced, not patched
    assert KernelCache(tmp_path).get_or_build(key, SOURCE, Builder().build, Builder().load) == SOURCE


# --- env knobs ----------------------------------------------------------------------------------

def test_force_recompile_rebuilds_once_per_process(tmp_path, monkeypatch):
    key, entry = fill(tmp_path)
    created = json.loads((entry / META_NAME).read_text())["created"]
    monkeypatch.setenv(env.FORCE_RECOMPILE, "1")
    cache, builder = KernelCache(tmp_path), Builder()
    cache.get_or_build(key, SOURCE, builder.build, builder.load)
    cache.get_or_build(key, SOURCE, builder.build, builder.load)
    assert (builder.builds, cache.stats.hits_disk, cache.stats.hits_memory) == (1, 0, 1)
    assert json.loads((entry / META_NAME).read_text())["created"] > created


def test_disable_cache_writes_nothing_under_root(tmp_path, monkeypatch):
    monkeypatch.setenv(env.DISABLE_CACHE, "true")
    root = tmp_path / "root"
    cache, builder, key = KernelCache(root), Builder(), make_key()
    assert cache.get_or_build(key, SOURCE, builder.build, builder.load) == SOURCE
    assert cache.get_or_build(key, SOURCE, builder.build, builder.load) == SOURCE
    assert (builder.builds, cache.stats.hits_memory) == (1, 1)
    assert not root.exists()


def test_default_cache_follows_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path / "elsewhere"))
    assert default_cache() is default_cache()
    assert default_cache().root == tmp_path / "elsewhere"


def test_cache_dir_default_uses_absolute_xdg_only(monkeypatch, tmp_path):
    monkeypatch.delenv(env.CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert env.cache_dir() == tmp_path / "fa_gen"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    assert env.cache_dir() == Path.home() / ".cache" / "fa_gen"


def test_bad_boolean_is_an_error_that_describe_shows(monkeypatch):
    monkeypatch.setenv(env.FORCE_RECOMPILE, "maybe")
    with pytest.raises(FaGenError, match="FA_GEN_FORCE_RECOMPILE='maybe' is not a boolean"):
        env.force_recompile()
    knobs = env.describe()
    assert set(knobs) == {env.CACHE_DIR, env.DISABLE_CACHE, env.FORCE_RECOMPILE, env.ARCH, env.DUMP_DIR, env.FAST_LOAD}
    assert knobs[env.FORCE_RECOMPILE]["value"].startswith("<invalid")


def test_clear_removes_entries_but_not_foreign_files(tmp_path):
    fill(tmp_path)
    (tmp_path / "not_ours").mkdir()
    KernelCache(tmp_path).clear()
    assert [p.name for p in tmp_path.iterdir()] == ["not_ours"]


# --- keys and fingerprint -----------------------------------------------------------------------

KEY_VARIANTS = {
    "spec": dict(fields={"spec": '{"head_dim":64}', "options": "--enable-tvm-ffi"}),
    "source": dict(source="OBJ: kernel source v2\n"),
    "options": dict(fields={"spec": '{"head_dim":128}', "options": "--enable-tvm-ffi -O2"}),
    "toolchain": dict(toolchain="cd" * 32),
    "arch": dict(arch="sm_100a"),
    "kind": dict(kind="backward"),
}


def test_key_is_deterministic_and_ignores_field_order():
    reordered = make_key(fields={"options": "--enable-tvm-ffi", "spec": '{"head_dim":128}'})
    assert make_key().digest == reordered.digest
    assert len(make_key().digest) == 64


@pytest.mark.parametrize("field", sorted(KEY_VARIANTS))
def test_key_changes_when_a_field_changes(field):
    variant = KEY_VARIANTS[field]
    assert make_key(**variant).digest != make_key().digest


def test_key_rejects_values_without_one_json_spelling():
    with pytest.raises(TypeError):
        make_key(fields={"spec": object()})


@pytest.fixture
def templates_copy(tmp_path, monkeypatch):
    copy = tmp_path / "templates"
    shutil.copytree(paths.templates_dir(), copy)
    monkeypatch.setattr(paths, "templates_dir", lambda: copy)
    toolchain.clear_fingerprint_cache()
    yield copy
    toolchain.clear_fingerprint_cache()  # drop the hash of the temporary copy


def test_fingerprint_changes_when_a_template_changes(templates_copy):
    # Our own file in the copy, so the test does not depend on which templates exist yet.
    template = templates_copy / "common" / "probe.j2"
    template.parent.mkdir(exist_ok=True)
    template.write_text("{{ spec.name }}\n")
    before = toolchain.fingerprint_hash()
    template.write_text("{{ spec.name }} edited\n")
    assert toolchain.fingerprint_hash() == before  # cached for the process, by design
    toolchain.clear_fingerprint_cache()
    assert toolchain.fingerprint_hash() != before


def test_fingerprint_names_the_toolchain():
    fingerprint = toolchain.fingerprint()
    assert fingerprint["fa_gen"] and len(fingerprint["sources_sha256"]) == 64
    assert fingerprint["distributions"]["nvidia-cutlass-dsl"] == "4.8.1"
    assert {"apache-tvm-ffi", "cuda-python", "cuda-bindings"} <= fingerprint["distributions"].keys()
    assert fingerprint["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert fingerprint["dsl_cuda"] in ("cu12", "cu13")
    assert toolchain.fingerprint_hash() == toolchain.sha256_text(toolchain.canonical_json(fingerprint))


# --- across processes ---------------------------------------------------------------------------

def start_worker(cache_root: Path, count_file: Path, *args: str, toolchain_hash: str = TOOLCHAIN,
                 **env_extra: str) -> subprocess.Popen:
    worker_env = dict(os.environ, FA_GEN_CACHE_DIR=str(cache_root), PYTHONPATH=str(REPO), **env_extra)
    command = [sys.executable, str(WORKER), "--count-file", str(count_file),
               "--toolchain", toolchain_hash]
    return subprocess.Popen([*command, *args],
                            env=worker_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, timeout: float = 60) -> dict:
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr
    return json.loads(stdout)


def build_count(count_file: Path) -> int:
    return len(count_file.read_text().splitlines()) if count_file.exists() else 0


def test_second_process_loads_from_disk_without_building(tmp_path):
    root, count = tmp_path / "shared", tmp_path / "builds.txt"
    first = finish(start_worker(root, count))
    second = finish(start_worker(root, count))
    assert (first["builds"], second["builds"], second["hits_disk"]) == (1, 0, 1)
    assert first["value"] == second["value"] and first["entry"] == second["entry"]
    assert build_count(count) == 1


def test_two_processes_racing_for_one_key_build_once(tmp_path):
    root, count, go = tmp_path / "shared", tmp_path / "builds.txt", tmp_path / "go"
    racers = [start_worker(root, count, "--start-file", str(go), "--build-seconds", "0.5")
              for _ in range(2)]
    while len(list(tmp_path.glob("go.ready.*"))) < len(racers):  # both wait at the barrier
        assert all(racer.poll() is None for racer in racers), finish(racers[0])
        time.sleep(0.01)
    go.touch()
    results = [finish(racer) for racer in racers]
    assert build_count(count) == 1
    assert sorted((r["builds"], r["hits_disk"]) for r in results) == [(0, 1), (1, 0)]


def test_real_cute_kernel_compiles_once_and_loads_in_another_process(tmp_path):
    root, count = tmp_path / "shared", tmp_path / "builds.txt"
    args = ("--kind", "cute")
    real = dict(toolchain_hash=toolchain.fingerprint_hash(), CUTE_DSL_ARCH="sm_80")
    started = time.perf_counter()
    cold = finish(start_worker(root, count, *args, **real), timeout=300)
    cold_wall = time.perf_counter() - started
    started = time.perf_counter()
    warm = finish(start_worker(root, count, *args, **real), timeout=300)
    warm_wall = time.perf_counter() - started
    assert (cold["builds"], warm["builds"], warm["hits_disk"], build_count(count)) == (1, 0, 1, 1)
    assert cold["is_tvm_ffi_function"] and warm["is_tvm_ffi_function"]
    assert (Path(warm["entry"]) / OBJECT_NAME).stat().st_size > 0
    print(f"\ncute toy kernel: cold compile {cold['build_seconds']:.3f} s "
          f"(+ load {cold['load_seconds']:.3f} s, process {cold_wall:.2f} s); "
          f"warm load {warm['load_seconds']:.3f} s (process {warm_wall:.2f} s)")


# --- the by-target index: a warm process loads without rendering ---------------------------------

TARGET_KEY = "cd" * 32


def test_index_maps_a_target_to_its_entry_for_a_new_process(tmp_path):
    key, entry = fill(tmp_path)
    KernelCache(tmp_path).index(TARGET_KEY, key, filename="forward.py")
    record = json.loads(KernelCache(tmp_path).index_path(TOOLCHAIN, "sm_90a", TARGET_KEY).read_text())
    assert record == {"digest": key.digest, "entry": entry.relative_to(tmp_path).as_posix(), "filename": "forward.py"}
    cache, builder = KernelCache(tmp_path), Builder()    # a new process: nothing in memory
    value, found = cache.get_indexed(TOOLCHAIN, "sm_90a", TARGET_KEY, builder.load)
    assert (value, found["filename"], builder.builds, cache.stats.hits_disk) == (SOURCE, "forward.py", 0, 1)
    # Another toolchain (sources or templates changed) or another target: no record.
    assert cache.get_indexed("ef" * 32, "sm_90a", TARGET_KEY, builder.load) is None
    assert cache.get_indexed(TOOLCHAIN, "sm_90a", "00" * 32, builder.load) is None


@pytest.mark.parametrize("damage", ["no entry", "corrupt object", "bad record"])
def test_an_index_record_whose_entry_is_unusable_is_a_miss(tmp_path, damage):
    key, entry = fill(tmp_path)
    cache = KernelCache(tmp_path)
    cache.index(TARGET_KEY, key, filename="forward.py")
    if damage == "no entry":
        shutil.rmtree(entry)
    elif damage == "corrupt object":
        (entry / OBJECT_NAME).write_text("OBJ: something else\n")
    else:
        cache.index_path(TOOLCHAIN, "sm_90a", TARGET_KEY).write_text("{not json")
    assert KernelCache(tmp_path).get_indexed(TOOLCHAIN, "sm_90a", TARGET_KEY, Builder().load) is None


def test_index_is_skipped_with_the_cache_disabled_or_a_forced_recompile(tmp_path, monkeypatch):
    key, _ = fill(tmp_path)
    KernelCache(tmp_path).index(TARGET_KEY, key, filename="forward.py")
    for name in (env.DISABLE_CACHE, env.FORCE_RECOMPILE):
        monkeypatch.setenv(name, "1")
        assert KernelCache(tmp_path).get_indexed(TOOLCHAIN, "sm_90a", TARGET_KEY, Builder().load) is None
        monkeypatch.delenv(name)


def test_a_warm_load_target_neither_renders_nor_imports_jinja(tmp_path):
    """Through the runtime, in fresh processes sharing a cache root: the first compiles (and
    records the target), the second loads the entry without rendering (jinja2 never imported)."""
    code = ("import sys, json; from fa_gen.runtime import load_kernel_function, resolve_spec; "
            "f, info = load_kernel_function(resolve_spec('causal_fp16_d64'), 'sm_80'); "
            "print(json.dumps({'compiled': info.compiled, 'jinja2': 'jinja2' in sys.modules, "
            "'file': info.source_filename, 'entry': str(info.entry_dir)}))")
    environ = {**os.environ, env.CACHE_DIR: str(tmp_path), "CUTE_DSL_ARCH": "sm_80"}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                                      check=True, cwd=REPO).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["compiled"] and runs[0]["jinja2"]
    assert not runs[1]["compiled"] and not runs[1]["jinja2"]
    assert runs[1]["file"] == runs[0]["file"] == "forward.py" and runs[1]["entry"] == runs[0]["entry"]
