"""Loading a text model (provider/engine/loading.py): the load serves once before the first request
does (`warm`), leaves nothing behind in the batch, and says where its seconds went."""

from __future__ import annotations

import pytest

from engine_reference import NO_EOS, PROMPTS, greedy, messages
from provider.engine import ChatRequest, Engine, Finished, loading


async def test_a_load_serves_once_and_leaves_the_batch_empty(tiny_model_path, monkeypatch):
    served = []
    warm = loading.warm

    def counted(slot):
        warm(slot)
        served.append((list(slot.generator._generation_batch.uids), list(slot.generator._unprocessed_sequences),
                       slot.generator._counters.generation_tokens))

    monkeypatch.setattr(loading, "warm", counted)
    async with Engine() as engine:
        info = await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        assert await engine.kv_cache_bytes("m") == 0
        _, fin = await engine.submit("m", ChatRequest("r", messages(PROMPTS[0]), greedy(4))).collect()
    assert isinstance(fin, Finished) and len(fin.completion_ids) == 4
    [(uids, waiting, decoded)] = served
    assert uids == [] and waiting == [] and decoded >= 2  # both prompts decoded, and left
    parts = info.weights_seconds + info.measure_seconds + info.warm_seconds
    assert info.warm_seconds > 0 and parts == pytest.approx(info.load_seconds, abs=1e-6)


async def test_a_warm_up_that_fails_costs_the_load_nothing(tiny_model_path, monkeypatch, caplog):
    monkeypatch.setattr(loading, "_WARM_PROMPTS", ([],))  # an empty prompt: mlx-lm refuses the insert
    async with Engine() as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        _, fin = await engine.submit("m", ChatRequest("r", messages(PROMPTS[1]), greedy(3))).collect()
    assert isinstance(fin, Finished) and len(fin.completion_ids) == 3
    assert [r.getMessage() for r in caplog.records if r.name == "provider.engine"] == ["warm-up failed"]
