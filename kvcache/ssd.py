"""SSD tier: prefix caches encrypted to disk, readable only by the process that wrote them.

File layout (one file per cached prefix, in the model's directory), format 3:

    MAGIC(4) | version(u16 BE) | nonce(12) | AES-256-GCM(header_len(u32 BE) | header | ids | payload | padding)

* Only MAGIC and the format version are in clear. The header (model id, weight hash, token count,
  per-layer dtypes and shapes, msgpack), the token ids (u32 LE each) and the payload (the raw K/V
  bytes) are sealed together, so the disk does not say which model a file is for, what its prompt
  was or how long. MAGIC, the version and the file name are the associated data: an edit, a swapped
  or renamed file all fail the tag.
* The sealed plaintext is padded with zeros to the Padmé length (`_padme`): a file's size is the one
  thing left that grows with the prompt, and it now gives the number of positions only to within a
  few percent (at most 12 % of padding, about 3 % for files of megabytes), not exactly.
* Format 1 had its header in clear, format 2 no token ids. A file of another version is a miss
  (deleted, never parsed), and files of an earlier process, whatever their format, are removed
  unread by `disk.startup_sweep`.
* The AES key and the HMAC key are random per process and kept only in memory: files from an
  earlier process are unreadable by design, and `disk.startup_sweep` deletes them.
* File names are HMAC-SHA256(name key, model id ‖ token ids), its first 128 bits in hex: no token
  content is visible on disk, and a name stands for its sequence exactly (an exact `read` needs no
  index). Directory names are a keyed hash of the model id plus a random epoch per open.
* Directories are 0700, files 0600, written to a temp file, fsynced, then renamed into place.
* A corrupt, truncated or tampered file is a miss: it is deleted and `read` returns None.

The closed latch: `purge(model)` closes the model's directory
under the lock and then deletes it. A write checks the latch before writing and again after the
rename; if a purge closed it in between, the write deletes its own file (and the directory it may
have re-created), so a write racing a purge never leaves a file behind. A purge whose delete lands
during the write (the temp file made, not yet renamed) makes the rename fail: with the latch
closed that is the same race (`RACED_PURGE`), not an error of the disk.

The index in memory holds no tokens: `kvcache/blockindex` keeps keyed digests of 32-token blocks,
a constant few hundred bytes per file plus 8 bytes per 32 tokens no other file shares. A lookup by
digests only says which file to read and a lower bound of what it shares (`longest_match`); `fetch`
reads that file and compares its sealed token ids with the query, so what it hands back shares
exactly `common` tokens with the query, never a token that differs. The index's bytes are charged
through the `IndexMeter` a model's directory is opened with (the memory ledger, kvcache/manager.py):
a write the meter refuses is not made (`NO_MEMORY`).

MLX-free: callers hand in `HostCache` values (`kvcache/state` converts on the engine thread).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import shutil
import struct
import sys
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvcache.bits import KvBits
from kvcache.blockindex import BlockIndex, Digested, common_tokens
from kvcache.disk import DiskBudget, atomic_write, ensure_private_dir
from kvcache.host import SLICE_BYTES, HostArray, HostCache
from kvcache.trie import Key

MAGIC = b"DBKV"
FORMAT_VERSION = 3  # 1: the header in clear; 2: no token ids
_VERSION = struct.Struct(">H")
_LEN = struct.Struct(">I")
_CLEAR = len(MAGIC) + _VERSION.size  # MAGIC | version: the associated data, with the file name
_NONCE_BYTES = 12
_TAG_BYTES = 16
_MAX_HEADER_BYTES = 1 << 20
_NAME_HEX = 32  # a file name: the first 128 bits of its HMAC, in hex
_TOKEN_BYTES = 4
# What a file's record in the disk budget takes in memory (its (model, name) tuple, its size, its
# place in the budget's LRU), charged with the index's own bytes (`index_bytes`).
_BUDGET_RECORD_BYTES = 56 + 32 + 96
# What a damaged file can raise while being parsed; each one means "miss, delete it".
_CORRUPT = (InvalidTag, ValueError, TypeError, KeyError, IndexError, struct.error,
            msgpack.UnpackException, msgpack.ExtraData)


class WriteOutcome(Enum):
    WRITTEN = "written"
    CLOSED = "closed"  # the model's directory is closed (purged, or never opened)
    RACED_PURGE = "raced_purge"  # a purge closed it during the write; the file was deleted
    OVER_BUDGET = "over_budget"  # the file alone exceeds the disk budget
    NO_MEMORY = "no_memory"  # the meter refused the bytes its index entry takes in memory
    EXISTS = "exists"


class IndexMeter(Protocol):
    """Where a model's index charges its bytes in memory (the ledger, kvcache/manager.py)."""

    def charge(self, nbytes: int) -> bool: ...  # False: refused, nothing charged

    def discharge(self, nbytes: int) -> None: ...


@dataclass(frozen=True, slots=True)
class SsdHit:
    """What `fetch` read: the stored sequence `key` (its token ids, from its file), the `cache` of all
    its positions, and the `common` leading tokens it shares with the query, compared id by id."""

    key: Key
    cache: HostCache
    common: int


@dataclass(slots=True)
class _ModelDir:
    model_id: str
    weight_hash: str
    path: Path
    meter: IndexMeter | None = None
    closed: bool = False
    index: BlockIndex = field(default_factory=BlockIndex)  # block digests -> file name
    charged: int = 0  # the index's bytes charged to the meter


class SsdStore:
    """Encrypted prefix-cache files under `root`, one directory per open model. Thread-safe."""

    def __init__(self, root: Path, *, budget: DiskBudget, key: bytes | None = None) -> None:
        if key is not None and len(key) != 64:
            raise ValueError("key must be 64 bytes (AES-256 key ‖ HMAC key)")
        key = key if key is not None else secrets.token_bytes(64)
        self._aes = algorithms.AES(key[:32])
        self._name_key = key[32:]
        self._digest_key = hmac.new(self._name_key, b"blocks", hashlib.sha256).digest()
        self.root = Path(root)
        self._budget = budget
        self._lock = threading.Lock()
        self._dirs: dict[str, _ModelDir] = {}
        # Test seam: runs after the latch check and before the file is written.
        self._between_check_and_write: Callable[[], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self, model_id: str, weight_hash: str, *, meter: IndexMeter | None = None) -> None:
        """Open a fresh directory for a model that was just loaded (a new epoch every time); its
        index's bytes are charged to `meter` (none: not charged)."""
        tag = hmac.new(self._name_key, b"dir\0" + model_id.encode(), hashlib.sha256).hexdigest()[:32]
        path = self.root / f"{tag}.{secrets.token_hex(8)}"
        with self._lock:
            old = self._dirs.get(model_id)
            if old is not None and not old.closed:
                raise RuntimeError("model already open in the SSD tier; purge it first")
            self._dirs[model_id] = _ModelDir(model_id, weight_hash, path, meter)

    def purge(self, model_id: str) -> int:
        """Close the latch, then delete the model's directory. Idempotent; returns bytes freed."""
        with self._lock:
            d = self._dirs.pop(model_id, None)
            if d is None:
                return 0
            d.closed = True
            d.index.clear()
            self._recharge_locked(d)
            freed = self._budget.forget_model(model_id)
        shutil.rmtree(d.path, ignore_errors=True)
        return freed

    # -- writing -----------------------------------------------------------------------------

    def write(self, model_id: str, weight_hash: str, tokens: Sequence[int], cache: HostCache) -> WriteOutcome:
        seq = self._digested(tokens)  # outside the lock, like the sealing
        if cache.tokens != seq.length:
            raise ValueError("cache holds a different number of positions than tokens")
        name = self._file_name(model_id, seq.raw)
        blob = self._seal(self._header(model_id, weight_hash, cache), name, seq.raw, cache)
        size = sum(len(part) for part in blob)
        with self._lock:
            d = self._dirs.get(model_id)
            if d is None or d.closed or d.weight_hash != weight_hash:
                return WriteOutcome.CLOSED
            if name in d.index:
                return WriteOutcome.EXISTS
            admission = self._budget.admit((model_id, name), size)
            if not admission.admitted:
                return WriteOutcome.OVER_BUDGET
            victims = [self._drop_locked(fid) for fid in admission.evict]
            replaced = d.index.insert(seq, name)
            if replaced is not None:  # another sequence with the same digests: its file goes
                self._budget.discharge((model_id, replaced))
                victims.append(d.path / replaced)
            if not self._recharge_locked(d):  # the meter has no room for its entry: not written
                self._forget_locked(d, name)
                refused = True
            else:
                refused = False
        for path in victims:
            if path is not None:
                path.unlink(missing_ok=True)
        if refused:
            return WriteOutcome.NO_MEMORY
        if self._between_check_and_write is not None:
            self._between_check_and_write()
        final = d.path / name
        try:
            ensure_private_dir(final.parent)
            atomic_write(final, blob)
        except OSError:
            self._forget(d, name)
            final.unlink(missing_ok=True)
            with self._lock:
                closed = d.closed
            if not closed:
                raise
            # A purge deleted the folder while we wrote (the rename found no temp file, or
            # no folder): the race the latch is for, not a failing disk.
            _rmdir_if_empty(d.path)
            return WriteOutcome.RACED_PURGE
        # Post-write re-check: a purge that closed the latch while we wrote must not find (or
        # leave) our file. Everything it deleted before our rename we delete here ourselves.
        with self._lock:
            closed = d.closed
            # Shorter files on the same path are now redundant (a lookup trims the new one to
            # them), as in the RAM tier: a conversation keeps one file, not one per turn.
            shorter = [] if closed else [self._forget_locked(d, n) for n in d.index.prefixes_of(seq)]
        if closed:
            final.unlink(missing_ok=True)
            _rmdir_if_empty(d.path)
            return WriteOutcome.RACED_PURGE
        for path in shorter:
            path.unlink(missing_ok=True)
        return WriteOutcome.WRITTEN

    # -- reading -----------------------------------------------------------------------------

    def longest_match(self, model_id: str, tokens: Sequence[int]) -> int:
        """A lower bound of the most leading tokens a stored sequence shares with `tokens`, from the
        index alone (no disk access): short of the truth by less than one block where the two part
        inside a block (`fetch` finds the exact figure)."""
        seq = self._digested(tokens)
        with self._lock:
            d = self._dirs.get(model_id)
            found = None if d is None or d.closed else d.index.longest(seq)
        return 0 if found is None else found.common

    def covers(self, model_id: str, tokens: Sequence[int]) -> bool:
        """True when a stored sequence starts with all of `tokens` (from the index alone; a sequence
        ending inside a block counts as covered only when it is stored itself)."""
        seq = self._digested(tokens)
        with self._lock:
            d = self._dirs.get(model_id)
            return d is not None and not d.closed and d.index.covers(seq)

    def fetch(self, model_id: str, weight_hash: str, tokens: Sequence[int]) -> SsdHit | None:
        """Read the stored sequence sharing the most leading tokens with `tokens`: its token ids and
        cache, and how many tokens it really shares with them (≥ 1), compared id by id from the
        sealed file. None when there is none, or its file is gone or damaged (deleted)."""
        seq = self._digested(tokens)
        with self._lock:
            d = self._dirs.get(model_id)
            if d is None or d.closed or d.weight_hash != weight_hash:
                return None
            found = d.index.longest(seq)
        if found is None:
            return None
        opened = self._read_file(d, found.name, weight_hash)
        if opened is None:
            return None
        ids, cache = opened
        common = common_tokens(ids, seq.raw)
        if common == 0:  # two blocks with one digest: this file is not for the query after all
            return None
        key = array("I")
        key.frombytes(ids)
        if sys.byteorder != "little":
            key.byteswap()
        return SsdHit(tuple(key), cache, common)

    def read(self, model_id: str, weight_hash: str, tokens: Sequence[int]) -> HostCache | None:
        """The cache stored under exactly `tokens`, or None (absent, closed, or damaged → deleted)."""
        seq = self._digested(tokens)
        name = self._file_name(model_id, seq.raw)
        with self._lock:
            d = self._dirs.get(model_id)
            if d is None or d.closed or d.weight_hash != weight_hash or name not in d.index:
                return None
        opened = self._read_file(d, name, weight_hash)
        if opened is None or opened[0] != seq.raw:
            return None
        return opened[1]

    def _read_file(self, d: _ModelDir, name: str, weight_hash: str) -> tuple[bytes, HostCache] | None:
        """A stored file's token ids and cache; a file gone or damaged is forgotten (and deleted)."""
        self._budget.touch((d.model_id, name))
        path = d.path / name
        try:
            blob = path.read_bytes()
        except OSError:
            self._forget(d, name)
            return None
        try:
            return self._open_blob(blob, name, d.model_id, weight_hash)
        except _CORRUPT:
            self._forget(d, name)
            path.unlink(missing_ok=True)
            return None

    def disk_bytes(self, model_id: str | None = None) -> int:
        return self._budget.used_bytes(model_id)

    def entries(self, model_id: str) -> int:
        with self._lock:
            d = self._dirs.get(model_id)
            return 0 if d is None else len(d.index)

    def index_bytes(self, model_id: str | None = None) -> int:
        """What the index holds in memory (every open model's, or one's)."""
        with self._lock:
            dirs = list(self._dirs.values()) if model_id is None else [
                d for d in [self._dirs.get(model_id)] if d is not None]
            return sum(_held(d) for d in dirs)

    def directory(self, model_id: str) -> Path | None:
        with self._lock:
            d = self._dirs.get(model_id)
            return None if d is None else d.path

    # -- internals ---------------------------------------------------------------------------

    def _digested(self, tokens: Sequence[int]) -> Digested:
        return Digested(tokens, self._digest_key)

    def _file_name(self, model_id: str, ids: bytes) -> str:
        """`ids`: the token ids as `blockindex.token_bytes` packs them (u32 LE)."""
        msg = model_id.encode() + b"\0" + ids
        return hmac.new(self._name_key, msg, hashlib.sha256).hexdigest()[:_NAME_HEX]

    @staticmethod
    def _header(model_id: str, weight_hash: str, cache: HostCache) -> bytes:
        layers = [[[a.dtype, list(a.shape)] for a in layer] for layer in cache.layers]
        header = {"model": model_id, "weights": weight_hash, "tokens": cache.tokens, "layers": layers}
        if cache.kv_bits is not None:  # quantized KV (kvcache/host.py)
            header.update(kv_bits=cache.kv_bits.as_json())
        return msgpack.packb(header)

    def _seal(self, header: bytes, name: str, ids: bytes, cache: HostCache) -> list[bytes]:
        """The file's bytes, in pieces: clear ‖ nonce ‖ AES-256-GCM(payload) ‖ tag, what `AESGCM.encrypt`
        gives for the whole payload, encrypted a `SLICE_BYTES` slice at a time (see kvcache/host.py)."""
        clear = MAGIC + _VERSION.pack(FORMAT_VERSION)
        nonce = secrets.token_bytes(_NONCE_BYTES)
        size = _LEN.size + len(header) + len(ids) + cache.nbytes
        encryptor = Cipher(self._aes, modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(clear + name.encode())
        pieces = [clear + nonce]
        for part in [_LEN.pack(len(header)), header, ids, *(a.data for layer in cache.layers for a in layer),
                     bytes(_padme(size) - size)]:
            view = memoryview(part)
            pieces.extend(encryptor.update(view[at: at + SLICE_BYTES]) for at in range(0, len(view), SLICE_BYTES))
        encryptor.finalize()
        pieces.append(encryptor.tag)
        return pieces

    def _decrypt(self, nonce: bytes, sealed: memoryview, aad: bytes) -> bytearray:
        """`AESGCM.decrypt`, a `SLICE_BYTES` slice at a time; InvalidTag when anything was changed."""
        if len(sealed) < _TAG_BYTES:
            raise InvalidTag()
        body, tag = sealed[:-_TAG_BYTES], bytes(sealed[-_TAG_BYTES:])
        decryptor = Cipher(self._aes, modes.GCM(nonce, tag)).decryptor()
        decryptor.authenticate_additional_data(aad)
        out = bytearray(len(body) + 15)  # update_into wants a block's slack; GCM writes exactly what it gets
        view = memoryview(out)
        for at in range(0, len(body), SLICE_BYTES):
            piece = body[at: at + SLICE_BYTES]
            decryptor.update_into(piece, view[at: at + len(piece) + 15])
        decryptor.finalize()
        del view
        del out[len(body):]
        return out

    def _open_blob(self, blob: bytes, name: str, model_id: str, weight_hash: str) -> tuple[bytes, HostCache]:
        """A file's token ids (u32 LE) and cache; raises one of `_CORRUPT` for anything amiss."""
        if blob[: len(MAGIC)] != MAGIC:
            raise ValueError("bad magic")
        if len(blob) < _CLEAR + _NONCE_BYTES + _TAG_BYTES:
            raise ValueError("truncated")
        if _VERSION.unpack_from(blob, len(MAGIC))[0] != FORMAT_VERSION:
            raise ValueError("another format")  # format 1 reads as version 0 (its header length's high bytes)
        clear, nonce = blob[:_CLEAR], blob[_CLEAR: _CLEAR + _NONCE_BYTES]
        plaintext = memoryview(self._decrypt(nonce, memoryview(blob)[_CLEAR + _NONCE_BYTES:], clear + name.encode()))
        (hlen,) = _LEN.unpack_from(plaintext)
        if hlen > _MAX_HEADER_BYTES:
            raise ValueError("header too long")
        header = msgpack.unpackb(bytes(plaintext[_LEN.size: _LEN.size + hlen]))
        if (header["model"], header["weights"]) != (model_id, weight_hash):
            raise ValueError("header does not match the request")
        tokens = int(header["tokens"])
        at = _LEN.size + hlen
        ids = bytes(plaintext[at: at + tokens * _TOKEN_BYTES])
        if len(ids) != tokens * _TOKEN_BYTES or self._file_name(model_id, ids) != name:
            raise ValueError("token ids do not match the file")
        layers, at = [], at + len(ids)
        for pair in header["layers"]:
            arrays = []
            for dtype, shape in pair:
                shape = tuple(int(x) for x in shape)
                n = HostArray.expected_nbytes(dtype, shape)
                arrays.append(HostArray(dtype, shape, plaintext[at: at + n]))
                at += n
            layers.append(tuple(arrays))
        if len(plaintext) != _padme(at):
            raise ValueError("payload length does not match the header")
        kv_bits = header.get("kv_bits")
        return ids, HostCache(tokens, tuple(layers), kv_bits=None if kv_bits is None else KvBits.from_json(kv_bits))

    def _forget(self, d: _ModelDir, name: str) -> None:
        with self._lock:
            d.index.remove(name)
            self._recharge_locked(d)
        self._budget.discharge((d.model_id, name))

    def _forget_locked(self, d: _ModelDir, name: str) -> Path:
        """Drop a stored file from the index and the budget; returns its path to delete."""
        d.index.remove(name)
        self._recharge_locked(d)
        self._budget.discharge((d.model_id, name))
        return d.path / name

    def _drop_locked(self, fid: tuple[str, str]) -> Path | None:
        """Forget an evicted file in its model's index; returns its path to delete."""
        model_id, name = fid
        d = self._dirs.get(model_id)
        if d is None:
            return None
        d.index.remove(name)
        self._recharge_locked(d)
        return d.path / name

    @staticmethod
    def _recharge_locked(d: _ModelDir) -> bool:
        """Bring the meter to what the index holds now; False when it refused more (nothing changed)."""
        delta = _held(d) - d.charged
        if d.meter is None or delta == 0:
            d.charged += delta
            return True
        if delta > 0:
            if not d.meter.charge(delta):
                return False
        else:
            d.meter.discharge(-delta)
        d.charged += delta
        return True


def _held(d: _ModelDir) -> int:
    """What a model's files take in memory: its index, and each file's record in the disk budget."""
    return d.index.nbytes + len(d.index) * _BUDGET_RECORD_BYTES


def _padme(length: int) -> int:
    """`length` rounded up to the Padmé length (Nikitin et al., "Reducing Metadata Leakage from
    Encrypted Files and Communication with PURBs", 2019): all but its top log2(log2(length)) + 1
    significant bits are zero, so sizes fall into few classes, at most 12 % above the length."""
    if length < 2:
        return length
    exponent = length.bit_length() - 1  # floor(log2(length))
    low = (1 << (exponent - exponent.bit_length())) - 1  # the bits that are rounded away
    return (length + low) & ~low


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
