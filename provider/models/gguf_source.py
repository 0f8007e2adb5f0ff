"""GGUF-backed sources for discovery: the folders `import` wrote, and Ollama's store.

Discovery (`provider/models/discovery.py`) turns these into candidates and `ModelInfo`s; this module
only reads: the import markers, the store's manifests, and a GGUF's header, planned as the import would
plan it (`summary`), so an Ollama model is listed at the size, dtype and KV it will have once imported.
A summary is kept per (file, size, mtime): listing again reads nothing new.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from provider.models.gguf import plan_import, read_marker
from provider.models.gguf.reader import opened
from provider.models.ollama import OllamaModel, list_models

_lock = threading.Lock()
_summaries: dict[tuple[str, int, int], Summary] = {}


@dataclass(frozen=True, slots=True)
class Summary:
    config: dict[str, Any]
    output_bytes: int
    dtype: str


def folder_name(model_id: str) -> str:
    """The folder an id is imported into (its id is in the folder's marker)."""
    return model_id.replace("/", "--")


def imported_folders(root: Path) -> list[tuple[str, Path]]:
    """(id, folder) of each folder in `root` with an import marker (a folder without one is not ours
    to serve from here: model_dirs is for those)."""
    found = []
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    for folder in children:
        marker = read_marker(folder)
        if marker is not None and isinstance(marker.get("model_id"), str) and marker["model_id"].strip():
            found.append((marker["model_id"], folder))
    return found


def imported_from(folder: Path) -> str | None:
    """The Ollama blob digest an imported folder was made from (None: not from Ollama)."""
    marker = read_marker(folder)
    source = marker.get("source") if marker is not None else None
    digest = source.get("sha256") if isinstance(source, dict) else None
    return digest if isinstance(digest, str) else None


def ollama_models(store: Path) -> list[OllamaModel]:
    return list_models(store)


def summary(path: Path) -> Summary:
    """What importing `path` with the defaults gives: config.json, bytes, dtype. Raises GgufError."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    with _lock:
        if key in _summaries:
            return _summaries[key]
    with opened(path, strings=False) as (header, view):
        plan = plan_import(header, view)
        found = Summary(plan.config, plan.output_bytes, plan.dtype)
    with _lock:
        _summaries[key] = found
    return found


__all__ = ["Summary", "folder_name", "imported_folders", "imported_from", "ollama_models", "summary"]
