"""Solo prefill (provider/engine/prefill.py, worker.py "Solo prefill") on the real tiny model.

A burst is prefilled one prompt at a time, each first token out as soon as its own prompt is, and the
batch holds its decode steps meanwhile (bounded), then decodes the whole burst together. It must give
the same greedy tokens as plain mlx-lm, release every request exactly once wherever it is cancelled,
and let a burst on one cold system prompt reuse the first request's prompt KV.
"""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

from engine_arithmetic import assert_decisive_reply
from engine_reference import NO_EOS, PROMPTS, greedy, messages, reference_greedy
from kvcache.manager import KvCacheManager
from memory.ledger import Ledger, ReservationKind
from memory.policy import GiB, figures
from memory.snapshot import MemorySnapshot
from provider.engine import ChatRequest, Engine, Finished, SamplingParams, TextDelta, worker
from provider.engine.prefill import PREFILL_STEP, PassCosts, solo_threshold, split_head

IDLE = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB)
SYSTEM = {"role": "system", "content": " ".join(["the river model token batch stream is blue"] * 12)}


class Gate:
    """A trace hook that can stop the engine thread before one phase of one request."""

    def __init__(self) -> None:
        self.phases: list[tuple[str | None, str]] = []
        self.hold: tuple[str | None, str] | None = None
        self.reached = threading.Event()
        self.go = threading.Event()

    def __call__(self, model_id: str, request_id: str | None, phase: str) -> None:
        self.phases.append((request_id, phase))
        if self.hold == (request_id, phase):
            self.hold = None
            self.reached.set()
            self.go.wait(30)


async def collect(stream):
    return await stream.collect()


async def test_a_solo_burst_gives_mlx_lm_greedy_tokens(tiny_model_path, reference):
    expected = [reference_greedy(reference, p, 24, eos=NO_EOS)[0] for p in PROMPTS]
    async with Engine(solo_min_tokens=1) as engine:
        info = await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
        assert info.solo_min_tokens == 1
        streams = [engine.submit("tiny", ChatRequest(f"r{i}", messages(p), greedy(24))) for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        alone = [(await engine.submit("tiny", ChatRequest(f"a{i}", messages(p), greedy(24))).collect())[1]
                 for i, p in enumerate(PROMPTS)]
    assert [list(fin.completion_ids) for _, fin in results] == expected
    assert [list(fin.completion_ids) for fin in alone] == expected


async def test_each_first_token_is_out_before_the_next_prompt_is_prefilled(tiny_model_path):
    gate = Gate()
    async with Engine(solo_min_tokens=1, trace=gate) as engine:
        await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
        gate.hold = ("r2", "solo")  # the engine stops before the third prompt's prefill
        streams = [engine.submit("tiny", ChatRequest(f"r{i}", messages(p), greedy(8))) for i, p in enumerate(PROMPTS[:3])]
        await asyncio.to_thread(gate.reached.wait, 30)
        firsts = [await asyncio.wait_for(anext(s), 30) for s in streams[:2]]  # delivered while it waits
        gate.go.set()
        rest = await asyncio.gather(*(collect(s) for s in streams))
    assert all(isinstance(e, TextDelta) for e in firsts)
    assert all(isinstance(fin, Finished) and fin.usage.completion_tokens == 8 for _, fin in rest)
    steps = [p for p in gate.phases if p[1] in ("solo", "batch")]
    # The whole burst is prefilled before the batch steps once: it then decodes all three together.
    assert steps[:3] == [("r0", "solo"), ("r1", "solo"), ("r2", "solo")]
    assert steps[3] == (None, "batch")


async def test_a_running_batch_waits_no_longer_than_the_hold(tiny_model_path, monkeypatch):
    monkeypatch.setattr(worker, "PREFILL_STEP", 16)  # chunks and hold of 16 tokens: several of each
    gate = Gate()
    async with Engine(solo_min_tokens=1, trace=gate) as engine:
        await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
        first = engine.submit("tiny", ChatRequest("first", messages("hello"), greedy(200)))
        assert isinstance(await anext(first), TextDelta)
        long = engine.submit("tiny", ChatRequest("long", messages(" ".join(["river stone"] * 60)), greedy(4)))
        _, fin = await long.collect()
        await first.aclose()
    assert isinstance(fin, Finished)
    solo = [i for i, p in enumerate(gate.phases) if p == ("long", "solo")]
    assert len(solo) > 4  # the long prompt took several chunks
    between = [gate.phases[a + 1:b] for a, b in zip(solo, solo[1:])]
    # One chunk of 16 tokens fills the hold: the running batch steps between every two chunks.
    assert all((None, "batch") in seg for seg in between)


@pytest.mark.parametrize("where", ["queued", "solo", "ready"])
async def test_a_cancel_anywhere_before_the_batch_releases_once(tiny_model_path, where, monkeypatch):
    if where == "solo":
        monkeypatch.setattr(worker, "PREFILL_STEP", 4)  # r1's prompt takes several chunks: cancelled between two
    gate = Gate()
    released: list[str] = []
    async with Engine(solo_min_tokens=1, trace=gate) as engine:
        await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
        # r0's prefill is held at the gate: r1 waits in the queue, or (released) is prefilled and
        # waits ready beside r2, which is held at the gate in turn.
        gate.hold = ("r0", "solo")
        streams = [engine.submit("tiny", ChatRequest(f"r{i}", messages(p), greedy(6)), on_released=released.append)
                   for i, p in enumerate(PROMPTS[:3])]
        await asyncio.to_thread(gate.reached.wait, 30)
        victim = "r1"
        if where != "queued":
            gate.reached.clear()
            gate.hold = ("r2", "solo") if where == "ready" else ("r1", "solo")
            gate.go.set()
            await asyncio.to_thread(gate.reached.wait, 30)
            gate.go.clear()
        if where == "ready":
            assert isinstance(await asyncio.wait_for(anext(streams[1]), 30), TextDelta)  # r1's first token
        engine.cancel(victim)
        gate.go.set()
        others = await asyncio.gather(collect(streams[0]), collect(streams[2]))
        assert await engine.kv_cache_bytes("tiny") == 0  # a round trip: everything has left
    assert all(isinstance(fin, Finished) for _, fin in others)
    assert sorted(released) == ["r0", "r1", "r2"]


async def test_a_burst_on_one_cold_system_prompt_reuses_the_first_prompt(tiny_model_path, reference):
    chats = [[SYSTEM, {"role": "user", "content": f"question {i} about {p}"}] for i, p in enumerate(PROMPTS)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    async with Engine(solo_min_tokens=1) as plain:
        await plain.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
        expected = [(await plain.submit("tiny", ChatRequest(f"p{i}", c, params)).collect())[1].completion_ids
                    for i, c in enumerate(chats)]
    for chat, ids in zip(chats, expected):  # reuse splits the prefill another way: no near-tie allowed
        assert_decisive_reply(reference, chat, ids, chat[-1]["content"])
    ledger = Ledger(figures(16 * GiB, env={}), sample=lambda: IDLE)
    manager = KvCacheManager(ledger)
    async with Engine(prefix_cache=manager.get, solo_min_tokens=1) as engine:
        await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
        manager.attach("tiny", "hash")
        system_tokens = await engine.count_prompt_tokens("tiny", [SYSTEM])
        streams = [engine.submit("tiny", ChatRequest(f"r{i}", c, params)) for i, c in enumerate(chats)]
        got = [(await s.collect())[1].completion_ids for s in streams]
        stats = manager.stats("tiny")
        manager.purge("tiny")
    assert got == expected
    # Every request after the first reused at least the system prompt, though all arrived together.
    assert stats.reused_tokens >= (len(chats) - 1) * (system_tokens - 8)
    assert ledger.snapshot().bytes_by_kind.get(ReservationKind.PREFIX_CACHE, 0) == 0


async def test_max_tokens_one_and_an_eos_first_token_finish_without_the_batch(tiny_model_path, reference):
    first = reference_greedy(reference, PROMPTS[1], 1, eos=NO_EOS)[0][0]
    async with Engine(solo_min_tokens=1) as engine:
        await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
        _, one = await engine.submit("tiny", ChatRequest("one", messages(PROMPTS[1]), greedy(1))).collect()
        await engine.unload("tiny")
        await engine.load("tiny", tiny_model_path, eos_token_ids=frozenset({first}))
        text, eos = await engine.submit("tiny", ChatRequest("eos", messages(PROMPTS[1]), greedy(5))).collect()
    assert one.reason == "length" and list(one.completion_ids) == [first]
    assert eos.reason == "stop" and list(eos.completion_ids) == [first] and text == ""


def test_split_head_only_where_the_logits_are_the_head_of_the_backbone(tiny_model_path):
    model, _ = mlx_lm.load(str(tiny_model_path))
    assert split_head(model) is not None

    class Scaled(nn.Module):  # a model that post-processes its logits (like a soft cap)
        def __init__(self, inner):
            super().__init__()
            self.model, self.inner = inner.model, inner

        def lm_head(self, h):
            return self.model.embed_tokens.as_linear(h)

        @property
        def layers(self):
            return self.inner.layers

        def __call__(self, x, cache=None):
            return 4.0 * self.inner(x, cache=cache)

    scaled = Scaled(model)
    assert scaled(mx.array([[1, 2, 3]])).shape[-1] == model.model.embed_tokens.weight.shape[0]  # it runs
    assert split_head(scaled) is None

    class Headless(nn.Module):
        def __call__(self, x, cache=None):
            return x

    assert split_head(Headless()) is None


def test_solo_threshold():
    assert solo_threshold(PassCosts(fixed_s=0.030, per_token_s=0.004)) == 68  # 30 ms ≤ 10 % of 30 + 68·4
    assert solo_threshold(PassCosts(fixed_s=0.040, per_token_s=0.0)) == PREFILL_STEP
    assert solo_threshold(PassCosts(fixed_s=0.0, per_token_s=0.004)) == 1
    assert solo_threshold(PassCosts(fixed_s=10.0, per_token_s=0.0001)) == PREFILL_STEP


async def test_a_failure_on_a_solo_first_token_fails_that_request_and_the_engine_goes_on(tiny_model_path,
                                                                                          monkeypatch):
    """What a solo first token goes through (its text, stop strings, delivery) failing is that request's
    failure, as it is in the batch's step: the engine thread lives on and serves the next request. The
    log says which failure, for which model, and the exception's type: never its message or the prompt."""
    from provider.engine import Failed
    from provider.engine.types import EngineFailure
    from provider.telemetry import capture_redacted_logs

    on_token = worker.Worker._on_token

    def failing(me, slot, active, *args, **kwargs):
        if active.request_id == "bad":
            raise RuntimeError("a fault in the first token's delivery")
        return on_token(me, slot, active, *args, **kwargs)

    monkeypatch.setattr(worker.Worker, "_on_token", failing)
    with capture_redacted_logs() as logs:
        async with Engine(solo_min_tokens=1) as engine:
            await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
            _, bad = await engine.submit("m", ChatRequest("bad", messages(PROMPTS[0]), greedy(4))).collect()
            _, good = await engine.submit("m", ChatRequest("good", messages(PROMPTS[1]), greedy(4))).collect()
    assert isinstance(bad, Failed) and bad.code is EngineFailure.INTERNAL_ERROR
    assert isinstance(good, Finished) and len(good.completion_ids) == 4
    [failed] = [e for e in logs if e["logger"] == "provider.engine"]
    assert (failed["event"], failed["model"], failed["exc_type"]) == ("first_token_failed", "m", "RuntimeError")
    assert "a fault" not in repr(logs) and PROMPTS[0] not in repr(logs)
