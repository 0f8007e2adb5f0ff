"""``runtime_hash``: one SHA-256 naming the exact code that serves requests.

A coordinator with a runtime manifest (``EIGENINFERENCE_KNOWN_RUNTIME_HASHES``) routes only to providers
whose ``register.runtime_hash`` is on its list; ``darkbloom-provider doctor`` / the CLI print this value
so an operator can put it there. The ``runtime_hash`` setting overrides it.

Definition (version ``v1``), deterministic for a given installation: the lowercase hex SHA-256 of the
UTF-8 text

    darkbloom-runtime-hash v1\\n
    then, for each distribution in the order darkbloom-provider, mlx, mlx-lm:
      dist <name> <version>\\n          (or ``dist <name> missing\\n`` when it is not installed)
      one line per file, sorted by path:  <path> sha256=<hex digest>\\n

* darkbloom-provider: every ``*.py`` file of its top-level packages (``top_level.txt``: protocol,
  memory, kvcache, provider), read from where Python imports them, paths relative to the package's
  parent directory. Reading the files (instead of the RECORD) covers editable installs, whose RECORD
  does not list the source.
* mlx, mlx-lm: the ``sha256`` entries of the distribution's RECORD (path as recorded, digest converted
  from RECORD's urlsafe base64 to hex); entries without a hash (RECORD itself, ``.pyc``) are skipped.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

VERSION_TAG = "darkbloom-runtime-hash v1"
PROVIDER_DIST = "darkbloom-provider"
RUNTIME_DISTS = (PROVIDER_DIST, "mlx", "mlx-lm")
_FALLBACK_PACKAGES = ("protocol", "memory", "kvcache", "provider")


def compute_runtime_hash() -> str:
    """The runtime hash of this installation. Blocking (reads files): call it off the event loop."""
    digest = hashlib.sha256()
    digest.update(f"{VERSION_TAG}\n".encode())
    for name in RUNTIME_DISTS:
        for line in _dist_lines(name):
            digest.update(f"{line}\n".encode())
    return digest.hexdigest()


def runtime_hash(override: str | None = None) -> str:
    """What goes in ``register.runtime_hash``: the configured override, else the computed hash."""
    return override if override else compute_runtime_hash()


def _dist_lines(name: str) -> list[str]:
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        return [f"dist {name} missing"]
    files = _source_files(dist) if name == PROVIDER_DIST else _record_files(dist)
    return [f"dist {name} {dist.version}", *(f"{path} sha256={hexdigest}" for path, hexdigest in sorted(files))]


def _record_files(dist: Distribution) -> list[tuple[str, str]]:
    out = []
    for entry in dist.files or ():
        if entry.hash is None or entry.hash.mode != "sha256":
            continue
        raw = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4))
        out.append((str(entry), raw.hex()))
    return out


def _source_files(dist: Distribution) -> list[tuple[str, str]]:
    top_level = (dist.read_text("top_level.txt") or "").split() or list(_FALLBACK_PACKAGES)
    out = []
    for package in sorted(set(top_level)):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            root = Path(location)
            for path in root.rglob("*.py"):
                if "__pycache__" in path.parts:
                    continue
                rel = path.relative_to(root.parent).as_posix()
                out.append((rel, hashlib.sha256(path.read_bytes()).hexdigest()))
    return out


__all__ = ["RUNTIME_DISTS", "VERSION_TAG", "compute_runtime_hash", "runtime_hash"]
