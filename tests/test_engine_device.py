"""MLX's memory settings on the engine: the wired limit follows resident models, not
per-model generators; the memory and buffer-cache limits come from the cap figures.

On this CPU machine `mx.set_wired_limit` does nothing and `device_info()` has no working-set figure,
so the wired-limit tests give MLX a fake Metal `device_info` and a `set_wired_limit` that keeps the
value it is set to and returns the previous one, as Metal's does. Everything else is real: mlx-lm's
`BatchGenerator` (which wires on creation and restores on `close()`), the engine thread, the models.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

import memory
from memory.mlx_limits import CACHE_LIMIT_CEILING_BYTES, MlxLimits, mlx_limits, wired_limit
from memory.policy import GiB, PolicySettings, compute_figures
from provider.engine import ChatRequest, Engine, Finished, SamplingParams
from provider.engine.device import DeviceLimits

MiB = 1 << 20
RECOMMENDED = 3 * GiB  # the fake device's max_recommended_working_set_size


class FakeMetalWired:
    """`mx.set_wired_limit` on Metal: sets the limit, returns the previous one (starts at 0)."""

    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()

    def __call__(self, limit: int) -> int:
        with self.lock:
            previous, self.value = self.value, int(limit)
            return previous


@pytest.fixture
def metal(monkeypatch):
    wired = FakeMetalWired()
    info = {"architecture": "applegpu_g15s", "device_name": "Apple M3 Max", "memory_size": 64 * GiB,
            "max_recommended_working_set_size": RECOMMENDED, "max_buffer_length": 32 * GiB}
    monkeypatch.setattr(mx, "device_info", lambda: dict(info))
    monkeypatch.setattr(mx, "set_wired_limit", wired)
    return wired


async def test_unloading_one_of_two_models_keeps_the_other_wired(metal, tiny_model_path, quantized_model_path):
    """The bug: with one BatchGenerator per model, closing A's restored the limit found before A (0)."""
    engine = Engine()
    try:
        assert metal.value == 0
        await engine.load("a", tiny_model_path)
        assert metal.value == RECOMMENDED
        await engine.load("b", quantized_model_path)
        assert metal.value == RECOMMENDED
        await engine.unload("a")
        assert metal.value == RECOMMENDED  # b is still resident and serving
        _, fin = await engine.submit("b", ChatRequest("r", [{"role": "user", "content": "hi"}],
                                                      SamplingParams(max_tokens=3, temperature=0.0))).collect()
        assert isinstance(fin, Finished)
        assert metal.value == RECOMMENDED
        await engine.unload("b")
        assert metal.value == 0  # nothing resident: what was there before the first model
        await engine.load("a", tiny_model_path)
        assert metal.value == RECOMMENDED
    finally:
        await engine.aclose()
    assert metal.value == 0  # closing unloads every model and gives the limit back


async def test_the_wired_limit_never_passes_the_memory_limit(metal, tiny_model_path):
    limits = MlxLimits(memory_limit_bytes=2 * GiB, cache_limit_bytes=16 * MiB)
    async with Engine(limits=limits) as engine:
        await engine.load("a", tiny_model_path)
        assert metal.value == 2 * GiB
        await engine.unload("a")
        assert metal.value == 0


def read_limits() -> tuple[int, int]:
    """MLX's current memory and cache limits (setting returns the previous value: set it back)."""
    memory_limit = mx.set_memory_limit(1 << 40)
    mx.set_memory_limit(memory_limit)
    cache_limit = mx.set_cache_limit(1 << 30)
    mx.set_cache_limit(cache_limit)
    return memory_limit, cache_limit


async def test_memory_and_cache_limits_apply_while_the_engine_runs(tiny_model_path):
    before = read_limits()
    limits = MlxLimits(memory_limit_bytes=min(before[0], 8 * GiB) - GiB, cache_limit_bytes=before[1] // 2)
    async with Engine(limits=limits) as engine:
        await engine.load("a", tiny_model_path)  # a command round trip: the worker has started
        assert read_limits() == (limits.memory_limit_bytes, limits.cache_limit_bytes)
    assert read_limits() == before  # put back when the engine stops


async def test_a_stricter_cache_limit_in_force_is_kept(tiny_model_path):
    before = read_limits()  # CPU: 32 MiB, below any cap's cache share
    async with Engine(limits=MlxLimits(memory_limit_bytes=before[0], cache_limit_bytes=8 * GiB)) as engine:
        await engine.load("a", tiny_model_path)
        assert read_limits()[1] == before[1]
    assert read_limits() == before


def test_a_refused_wired_limit_is_skipped_not_fatal():
    def refuse(limit):
        raise RuntimeError("[metal::set_wired_limit] Setting a wired limit larger than the maximum")

    fake = SimpleNamespace(device_info=lambda: {"max_recommended_working_set_size": RECOMMENDED},
                           set_wired_limit=refuse, set_memory_limit=lambda n: n, set_cache_limit=lambda n: n)
    device = DeviceLimits(None, mlx=fake)
    device.wire()  # logged, not raised
    device.unwire()


def test_no_wired_limit_on_a_device_without_a_working_set():
    calls = []
    fake = SimpleNamespace(device_info=lambda: {"architecture": "x86_64"}, set_wired_limit=calls.append)
    DeviceLimits(None, mlx=fake).wire()
    assert calls == []


# --- memory.mlx_limits: pure ----------------------------------------------------------------------


def test_limits_from_the_cap_figures():
    f = memory.figures(64 * GiB, env={})
    limits = mlx_limits(f)
    assert limits.memory_limit_bytes == f.effective_cap_bytes
    assert limits.cache_limit_bytes == CACHE_LIMIT_CEILING_BYTES  # 0.75 × 57.6 GiB > 8 GiB
    small = mlx_limits(memory.figures(8 * GiB, env={}))
    assert small.cache_limit_bytes == 3 * GiB  # 0.75 × the 4 GiB cap of an 8 GiB Mac
    assert mlx_limits(memory.figures(8 * GiB, env={}, memory_reserve_gb=8)) is None  # cap 0: nothing loads
    assert wired_limit(None, None) is None and wired_limit(limits, None) is None
    assert wired_limit(small, 48 * GiB) == small.memory_limit_bytes and wired_limit(limits, 40 * GiB) == 40 * GiB


@given(st.integers(min_value=0, max_value=1 << 42), st.floats(min_value=0.05, max_value=1.0),
       st.integers(min_value=0, max_value=64 * GiB))
def test_limits_never_pass_the_cap(physical, fraction, reserve):
    f = compute_figures(physical, PolicySettings(cap_fraction=fraction, memory_reserve_bytes=reserve))
    limits = mlx_limits(f)
    if limits is None:
        assert f.effective_cap_bytes == 0
        return
    assert limits.memory_limit_bytes == f.effective_cap_bytes
    assert 0 <= limits.cache_limit_bytes <= min(CACHE_LIMIT_CEILING_BYTES, limits.memory_limit_bytes * 3 // 4 + 1)
    assert wired_limit(limits, 1 << 50) == limits.memory_limit_bytes
