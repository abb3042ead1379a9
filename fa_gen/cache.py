"""The kernel cache: a memory dict in front of a disk directory of compiled objects.

The cache is generic: it stores whatever `build(source, object_path)` writes
and returns whatever `load(object_path)` makes of it. It knows nothing about
CuTe; the backend supplies both functions.

Key. `CacheKey.digest` is the sha256 of the canonical JSON of named fields:
uri, arch, kind, the rendered source's sha256, the toolchain fingerprint hash
and the caller's own fields (spec canonical JSON, compile options). Adding a
field changes every digest, which is what we want: an old entry is never
misread under a new meaning.

Disk layout::

    <root>/<toolchain[:16]>/<arch>/<uri>_<digest[:12]>/   source.py, object.o, meta.json
    <root>/<toolchain[:16]>/<arch>/<uri>_<digest[:12]>.lock
    <root>/<toolchain[:16]>/<arch>/by_target/<target key>.json

A `by_target` record maps what determines a rendered source (spec, family, kind, arch and
compile options; the toolchain fingerprint, which hashes fa_gen's sources and templates, names
the directory) to an entry's digest, so a warm process loads the entry without rendering (no
Jinja). Records are written whole (temp file then `os.replace`) after the entry; a record whose
entry is gone or corrupt is a miss, and the caller renders and takes `get_or_build`.

`meta.json` is the commit marker, written last. It holds the full digest and
key fields, the sha256 of object and source, compile seconds, creation time
and fa_gen version. An entry without a readable `meta.json` whose digest
matches, or whose object is missing or fails its sha256, or whose object the
loader rejects, is corrupt; corrupt entries are misses, deleted and rebuilt.

Concurrency model (threads of one process, and processes sharing a root):

1. Memory. `KernelCache._memory` maps digest -> loaded value. A hit returns at
   once, without any lock.
2. In-process lock. On a memory miss a thread takes the `threading.Lock` of
   that digest, then checks memory again: another thread may have finished
   the same kernel while this one waited. So a process builds or loads each
   key once, also when the disk cache is disabled.
3. Lock-free disk read. Still holding only the thread lock, the thread tries
   the entry on disk. Writers make `meta.json` appear last (temp file then
   `os.replace`), and every file is renamed into place whole, so a reader
   sees either no `meta.json` (a miss) or complete files. The one thing a
   reader can meet mid-write is a rebuild replacing an entry it is reading
   (forced recompile, or a corrupt entry being repaired). It then reads an
   object whose sha256 does not match the `meta.json` it read, or a file that
   has just gone away. Both read as a miss, and a lock-free reader never
   deletes or writes anything, so the worst outcome is a trip to step 4.
4. File lock. On a disk miss the thread takes the entry's `filelock`
   (a `flock` beside the entry directory, not in it, because repairs delete
   the directory) and checks disk again: the double check. A process that
   waited on the lock while another compiled finds the finished entry and
   loads it rather than compiling the same kernel a second time. Only the
   holder of this lock deletes, builds or writes an entry. It removes the old
   `meta.json` first, so that for the whole rebuild no reader takes the entry
   for complete. `flock` locks die with their process, so a crash leaves no
   stale lock. The wait has no timeout because a compile may take minutes.

Lock order is always thread lock, then file lock, so the two cannot deadlock.
The object's sha256 also protects against a torn write after a power loss
(nothing is fsynced): the entry just reads as corrupt.

`FA_GEN_DISABLE_CACHE`: build into a temporary directory outside the root,
load, keep in memory only. `FA_GEN_FORCE_RECOMPILE`: the first request per
key in a process skips the disk lookup and overwrites the entry. Later
requests in that process are memory hits, so a kernel is not rebuilt on
every call.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, TypeVar


from . import env
from .toolchain import canonical_json, fingerprint_hash, sha256_text
from .version import __version__

T = TypeVar("T")
_log = logging.getLogger(__name__)

SOURCE_NAME = "source.py"
OBJECT_NAME = "object.o"
META_NAME = "meta.json"
# <root>/<toolchain[:16]>/<arch>/by_target/<target key>.json: what a target renders to (KernelCache.index).
INDEX_DIR = "by_target"
_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_TOOLCHAIN_DIR = re.compile(r"^[0-9a-f]{16}$")


def _path_safe(name: str) -> str:
    # uri and arch become directory names; keep them to one harmless component.
    return _UNSAFE_PATH_CHARS.sub("_", name).strip(".") or "_"


@dataclass(frozen=True)
class CacheKey:
    """The identity of one compiled object. Build with `CacheKey.for_source`.

    `fields` holds the caller's own inputs (e.g. `{"spec": spec.canonical_json(),
    "options": "--enable-tvm-ffi --gpu-arch sm_90a"}`); it is copied through
    canonical JSON, so it must be JSON-native and later edits cannot desync it.
    """

    uri: str
    arch: str
    kind: str
    source_sha256: str
    toolchain: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    digest: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        frozen_fields = json.loads(canonical_json(dict(self.fields)))
        object.__setattr__(self, "fields", MappingProxyType(frozen_fields))
        object.__setattr__(self, "digest", sha256_text(canonical_json(self.named_fields())))

    @classmethod
    def for_source(cls, *, uri: str, arch: str, kind: str, source: str,
                   fields: Mapping[str, Any], toolchain: str | None = None) -> "CacheKey":
        """The key of `source` built for `arch`; `toolchain` defaults to this process's."""
        return cls(uri=uri, arch=arch, kind=kind, source_sha256=sha256_text(source),
                   toolchain=toolchain if toolchain is not None else fingerprint_hash(),
                   fields=fields)

    def named_fields(self) -> dict[str, Any]:
        """Everything the digest covers, by name (also stored in meta.json)."""
        return {"uri": self.uri, "arch": self.arch, "kind": self.kind,
                "source_sha256": self.source_sha256, "toolchain": self.toolchain,
                "fields": dict(self.fields)}

    def __hash__(self) -> int:
        return hash(self.digest)


@dataclass
class CacheStats:
    """Counters of one `KernelCache`, for tests, the CLI and timing reports."""

    hits_memory: int = 0
    hits_disk: int = 0
    builds: int = 0
    repaired: int = 0  # corrupt entries deleted and rebuilt
    last_build_seconds: float | None = None
    last_load_seconds: float | None = None
    last_entry: Path | None = None


class CorruptEntry(Exception):
    """An entry on disk that must not be used (reason in the message)."""


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    # Same directory, so os.replace is a rename within one filesystem: atomic.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_meta(entry: Path, digest: str) -> dict:
    """The entry's committed meta.json, checked against `digest` and the object's sha256."""
    try:
        meta = json.loads((entry / META_NAME).read_text())
    except FileNotFoundError:
        raise CorruptEntry("no meta.json (never committed)") from None
    except (OSError, ValueError) as exc:
        raise CorruptEntry(f"unreadable meta.json: {exc}") from None
    if not isinstance(meta, dict) or meta.get("key") != digest:
        raise CorruptEntry("meta.json belongs to another key")
    try:
        object_sha256 = _file_sha256(entry / OBJECT_NAME)
    except OSError as exc:
        raise CorruptEntry(f"object unreadable: {exc}") from None
    if object_sha256 != meta.get("object_sha256"):
        raise CorruptEntry("object sha256 does not match meta.json")
    return meta


class KernelCache:
    """Memory dict in front of a disk cache; see the module docstring for the protocol."""

    def __init__(self, root: Path | None = None):
        self._root = Path(root) if root is not None else None
        self._memory: dict[str, Any] = {}
        self._key_locks: dict[str, threading.Lock] = {}
        self._key_locks_guard = threading.Lock()
        self.stats = CacheStats()

    @property
    def root(self) -> Path:
        """The disk root; `FA_GEN_CACHE_DIR` is read at use time when none was given."""
        return self._root if self._root is not None else env.cache_dir()

    def entry_dir(self, key: CacheKey) -> Path:
        return (self.root / key.toolchain[:16] / _path_safe(key.arch)
                / f"{_path_safe(key.uri)}_{key.digest[:12]}")

    def get_or_build(self, key: CacheKey, source: str, build: Callable[[str, Path], None],
                     load: Callable[[Path], T]) -> T:
        """The loaded kernel of `key`: from memory, else disk, else `build` then `load`.

        `build(source, object_path)` must write the object file at `object_path`;
        `load(object_path)` returns the loaded callable (it may raise on a bad object).
        """
        if key.digest in self._memory:
            self.stats.hits_memory += 1
            return self._memory[key.digest]
        # Checked on misses only: a memory hit must stay cheap, and only builds store `source`.
        if sha256_text(source) != key.source_sha256:
            raise ValueError(f"source does not match the key of {key.uri!r}")
        with self._key_lock(key.digest):
            if key.digest in self._memory:  # another thread finished it while we waited
                self.stats.hits_memory += 1
                return self._memory[key.digest]
            if env.cache_disabled():
                value = self._build_in_tempdir(source, build, load)
            else:
                value = self._get_or_build_on_disk(key, source, build, load)
            self._memory[key.digest] = value
            return value

    def index_path(self, toolchain: str, arch: str, target_key: str) -> Path:
        return self.root / toolchain[:16] / _path_safe(arch) / INDEX_DIR / f"{target_key}.json"

    def get_indexed(self, toolchain: str, arch: str, target_key: str, load: Callable[[Path], T]):
        """(loaded value, index record) of the entry `index` recorded for `target_key`, without the
        source; None on a miss (no record, or its entry gone or corrupt: the caller then renders and
        takes get_or_build). Never with the cache disabled or a forced recompile."""
        if env.cache_disabled() or env.force_recompile():
            return None
        try:
            record = json.loads(self.index_path(toolchain, arch, target_key).read_text())
            digest, entry = record["digest"], self.root / record["entry"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if digest in self._memory:
            self.stats.hits_memory += 1
            return self._memory[digest], record
        with self._key_lock(digest):
            if digest not in self._memory:
                found = self._try_load(entry, digest, load)
                if found is _MISS:
                    return None
                self._memory[digest] = found
            return self._memory[digest], record

    def index(self, target_key: str, key: CacheKey, **extra) -> None:
        """Record that `target_key` (what determines the rendered source, toolchain aside) renders
        to the source of `key`, so that a later process loads its entry without rendering."""
        if env.cache_disabled():
            return
        path = self.index_path(key.toolchain, key.arch, target_key)
        record = {"digest": key.digest, "entry": self.entry_dir(key).relative_to(self.root).as_posix(), **extra}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, json.dumps(record, sort_keys=True).encode())
        except OSError as exc:  # a read-only cache still serves: the next load renders again
            _log.debug("fa_gen cache: index %s not written: %s", path, exc)

    def _key_lock(self, digest: str) -> threading.Lock:
        with self._key_locks_guard:
            return self._key_locks.setdefault(digest, threading.Lock())

    def _get_or_build_on_disk(self, key: CacheKey, source: str, build, load):
        entry = self.entry_dir(key)
        force = env.force_recompile()
        if not force:
            found = self._try_load(entry, key.digest, load)  # lock-free fast path
            if found is not _MISS:
                return found
        entry.parent.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock  # only a miss takes it: a warm load never imports it

        with FileLock(str(entry) + ".lock"):
            if not force:
                found = self._try_load(entry, key.digest, load)  # double check under the lock
                if found is not _MISS:
                    return found
                if entry.exists():
                    self.stats.repaired += 1
                    _log.warning("fa_gen cache: replacing corrupt entry %s", entry)
            self._build_entry(entry, key, source, build)
            return self._timed_load(entry, load)

    def _try_load(self, entry: Path, digest: str, load):
        """The loaded entry, or `_MISS` when absent or corrupt (never deletes anything)."""
        if not (entry / META_NAME).exists():
            return _MISS
        try:
            read_meta(entry, digest)
            value = self._timed_load(entry, load)
        except Exception as exc:  # CorruptEntry, or the loader rejecting the object
            _log.debug("fa_gen cache: %s unusable: %s", entry, exc)
            return _MISS
        self.stats.hits_disk += 1
        return value

    def _timed_load(self, entry: Path, load):
        start = time.perf_counter()
        value = load(entry / OBJECT_NAME)
        self.stats.last_load_seconds = time.perf_counter() - start
        self.stats.last_entry = entry
        return value

    def _build_entry(self, entry: Path, key: CacheKey, source: str, build) -> None:
        """Replace whatever is at `entry` with a fresh build; caller holds the file lock."""
        # Un-commit first: from here on lock-free readers see a miss, never a torn entry.
        (entry / META_NAME).unlink(missing_ok=True)
        shutil.rmtree(entry, ignore_errors=True)
        entry.mkdir(parents=True)
        try:
            _write_atomically(entry / SOURCE_NAME, source.encode())
            seconds = self._timed_build(entry, source, build)
            _write_atomically(entry / META_NAME, self._meta(entry, key, seconds).encode())
        except BaseException:
            shutil.rmtree(entry, ignore_errors=True)
            raise

    def _timed_build(self, workdir: Path, source: str, build) -> float:
        # Named *.o so that tools keyed on the suffix (the DSL's exporter) accept it.
        tmp_object = workdir / f".{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp.o"
        start = time.perf_counter()
        build(source, tmp_object)
        seconds = time.perf_counter() - start
        os.replace(tmp_object, workdir / OBJECT_NAME)
        self.stats.builds += 1
        self.stats.last_build_seconds = seconds
        return seconds

    def _meta(self, entry: Path, key: CacheKey, compile_seconds: float) -> str:
        return json.dumps({
            "key": key.digest,
            "key_fields": key.named_fields(),
            "object_sha256": _file_sha256(entry / OBJECT_NAME),
            "source_sha256": key.source_sha256,
            "compile_seconds": round(compile_seconds, 6),
            "created": time.time(),
            "fa_gen_version": __version__,
        }, indent=1, sort_keys=True)

    def _build_in_tempdir(self, source: str, build, load):
        with tempfile.TemporaryDirectory(prefix="fa_gen_nocache_") as workdir:
            self._timed_build(Path(workdir), source, build)
            return self._timed_load(Path(workdir), load)

    def entries(self) -> list[tuple[Path, dict]]:
        """Every committed entry under the root with its parsed meta.json, sorted by path."""
        found = []
        for meta_path in sorted(self.root.glob(f"*/*/*/{META_NAME}")):
            try:
                found.append((meta_path.parent, json.loads(meta_path.read_text())))
            except (OSError, ValueError):
                continue  # corrupt; get_or_build repairs it on next use
        return found

    def clear(self) -> None:
        """Forget memory entries and delete every toolchain directory under the root.

        Only directories named like a fingerprint are removed, so a cache root
        mistakenly pointed at a directory with other content loses nothing else.
        """
        self._memory.clear()
        if not self.root.is_dir():
            return
        for child in self.root.iterdir():
            if child.is_dir() and _TOOLCHAIN_DIR.match(child.name):
                shutil.rmtree(child, ignore_errors=True)


_MISS = object()
_DEFAULT: KernelCache | None = None
_DEFAULT_GUARD = threading.Lock()


def default_cache() -> KernelCache:
    """The process-wide cache (its root follows `FA_GEN_CACHE_DIR` at use time)."""
    global _DEFAULT
    with _DEFAULT_GUARD:
        if _DEFAULT is None:
            _DEFAULT = KernelCache()
        return _DEFAULT
