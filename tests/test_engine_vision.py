"""provider/engine on the tiny VLM (real mlx-vlm on MLX): vision requests on the one worker thread.

* greedy output equals mlx-vlm's own `generate` for the same messages and images;
* the media hook fires once when the rasters and pixel tensor are gone, the KV hook once when the
  request ends, on every path (finish, cancel, unload, a refusal);
* text requests keep being stepped between a vision request's pre-token steps (the structural
  property; the decode-rate figure is measured in benchmarks/vision_bench.py).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_arithmetic import mlx_vlm_greedy
from provider.engine import ChatRequest, Engine, EngineFailure, Failed, Finished, SamplingParams, TextDelta
from provider.engine.vision import DutyCycle
from provider.request.body import IMAGE_MARKER
from provider.request.media import decode_images, inspect_images
from vision_images import data_uri, jpeg_bytes, png_bytes

NO_EOS = frozenset({10**9})
PREFILL_STEP = 8  # small, so a request with two images prefills in several interleaved steps


def two_image_messages() -> list[dict]:
    return [{"role": "system", "content": "describe briefly"},
            {"role": "user", "content": ({"type": "text", "text": "what is in"}, IMAGE_MARKER,
                                         {"type": "text", "text": "and in"}, IMAGE_MARKER)}]


def two_images():
    plan = inspect_images([data_uri(png_bytes(40, 30, (220, 30, 30))),
                           data_uri(jpeg_bytes(96, 64, (20, 40, 200)), "image/jpeg")])
    return tuple(decode_images(plan))


class Hooks:
    """Release hooks that record (kind, request id, thread name) in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.kv_done = threading.Event()

    def media(self, rid: str) -> None:
        self.calls.append(("media", rid, threading.current_thread().name))

    def kv(self, rid: str) -> None:
        self.calls.append(("kv", rid, threading.current_thread().name))
        self.kv_done.set()

    def kinds(self, rid: str) -> list[str]:
        return [k for k, r, _ in self.calls if r == rid]


@pytest.fixture
async def engine():
    eng = Engine(vision_prefill_step=PREFILL_STEP)
    yield eng
    await eng.aclose()


async def test_greedy_output_equals_mlx_vlm_generate(engine, tiny_vlm_path):
    from mlx_vlm import load

    from provider.engine.vlm import render_prompt

    info = await engine.load("vlm", tiny_vlm_path, vision=True)
    assert info.vision and info.context_length == 4096
    images = two_images()
    hooks = Hooks()
    stream = engine.submit("vlm", ChatRequest("v1", two_image_messages(), SamplingParams(max_tokens=24, temperature=0),
                                              images=images), on_released=hooks.kv, on_media_released=hooks.media)
    text, done = await stream.collect()
    assert isinstance(done, Finished)
    # mlx-vlm's own pipeline, same prompt and images, same prefill step, on this (idle) thread,
    # under the engine's attention (engine_arithmetic.py).
    model, processor = load(str(tiny_vlm_path))
    prompt, n_images = render_prompt(processor, model.config, two_image_messages())
    assert n_images == 2
    ref = mlx_vlm_greedy(model, processor, prompt, list(images), 24, prefill_step_size=PREFILL_STEP)
    assert len(done.completion_ids) >= 8  # enough output to compare
    assert list(done.completion_ids) == ref.token_ids[:len(done.completion_ids)]
    if done.reason.value == "length":
        assert list(done.completion_ids) == ref.token_ids
    assert done.usage.prompt_tokens == ref.prompt_tokens  # exact: the image soft tokens included
    assert done.usage.prompt_tokens > 2 * 16
    assert text == processor.tokenizer.decode([t for t in done.completion_ids if t not in info.eos_token_ids])
    assert hooks.kinds("v1") == ["media", "kv"]
    assert {t for _, _, t in hooks.calls} == {"mlx-engine"}


async def test_media_is_released_after_encoding_and_kv_at_the_end(engine, tiny_vlm_path):
    trace: list[tuple[str, str | None, str]] = []
    hooks = Hooks()

    def media(rid: str) -> None:
        trace.append(("hook", rid, "media"))
        hooks.media(rid)

    eng = Engine(vision_prefill_step=PREFILL_STEP, trace=lambda m, r, p: trace.append((m, r, p)))
    try:
        await eng.load("vlm", tiny_vlm_path, vision=True, eos_token_ids=NO_EOS)
        stream = eng.submit("vlm", ChatRequest("v", two_image_messages(), SamplingParams(max_tokens=5, temperature=0),
                                               images=two_images()), on_released=hooks.kv, on_media_released=media)
        _, done = await stream.collect()
        assert isinstance(done, Finished) and done.usage.completion_tokens == 5
        phases = [p for m, r, p in trace if r == "v"]
        assert phases[0] == "prepare" and phases[1] == "encode"
        assert phases.count("prefill") >= 3 and phases.count("decode") == 4
        assert trace.index(("hook", "v", "media")) == trace.index(("vlm", "v", "encode")) + 1
        assert hooks.kinds("v") == ["media", "kv"]
    finally:
        await eng.aclose()


async def test_cancel_during_prefill_releases_media_and_kv_once(engine, tiny_vlm_path):
    await engine.load("vlm", tiny_vlm_path, vision=True, eos_token_ids=NO_EOS)
    hooks = Hooks()
    stream = engine.submit("vlm", ChatRequest("c", two_image_messages(), SamplingParams(max_tokens=500, temperature=0),
                                              images=two_images()), on_released=hooks.kv, on_media_released=hooks.media)
    engine.cancel("c")
    assert await asyncio.to_thread(hooks.kv_done.wait, 30)
    assert hooks.kinds("c") == ["media", "kv"]
    assert [e async for e in stream] == []  # a cancel ends the stream with no event
    assert engine.stats("vlm").num_running + engine.stats("vlm").num_waiting == 0
    assert await engine.kv_cache_bytes("vlm") == 0


async def test_unload_fails_running_vision_requests_and_releases(engine, tiny_vlm_path):
    await engine.load("vlm", tiny_vlm_path, vision=True, eos_token_ids=NO_EOS)
    hooks = Hooks()
    stream = engine.submit("vlm", ChatRequest("u", two_image_messages(), SamplingParams(max_tokens=2000, temperature=0),
                                              images=two_images()), on_released=hooks.kv, on_media_released=hooks.media)
    first = await anext(stream)
    assert isinstance(first, TextDelta)
    await engine.unload("vlm")
    rest = [e async for e in stream]
    assert rest[-1] == Failed(EngineFailure.MODEL_UNLOADED)
    assert hooks.kinds("u") == ["media", "kv"]


async def test_images_for_a_text_model_are_refused_and_released(engine, tiny_model_path):
    await engine.load("tiny", tiny_model_path)
    hooks = Hooks()
    stream = engine.submit("tiny", ChatRequest("t", [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3),
                                               images=two_images()), on_released=hooks.kv, on_media_released=hooks.media)
    assert [e async for e in stream] == [Failed(EngineFailure.INVALID_REQUEST)]
    assert hooks.kinds("t") == ["media", "kv"]


async def test_the_output_is_clamped_to_the_reserved_span(engine, tiny_vlm_path):
    await engine.load("vlm", tiny_vlm_path, vision=True, eos_token_ids=NO_EOS)
    probe = engine.submit("vlm", ChatRequest("p", two_image_messages(), SamplingParams(max_tokens=1, temperature=0),
                                             images=two_images()))
    _, done = await probe.collect()
    prompt = done.usage.prompt_tokens
    stream = engine.submit("vlm", ChatRequest("s", two_image_messages(), SamplingParams(max_tokens=50, temperature=0),
                                              images=two_images(), kv_tokens=prompt + 7))
    _, done = await stream.collect()
    assert done.usage.completion_tokens == 7 and done.reason.value == "length"
    short = engine.submit("vlm", ChatRequest("x", two_image_messages(), SamplingParams(max_tokens=50, temperature=0),
                                             images=two_images(), kv_tokens=prompt - 1))
    assert (await short.collect())[1] == Failed(EngineFailure.INTERNAL_ERROR)  # never past the reservation


async def test_a_text_only_request_on_the_vlm(engine, tiny_vlm_path):
    await engine.load("vlm", tiny_vlm_path, vision=True, eos_token_ids=NO_EOS)
    stream = engine.submit("vlm", ChatRequest("t", [{"role": "user", "content": "hello there"}],
                                              SamplingParams(max_tokens=6, temperature=0)))
    text, done = await stream.collect()
    assert isinstance(done, Finished) and done.usage.completion_tokens == 6 and text


async def test_text_keeps_streaming_between_vision_prefill_steps(tiny_model_path, tiny_vlm_path):
    """Structural: while a vision request is before its first token, the text batch is stepped
    between any two of its steps (and its output keeps arriving)."""
    trace: list[tuple[str, str | None, str]] = []
    eng = Engine(vision_prefill_step=4, trace=lambda m, r, p: trace.append((m, r, p)))
    try:
        await eng.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
        await eng.load("vlm", tiny_vlm_path, vision=True, eos_token_ids=NO_EOS)
        text_stream = eng.submit("tiny", ChatRequest("text", [{"role": "user", "content": "count with me"}],
                                                     SamplingParams(max_tokens=1500, temperature=0)))
        await anext(text_stream)  # the text request is decoding
        vision = eng.submit("vlm", ChatRequest("vis", two_image_messages(), SamplingParams(max_tokens=3, temperature=0),
                                               images=two_images()))
        _, done = await vision.collect()
        assert isinstance(done, Finished)
        await text_stream.aclose()
    finally:
        await eng.aclose()
    pre = [i for i, (m, r, p) in enumerate(trace) if r == "vis" and p in ("prepare", "encode", "prefill")]
    assert len(pre) >= 10  # 2 images × 16 soft tokens + text, 4 tokens per prefill step
    last_text = max(i for i, (m, r, _) in enumerate(trace) if r is None and m == "tiny")
    while_text_ran = [i for i in pre if i < last_text]  # (a text request that has ended has no steps)
    assert len(while_text_ran) >= 10
    for a, b in zip(while_text_ran, while_text_ran[1:]):
        assert any(r is None and m == "tiny" for m, r, _ in trace[a + 1:b]), "no text step between vision steps"


def test_duty_cycle_limits_vision_to_its_share() -> None:
    duty = DutyCycle(share=0.2, max_credit_s=10)
    text = vision = 0.0
    for _ in range(1000):  # text steps of 10 ms; vision steps of 30 ms whenever allowed
        duty.text_ran(0.010)
        text += 0.010
        if duty.may_run():
            duty.vision_ran(0.030)
            vision += 0.030
    assert vision / (text + vision) <= 0.2 + 0.01
    assert vision / (text + vision) > 0.15
    duty.reset()
    assert not duty.may_run()
