"""Vision requests end to end through a job (the coordinator path, no socket): real engine, real
mlx-vlm, the tiny VLM, the real model manager and ledger on an emulated machine.

* a PNG + JPEG chat equals mlx-vlm's own `generate` on the same messages (mlx-vlm decoding the same
  data: URIs itself), with exact usage;
* the ledger holds the request's `media` (the projected decode bytes) and its KV span while the
  image is encoded; both are released on every path: finish, cancel, disconnect, error;
* 10 concurrent vision requests: the admitted ones are served, the rest fast 503 (no accept);
* bounds before allocation reach the wire as 400 / 413 / 415 without an accept.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from engine_arithmetic import mlx_vlm_greedy
from job_harness import Coordinator, sse_json
from memory import Ledger, Probe, ReservationKind
from memory.media import projected_decode_bytes
from provider.config import Settings
from provider.doctor import cap_figures
from provider.engine import Engine
from provider.jobs import JobContext, JobOutcome, PromptCounter, ServingStats, run_job
from provider.models import discover, kv_bytes_for_tokens
from provider.request.body import parse_chat_body
from provider.slots import ModelManager
from settings_for import settings_for
from vision_images import data_uri, detokenized, image_part, jpeg_bytes, png_bytes

NO_EOS = frozenset({10**9})


class VisionHarness:
    def __init__(self, settings: Settings, engine: Engine, *, eos: frozenset[int] | None = None) -> None:
        from protocol.crypto import ProviderIdentity

        self.identity = ProviderIdentity.generate()
        self.coordinator = Coordinator(self.identity.public_key_b64)
        inventory = discover(hf_cache=None, aliases=settings.model_aliases)
        self.info = inventory.get("vlm")
        self.probe = Probe(settings.memory_limit_gb)
        self.ledger = Ledger(cap_figures(settings, self.probe.snapshot()), sample=self.probe.snapshot)
        self.engine = engine
        self.manager = ModelManager.from_settings(settings, engine, inventory, self.ledger, self.probe,
                                                  eos_token_ids={"vlm": eos} if eos else None)
        counter = PromptCounter({m.id: m.path for m in inventory.models},
                                vision={m.id for m in inventory.models if m.is_vision})
        self.ctx = JobContext(identity=self.identity, manager=self.manager, counter=counter, stats=ServingStats())
        self.frames: list[dict] = []
        self._arrived = asyncio.Condition()

    def send(self, text: str) -> None:
        self.frames.append(json.loads(text))
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._arrived:
            self._arrived.notify_all()

    async def wait_frame(self, rid: str, frame_type: str) -> None:
        async with self._arrived:
            await self._arrived.wait_for(lambda: any(f["type"] == frame_type for f in self.of(rid)))

    async def run(self, rid: str, body: dict) -> JobOutcome:
        return await run_job(self.coordinator.request(rid, body), self.ctx, self.send)

    def of(self, rid: str) -> list[dict]:
        return [f for f in self.frames if f.get("request_id") == rid]

    def content(self, rid: str) -> str:
        parts = []
        for f in self.of(rid):
            if f["type"] == "inference_response_chunk":
                event = self.coordinator.open_chunk(f)
                if event.startswith(b"data: {"):
                    chunk = sse_json(event)
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        parts.append(chunk["choices"][0]["delta"]["content"])
        return "".join(parts)

    def request_reservations(self) -> dict[ReservationKind, int]:
        return dict(self.ledger.snapshot().count_by_kind)


PNG = data_uri(png_bytes(40, 30, (220, 30, 30)))
JPEG = data_uri(jpeg_bytes(96, 64, (20, 40, 200)), "image/jpeg")


def vision_body(max_tokens: int = 20, **extra) -> dict:
    return {"model": "vlm", "max_tokens": max_tokens, "temperature": 0, "messages": [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": [{"type": "text", "text": "what is in"}, image_part(PNG),
                                     {"type": "text", "text": "and in"}, image_part(JPEG)]}], **extra}


def first_error(h: VisionHarness, rid: str) -> dict:
    (frame,) = [f for f in h.of(rid) if f["type"] == "inference_error"]
    return frame


@pytest.fixture
async def harness(tiny_vlm_path, tmp_path):
    trace: list = []
    engine = Engine(trace=lambda *step: trace.append(step))
    h = VisionHarness(settings_for(tmp_path, {"vlm": tiny_vlm_path}), engine)
    h.trace = trace
    yield h
    await h.manager.unload_all()
    await engine.aclose()
    assert len(h.ledger) == 0  # every reservation released, on every path


async def test_png_and_jpeg_chat_equals_mlx_vlm_generate(harness, tiny_vlm_path):
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template

    assert await harness.run("v1", vision_body()) is JobOutcome.COMPLETED
    types = [f["type"] for f in harness.of("v1")]
    assert types[0] == "inference_accepted" and types[-1] == "inference_complete"
    usage = harness.of("v1")[-1]["usage"]
    # mlx-vlm by itself: its own template helper on the OpenAI messages, its own data: URI loader.
    model, processor = load(str(tiny_vlm_path))
    messages = vision_body()["messages"]
    prompt = apply_chat_template(processor, model.config, messages, num_images=2)
    ref = mlx_vlm_greedy(model, processor, prompt, [PNG, JPEG], 20)
    assert harness.content("v1") == detokenized(tiny_vlm_path, ref.token_ids)  # the same greedy tokens
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (ref.prompt_tokens, ref.generation_tokens)
    assert usage["prompt_tokens"] > 2 * 16  # the images' soft tokens are part of the prompt


async def test_media_and_the_whole_span_are_reserved_while_the_image_is_encoded(tiny_vlm_path, tmp_path):
    seen: dict = {}
    holder: dict = {}

    def trace(model_id, request_id, phase):
        if phase == "encode" and request_id:
            seen["encode"] = holder["h"].ledger.snapshot()

    engine = Engine(trace=trace)
    h = VisionHarness(settings_for(tmp_path, {"vlm": tiny_vlm_path}), engine, eos=NO_EOS)
    holder["h"] = h
    try:
        assert await h.run("r", vision_body(max_tokens=12)) is JobOutcome.COMPLETED
        at_encode = seen["encode"]
        assert at_encode.count_by_kind[ReservationKind.MEDIA] == 1
        assert at_encode.bytes_by_kind[ReservationKind.MEDIA] == projected_decode_bytes([(40, 30), (96, 64)], input_pixels=64 * 64)
        # The KV covers prompt text (with what the processor wraps around each image) + 2 × 16 soft
        # tokens + the output, not the output alone: exactly the prompt the engine processed + 12.
        prompt_tokens = h.of("r")[-1]["usage"]["prompt_tokens"]
        wrapper = h.manager.info("vlm").vision.image_text_tokens
        assert wrapper > 0  # Gemma 3 puts blank lines and begin/end-of-image tokens around each image
        prompt_text = await h.ctx.counter.count("vlm", parse_chat_body(vision_body()).messages)
        assert prompt_text + 2 * (wrapper + 16) == prompt_tokens
        span = prompt_tokens + 12
        assert at_encode.bytes_by_kind[ReservationKind.REQUEST_KV] == kv_bytes_for_tokens(h.info.kv, span)
        assert h.of("r")[-1]["usage"]["completion_tokens"] == 12
        assert h.request_reservations()[ReservationKind.MEDIA] == 0
        assert h.request_reservations()[ReservationKind.REQUEST_KV] == 0
    finally:
        await h.manager.unload_all()
        await engine.aclose()
    assert len(h.ledger) == 0


async def test_cancel_and_disconnect_release_media_and_kv(tiny_vlm_path, tmp_path):
    engine = Engine(vision_prefill_step=4)
    h = VisionHarness(settings_for(tmp_path, {"vlm": tiny_vlm_path}), engine, eos=NO_EOS)
    try:
        # Cancel mid-stream (the coordinator's cancel, or a lost connection: the job's task is cancelled).
        task = asyncio.create_task(h.run("c1", vision_body(max_tokens=2000)))
        await asyncio.wait_for(h.wait_frame("c1", "inference_response_chunk"), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.kv_cache_bytes("vlm")  # a command round-trip: the engine has handled the cancel
        assert h.request_reservations()[ReservationKind.MEDIA] == 0
        assert h.request_reservations()[ReservationKind.REQUEST_KV] == 0
        # Cancelled right after the accept, before the image was encoded: media was still held.
        task = asyncio.create_task(h.run("c2", vision_body(max_tokens=2000)))
        await asyncio.wait_for(h.wait_frame("c2", "inference_accepted"), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.kv_cache_bytes("vlm")  # the engine has handled the cancel, if it got that far
        # If the cancel caught the images mid-decode, the media is released when the decoding
        # thread finishes (there is no event for that: a bounded wait on the ledger itself).
        for _ in range(500):
            if len(h.ledger) == 0:
                break
            await asyncio.sleep(0.01)
        assert h.request_reservations()[ReservationKind.MEDIA] == 0
        assert h.request_reservations()[ReservationKind.REQUEST_KV] == 0
    finally:
        await h.manager.unload_all()
        await engine.aclose()
    assert len(h.ledger) == 0


async def test_an_image_that_fails_to_decode_after_the_accept_releases_everything(harness):
    raw = png_bytes(64, 64, (10, 200, 10))
    truncated = raw[:-40] + b"\x00" * 8  # a readable header, broken pixel data
    body = vision_body()
    body["messages"][1]["content"][1] = image_part(data_uri(truncated))
    assert await harness.run("bad", body) in (JobOutcome.FAILED, JobOutcome.REJECTED)
    frame = first_error(harness, "bad")
    assert frame["status_code"] == 400 and frame["failure_code"] == "invalid_media"
    assert harness.request_reservations()[ReservationKind.MEDIA] == 0


@pytest.mark.parametrize(("url", "status", "code"), [
    ("https://example.com/cat.png", 415, "unsupported_media"),
    ("data:image/png;base64," + "A" * (40 * 2**20), 413, "media_too_large"),
])
async def test_bounds_are_refused_before_the_accept(harness, url, status, code):
    body = vision_body()
    body["messages"][1]["content"][1] = image_part(url)
    assert await harness.run("x", body) is JobOutcome.REJECTED
    (frame,) = harness.of("x")
    assert (frame["type"], frame["status_code"], frame["failure_code"]) == ("inference_error", status, code)


async def test_ten_concurrent_vision_requests_admitted_ones_served_the_rest_fast_503(tiny_vlm_path, tmp_path):
    engine = Engine()
    # A small emulated machine; at most 2 requests with images per model (the default).
    h = VisionHarness(settings_for(tmp_path, {"vlm": tiny_vlm_path}, memory_limit_gb=7.5), engine, eos=NO_EOS)
    try:
        outcomes = await asyncio.gather(*(h.run(f"r{i}", vision_body(max_tokens=8)) for i in range(10)))
        served = [f"r{i}" for i, o in enumerate(outcomes) if o is JobOutcome.COMPLETED]
        refused = [f"r{i}" for i, o in enumerate(outcomes) if o is JobOutcome.REJECTED]
        assert len(served) == 2 and len(refused) == 8
        for rid in refused:
            (frame,) = h.of(rid)  # no accept before the error: the coordinator reroutes at once
            assert frame["type"] == "inference_error" and frame["status_code"] == 503
            assert frame["error_reason"] == "queue_full" and frame["rejection_reason"] == "slot_state"
        for rid in served:
            assert h.of(rid)[-1]["usage"]["completion_tokens"] == 8
        assert len(h.ledger) == 0  # media and KV of every request released
        # The places free up: the next requests are served.
        assert await h.run("after", vision_body(max_tokens=4)) is JobOutcome.COMPLETED
    finally:
        await h.manager.unload_all()
        await engine.aclose()


async def test_ten_concurrent_large_image_requests_are_admitted_as_memory_allows(tiny_vlm_path, tmp_path):
    """A 7 GiB machine (effective cap 5 GiB: ~2 GiB left for requests after the load and the 3 GiB
    activation reserve); each request carries three 4096² images, 768 MiB of projected decode.
    The place limit is raised to 10, so memory alone decides: as many as fit are served, the others
    get a 503 before any accept, and nothing stays reserved."""
    engine = Engine()
    h = VisionHarness(settings_for(tmp_path, {"vlm": tiny_vlm_path}, memory_limit_gb=7.0, max_vision_requests=10),
                      engine, eos=NO_EOS)
    big = data_uri(png_bytes(4096, 4096, (90, 90, 200)))
    body = vision_body(max_tokens=4)
    body["messages"][1]["content"] = [{"type": "text", "text": "three"}, image_part(big), image_part(big),
                                      image_part(big)]
    try:
        await h.manager.ensure_loaded("vlm")
        need = projected_decode_bytes([(4096, 4096)] * 3, input_pixels=64 * 64)
        fits = h.ledger.available_bytes() // need
        assert 1 <= fits < 10
        outcomes = await asyncio.gather(*(h.run(f"m{i}", body) for i in range(10)))
        served = [i for i, o in enumerate(outcomes) if o is JobOutcome.COMPLETED]
        refused = [i for i, o in enumerate(outcomes) if o is JobOutcome.REJECTED]
        assert 1 <= len(served) <= fits and len(served) + len(refused) == 10
        for i in refused:
            (frame,) = h.of(f"m{i}")  # fast: the error is the only frame, no accept before it
            assert frame["status_code"] == 503 and frame["rejection_reason"] in ("kv_headroom", "token_budget")
        assert len(h.ledger) == 0
    finally:
        await h.manager.unload_all()
        await engine.aclose()


async def test_a_text_request_on_the_vlm_is_served_without_media(harness):
    body = {"model": "vlm", "max_tokens": 5, "temperature": 0, "messages": [{"role": "user", "content": "hello"}]}
    assert await harness.run("t", body) is JobOutcome.COMPLETED
    assert harness.of("t")[-1]["usage"]["completion_tokens"] >= 1


async def test_places_are_taken_at_booking_and_given_back_by_release(harness):
    """The place among `max_vision_requests` is part of the booking (before the accept), not of
    serving: a third booking with images is refused while two are held, whatever runs in between."""
    from provider.request.media import inspect_images
    from provider.slots import Refused

    plan = inspect_images([PNG])
    first = harness.manager.book("b1", "vlm", 40, 8, media=plan)
    second = harness.manager.book("b2", "vlm", 40, 8, media=plan)
    assert not isinstance(first, Refused) and not isinstance(second, Refused)
    third = harness.manager.book("b3", "vlm", 40, 8, media=plan)
    assert isinstance(third, Refused) and third.failure.reason.value == "queue_full"
    assert not isinstance(harness.manager.book("t", "vlm", 40, 8), Refused)  # text on the VLM: no place needed
    first.release()
    first.release()  # idempotent
    again = harness.manager.book("b4", "vlm", 40, 8, media=plan)
    assert not isinstance(again, Refused)
    second.release()
    again.release()
    assert harness.manager.view().vision_requests == {}
