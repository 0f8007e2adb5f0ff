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
files that changed. The hashing runs in a worker thread: the event loop never reads weights.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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


class DigestCache:
    """Per-file SHA-256 digests keyed by (real path, size, mtime_ns). Thread-safe."""

    def __init__(self) -> None:
        self._digests: dict[_FileKey, str] = {}
        self._lock = threading.Lock()

    def get(self, key: _FileKey) -> str | None:
        with self._lock:
            return self._digests.get(key)

    def put(self, key: _FileKey, digest: str) -> None:
        with self._lock:
            self._digests[key] = digest

    def __len__(self) -> int:
        with self._lock:
            return len(self._digests)


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
    return outer.hexdigest()


async def weight_hash(model_dir: Path, *, cache: DigestCache | None = None,
                      progress: Progress | None = None) -> str:
    """The weight hash of a model directory, computed in a worker thread (see module docstring)."""
    return await asyncio.to_thread(weight_hash_sync, model_dir, cache=cache, progress=progress)


def _file_digest(path: Path, progress: Progress | None, done_before: int, total: int) -> str:
    sha = hashlib.sha256()
    read = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            sha.update(chunk)
            read += len(chunk)
            if progress is not None:
                progress(done_before + read, total)
    return sha.hexdigest()
