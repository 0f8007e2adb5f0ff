"""kvcache.disk.atomic_write: the one way a file is replaced (all or nothing, its mode whatever the umask)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcache.disk import TEMP_SUFFIX, atomic_write


def test_replaces_the_file_with_the_pieces_in_order_and_the_mode_asked_whatever_the_umask(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    target.write_bytes(b"old")
    old = os.umask(0o077)
    try:
        atomic_write(target, [b"a", memoryview(b"bc"), bytearray(b"d")], mode=0o644)
    finally:
        os.umask(old)
    assert target.read_bytes() == b"abcd"
    assert target.stat().st_mode & 0o777 == 0o644
    assert os.listdir(tmp_path) == ["f.json"]


def test_a_failed_write_leaves_the_file_as_it_was_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def pieces():
        yield b"new"
        raise RuntimeError("the writer failed half way")

    with pytest.raises(RuntimeError):
        atomic_write(target, pieces())
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_a_temp_file_a_killed_writer_left_does_not_block_the_next_write(tmp_path: Path) -> None:
    target = tmp_path / "f"
    stale = tmp_path / f".f.{os.getpid()}{TEMP_SUFFIX}"
    stale.write_bytes(b"half")
    atomic_write(target, b"whole")
    assert target.read_bytes() == b"whole" and target.stat().st_mode & 0o777 == 0o600
