"""kvcache.ssd and kvcache.disk: encrypted files, permissions, tamper = miss, the purge race,
the disk budget and the startup sweep. MLX-free: caches are `HostCache` byte blobs."""

from __future__ import annotations

import os
import stat
import struct
import threading
from pathlib import Path

import msgpack
import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvcache.disk import DiskBudget, startup_sweep
from kvcache.host import HostArray, HostCache
from kvcache.ssd import FORMAT_VERSION, MAGIC, SsdStore, WriteOutcome

GiB = 2**30
MODEL, WEIGHTS = "org/tiny-model", "sha256:abc"


def host_cache(tokens: int, *, layers: int = 2, seed: int = 0) -> HostCache:
    def arr(i: int) -> HostArray:
        shape = (1, 2, tokens, 4)
        n = HostArray.expected_nbytes("float32", shape)
        return HostArray("float32", shape, bytes((seed * 31 + i * 7 + j) % 251 for j in range(n)))

    return HostCache(tokens, tuple((arr(2 * li), arr(2 * li + 1)) for li in range(layers)))


def make_store(root: Path, *, budget_bytes: int = GiB, free: int = 100 * GiB) -> SsdStore:
    store = SsdStore(root, budget=DiskBudget(root, budget_bytes, free_bytes_fn=lambda _: free))
    store.open(MODEL, WEIGHTS)
    return store


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def the_file(root: Path) -> Path:
    (path,) = files_under(root)
    return path


def test_round_trip_names_and_permissions(tmp_path: Path) -> None:
    tokens = [101, 102, 103, 104, 105]
    cache = host_cache(len(tokens))
    store = make_store(tmp_path)
    assert store.write(MODEL, WEIGHTS, tokens, cache) is WriteOutcome.WRITTEN
    assert store.write(MODEL, WEIGHTS, tokens, cache) is WriteOutcome.EXISTS
    assert store.read(MODEL, WEIGHTS, tokens) == cache
    assert store.read(MODEL, "sha256:other", tokens) is None  # another weight hash never matches
    path = the_file(tmp_path)
    assert len(path.name) == 32 and all(c in "0123456789abcdef" for c in path.name)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    blob = path.read_bytes()
    assert cache.layers[0][0].data[:64] not in blob  # the KV bytes are encrypted
    assert store.disk_bytes(MODEL) == store.disk_bytes() == len(blob)
    hit = store.fetch(MODEL, WEIGHTS, tokens + [9])  # a stored prefix of the query
    assert hit is not None and (hit.key, hit.common, hit.cache) == (tuple(tokens), 5, cache)
    assert store.longest_match(MODEL, tokens + [9]) == 5


def test_a_fetch_shares_exactly_the_tokens_the_file_holds(tmp_path: Path) -> None:
    """The index sees whole blocks of 32 tokens (and a stored sequence's own end): where a query parts
    from a stored sequence inside a block, `longest_match` says the block before it and `fetch`, which
    compares the sealed token ids, the exact figure; a query that parts in the first block finds
    nothing, and KV is never handed back for a token that differs."""
    store = make_store(tmp_path)
    stored = list(range(1000, 1080))
    cache = host_cache(len(stored))
    assert store.write(MODEL, WEIGHTS, stored, cache) is WriteOutcome.WRITTEN
    query = stored[:70] + [7, 8, 9]
    assert store.longest_match(MODEL, query) == 64
    hit = store.fetch(MODEL, WEIGHTS, query)
    assert hit is not None and (hit.key, hit.common, hit.cache) == (tuple(stored), 70, cache)
    assert store.fetch(MODEL, WEIGHTS, stored[:20] + [1]) is None and store.longest_match(MODEL, stored[:20]) == 0
    assert store.fetch(MODEL, WEIGHTS, stored[:40]).common == 40  # a query the stored sequence goes on from


def test_only_the_format_is_in_clear_and_the_size_tells_the_length_only_roughly(tmp_path: Path) -> None:
    """The header (model, weight hash, token count, shapes) is sealed with the payload: in clear are
    the magic and the format version; the plaintext is padded (Padmé), so a file's size gives the
    number of positions only to a few percent, not exactly."""
    sizes = {}
    for n in range(40, 56):
        store = make_store(tmp_path / str(n))
        store.write(MODEL, WEIGHTS, list(range(n)), host_cache(n))
        blob = the_file(tmp_path / str(n)).read_bytes()
        assert blob[:6] == MAGIC + FORMAT_VERSION.to_bytes(2, "big")
        for clear in (MODEL.encode(), WEIGHTS.encode(), b"tokens", b"float32", b"layers"):
            assert clear not in blob
        assert store.read(MODEL, WEIGHTS, list(range(n))) == host_cache(n)
        sizes[n] = len(blob)
        assert len(blob) < 1.15 * host_cache(n).nbytes  # the padding: a few percent
    assert len(set(sizes.values())) <= len(sizes) // 2  # 16 lengths, at most 8 sizes


def test_a_file_of_the_previous_format_is_a_miss_that_deletes_it_and_the_sweep_removes_it(tmp_path: Path) -> None:
    """Format 1 had the header in clear (MAGIC | header length | msgpack header | nonce | sealed
    payload). One met by `read`, even sealed with this process's own key, is a miss and deleted,
    never parsed as the current format; the start-up sweep removes any such directory unread."""
    key = bytes(range(64))
    store = SsdStore(tmp_path, budget=DiskBudget(tmp_path, GiB, free_bytes_fn=lambda _: 100 * GiB), key=key)
    store.open(MODEL, WEIGHTS)
    tokens, cache = [1, 2, 3], host_cache(3)
    store.write(MODEL, WEIGHTS, tokens, cache)
    path = the_file(tmp_path)
    layers = [[[k.dtype, list(k.shape)], [v.dtype, list(v.shape)]] for k, v in cache.layers]
    header = msgpack.packb({"v": 1, "model": MODEL, "weights": WEIGHTS, "tokens": 3, "layers": layers})
    prefix = MAGIC + struct.pack(">I", len(header)) + header
    nonce = os.urandom(12)
    payload = b"".join(a.data for pair in cache.layers for a in pair)
    path.write_bytes(prefix + nonce + AESGCM(key[:32]).encrypt(nonce, payload, prefix + path.name.encode()))
    assert store.read(MODEL, WEIGHTS, tokens) is None
    assert not path.exists() and store.entries(MODEL) == 0 and store.disk_bytes(MODEL) == 0

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(prefix + nonce)  # a previous process's directory, left by a kill
    assert startup_sweep(tmp_path) == 1 and files_under(tmp_path) == []


def test_names_are_keyed_per_process(tmp_path: Path) -> None:
    first, second = make_store(tmp_path / "a"), make_store(tmp_path / "b")
    first.write(MODEL, WEIGHTS, [7, 7, 7], host_cache(3))
    second.write(MODEL, WEIGHTS, [7, 7, 7], host_cache(3))
    # Same model and tokens, a different per-process key: unrelated names and directories, so a
    # name says nothing about the tokens without the in-memory key.
    a, b = the_file(tmp_path / "a"), the_file(tmp_path / "b")
    assert a.name != b.name and a.parent.name != b.parent.name


@pytest.mark.parametrize("damage", ["flip_ciphertext", "flip_header", "flip_nonce", "truncate",
                                    "empty", "garbage", "extend"])
def test_damaged_file_is_a_miss_that_deletes_it(tmp_path: Path, damage: str) -> None:
    tokens = [1, 2, 3, 4]
    store = make_store(tmp_path)
    store.write(MODEL, WEIGHTS, tokens, host_cache(4))
    path = the_file(tmp_path)
    blob = bytearray(path.read_bytes())
    match damage:
        case "flip_ciphertext":
            blob[-5] ^= 0x01
        case "flip_header":
            blob[12] ^= 0x01
        case "flip_nonce":
            blob[len(blob) - len(blob) // 2] ^= 0x80
        case "truncate":
            blob = blob[: len(blob) // 3]
        case "empty":
            blob = bytearray()
        case "garbage":
            blob = bytearray(os.urandom(len(blob)))
        case "extend":
            blob += b"\0" * 16
    path.write_bytes(bytes(blob))
    assert store.read(MODEL, WEIGHTS, tokens) is None
    assert not path.exists()
    assert store.disk_bytes(MODEL) == 0 and store.entries(MODEL) == 0
    assert store.longest_match(MODEL, tokens) == 0 and store.fetch(MODEL, WEIGHTS, tokens) is None


def test_swapped_files_fail_authentication(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    a, b = [1, 2, 3], [4, 5, 6]
    store.write(MODEL, WEIGHTS, a, host_cache(3, seed=1))
    store.write(MODEL, WEIGHTS, b, host_cache(3, seed=2))
    pa, pb = files_under(tmp_path)
    da, db = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(db)
    pb.write_bytes(da)  # same shapes, valid ciphertexts, wrong names: the name is in the AAD
    assert store.read(MODEL, WEIGHTS, a) is None and store.read(MODEL, WEIGHTS, b) is None
    assert files_under(tmp_path) == []


def test_a_previous_process_files_are_unreadable_and_swept(tmp_path: Path) -> None:
    crashed = make_store(tmp_path)  # "process 1": writes, then dies without purging (kill -9)
    crashed.write(MODEL, WEIGHTS, [1, 2, 3], host_cache(3))
    stale = the_file(tmp_path)
    blob = stale.read_bytes()

    fresh = SsdStore(tmp_path, budget=DiskBudget(tmp_path, GiB, free_bytes_fn=lambda _: 100 * GiB))
    with pytest.raises(InvalidTag):  # a new random key: the old file cannot be opened
        fresh._open_blob(blob, stale.name, MODEL, WEIGHTS)

    (tmp_path / "unrelated-dir").mkdir()
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / ("0" * 64 + ".ab12cd34.tmp")).write_bytes(b"half a write")
    assert startup_sweep(tmp_path) == 2  # the model directory and the stray temp file
    assert not stale.exists() and not stale.parent.exists()
    assert (tmp_path / "unrelated-dir").is_dir() and (tmp_path / "notes.txt").exists()
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700


def test_purge_removes_directory_closes_latch_and_reopen_gets_a_fresh_dir(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    store.write(MODEL, WEIGHTS, [1, 2, 3], host_cache(3))
    first_dir = store.directory(MODEL)
    freed = store.purge(MODEL)
    assert freed > 0 and not first_dir.exists() and files_under(tmp_path) == []
    assert store.write(MODEL, WEIGHTS, [1, 2, 3], host_cache(3)) is WriteOutcome.CLOSED
    assert store.read(MODEL, WEIGHTS, [1, 2, 3]) is None
    assert store.purge(MODEL) == 0  # idempotent
    store.open(MODEL, WEIGHTS)
    assert store.directory(MODEL) != first_dir
    assert store.write(MODEL, WEIGHTS, [1, 2, 3], host_cache(3)) is WriteOutcome.WRITTEN


def test_write_racing_purge_leaves_no_file(tmp_path: Path) -> None:
    """Regression (seed Phase 4): a write that passed the latch, then a purge, then the write lands.

    The hook runs between the latch check and the file write. Without the post-write re-check the
    rename re-creates the purged directory and the file survives; with it, the writer deletes it."""
    store = make_store(tmp_path)
    model_dir = store.directory(MODEL)
    purged = threading.Event()

    def purge_now() -> None:
        store.purge(MODEL)
        purged.set()

    store._between_check_and_write = purge_now
    outcome = store.write(MODEL, WEIGHTS, [9, 8, 7], host_cache(3))
    assert purged.is_set()
    assert outcome is WriteOutcome.RACED_PURGE
    assert files_under(tmp_path) == [] and not model_dir.exists()
    assert store.disk_bytes() == 0


def test_write_racing_purge_from_another_thread(tmp_path: Path) -> None:
    """The same race with a real second thread: the purge runs while the writer is parked in the seam."""
    store = make_store(tmp_path)
    at_seam, purge_done = threading.Event(), threading.Event()

    def park() -> None:
        at_seam.set()
        assert purge_done.wait(10)

    store._between_check_and_write = park
    result: list[WriteOutcome] = []
    writer = threading.Thread(target=lambda: result.append(store.write(MODEL, WEIGHTS, [5, 6], host_cache(2))))
    writer.start()
    assert at_seam.wait(10)
    store.purge(MODEL)
    purge_done.set()
    writer.join(10)
    assert result == [WriteOutcome.RACED_PURGE] and files_under(tmp_path) == []


def test_a_purge_that_removes_the_directory_during_the_write_is_the_same_race(tmp_path: Path, monkeypatch) -> None:
    """The purge's delete lands while the file is being written (its temp file made, not yet renamed):
    the rename finds neither the temp file nor the folder. That is the race the latch is for, not a
    failing disk: the write says RACED_PURGE and leaves nothing (before: FileNotFoundError, logged as
    a failed write with its traceback, at an unload that met a write in progress)."""
    import kvcache.ssd

    store = make_store(tmp_path)
    real_write = kvcache.ssd.atomic_write

    def write_while_purged(path, data, **kw) -> None:
        def pieces():
            store.purge(MODEL)  # the folder and the temp file in it go
            yield from data
        real_write(path, pieces(), **kw)

    monkeypatch.setattr(kvcache.ssd, "atomic_write", write_while_purged)
    assert store.write(MODEL, WEIGHTS, [4, 5, 6], host_cache(3)) is WriteOutcome.RACED_PURGE
    assert files_under(tmp_path) == [] and list(tmp_path.iterdir()) == []
    assert store.disk_bytes() == 0


def test_a_failing_disk_still_fails_the_write(tmp_path: Path, monkeypatch) -> None:
    """Without a purge, an OSError of the write is the caller's (it logs it): nothing is left behind."""
    import errno

    import kvcache.ssd

    store = make_store(tmp_path)

    def full_disk(path, data, **kw) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kvcache.ssd, "atomic_write", full_disk)
    with pytest.raises(OSError):
        store.write(MODEL, WEIGHTS, [4, 5, 6], host_cache(3))
    assert files_under(tmp_path) == [] and store.disk_bytes() == 0
    assert store.longest_match(MODEL, [4, 5, 6]) == 0


def test_budget_is_min_of_configured_and_half_free(tmp_path: Path) -> None:
    assert DiskBudget(tmp_path, 10 * GiB, free_bytes_fn=lambda _: 8 * GiB).limit_bytes() == 4 * GiB
    assert DiskBudget(tmp_path, 1 * GiB, free_bytes_fn=lambda _: 8 * GiB).limit_bytes() == 1 * GiB
    real = DiskBudget(tmp_path, 2**62)  # the default reads the real disk
    assert 0 < real.limit_bytes() <= 2**62


def test_budget_evicts_least_recently_used_files(tmp_path: Path) -> None:
    one = len(_sealed_size(tmp_path / "probe"))
    store = make_store(tmp_path / "kv", budget_bytes=2 * one + one // 2)
    a, b, c = [1, 1, 1], [2, 2, 2], [3, 3, 3]
    for key in (a, b):
        assert store.write(MODEL, WEIGHTS, key, host_cache(3)) is WriteOutcome.WRITTEN
    assert store.read(MODEL, WEIGHTS, a) is not None  # a is now more recent than b
    assert store.write(MODEL, WEIGHTS, c, host_cache(3)) is WriteOutcome.WRITTEN
    assert store.entries(MODEL) == 2 and len(files_under(tmp_path / "kv")) == 2
    assert store.read(MODEL, WEIGHTS, b) is None  # evicted: oldest
    assert store.read(MODEL, WEIGHTS, a) is not None and store.read(MODEL, WEIGHTS, c) is not None
    assert store.disk_bytes(MODEL) == 2 * one
    # A file bigger than the whole budget is refused and nothing is evicted for it.
    assert store.write(MODEL, WEIGHTS, list(range(40)), host_cache(40)) is WriteOutcome.OVER_BUDGET
    assert store.entries(MODEL) == 2


def test_disk_accounting_per_model(tmp_path: Path) -> None:
    budget = DiskBudget(tmp_path, 1000, free_bytes_fn=lambda _: 10**9)
    assert budget.admit(("m1", "f1"), 300).admitted and budget.admit(("m2", "f2"), 300).admitted
    assert budget.admit(("m1", "f3"), 300).admitted
    assert (budget.used_bytes("m1"), budget.used_bytes("m2"), budget.used_bytes()) == (600, 300, 900)
    adm = budget.admit(("m2", "f4"), 300)  # 1200 > 1000: the oldest file goes
    assert adm.admitted and adm.evict == (("m1", "f1"),)
    assert budget.forget_model("m1") == 300 and budget.used_bytes() == 600
    assert budget.discharge(("m2", "f2")) == 300 and budget.discharge(("m2", "f2")) == 0
    assert not budget.admit(("m3", "huge"), 1001).admitted


def _sealed_size(root: Path) -> bytes:
    store = make_store(root)
    store.write(MODEL, WEIGHTS, [0, 0, 0], host_cache(3))
    return the_file(root).read_bytes()


def test_a_longer_sequence_replaces_the_files_it_extends(tmp_path: Path) -> None:
    """A conversation's next turn stores prompt + answer, which extends the previous turn's key: the
    shorter file goes (lookups trim the longer one to it), so a chat keeps one file, not one per turn."""
    store = make_store(tmp_path)
    turn1, other = list(range(5, 45)), [5, 9]
    for key in (turn1, other):
        assert store.write(MODEL, WEIGHTS, key, host_cache(len(key))) is WriteOutcome.WRITTEN
    turn2 = turn1 + [8, 10, 11]
    assert store.write(MODEL, WEIGHTS, turn2, host_cache(len(turn2))) is WriteOutcome.WRITTEN
    assert store.entries(MODEL) == 2 and len(files_under(tmp_path)) == 2
    assert store.read(MODEL, WEIGHTS, turn1) is None and store.read(MODEL, WEIGHTS, other) is not None
    hit = store.fetch(MODEL, WEIGHTS, turn1 + [99])
    assert hit is not None and (hit.key, hit.common) == (tuple(turn2), len(turn1))
    assert store.disk_bytes(MODEL) == sum(p.stat().st_size for p in files_under(tmp_path))
