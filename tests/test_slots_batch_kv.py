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
from provider.engine import ChatRequest, SamplingParams, TextDelta

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
