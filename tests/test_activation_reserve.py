"""The activation reserve measured per model at load (real MLX, the suite's tiny model).

A load already runs timed passes (engine/calibration.py); MLX's peak memory over each of them gives the
model's activation profile (memory/activation.py), which the policy scales to a full prefill window at
the model's whole context. Checked against what a real request of the whole context holds: the reserve
never under-states it, and is at most 1.5 times it.
"""

from __future__ import annotations

import json

import mlx.core as mx

from cli_runner import run_cli
from engine_reference import NO_EOS, greedy
from memory.activation import ReserveSource
from memory.policy import DEFAULT_ACTIVATION_RESERVE_BYTES
from provider.engine import ChatRequest, Engine, Finished
from provider.models.activation import ActivationStore, estimate_for
from provider.models.discovery import inspect_model
from provider.models.kv import round_up_to_step
from provider.runtime import Runtime
from settings_for import settings_for


async def whole_context_peak(engine: Engine, model_id: str, context: int) -> int:
    """What a request of the whole context holds beside the weights and its KV: MLX's peak over it
    (the engine thread is MLX's only user, and idle before and after), less its KV."""
    per_token = await engine.kv_bytes_per_token(model_id)
    await engine.reclaim()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    prompt = [3 + i % 500 for i in range(context - 1)]
    _, fin = await engine.submit(model_id, ChatRequest("whole", [], greedy(1), prompt_ids=prompt)).collect()
    assert isinstance(fin, Finished)
    return mx.get_peak_memory() - before - per_token * round_up_to_step(context)


async def test_the_reserve_measured_at_load_covers_a_whole_context_request_within_half_again(tiny_model_path):
    async with Engine() as engine:
        info = await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        profile = info.activation
        assert profile is not None and profile.source is ReserveSource.MEASURED
        assert profile.window_tokens >= 2048 and profile.peak_bytes > 0  # the largest pass the load ran
        context = info.context_length
        peak = await whole_context_peak(engine, "m", context)
    reserve = profile.reserve_bytes(context)
    assert peak > 0
    assert 1.0 <= reserve / peak <= 1.5, (reserve, peak)
    assert reserve < DEFAULT_ACTIVATION_RESERVE_BYTES / 20  # the fixed 3 GiB was ~80x this
    # Before any load, the config's estimate does not under-state it either.
    estimate = estimate_for(inspect_model(tiny_model_path, "m"), window_tokens=profile.window_tokens,
                            batch_rows=profile.batch_rows)
    assert estimate is not None and estimate.source is ReserveSource.ESTIMATED
    assert estimate.reserve_bytes(context) >= peak


def test_the_store_keeps_a_measurement_for_the_same_weights_only(tmp_path, tiny_model_path):
    info = inspect_model(tiny_model_path, "m")
    estimate = estimate_for(info, window_tokens=2048, batch_rows=32)
    assert estimate is not None
    store = ActivationStore(tmp_path / "state")
    assert store.get(info) is None
    store.put(info, estimate)
    stored = ActivationStore(tmp_path / "state").get(info)  # a fresh process reads it back
    assert stored is not None and stored.source is ReserveSource.STORED
    assert stored.reserve_bytes(2048) == estimate.reserve_bytes(2048)
    other = inspect_model(tiny_model_path, "other")
    assert ActivationStore(tmp_path / "state").get(other) is None  # another model id
    (tmp_path / "state" / ActivationStore.FILE).write_text("{not json")
    assert ActivationStore(tmp_path / "state").get(info) is None  # a damaged file is nothing stored


async def test_a_load_stores_its_measurement_and_doctor_shows_it(tmp_path, tiny_model_path):
    """Before any load doctor shows the config's estimate; the agent's load stores what it measured
    (the state dir), which doctor then shows, and the next start uses, as the model's reserve."""
    settings = settings_for(tmp_path, {"demo/tiny": tiny_model_path})
    env = {"DARKBLOOM_MODEL_ALIASES": f"demo/tiny={tiny_model_path}", "DARKBLOOM_HF_CACHE_DIR": str(tmp_path / "hf"),
           "DARKBLOOM_STATE_DIR": str(settings.state_dir)}

    def doctor_reserve() -> dict:
        out = run_cli("doctor", "--json", "--no-coordinator", env=env, home=tmp_path)
        assert out.returncode == 0, out.stderr
        [model] = json.loads(out.stdout)["models"]
        return model["activation_reserve"]

    before = doctor_reserve()
    assert before["source"] == "estimated" and 0 < before["bytes"] < DEFAULT_ACTIVATION_RESERVE_BYTES
    runtime = await Runtime.start(settings, hash_weights=False)
    try:
        assert runtime.manager.info("demo/tiny").activation.source is ReserveSource.ESTIMATED
        loaded = await runtime.manager.ensure_loaded("demo/tiny")
        measured = loaded.activation
        assert measured is not None and measured.source is ReserveSource.MEASURED
        info = runtime.manager.info("demo/tiny")
        assert info.activation == measured
        # the reserve in force is the resident model's own, not the fixed 3 GiB
        assert runtime.ledger.figures.activation_reserve_bytes == info.activation_reserve_bytes
    finally:
        await runtime.aclose()
    after = doctor_reserve()
    assert after["source"] == "stored" and after["bytes"] == measured.reserve_bytes(info.context_length)
    assert after["measured_peak_bytes"] == measured.peak_bytes > 0
    assert after["measured_peak_tokens"] == measured.peak_tokens > 0
