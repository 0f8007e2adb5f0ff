"""The weight hash: one SHA-256 that identifies what a model directory will serve.

File set (top level of the model directory only, symlinks followed):
    model*.safetensors, model.safetensors.index.json      weights, as mlx-lm loads them
    config.json, generation_config.json                   architecture and generation defaults
    tokenizer.json, tokenizer_config.json, tokenizer.model, special_tokens_map.json,
    added_tokens.json, vocab.json, vocab.txt, merges.txt, *.tiktoken, tiktoken.model
                                                          tokenizer
    chat_template.json, chat_template.jinja, *.jinja       chat template
Format: every file is hashed with SHA-256 on its own, streamed in 1 MiB reads; the files are
sorted by name (byte order of the UTF-8 name) and the weight hash is the lowercase hex SHA-256 of
the concatenation of `name + "\\0" + hex_digest + "\\n"` for each, e.g.
    sha256(b"config.json\\0<64 hex>\\nmodel.safetensors\\0<64 hex>\\n...")

Per-file digests are cached by (real path, size, mtime_ns), so a re-hash after a rescan only reads
files that changed. A `DigestCache` opened on a file (`DigestCache.open(state_dir /
"weight-hashes.json")`, what the agent does) keeps them across processes: a restart re-reads only
weight files whose size or modification time changed, instead of every byte of every model. The
hashing runs in a worker thread: the event loop never reads weights.

Hashing leaves the page cache as it found it. Reading 30 GB of weights through the cache would fill it:
the memory the agent's gate sees as available shrinks by as much (a model that fits is turned away),
and on a lent Mac the owner's cached files are pushed out. So on macOS the file is read with
``F_NOCACHE`` (``fcntl``), and on Linux every chunk read is dropped from the cache behind it
(``posix_fadvise(POSIX_FADV_DONTNEED)``) except the pages that were cached before the read began
(``mincore`` on a mapping of the file that is never touched, through ctypes); where that cannot be
asked, every chunk is dropped.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import fnmatch
import hashlib
import json
import mmap
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from kvcache.disk import atomic_write

log = structlog.get_logger(__name__)

HASHED_PATTERNS = (
    "model*.safetensors", "model.safetensors.index.json",
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken", "tiktoken.model",
    "chat_template.json", "chat_template.jinja", "*.jinja",
)
_CHUNK = 1 << 20

Progress = Callable[[int, int], None]  # (bytes hashed so far, total bytes); called on the worker thread


@dataclass(frozen=True, slots=True)
class _FileKey:
    real_path: str
    size: int
    mtime_ns: int


CACHE_FORMAT = 1  # the persisted file's "format"; another value is ignored (and rewritten)
CACHE_FILE = "weight-hashes.json"  # its name in the state dir


class DigestCache:
    """Per-file SHA-256 digests keyed by (real path, size, mtime_ns). Thread-safe.

    In memory by default; `DigestCache.open(path)` loads a persisted cache and `save()` writes it
    back (atomically, mode 0600) when something changed. A missing, unreadable or foreign file is an
    empty cache, never an error: the worst case is hashing again."""

    def __init__(self, path: Path | None = None) -> None:
        self._digests: dict[_FileKey, str] = {}
        self._lock = threading.Lock()
        self._path = path
        self._dirty = False
        self._save_lock = threading.Lock()  # one writer of the file at a time

    @classmethod
    def open(cls, path: Path) -> DigestCache:
        cache = cls(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") == CACHE_FORMAT:
                for e in data["files"]:
                    key = _FileKey(str(e["path"]), int(e["size"]), int(e["mtime_ns"]))
                    digest = str(e["sha256"])
                    if len(digest) == 64:
                        cache._digests[key] = digest
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            log.warning("weight_hash_cache_unreadable", path=str(path))
            cache._digests.clear()
        return cache

    def get(self, key: _FileKey) -> str | None:
        with self._lock:
            return self._digests.get(key)

    def put(self, key: _FileKey, digest: str) -> None:
        with self._lock:
            self._dirty = self._dirty or self._digests.get(key) != digest
            self._digests[key] = digest

    def save(self) -> None:
        """Write the cache to its file if it has one and anything changed. Entries whose file is
        gone or changed since are dropped. An OS error is logged, not raised."""
        if self._path is None:
            return
        with self._save_lock:
            with self._lock:
                if not self._dirty:
                    return
                entries = list(self._digests.items())
                self._dirty = False
            entries = [(k, v) for k, v in entries if _still_current(k)]  # stat outside the lock
            doc = {"format": CACHE_FORMAT, "files": [
                {"path": k.real_path, "size": k.size, "mtime_ns": k.mtime_ns, "sha256": v} for k, v in entries]}
            try:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(self._path, json.dumps(doc, separators=(",", ":")).encode(), mode=0o600)
            except OSError as exc:
                log.warning("weight_hash_cache_not_saved", path=str(self._path), exc_type=type(exc).__name__)

    def __len__(self) -> int:
        with self._lock:
            return len(self._digests)


def _still_current(key: _FileKey) -> bool:
    try:
        st = os.stat(key.real_path)
    except OSError:
        return False
    return st.st_size == key.size and st.st_mtime_ns == key.mtime_ns


_default_cache = DigestCache()


def hashed_files(model_dir: Path) -> list[Path]:
    """The files that enter the weight hash, sorted by name."""
    files = [p for p in model_dir.iterdir()
             if p.is_file() and any(fnmatch.fnmatchcase(p.name, pat) for pat in HASHED_PATTERNS)]
    return sorted(files, key=lambda p: p.name.encode())


def weight_hash_sync(model_dir: Path, *, cache: DigestCache | None = None,
                     progress: Progress | None = None) -> str:
    """Blocking form of `weight_hash`, for worker threads and the CLI."""
    cache = _default_cache if cache is None else cache
    files = hashed_files(Path(model_dir))
    if not any(fnmatch.fnmatchcase(p.name, "model*.safetensors") for p in files):
        raise FileNotFoundError(f"no weight files in {model_dir}")
    keyed = []
    for path in files:
        stat = path.stat()
        keyed.append((path, _FileKey(str(path.resolve()), stat.st_size, stat.st_mtime_ns)))
    total = sum(key.size for _, key in keyed)
    done = 0
    outer = hashlib.sha256()
    for path, key in keyed:
        digest = cache.get(key)
        if digest is None:
            digest = _file_digest(path, progress, done, total)
            cache.put(key, digest)
        done += key.size
        if progress is not None:
            progress(done, total)
        outer.update(path.name.encode() + b"\0" + digest.encode() + b"\n")
    cache.save()  # a no-op for an in-memory cache, or when every digest came from it
    return outer.hexdigest()


def weight_fingerprint_sync(model_dir: Path) -> str:
    """What binds a process's own prefix-cache entries to the weights it loaded, without reading them:
    the same files as the weight hash, by name, real path, size and modification time. Cheap (a stat
    per file), so `serve --local`, which advertises nothing to a network, never waits for a weight
    hash (14 s for an 8B model's first one); its SSD entries never outlive the process anyway."""
    outer = hashlib.sha256(b"darkbloom-weight-fingerprint v1\n")
    for path in hashed_files(Path(model_dir)):
        stat = path.stat()
        outer.update(f"{path.name}\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return "fingerprint-" + outer.hexdigest()


async def weight_hash(model_dir: Path, *, cache: DigestCache | None = None,
                      progress: Progress | None = None) -> str:
    """The weight hash of a model directory, computed in a worker thread (see module docstring)."""
    return await asyncio.to_thread(weight_hash_sync, model_dir, cache=cache, progress=progress)


def _file_digest(path: Path, progress: Progress | None, done_before: int, total: int) -> str:
    sha = hashlib.sha256()
    read = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        behind = _CacheKeeper(fd)
        while n := os.readv(fd, [view]):
            sha.update(view[:n])
            behind.drop(read, n)
            read += n
            if progress is not None:
                progress(done_before + read, total)
        behind.finish()
    finally:
        os.close(fd)
    return sha.hexdigest()


# --- reading without filling the page cache

_PAGE = mmap.PAGESIZE
_F_NOCACHE = 48  # macOS <sys/fcntl.h>; the fcntl module names it on recent Pythons only
_RESIDENT = bytes(b & 1 for b in range(256))  # mincore's per-page byte: bit 0 is "in the page cache"


class _CacheKeeper:
    """Puts the page cache back as it was for one open file, as its chunks are consumed (`drop`) and once
    it is read (`finish`). A page just read may still sit in another CPU's batch of pages on their way to
    the cache's lists, where a drop cannot reach it yet: each drop covers the last `_LAG` bytes again, and
    `finish` the whole file."""

    __slots__ = ("_before", "_fd", "_size")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._size = os.fstat(fd).st_size
        self._before: bytes | None = None  # one byte per page, 1: cached before the first read
        if sys.platform == "darwin":
            import fcntl

            try:  # reads bypass the cache; what was cached stays
                fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE), 1)
            except OSError:
                pass
        elif _CAN_DROP:
            self._before = _resident_pages(fd, self._size)

    def drop(self, offset: int, length: int) -> None:
        """[offset, offset + length) was read and hashed: drop what the reads brought into the cache."""
        start = max(0, offset - _LAG)
        self._drop(start, offset + length - start)

    def finish(self) -> None:
        self._drop(0, max(self._size, 1))

    def _drop(self, offset: int, length: int) -> None:
        if not _CAN_DROP or sys.platform == "darwin":
            return
        before = self._before
        if before is None:
            _dontneed(self._fd, offset, length)
            return
        first, end = offset // _PAGE, -(-(offset + length) // _PAGE)
        page = before.find(0, first, end)  # the first page this hashing brought in
        while page != -1:
            cached = before.find(1, page, end)
            stop = end if cached == -1 else cached
            _dontneed(self._fd, page * _PAGE, (stop - page) * _PAGE)
            page = -1 if cached == -1 else before.find(0, cached, end)


_LAG = 8 * _CHUNK


_CAN_DROP = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def _dontneed(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass  # a filesystem that keeps no page cache of its own (tmpfs): nothing to put back


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    return libc


_LIBC = _libc() if _CAN_DROP else None
_MAP_FAILED = ctypes.c_void_p(-1).value


def _resident_pages(fd: int, size: int) -> bytes | None:
    """One byte per page of the open file (`size` bytes), 1 where the page is in the page cache now
    (mincore on a read-only mapping that is never touched, so asking reads nothing); None when it cannot
    be told."""
    if _LIBC is None or size == 0:
        return None
    addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        pages = (ctypes.c_ubyte * (-(-size // _PAGE)))()
        if _LIBC.mincore(addr, size, pages) != 0:
            return None
        return bytes(pages).translate(_RESIDENT)
    finally:
        _LIBC.munmap(addr, size)
