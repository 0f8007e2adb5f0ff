"""Intake during a step (provider/engine/worker.py): Submits that arrive while a decode step computes
are started before that call's prefill wave is formed; any other command, and every command after
it, waits for the step's end, so their order holds. On the real tiny model."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_reference import NO_EOS, PROMPTS, greedy, messages, reference_greedy
from provider.engine import ChatRequest, Engine, Finished, worker
from provider.mlxlm import waiting, waiting_uid


class DuringStep:
    """Wraps `Worker._intake`: the first time a step computes, the engine thread waits there until the
    test has queued its commands, then takes them as it would have; what the generator then holds is
    recorded before the call goes on to its prefill wave."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int = 1) -> None:
        self.inside = threading.Event()
        self.queued = threading.Event()
        self.unprocessed: list[int] | None = None
        self.deferred: list[str] = []
        self.calls = 0
        intake = worker.Worker._intake

        def wrapped(me: worker.Worker) -> None:
            self.calls += 1
            if self.unprocessed is not None or self.calls < at:
                return intake(me)
            self.inside.set()
            assert self.queued.wait(30)
            intake(me)
            slot = me._slots["m"]
            self.unprocessed = [waiting_uid(entry) for entry in waiting(slot.generator)]
            self.deferred = [type(c).__name__ for c in me._deferred]
            return None

        monkeypatch.setattr(worker.Worker, "_intake", wrapped)


async def test_a_request_arriving_during_a_step_joins_that_calls_prefill_wave(tiny_model_path, reference,
                                                                               monkeypatch):
    during = DuringStep(monkeypatch)
    async with Engine(solo_min_tokens=0, next_turn_scratch_bytes=0) as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        first = engine.submit("m", ChatRequest("a", messages(PROMPTS[0]), greedy(24)))
        assert await asyncio.to_thread(during.inside.wait, 30)  # "a" decodes: its step calls the intake
        second = engine.submit("m", ChatRequest("b", messages(PROMPTS[1]), greedy(8)))
        during.queued.set()
        _, fin = await second.collect()
        _, fin_a = await first.collect()
    assert isinstance(fin, Finished) and len(fin.completion_ids) == 8
    assert isinstance(fin_a, Finished) and len(fin_a.completion_ids) == 24
    # Taken inside the step: inserted into the generator before the call formed its wave.
    assert during.unprocessed is not None and len(during.unprocessed) == 1 and not during.deferred
    assert list(fin.completion_ids) == reference_greedy(reference, PROMPTS[1], 8, eos=NO_EOS)[0]


async def test_other_commands_and_all_after_them_wait_for_the_steps_end(tiny_model_path, monkeypatch):
    during = DuringStep(monkeypatch)
    async with Engine(solo_min_tokens=0, next_turn_scratch_bytes=0) as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        engine.submit("m", ChatRequest("a", messages(PROMPTS[0]), greedy(40)))
        assert await asyncio.to_thread(during.inside.wait, 30)
        engine.cancel("a")  # changes the batch: waits for the step's end
        second = engine.submit("m", ChatRequest("b", messages(PROMPTS[1]), greedy(4)))  # after it: waits too
        during.queued.set()
        _, fin = await second.collect()
    assert during.unprocessed == [] and during.deferred == ["Cancel"]
    assert isinstance(fin, Finished) and len(fin.completion_ids) == 4


async def test_a_command_taken_during_the_last_step_is_answered_when_the_engine_goes_idle(tiny_model_path,
                                                                                          monkeypatch):
    """The step that ends the last request defers the command that came in during it: the engine handles
    it before it waits idle (it waited there for the next command to arrive, however long that took)."""
    during = DuringStep(monkeypatch, at=2)  # greedy(2)'s last step: the intake's second call
    async with Engine(solo_min_tokens=0, next_turn_scratch_bytes=0) as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        only = engine.submit("m", ChatRequest("a", messages(PROMPTS[0]), greedy(2)))
        assert await asyncio.to_thread(during.inside.wait, 30)
        reading = asyncio.ensure_future(engine.kv_cache_bytes("m"))
        await asyncio.sleep(0)  # the command is queued before the step goes on (the call puts it at once)
        during.queued.set()
        _, fin = await only.collect()
        assert isinstance(fin, Finished) and len(fin.completion_ids) == 2
        done, _ = await asyncio.wait({reading}, timeout=20)
        assert done, "the deferred command waited for another command to arrive"
        assert reading.result() >= 0
    assert during.deferred == ["KvCacheBytes"]
