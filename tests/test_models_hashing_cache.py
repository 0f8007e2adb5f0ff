"""Hashing a model's weights leaves the page cache as it found it (Linux): the pages a hash reads are
dropped behind it, and the pages that were cached before stay cached.

Residency is read per file, page by page (mincore on a private mapping of the file, which asks without
reading), so other activity on the machine cannot move the figures: only this file's pages are counted.
The file is written, synced and dropped first; a filesystem that keeps files in memory anyway (tmpfs)
cannot show anything and is skipped."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import mmap
import os
import sys
from pathlib import Path

import pytest

from provider.models.hashing import DigestCache, weight_hash_sync

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise and mincore: Linux")

MIB = 1 << 20
FILE_MIB = 200
PAGE = mmap.PAGESIZE


def resident(path: Path) -> bytes:
    """One byte per page of the file, 1 where the page is in the page cache."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) as mapping:
        pages = (ctypes.c_ubyte * (-(-len(mapping) // PAGE)))()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(mapping)), pages) == 0, ctypes.get_errno()
        result = bytes(p & 1 for p in pages)
        del address  # the exported buffer must be gone before the mapping closes
    return result


def share(pages: bytes) -> float:
    return sum(pages) / max(1, len(pages))


@pytest.fixture
def cold_model(tmp_path: Path) -> Path:
    """A model folder whose 200 MB weight file is on disk and not in the page cache."""
    folder = tmp_path / "model"
    folder.mkdir()
    weights = folder / "model.safetensors"
    with open(weights, "wb") as handle:
        for _ in range(FILE_MIB):
            handle.write(os.urandom(MIB))
        handle.flush()
        os.fsync(handle.fileno())  # dirty pages cannot be dropped
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    (folder / "config.json").write_text("{}")
    if share(resident(weights)) > 0.05:
        pytest.skip("this filesystem keeps its files in memory (tmpfs?): the page cache cannot be observed")
    return folder


def test_hashing_a_cold_weight_file_does_not_fill_the_page_cache(cold_model):
    weights = cold_model / "model.safetensors"
    digest = weight_hash_sync(cold_model, cache=DigestCache())
    after = resident(weights)
    assert share(after) < 0.05, f"{share(after):.0%} of the {FILE_MIB} MB stayed in the page cache"
    # and the hash is the hash of those bytes (read here after the check: this read fills the cache)
    inner = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (cold_model / "config.json", weights)}
    outer = hashlib.sha256(b"".join(f"{n}\0{inner[n]}\n".encode() for n in sorted(inner)))
    assert digest == outer.hexdigest()


def test_the_pages_cached_before_the_hash_stay_cached(cold_model):
    weights = cold_model / "model.safetensors"
    with open(weights, "rb", buffering=0) as handle:  # the owner read the first half: it is in the cache
        # and only it: readahead past the half would still be in flight (not yet counted as cached) when
        # `before` is taken here, and land before the hash looks, which then rightly keeps it
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        while handle.tell() < FILE_MIB // 2 * MIB:
            handle.read(MIB)
    before = resident(weights)
    assert 0.45 < share(before) < 0.55
    weight_hash_sync(cold_model, cache=DigestCache())
    after = resident(weights)
    kept = sum(1 for b, a in zip(before, after, strict=True) if b and a) / sum(before)
    brought = sum(1 for b, a in zip(before, after, strict=True) if a and not b) / (len(before) - sum(before))
    assert kept > 0.9, f"the hash dropped {1 - kept:.0%} of the pages that were cached before it"
    assert brought < 0.05, f"the hash left {brought:.0%} of the pages it read in the cache"
