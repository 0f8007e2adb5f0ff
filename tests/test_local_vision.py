"""`serve --local` with the tiny VLM in a subprocess, driven with the openai SDK.

A PNG + JPEG chat streams the same text as mlx-vlm's own `generate` (run here, in the test process,
on the same folder and the same data: URIs); the decode bomb is refused with 400 before any raster
exists in the *server* process (its peak RSS, reset through /proc/<pid>/clear_refs, does not move);
a 30 MiB data: URI is 413, an https:// image 415; a consumer that disconnects mid-stream leaves no
media or KV reservation behind (/status).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine_arithmetic import mlx_vlm_greedy
from local_server import MODEL, Server, start_server
from vision_images import bomb_png, data_uri, detokenized, image_part, jpeg_bytes, png_bytes

PNG = data_uri(png_bytes(40, 30, (220, 30, 30)))
JPEG = data_uri(jpeg_bytes(96, 64, (20, 40, 200)), "image/jpeg")
MESSAGES = [{"role": "system", "content": "answer briefly"},
            {"role": "user", "content": [{"type": "text", "text": "what is in"}, image_part(PNG),
                                         {"type": "text", "text": "and in"}, image_part(JPEG)]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_vlm_path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("local-vision"), tiny_vlm_path)
    srv.model_path = tiny_vlm_path
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_vlm_path):
    """mlx-vlm by itself: its template helper on the OpenAI messages, its own data: URI loader."""
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(tiny_vlm_path))

    def run(max_tokens: int, messages: list[dict] = MESSAGES):
        images = [p["image_url"]["url"] for m in messages if isinstance(m["content"], list)
                  for p in m["content"] if p["type"] == "image_url"]
        prompt = apply_chat_template(processor, model.config, messages, num_images=len(images))
        return mlx_vlm_greedy(model, processor, prompt, images, max_tokens)

    return run


def server_model(server: Server) -> Path:
    return server.model_path


def status(server: Server) -> dict:
    return httpx.get(server.base_url + "/status", timeout=10).json()


def request_reservations(server: Server) -> tuple[int, int]:
    counts = status(server)["ledger"]["count_by_kind"]
    return counts["media"], counts["request_kv"]


def proc_kib(pid: int, field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))


def test_png_and_jpeg_stream_equals_mlx_vlm_generate(server, reference):
    ref = reference(20)
    stream = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == detokenized(server_model(server), ref.token_ids)  # the same greedy tokens
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (ref.prompt_tokens, ref.generation_tokens)
    same = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    assert same.choices[0].message.content == text
    assert request_reservations(server) == (0, 0)
    assert [m for m in status(server)["models"] if m["id"] == MODEL][0]["vision"] is True


def test_the_16000_square_bomb_is_400_before_any_raster_exists(server):
    bomb = data_uri(bomb_png())
    client = server.client()
    pid = server.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the server's peak RSS
    before = proc_kib(pid, "VmRSS")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this"}, image_part(bomb)]}])
    grew_mib = (proc_kib(pid, "VmHWM") - before) / 1024
    assert err.value.response.json()["error"]["code"] == "invalid_media"
    assert grew_mib < 48, f"server peak RSS grew {grew_mib:.0f} MiB (the bomb's raster is 977 MiB)"
    assert request_reservations(server) == (0, 0)


@pytest.mark.parametrize(("url", "status_code", "code"), [
    ("data:image/png;base64," + "A" * (40 * 2**20), 413, "media_too_large"),  # decodes to 30 MiB
    ("https://example.com/cat.png", 415, "unsupported_media"),
])
def test_oversized_and_remote_images_are_refused(server, url, status_code, code):
    with pytest.raises(openai.APIStatusError) as err:
        server.client().chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this"}, image_part(url)]}])
    assert err.value.status_code == status_code
    assert err.value.response.json()["error"]["code"] == code
    assert "retry-after" not in err.value.response.headers


def test_a_disconnect_mid_stream_releases_media_and_kv(server):
    long_messages = [{"role": "user", "content": [{"type": "text", "text": "tell me a long story"}, image_part(PNG)]}]
    client = server.client()
    seen = 0
    with client.chat.completions.create(model=MODEL, messages=long_messages, max_tokens=300, temperature=0,
                                        stream=True) as stream:
        for n, _ in enumerate(stream):
            seen = n
            if n == 3:
                # Streaming: the KV span is held; the media went once the image was encoded.
                assert request_reservations(server) == (0, 1)
                break  # the consumer goes away; the context manager closes the connection
    # Whatever token greedy decoding picks at a near-tie (BLAS builds differ in the last bit there), the
    # answer must still be running at its fourth chunk for the disconnect to come mid-stream.
    assert seen == 3, "the answer ended before the disconnect: use a longer prompt"
    deadline = time.monotonic() + 30
    while request_reservations(server) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)  # across processes there is no event: poll /status with a deadline
    assert request_reservations(server) == (0, 0)
    assert status(server)["in_flight"] == 0


def test_a_legacy_completion_for_a_vision_model_is_a_400_naming_the_model(server):
    """A vision model's processor renders messages with their images; there is no raw prompt to give it."""
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model=MODEL, prompt="what is in", max_tokens=2)
    assert caught.value.body["param"] == "model" and "/v1/chat/completions" in caught.value.body["message"]
