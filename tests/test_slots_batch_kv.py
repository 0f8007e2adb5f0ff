"""The batch KV footprint on real MLX: mlx-lm's BatchKVCache stores the whole batch as one
left-padded `(B, heads, T_max, dim)` array per layer, so a short request batched with a long one
really costs the long one's length. The ledger's request_kv reservations for a model must cover
what its batch measures (`engine.kv_cache_bytes`), whichever order the requests arrive in, and
still after the long one leaves (the filtered batch may keep the long buffer until it re-grows).
"""

from __future__ import annotations

import asyncio

import pytest

from manager_rigs import MESSAGES, NEVER_STOP
from memory import ReservationKind
from provider.engine import ChatRequest, Engine, EngineOptions, Finished, FinishReason, SamplingParams, TextDelta
from provider.slots import Booking

SHORT = 3  # short requests beside the long one
SHORT_MAX = 400  # output tokens: they stay in the batch for the whole measurement


def long_messages(words: int) -> list[dict]:
    return [{"role": "user", "content": " ".join(f"w{i % 97}" for i in range(words))}]


class Flight:
    """One request inside `manager.serve`, decoding until `leave` is set."""

    def __init__(self, manager, rid: str, messages, prompt_tokens: int, max_tokens: int) -> None:
        self.started = asyncio.Event()
        self.leave = asyncio.Event()
        self.task = asyncio.create_task(self._run(manager, rid, messages, prompt_tokens, max_tokens))

    async def _run(self, manager, rid, messages, prompt_tokens, max_tokens) -> None:
        async with manager.serve(rid, "tiny", prompt_tokens, max_tokens) as slot:
            stream = slot.submit(ChatRequest(rid, messages, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
            assert isinstance(await anext(stream), TextDelta)
            self.started.set()
            await self.leave.wait()

    async def stop(self) -> None:
        self.leave.set()
        await self.task


def reserved_kv(rig) -> int:
    return rig.ledger.snapshot().bytes_by_kind[ReservationKind.REQUEST_KV]


@pytest.mark.parametrize("long_first", [True, False], ids=["long-first", "short-first"])
async def test_reservations_cover_the_padded_batch(rigs, tiny_model_path, long_first):
    make, _ = rigs
    rig = make({"tiny": tiny_model_path}, 100 * 10**6, eos_token_ids={"tiny": NEVER_STOP})
    m, engine = rig.manager, rig.engine
    await m.ensure_loaded("tiny")
    long_msgs = long_messages(650)
    long_prompt = await engine.count_prompt_tokens("tiny", long_msgs)
    short_prompt = await engine.count_prompt_tokens("tiny", MESSAGES)
    assert 1200 < long_prompt < 1900

    flights: list[Flight] = []

    async def start(rid, msgs, prompt, max_tokens) -> Flight:
        f = Flight(m, rid, msgs, prompt, max_tokens)
        await f.started.wait()  # prefilled and decoding: its cache is in the generation batch
        flights.append(f)
        return f

    try:
        if long_first:
            long = await start("long", long_msgs, long_prompt, 64)
        for i in range(SHORT):
            await start(f"s{i}", MESSAGES, short_prompt, SHORT_MAX)
        if not long_first:
            long = await start("long", long_msgs, long_prompt, 64)

        measured = await engine.kv_cache_bytes("tiny")
        stats = engine.stats("tiny")
        assert stats.num_running == SHORT + 1, "a request left the batch before the measurement"
        assert measured > 0
        assert reserved_kv(rig) >= measured, (measured, reserved_kv(rig))

        # The long one leaves first: the short ones' batch may still hold the long buffer.
        await long.stop()
        flights.remove(long)
        after = await engine.kv_cache_bytes("tiny")  # a round-trip: the cancel was handled
        assert engine.stats("tiny").num_running == SHORT
        assert reserved_kv(rig) >= after, (after, reserved_kv(rig))
    finally:
        for f in flights:
            await f.stop()
    await engine.kv_cache_bytes("tiny")
    assert reserved_kv(rig) == 0


SOLO = 64  # prompt tokens from which a prompt is prefilled alone (the engine's solo_min_tokens)
ANSWER = 16  # output tokens at most


def mixed_burst(n: int) -> list[list[dict]]:
    """`n` prompts: even ones short (prefilled in the batch), odd ones long (prefilled alone)."""
    return [[{"role": "user", "content": f"question number {i} " * (1 if i % 2 == 0 else 24)}] for i in range(n)]


def ends_at(eos: frozenset[int], answer: tuple[int, ...]) -> int:
    """The step a greedy answer ends on with these EOS ids (its length when none comes)."""
    return next((k + 1 for k, token in enumerate(answer) if token in eos), len(answer))


def spread_eos(answers: list[tuple[int, ...]], size: int = 6) -> frozenset[int]:
    """`size` tokens of the answers as EOS ids, picked one by one so that a short and a long prompt's
    request end on their first token, the short ones and the long ones on as many different steps as
    can be, and as many as can be at EOS."""
    def score(eos: frozenset[int]) -> tuple[bool, int, int]:
        steps = [ends_at(eos, a) for a in answers]
        first = {i % 2 for i, step in enumerate(steps) if step == 1}
        stopped = sum(a[step - 1] in eos for a, step in zip(answers, steps))
        return first == {0, 1}, len(set(steps[0::2])) + len(set(steps[1::2])), stopped

    tokens = sorted({t for a in answers for t in a})
    eos: frozenset[int] = frozenset()
    for _ in range(size):
        eos = max((eos | {t} for t in tokens), key=score)
    return eos


async def serve_burst(manager, engine, tag: str, prompts: list[list[dict]]) -> list[Finished]:
    async def one(i: int, messages: list[dict]) -> Finished:
        rid = f"{tag}{i}"
        tokens = await engine.count_prompt_tokens("tiny", messages)
        async with manager.serve(rid, "tiny", tokens, ANSWER) as slot:
            _, fin = await slot.submit(ChatRequest(rid, messages, SamplingParams(max_tokens=ANSWER,
                                                                                 temperature=0.0))).collect()
        assert isinstance(fin, Finished), fin
        return fin

    return list(await asyncio.gather(*(one(i, m) for i, m in enumerate(prompts))))


async def test_requests_that_end_at_eos_at_different_steps_all_leave_the_batch(rigs, tiny_model_path):
    """Random weights almost never emit an EOS token, so no other test has requests leave the batch at
    EOS. Here the EOS ids are tokens of the model's own greedy answers (from a first burst without
    EOS): in a burst of a whole batch, half prefilled in the batch and half alone (solo prefill),
    requests end at EOS on their first token, on later steps and several on one step. After two such
    bursts the model's batch book is empty and a whole batch is admitted again without a refusal."""
    make, _ = rigs
    options = EngineOptions(solo_min_tokens=SOLO)
    async with Engine(options) as probe:
        await probe.load("tiny", tiny_model_path, eos_token_ids=NEVER_STOP)
        prompts = mixed_burst(probe.batch_size)
        short = await probe.count_prompt_tokens("tiny", prompts[0])
        long = await probe.count_prompt_tokens("tiny", prompts[1])
        assert short < SOLO <= long
        answers = await asyncio.gather(*(probe.submit("tiny", ChatRequest(f"p{i}", m, SamplingParams(
            max_tokens=ANSWER, temperature=0.0))).collect() for i, m in enumerate(prompts)))
    eos = spread_eos([fin.completion_ids for _, fin in answers])

    rig = make({"tiny": tiny_model_path}, 100 * 10**6, eos_token_ids={"tiny": eos}, engine_options=options)
    m, engine = rig.manager, rig.engine
    await m.ensure_loaded("tiny")
    for tag in ("a", "b"):
        ends = await serve_burst(m, engine, tag, prompts)
        steps = [fin.usage.completion_tokens for fin in ends]
        assert sum(fin.reason is FinishReason.STOP for fin in ends) >= len(ends) // 3
        assert min(steps[0::2]) == min(steps[1::2]) == 1, steps
        assert len(set(steps[0::2])) >= 3 and len(set(steps[1::2])) >= 2, steps
        assert m.view().slots["tiny"].kv.members == 0
        assert reserved_kv(rig) == 0

    bookings = [m.book(f"c{i}", "tiny", long, ANSWER) for i in range(engine.batch_size)]
    try:
        assert all(isinstance(b, Booking) for b in bookings), bookings
    finally:
        for b in bookings:
            if isinstance(b, Booking):
                b.release()
    assert m.view().slots["tiny"].kv.members == 0
