"""The weight hash: file set, exact format, caching, worker thread, symlinked snapshots."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_folders import REV_NEW, model_files, write_dir, write_hf_repo
from provider.models import DigestCache, weight_hash, weight_hash_sync
from provider.models.hashing import hashed_files

HASHED = {
    "model.safetensors": b"weights" * 1000,
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "config.json": b'{"model_type": "llama"}',
    "generation_config.json": b"{}",
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
    "tokenizer.model": b"sp",
    "special_tokens_map.json": b"{}",
    "added_tokens.json": b"{}",
    "vocab.json": b"{}",
    "merges.txt": b"#",
    "chat_template.jinja": b"{{ x }}",
    "tool_use.jinja": b"{{ y }}",
    "chat_template.json": b"{}",
    "cl100k.tiktoken": b"t",
}
NOT_HASHED = {
    "README.md": b"# card",
    ".gitattributes": b"*",
    "adapters.safetensors": b"lora",  # mlx-lm does not load it as part of the model
    "consolidated.safetensors": b"dup",
    "LICENSE": b"text",
}


def expected_hash(directory: Path) -> str:
    """The documented format, recomputed independently."""
    lines = b""
    for name in sorted(HASHED, key=str.encode):
        digest = hashlib.sha256((directory / name).read_bytes()).hexdigest()
        lines += name.encode() + b"\0" + digest.encode() + b"\n"
    return hashlib.sha256(lines).hexdigest()


def test_file_set_and_format(tmp_path: Path) -> None:
    path = write_dir(tmp_path / "m", {**HASHED, **NOT_HASHED})
    (path / "subdir").mkdir()
    (path / "subdir" / "config.json").write_bytes(b"nested files are not hashed")
    assert [p.name for p in hashed_files(path)] == sorted(HASHED, key=str.encode)
    assert weight_hash_sync(path, cache=DigestCache()) == expected_hash(path)


@pytest.mark.parametrize("name", sorted(HASHED))
def test_every_hashed_file_changes_the_hash(tmp_path: Path, name: str) -> None:
    path = write_dir(tmp_path / "m", HASHED)
    before = weight_hash_sync(path, cache=DigestCache())
    (path / name).write_bytes((path / name).read_bytes() + b" ")
    assert weight_hash_sync(path, cache=DigestCache()) != before


def test_unhashed_files_do_not_change_the_hash(tmp_path: Path) -> None:
    path = write_dir(tmp_path / "m", HASHED)
    before = weight_hash_sync(path, cache=DigestCache())
    write_dir(path, NOT_HASHED)
    assert weight_hash_sync(path, cache=DigestCache()) == before


def test_a_renamed_file_changes_the_hash(tmp_path: Path) -> None:
    path = write_dir(tmp_path / "m", HASHED)
    before = weight_hash_sync(path, cache=DigestCache())
    (path / "chat_template.jinja").rename(path / "other.jinja")
    assert weight_hash_sync(path, cache=DigestCache()) != before


def test_no_weights_is_an_error(tmp_path: Path) -> None:
    path = write_dir(tmp_path / "m", {"config.json": b"{}"})
    with pytest.raises(FileNotFoundError):
        weight_hash_sync(path, cache=DigestCache())


def test_digests_are_cached_by_path_size_and_mtime(tmp_path: Path) -> None:
    path = write_dir(tmp_path / "m", HASHED)
    cache = DigestCache()
    first = weight_hash_sync(path, cache=cache)
    assert len(cache) == len(HASHED)
    # Same size, same mtime, different bytes: the cached digest is used (no re-read)...
    weights = path / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"W" + weights.read_bytes()[1:])
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weight_hash_sync(path, cache=cache) == first
    # ...a fresh cache reads it, and a new mtime invalidates the entry.
    assert weight_hash_sync(path, cache=DigestCache()) != first
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert weight_hash_sync(path, cache=cache) != first
    assert len(cache) == len(HASHED) + 1


def test_snapshot_of_symlinks_hashes_like_a_plain_copy(tmp_path: Path) -> None:
    files = model_files()
    repo = write_hf_repo(tmp_path / "hub", "org/m", {REV_NEW: files})
    snapshot = repo / "snapshots" / REV_NEW
    plain = tmp_path / "copy"
    shutil.copytree(snapshot, plain, symlinks=False)
    assert (snapshot / "model.safetensors").is_symlink()
    assert weight_hash_sync(snapshot, cache=DigestCache()) == weight_hash_sync(plain, cache=DigestCache())


async def test_async_hash_runs_off_the_loop_and_reports_progress(tmp_path: Path) -> None:
    big = {**HASHED, "model.safetensors": os.urandom(3 * (1 << 20) + 5)}
    path = write_dir(tmp_path / "m", big)
    loop_thread = threading.get_ident()
    calls: list[tuple[int, int, int]] = []

    def progress(done: int, total: int) -> None:
        calls.append((done, total, threading.get_ident()))

    result = await weight_hash(path, cache=DigestCache(), progress=progress)
    expected = hashlib.sha256(b"".join(
        name.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n"
        for name, data in sorted(big.items(), key=lambda kv: kv[0].encode()))).hexdigest()
    assert result == expected
    total = sum(len(v) for v in big.values())
    assert all(thread != loop_thread for _, _, thread in calls)
    assert all(t == total for _, t, _ in calls)
    dones = [d for d, _, _ in calls]
    assert dones == sorted(dones) and dones[-1] == total
    assert len(calls) > len(big)  # the 3 MiB file reports progress per 1 MiB read


async def test_concurrent_hashes_share_one_cache(tmp_path: Path) -> None:
    paths = [write_dir(tmp_path / f"m{i}", HASHED) for i in range(3)]
    cache = DigestCache()
    results = await asyncio.gather(*(weight_hash(p, cache=cache) for p in paths))
    assert len(set(results)) == 1
    assert len(cache) == 3 * len(HASHED)  # keyed by real path: three copies, three entries


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(HASHED)), st.binary(max_size=64), min_size=1))
def test_hash_is_a_function_of_names_and_contents(tmp_path_factory, files: dict[str, bytes]) -> None:
    files = {"model.safetensors": b"w", **files}
    a = write_dir(tmp_path_factory.mktemp("a"), files)
    b = write_dir(tmp_path_factory.mktemp("b"), dict(reversed(list(files.items()))))
    assert weight_hash_sync(a, cache=DigestCache()) == weight_hash_sync(b, cache=DigestCache())


# --- the cache persists across processes

_SECOND_PROCESS = """
import sys
from pathlib import Path
import provider.models.hashing as hashing

reads = []
real = hashing._file_digest
def counting(path, *args):
    reads.append(path.name)
    if "--forbid-reads" in sys.argv:
        raise AssertionError("read " + path.name)
    return real(path, *args)
hashing._file_digest = counting
cache = hashing.DigestCache.open(Path(sys.argv[2]))
print(hashing.weight_hash_sync(Path(sys.argv[1]), cache=cache))
print(",".join(reads))
"""


def hash_in_a_new_process(model: Path, cache_file: Path, *flags: str) -> tuple[str, list[str]]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, str(model), str(cache_file), *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    digest, reads = out.stdout.splitlines()
    return digest, [r for r in reads.split(",") if r]


def test_a_second_process_reuses_the_persisted_digests_and_rereads_only_what_changed(tmp_path: Path) -> None:
    model = write_dir(tmp_path / "m", {**HASHED, "model-00002-of-00002.safetensors": b"more weights" * 500})
    cache_file = tmp_path / "state" / "weight-hashes.json"
    first, reads = hash_in_a_new_process(model, cache_file)
    assert first == weight_hash_sync(model, cache=DigestCache())
    assert len(reads) == len(HASHED) + 1  # a cold cache reads every file
    assert cache_file.exists() and (cache_file.stat().st_mode & 0o777) == 0o600

    second, reads = hash_in_a_new_process(model, cache_file, "--forbid-reads")
    assert (second, reads) == (first, [])  # nothing read: every digest came from the file

    shard = model / "model-00002-of-00002.safetensors"
    shard.write_bytes(b"other weights" * 500)  # new content, new size and mtime
    third, reads = hash_in_a_new_process(model, cache_file)
    assert reads == [shard.name] and third != first
    assert third == weight_hash_sync(model, cache=DigestCache())


@pytest.mark.parametrize("content", [b"", b"not json", b'{"format": 99, "files": []}', b'{"format": 1, "files": 3}'])
def test_an_unusable_cache_file_is_an_empty_cache(tmp_path: Path, content: bytes) -> None:
    model = write_dir(tmp_path / "m", HASHED)
    cache_file = tmp_path / "weight-hashes.json"
    cache_file.write_bytes(content)
    cache = DigestCache.open(cache_file)
    assert len(cache) == 0
    assert weight_hash_sync(model, cache=cache) == expected_hash(model)
    assert len(DigestCache.open(cache_file)) == len(HASHED)  # rewritten in the current format


def test_entries_of_files_that_are_gone_are_dropped_on_save(tmp_path: Path) -> None:
    a, b = write_dir(tmp_path / "a", HASHED), write_dir(tmp_path / "b", {**HASHED, "config.json": b"{}"})
    cache_file = tmp_path / "weight-hashes.json"
    cache = DigestCache.open(cache_file)
    weight_hash_sync(a, cache=cache)
    weight_hash_sync(b, cache=cache)
    shutil.rmtree(a)
    (b / "extra.jinja").write_bytes(b"{{ z }}")  # something changed: the next hash saves again
    weight_hash_sync(b, cache=cache)
    assert len(DigestCache.open(cache_file)) == len(HASHED) + 1
