"""memory.heap: the engine hands glibc's free heap pages back, at most every interval while it works and
once when it has nothing left to do.

The rule is checked with a clock in hand; the trim itself with glibc in a fresh interpreter (the heap is
the process's: freed holes between live blocks stay resident until the trim); the engine's use of it on
the tiny model, with the trim recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memory import heap

REPO = Path(__file__).resolve().parents[1]

HOLES = r"""
import ctypes, json
from memory.heap import Trimmer

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

size, n = 64 * 1024, 2048  # under glibc's mmap threshold: from the arena, 128 MiB in all
blocks = [libc.malloc(size) for _ in range(n)]
for b in blocks:
    ctypes.memset(b, 1, size)  # resident
held = rss()
for b in blocks[::2]:
    libc.free(b)  # holes between live blocks: freed, still resident
freed = rss()
trimmer = Trimmer(every_s=0.0)
trimmer.working()
print(json.dumps({"held": held, "freed": freed, "trimmed": rss(), "trims": trimmer.trims}))
"""


@pytest.mark.skipif(heap.malloc_trim() is None, reason="glibc's malloc_trim only")
def test_a_trim_hands_back_the_holes_freed_between_live_blocks() -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", HOLES], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    got = json.loads(out.stdout.splitlines()[-1])
    MiB = 2**20
    assert got["freed"] > got["held"] - 8 * MiB  # glibc kept the freed half resident
    assert got["trims"] == 1 and got["trimmed"] < got["freed"] - 48 * MiB  # ~64 MiB of holes went back


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_working_engine_trims_at_most_every_interval() -> None:
    clock, calls = Clock(), []
    trimmer = heap.Trimmer(calls.append, every_s=30.0, idle_after_s=5.0, clock=clock)
    for _ in range(3):
        trimmer.working()
    assert calls == []
    clock.now += 30.0
    trimmer.working()
    trimmer.working()
    assert calls == [0]
    clock.now += 29.0
    trimmer.working()
    assert calls == [0]
    clock.now += 1.0
    trimmer.working()
    assert calls == [0, 0] and trimmer.trims == 2


def test_an_idle_engine_trims_once_after_work() -> None:
    clock, calls = Clock(), []
    trimmer = heap.Trimmer(calls.append, every_s=30.0, idle_after_s=5.0, clock=clock)
    trimmer.idle()
    assert calls == []  # no work since the start: nothing to give back
    trimmer.working()
    clock.now += 4.0
    trimmer.idle()
    assert calls == []  # the last trim (the start counts as one) is too recent
    clock.now += 1.0
    trimmer.idle()
    trimmer.idle()
    clock.now += 60.0
    trimmer.idle()
    assert calls == [0]  # once: idling on is no new work
    trimmer.working()
    clock.now += 5.0
    trimmer.idle()
    assert calls == [0, 0]


def test_without_glibc_nothing_is_trimmed(monkeypatch) -> None:
    monkeypatch.setattr(heap, "malloc_trim", lambda: None)
    trimmer = heap.Trimmer(every_s=0.0, idle_after_s=0.0)
    trimmer.working()
    trimmer.idle()
    assert trimmer.trims == 0


async def test_the_engine_trims_when_it_has_nothing_left_to_do(tiny_model_path: Path, monkeypatch) -> None:
    """After a request the engine trims once before it waits for the next command (so a command
    answered after the request's end comes after the trim), and not again while it only idles."""
    import provider.engine.worker
    from provider.engine import ChatRequest, Engine, Finished, SamplingParams

    calls: list[int] = []
    monkeypatch.setattr(provider.engine.worker, "Trimmer",
                        lambda: heap.Trimmer(calls.append, every_s=3600.0, idle_after_s=0.0))
    async with Engine() as engine:
        await engine.load("tiny", tiny_model_path)
        await engine.kv_cache_bytes("tiny")
        assert calls == []  # a load is no serving work
        chat = [{"role": "user", "content": "hello there"}]
        _, fin = await engine.submit("tiny", ChatRequest("r0", chat, SamplingParams(max_tokens=4))).collect()
        assert isinstance(fin, Finished)
        await engine.kv_cache_bytes("tiny")
        assert calls == [0]
        await engine.kv_cache_bytes("tiny")
        assert calls == [0]
