"""Delivery in a large batch (delivery.py): with `stream_interval_s`, text after a
request's first token is handed over in fewer, longer deltas while more than
STREAM_INTERVAL_MIN_REQUESTS requests run; the text, tokens and order are what every-token delivery
gives, first tokens and ends go out at once, and a small batch is untouched."""

from __future__ import annotations

import asyncio

import pytest

from provider.engine import ChatRequest, Engine, Finished, SamplingParams, TextDelta
from provider.engine.delivery import STREAM_INTERVAL_MIN_REQUESTS

NO_EOS = frozenset()
TOKENS = 24


async def deltas_of(engine: Engine, n: int) -> list[tuple[list[str], Finished]]:
    """n greedy requests submitted together; per request its TextDelta texts and its Finished."""

    async def one(i: int) -> tuple[list[str], Finished]:
        request = ChatRequest(f"r{i}", [{"role": "user", "content": f"tell me about the number {i} and the river"}],
                              SamplingParams(max_tokens=TOKENS, temperature=0.0))
        texts, end = [], None
        async for event in engine.submit("m", request):
            if isinstance(event, TextDelta):
                texts.append(event.text)
            else:
                end = event
        assert isinstance(end, Finished)
        return texts, end

    return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("requests", [STREAM_INTERVAL_MIN_REQUESTS + 2, STREAM_INTERVAL_MIN_REQUESTS])
async def test_a_large_batch_gets_the_same_text_in_fewer_deltas(tiny_model_path, requests: int):
    results = {}
    for interval in (0.0, 60.0):  # 60 s: nothing is released by the clock within this test
        async with Engine(batch_size=16, stream_interval_s=interval) as engine:
            await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
            results[interval] = await deltas_of(engine, requests)
    for (every, every_end), (held, held_end) in zip(results[0.0], results[60.0], strict=True):
        assert held_end.completion_ids == every_end.completion_ids and held_end.usage == every_end.usage
        assert "".join(held) == "".join(every)
        assert held[0] == every[0]  # the first token's text goes out alone, at once
        if requests > STREAM_INTERVAL_MIN_REQUESTS:
            assert len(held) < len(every)  # the rest came held, in longer deltas
        else:
            assert held == every  # a small batch: every token as it comes


async def test_a_cancelled_request_with_held_text_leaves_the_others_whole(tiny_model_path):
    async with Engine(batch_size=16, stream_interval_s=60.0) as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=NO_EOS)
        first_tokens = asyncio.Event()
        seen = {}

        async def watch(i: int) -> str:
            request = ChatRequest(f"w{i}", [{"role": "user", "content": f"count the stones {i}"}],
                                  SamplingParams(max_tokens=TOKENS, temperature=0.0))
            stream = engine.submit("m", request)
            text = []
            async for event in stream:
                if isinstance(event, TextDelta):
                    text.append(event.text)
                    seen[i] = True
                    if len(seen) == STREAM_INTERVAL_MIN_REQUESTS + 2:
                        first_tokens.set()
                    if i == 0:
                        await first_tokens.wait()
                        await stream.aclose()  # its later text is held in the worker now
                        return "cancelled"
                elif isinstance(event, Finished):
                    return "".join(text)
            return "ended"

        outcomes = await asyncio.gather(*(watch(i) for i in range(STREAM_INTERVAL_MIN_REQUESTS + 2)))
        assert outcomes[0] == "cancelled"
        assert all(o not in ("cancelled", "ended") for o in outcomes[1:])
        assert engine.stats("m").num_running == 0 and not engine._worker._delivery.held
