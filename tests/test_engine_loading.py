"""Loading a text model (provider/engine/loading.py): after the weights, a load measures and warms on a
time budget (budget.py, calibration.py, warmup.py), says where each figure came from, reports each
step as it ends, serves the shapes serving uses once before the first request does, and leaves
nothing behind in the batch."""

from __future__ import annotations

import pytest

from engine_reference import NO_EOS, PROMPTS, greedy, messages, reference_greedy
from provider import mlxlm
from provider.engine import Calibrated, ChatRequest, Engine, Finished, LoadPhase, loading, warmup
from provider.telemetry import capture_redacted_logs

ROOMY = 600.0  # a budget no tiny model's passes come near: every measurement at its full size


async def test_a_load_with_room_measures_everything_and_serves_every_shape_once(tiny_model_path, monkeypatch):
    served = []
    warm = loading.warm

    def counted(slot, budget, passes, **kw):
        warmed = warm(slot, budget, passes, **kw)
        generator = slot.generator
        served.append((warmed, list(mlxlm.generation_batch(generator).uids), list(mlxlm.waiting(generator)),
                       generator.counters.generation_tokens))
        return warmed

    monkeypatch.setattr(loading, "warm", counted)
    async with Engine(measure_budget_s=ROOMY) as engine:
        info = await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        assert await engine.kv_cache_bytes("m") == 0
        _, fin = await engine.submit("m", ChatRequest("r", messages(PROMPTS[0]), greedy(4))).collect()
    assert isinstance(fin, Finished) and len(fin.completion_ids) == 4
    [(warmed, uids, waiting, decoded)] = served
    assert warmed.served == tuple(warmup.Shape) and warmed.skipped == ()
    assert uids == [] and waiting == [] and decoded > 0  # every shape decoded, and left
    assert (info.solo_from, info.rates_from) == (Calibrated.MEASURED, Calibrated.MEASURED)
    assert (info.warm_shapes, info.warm_skipped) == (len(warmup.Shape), 0)
    assert info.solo_min_tokens is not None and info.prefill_tps > 0 and info.decode_tps > 0
    assert info.measure_budget_seconds == ROOMY
    parts = info.weights_seconds + info.measure_seconds + info.warm_seconds
    assert info.warm_seconds > 0 and parts == pytest.approx(info.load_seconds, abs=1e-6)


async def test_a_load_with_no_budget_left_runs_one_pass_falls_back_and_serves(tiny_model_path, reference):
    """The budget spent before the first pass ends (a model whose passes take seconds on this CPU):
    the probe stops after its first pass, so solo prefill is off; the rates come from that pass; no
    shape is warmed; requests are served as they would be."""
    expected, _, _ = reference_greedy(reference, PROMPTS[1], 6, eos=NO_EOS)
    async with Engine(measure_budget_s=0.0) as engine:
        info = await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        _, fin = await engine.submit("m", ChatRequest("r", messages(PROMPTS[1]), greedy(6))).collect()
    assert isinstance(fin, Finished) and list(fin.completion_ids) == expected
    assert info.solo_from is Calibrated.FALLBACK and info.solo_min_tokens is None
    assert info.rates_from is Calibrated.FALLBACK and info.prefill_tps > 0 and info.decode_tps > 0
    assert info.warm_shapes == 0 and info.warm_skipped == len(warmup.Shape) - 1  # solo: off, not skipped


async def test_a_load_reports_each_step_before_it_returns(tiny_model_path, monkeypatch):
    monkeypatch.setattr(loading, "WEIGHT_PART_BYTES", 1 << 20)  # the tiny model's ~5 MB in parts
    phases: list[LoadPhase] = []
    async with Engine(measure_budget_s=ROOMY) as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS, on_progress=phases.append)
    parts = phases.count(LoadPhase.WEIGHTS)
    assert parts >= 4
    assert phases == [LoadPhase.WEIGHTS] * parts + [LoadPhase.WEIGHTS_READ, LoadPhase.SOLO_CALIBRATED] \
        + [LoadPhase.WARM_SHAPE] * len(warmup.Shape) + [LoadPhase.RATES_TIMED]


async def test_weights_read_in_parts_serve_as_read_at_once(tiny_model_path, reference, monkeypatch):
    expected, _, _ = reference_greedy(reference, PROMPTS[3], 8, eos=NO_EOS)
    monkeypatch.setattr(loading, "WEIGHT_PART_BYTES", 1 << 16)
    async with Engine() as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        _, fin = await engine.submit("m", ChatRequest("r", messages(PROMPTS[3]), greedy(8))).collect()
    assert list(fin.completion_ids) == expected


async def test_a_warm_up_that_fails_costs_the_load_nothing(tiny_model_path, monkeypatch):
    monkeypatch.setattr(warmup, "_BURST", (8, 0))  # an empty prompt: mlx-lm refuses the insert
    with capture_redacted_logs() as logs:
        async with Engine(measure_budget_s=ROOMY) as engine:
            info = await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
            assert await engine.kv_cache_bytes("m") == 0
            _, fin = await engine.submit("m", ChatRequest("r", messages(PROMPTS[1]), greedy(3))).collect()
    assert isinstance(fin, Finished) and len(fin.completion_ids) == 3
    [failed] = [e for e in logs if e["logger"] == "provider.engine"]
    assert (failed["event"], failed["level"], failed["model"], failed["phase"]) == ("warm_up_failed", "error", "m", "burst")
    assert failed["exc_type"] == "ValueError" and "redacted" not in failed  # the type, never its message
    assert (info.warm_shapes, info.warm_skipped) == (2, 2)  # alone and solo served; burst failed, wide left
