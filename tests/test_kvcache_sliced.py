"""The SSD tier's host work in slices (kvcache/host.py SLICE_BYTES): copies and AES-GCM in pieces
that each hold the GIL briefly, with the same bytes on disk as one-shot AES-GCM (format 2 unchanged)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache.host
import kvcache.ssd
from kvcache.disk import DiskBudget
from kvcache.host import HostArray, HostCache, copy_sliced
from kvcache.ssd import FORMAT_VERSION, MAGIC, SsdStore

GiB = 2**30
MODEL, WEIGHTS = "org/tiny-model", "sha256:abc"
KEY = bytes(range(64))
CLEAR = MAGIC + struct.pack(">H", FORMAT_VERSION)


def big_cache(tokens: int, *, layers: int = 2) -> HostCache:
    """float32 [1, 2, tokens, 64] per array: 512 bytes a token an array."""
    def arr(i: int) -> HostArray:
        shape = (1, 2, tokens, 64)
        n = HostArray.expected_nbytes("float32", shape)
        return HostArray("float32", shape, bytes((i * 7 + j) % 251 for j in range(n)))

    return HostCache(tokens, tuple((arr(2 * li), arr(2 * li + 1)) for li in range(layers)))


def store_at(root: Path) -> SsdStore:
    store = SsdStore(root, budget=DiskBudget(root, GiB, free_bytes_fn=lambda _: 100 * GiB), key=KEY)
    store.open(MODEL, WEIGHTS)
    return store


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=200), slice_bytes=st.integers(1, 17))
def test_a_sliced_copy_is_the_whole_copy(data: bytes, slice_bytes: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvcache.host, "SLICE_BYTES", slice_bytes)
        out = bytearray(len(data))
        copy_sliced(memoryview(data), memoryview(out))
    assert out == data


def test_a_sliced_copy_refuses_another_length() -> None:
    with pytest.raises(ValueError):
        copy_sliced(memoryview(b"abc"), memoryview(bytearray(2)))


@pytest.mark.parametrize("slice_bytes", [1000, 4096, 1 << 20])
def test_a_file_sealed_in_slices_is_what_one_shot_aes_gcm_seals(tmp_path: Path, monkeypatch, slice_bytes: int) -> None:
    """Written in slices (several slices per array, slices across array bounds), the file opens with
    one-shot AES-GCM; one sealed in one shot reads back through the sliced reader."""
    monkeypatch.setattr(kvcache.ssd, "SLICE_BYTES", slice_bytes)
    store = store_at(tmp_path)
    tokens, cache = list(range(3, 40)), big_cache(37)  # 37 x 512 = 18,944 bytes an array
    store.write(MODEL, WEIGHTS, tokens, cache)
    (path,) = [p for p in tmp_path.rglob("*") if p.is_file()]
    blob = path.read_bytes()
    assert blob[: len(CLEAR)] == CLEAR
    nonce = blob[len(CLEAR): len(CLEAR) + 12]
    plaintext = AESGCM(KEY[:32]).decrypt(nonce, blob[len(CLEAR) + 12:], CLEAR + path.name.encode())
    (hlen,) = struct.unpack_from(">I", plaintext)
    ids = 4 + hlen + 4 * len(tokens)  # the token ids (u32 LE) come between the header and the arrays
    assert plaintext[4 + hlen: ids] == struct.pack(f"<{len(tokens)}I", *tokens)
    assert plaintext[ids: ids + cache.nbytes] == b"".join(a.data for pair in cache.layers for a in pair)

    fresh_nonce = bytes(12)
    path.write_bytes(CLEAR + fresh_nonce + AESGCM(KEY[:32]).encrypt(fresh_nonce, plaintext, CLEAR + path.name.encode()))
    back = store.read(MODEL, WEIGHTS, tokens)
    assert back is not None and back.tokens == 37
    assert [(bytes(k.data), bytes(v.data)) for k, v in back.layers] == [(k.data, v.data) for k, v in cache.layers]


def test_a_change_anywhere_in_a_sliced_file_is_a_miss(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(kvcache.ssd, "SLICE_BYTES", 1000)
    store = store_at(tmp_path)
    tokens, cache = list(range(3, 40)), big_cache(37)
    store.write(MODEL, WEIGHTS, tokens, cache)
    (path,) = [p for p in tmp_path.rglob("*") if p.is_file()]
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 1  # a byte in a middle slice
    path.write_bytes(bytes(blob))
    assert store.read(MODEL, WEIGHTS, tokens) is None
    assert not path.exists()
