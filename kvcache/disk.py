"""Disk budget for the SSD tier, the startup sweep, and the one way a file is replaced on disk.

The budget is `min(configured bytes, half of the free disk)`, where "free" counts the bytes our
own files already use as free (they are ours to give back), so the limit does not shrink just
because the cache filled up. Files are accounted per model in one process-wide LRU; admitting a
new file names the least recently used files to delete first. This module only does the
arithmetic; `kvcache/ssd` deletes the files it is told to.

The sweep: the encryption key lives only in memory, so whatever a previous process left on disk
(it was killed before it could purge, e.g. a jetsam SIGKILL) is unreadable by design; the sweep
deletes it at startup, before any model opens a directory. It only touches names this package
creates, so a mistyped root cannot wipe someone else's files.

`atomic_write` is how every file the agent replaces is written (the SSD tier's entries, the identity
keys, the service files, the weight-hash cache, the crash-loop guard's records): all or nothing, and
durable once it returns. It imports nothing beyond the standard library, so any package may use it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# Per-model directory: <32 hex: keyed hash of the model id>.<16 hex: epoch of this open>
MODEL_DIR_RE = re.compile(r"^[0-9a-f]{32}\.[0-9a-f]{16}$")
TEMP_SUFFIX = ".tmp"
KVCACHE_DIR = "kvcache"  # the SSD tier's directory under the agent's state_dir

FileId = tuple[str, str]  # (model_id, file name)


def _free_bytes(root: Path) -> int:
    return shutil.disk_usage(root).free


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    evict: tuple[FileId, ...]  # delete these first (least recently used first)


class DiskBudget:
    """Bytes on disk per model and in total, with LRU eviction over budget. Thread-safe."""

    def __init__(self, root: Path, configured_bytes: int, *,
                 free_bytes_fn: Callable[[Path], int] = _free_bytes) -> None:
        if configured_bytes < 0:
            raise ValueError("configured_bytes must be >= 0")
        self.root = Path(root)
        self._configured = configured_bytes
        self._free_fn = free_bytes_fn
        self._lock = threading.Lock()
        self._files: OrderedDict[FileId, int] = OrderedDict()  # oldest first
        self._by_model: dict[str, int] = {}
        self._used = 0

    def limit_bytes(self) -> int:
        with self._lock:
            return self._limit_locked()

    def _limit_locked(self) -> int:
        return min(self._configured, (self._free_fn(self.root) + self._used) // 2)

    def admit(self, fid: FileId, nbytes: int) -> Admission:
        """Charge a file about to be written; names the LRU files to delete to stay in budget.

        Refused (nothing charged, nothing to delete) when the file alone exceeds the budget."""
        with self._lock:
            limit = self._limit_locked()
            if nbytes > limit:
                return Admission(False, ())
            self._discharge_locked(fid)
            victims: list[FileId] = []
            for old in list(self._files):
                if self._used + nbytes <= limit:
                    break
                self._discharge_locked(old)
                victims.append(old)
            self._files[fid] = nbytes
            self._by_model[fid[0]] = self._by_model.get(fid[0], 0) + nbytes
            self._used += nbytes
            return Admission(True, tuple(victims))

    def touch(self, fid: FileId) -> None:
        with self._lock:
            if fid in self._files:
                self._files.move_to_end(fid)

    def discharge(self, fid: FileId) -> int:
        """Forget one file (deleted or never landed). Idempotent; returns its bytes."""
        with self._lock:
            return self._discharge_locked(fid)

    def forget_model(self, model_id: str) -> int:
        """Forget every file of `model_id` (its directory was removed)."""
        with self._lock:
            return sum(self._discharge_locked(fid) for fid in [f for f in self._files if f[0] == model_id])

    def used_bytes(self, model_id: str | None = None) -> int:
        with self._lock:
            return self._used if model_id is None else self._by_model.get(model_id, 0)

    def _discharge_locked(self, fid: FileId) -> int:
        nbytes = self._files.pop(fid, None)
        if nbytes is None:
            return 0
        self._used -= nbytes
        left = self._by_model[fid[0]] - nbytes
        if left:
            self._by_model[fid[0]] = left
        else:
            del self._by_model[fid[0]]
        return nbytes


def atomic_write(path: str | os.PathLike[str], data: bytes | Iterable[bytes], *, mode: int = 0o600) -> None:
    """Replace `path` with `data` (bytes, or pieces written in order and never joined), all or nothing.

    A temp file of a fresh random name in the same folder (O_EXCL, `mode` whatever the umask, ending
    in `TEMP_SUFFIX`) is written, flushed and fsynced, renamed over `path`, and the folder is fsynced
    so the rename survives a crash. A temp file a killed process left under a name of its own can
    never block the writes that follow. On any failure the temp file is removed and `path` is as it
    was. The folder must exist."""
    target = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
    tmp = Path(name)
    try:
        try:
            os.fchmod(fd, mode)
            for piece in (data,) if isinstance(data, bytes | bytearray | memoryview) else data:
                view = memoryview(piece).cast("B")
                while view:  # a full disk may take part of it, then refuse the rest
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def ensure_private_dir(path: Path) -> None:
    """Create `path` (and parents) as 0700; tighten it if it already existed."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def check_writable_dir(root: Path) -> None:
    """Make sure the SSD tier can live in `root`: create it as 0700 and write and remove one probe file.
    Raises `OSError` (read-only file system, permissions, a file in the way...)."""
    ensure_private_dir(root)
    fd, name = tempfile.mkstemp(prefix=".probe-", suffix=TEMP_SUFFIX, dir=root)
    os.close(fd)
    os.unlink(name)


def os_error_name(exc: OSError) -> str:
    """A closed-vocabulary name for why a file operation failed (`EROFS`, `EACCES`...), never its text."""
    return errno.errorcode.get(exc.errno or 0, "OSError")


def startup_sweep(root: Path) -> int:
    """Delete every per-model directory and stray temp file a previous process left in `root`.

    Call once at startup before any model opens the SSD tier. Returns how many entries it removed."""
    root = Path(root)
    ensure_private_dir(root)
    removed = 0
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink() and MODEL_DIR_RE.match(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
        elif entry.name.endswith(TEMP_SUFFIX) and (entry.is_file() or entry.is_symlink()):
            entry.unlink(missing_ok=True)
            removed += 1
    return removed
