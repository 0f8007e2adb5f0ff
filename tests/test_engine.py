"""provider/engine on a real tiny MLX model: correctness of batched generation and streaming."""

from __future__ import annotations

import asyncio
import threading

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine_arithmetic import assert_decisive_reply
from engine_reference import NO_EOS, PROMPTS, greedy, messages, reference_greedy
from protocol import sse
from provider.engine import (
    ChatRequest,
    Engine,
    EngineFailure,
    Failed,
    Finished,
    FinishReason,
    SamplingParams,
    TextDelta,
)
from provider.response.openai import ChatChunks, chat_completion


@pytest.fixture
async def engine():
    eng = Engine()
    yield eng
    await eng.aclose()
    assert not eng._thread.is_alive()


async def run(engine: Engine, model_id: str, rid: str, content: str, params: SamplingParams, **kw):
    return await engine.submit(model_id, ChatRequest(rid, messages(content), params), **kw).collect()


async def test_greedy_matches_mlx_lm_generate_sequentially_and_concurrently(engine, tiny_model_path, reference):
    await engine.load("tiny", tiny_model_path)
    max_tokens = [24, 31, 17, 40]
    expected = [reference_greedy(reference, p, n) for p, n in zip(PROMPTS, max_tokens)]

    sequential = [await run(engine, "tiny", f"s{i}", p, greedy(n))
                  for i, (p, n) in enumerate(zip(PROMPTS, max_tokens))]
    concurrent = await asyncio.gather(*(run(engine, "tiny", f"c{i}", p, greedy(n))
                                        for i, (p, n) in enumerate(zip(PROMPTS, max_tokens))))

    for (ids, text, n_prompt), seq, conc in zip(expected, sequential, concurrent):
        for got_text, fin in (seq, conc):
            assert isinstance(fin, Finished)
            assert list(fin.completion_ids) == ids
            assert got_text == text
            assert fin.usage.prompt_tokens == n_prompt
            assert fin.usage.completion_tokens == len(ids)
    assert sequential == concurrent


async def test_request_joining_a_running_batch_produces_before_earlier_ones_finish(engine, tiny_model_path):
    await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
    log: list[tuple[str, object]] = []
    long = engine.submit("tiny", ChatRequest("long", messages(PROMPTS[1]), greedy(400)))

    async def consume(name, stream):
        async for event in stream:
            log.append((name, event))

    for _ in range(5):
        log.append(("long", await anext(long)))
    long_task = asyncio.create_task(consume("long", long))
    short = engine.submit("tiny", ChatRequest("short", messages(PROMPTS[0]), greedy(6)))
    await consume("short", short)
    stats_while_long_runs = engine.stats("tiny")
    await long_task

    order = [(name, type(ev)) for name, ev in log]
    first_short = order.index(("short", TextDelta))
    short_done = order.index(("short", Finished))
    long_done = order.index(("long", Finished))
    assert first_short < short_done < long_done
    assert any(name == "long" for name, _ in order[first_short:short_done])  # they interleaved
    assert stats_while_long_runs.num_running == 1  # the long one was still decoding
    assert log[long_done][1].usage.completion_tokens == 400


async def test_cancel_mid_stream_stops_events_frees_cache_and_spares_others(engine, tiny_model_path, reference):
    await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
    _, solo = await run(engine, "tiny", "solo", PROMPTS[2], greedy(60))
    # `other` runs batched (other shapes, other last bits): equal to `solo` only where no choice is a near-tie.
    assert_decisive_reply(reference, messages(PROMPTS[2]), solo.completion_ids, "solo")

    loop = asyncio.get_running_loop()
    released: dict[str, str] = {}
    cancelled_released = asyncio.Event()

    def on_released(request_id: str) -> None:
        released[request_id] = threading.current_thread().name
        if request_id == "victim":
            loop.call_soon_threadsafe(cancelled_released.set)

    victim = engine.submit("tiny", ChatRequest("victim", messages(PROMPTS[1]), greedy(1000)),
                           on_released=on_released)
    other = engine.submit("tiny", ChatRequest("other", messages(PROMPTS[2]), greedy(60)),
                          on_released=on_released)
    other_task = asyncio.create_task(other.collect())
    for _ in range(5):
        assert isinstance(await anext(victim), TextDelta)
    kv_with_both = await engine.kv_cache_bytes("tiny")

    await victim.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(victim)
    await cancelled_released.wait()
    assert not other_task.done()  # released while the other request was still running
    kv_after = await engine.kv_cache_bytes("tiny")
    assert 0 < kv_after < kv_with_both

    _, other_fin = await other_task
    assert other_fin.completion_ids == solo.completion_ids
    assert released == {"victim": "mlx-engine", "other": "mlx-engine"}
    assert await engine.kv_cache_bytes("tiny") == 0
    assert engine.stats("tiny").active_tokens == 0
    with pytest.raises(StopAsyncIteration):  # still nothing after the others finished
        await anext(victim)


async def test_stop_string_straddling_tokens_is_cut_and_never_half_emitted(engine, tiny_model_path, reference):
    ids, text, _ = reference_greedy(reference, PROMPTS[3], 40, eos=NO_EOS)
    await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
    _, tok = reference
    # A stop string that starts inside one token's text and ends inside a later one.
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    start = len(pieces[5]) - 1
    stop = text[start: len(pieces[7]) + 1]
    assert len(stop) >= 3 and text.find(stop) == start

    stream = engine.submit("tiny", ChatRequest("s", messages(PROMPTS[3]), greedy(40, stop=(stop,))))
    deltas = []
    async for event in stream:
        if isinstance(event, TextDelta):
            deltas.append(event.text)
        else:
            fin = event
    assert "".join(deltas) == text[:start]
    assert fin.reason is FinishReason.STOP
    assert fin.usage.completion_tokens == len(fin.completion_ids) < 40


async def test_eos_token_ends_with_stop_and_is_counted_but_not_emitted(engine, tiny_model_path, reference):
    ids, _, _ = reference_greedy(reference, PROMPTS[1], 40, eos=NO_EOS)
    eos = ids[6]
    first = ids.index(eos)
    await engine.load("tiny", tiny_model_path, eos_token_ids=frozenset({eos}))
    text, fin = await run(engine, "tiny", "e", PROMPTS[1], greedy(40))
    assert fin.reason is FinishReason.STOP
    assert list(fin.completion_ids) == ids[: first + 1]
    assert text == reference[1].decode(ids[:first])


async def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine, tiny_model_path):
    await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
    seeded = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=1234)
    _, alone = await run(engine, "tiny", "alone", PROMPTS[0], seeded)
    batch = await asyncio.gather(
        run(engine, "tiny", "b0", PROMPTS[1], greedy(30)),
        run(engine, "tiny", "b1", PROMPTS[0], seeded),
        run(engine, "tiny", "b2", PROMPTS[2], SamplingParams(max_tokens=30, temperature=1.0)),
        run(engine, "tiny", "b3", PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.9, seed=99)),
    )
    # Batched, the logits differ from alone's in their last bits (~1e-7). A draw is the best of the
    # Gumbel-perturbed scores, whose lead over the second is exponential with mean 1: it flips only
    # when that lead is below ~1e-7, odds of about 1e-5 over these 30 steps (greedy needs a guard).
    assert batch[1][1].completion_ids == alone.completion_ids
    assert batch[3][1].completion_ids != alone.completion_ids


async def test_prompt_longer_than_context_is_refused_up_front(engine, tiny_model_path):
    info = await engine.load("tiny", tiny_model_path)
    long = " ".join(["river"] * (info.context_length + 10))
    n = await engine.count_prompt_tokens("tiny", messages(long))
    assert n > info.context_length
    released = []
    stream = engine.submit("tiny", ChatRequest("big", messages(long), greedy(8)), on_released=released.append)
    events = [e async for e in stream]
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].code.value == "request_exceeds_context" and events[0].code.is_client_error
    assert released == ["big"]
    assert engine.stats("tiny").active_tokens == 0
    _, fin = await run(engine, "tiny", "ok", PROMPTS[0], greedy(3))  # the engine still serves
    assert fin.usage.completion_tokens == 3


async def test_prompt_token_count_matches_usage(engine, tiny_model_path):
    await engine.load("tiny", tiny_model_path)
    for i, p in enumerate(PROMPTS):
        _, fin = await run(engine, "tiny", f"p{i}", p, greedy(2))
        assert await engine.count_prompt_tokens("tiny", messages(p)) == fin.usage.prompt_tokens


async def test_openai_chunks_and_completion_validate_with_the_openai_sdk(engine, tiny_model_path):
    await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
    chunks = ChatChunks("chatcmpl-1", "tiny")
    frames = [sse.event(chunks.role())]
    text = ""
    async for event in engine.submit("tiny", ChatRequest("o", messages(PROMPTS[0]), greedy(12))):
        frames += [sse.event(chunk) for chunk in chunks.for_event(event)]
        if isinstance(event, TextDelta):
            text += event.text
        fin = event
    assert all(f.startswith(b"data: ") and f.endswith(b"\n\n") for f in frames)
    parsed = [ChatCompletionChunk.model_validate_json(f[len(b"data: "):]) for f in frames]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parsed) == text
    assert parsed[-1].choices[0].finish_reason == "length"
    assert parsed[-1].usage.completion_tokens == 12
    assert all(p.choices[0].finish_reason is None for p in parsed[:-1])
    assert chunks.for_event(Failed(EngineFailure.INTERNAL_ERROR)) == []
    frame = sse.event(chat_completion("chatcmpl-1", "tiny", text, fin))
    full = ChatCompletion.model_validate_json(frame[len(b"data: "):])
    assert full.choices[0].message.content == text
    assert full.usage.total_tokens == fin.usage.total_tokens
