"""One answer for one question: a request that is refused is refused the same way however often it is
asked, on both doors.

Each refusal kind is asked ``ASKS`` times on the local server (its ASGI app) and on the coordinator's door
(`run_job` with a sealed request), over one `Runtime` on the suite's tiny models, and every answer must be
the expected one: the same status, code and reason each time, a `Retry-After` only where trying again can
help. The first ask of a question used to be answered by a later check than the asks after it (a model's
tokenizer size bound is learned on its first request, and with it an earlier check refuses), so a model
this machine can never load got a 400 and then a 503 with `Retry-After: 2`, for ever.

Two machines, emulated with `memory_limit_gb`: a roomy one (8 GiB, 0.5 GiB operator reserve: the tiny
models fit) and a small one (2.5 GiB: a hard cap of 0.5 GiB, under the 1 GiB of KV any load needs beside
its weights, so no model ever fits, whatever the activation reserve).
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from two_doors import JobAnswer, LocalAnswer, TwoDoors, model_loads, start_runtime

pytestmark = pytest.mark.asyncio(loop_scope="module")

ASKS = 10
ROOMY = {"memory_limit_gb": 8.0, "memory_reserve_gb": 0.5}
SMALL = {"memory_limit_gb": 2.5}
ERROR = ("inference_error",)  # a refusal before the accept: the error frame alone


def png_header(width: int, height: int) -> bytes:
    """A PNG that is only its header (the size a refusal reads first)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def image_message(data: bytes) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def chat(model: str, **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, **extra}


OVER_CONTEXT = [{"role": "user", "content": "hello " * 3000}]  # the tiny models' window is 2,048 tokens
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def variant(base: Path, dest: Path, *, config: dict | None = None, write: dict[str, str] | None = None) -> Path:
    shutil.copytree(base, dest)
    if config:
        path = dest / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    for name, text in (write or {}).items():
        (dest / name).write_text(text)
    return dest


async def ask(doors: TwoDoors, body: dict | bytes, path: str = "/v1/chat/completions") -> set[LocalAnswer]:
    return {await doors.local(body, path) for _ in range(ASKS)}


async def ask_job(doors: TwoDoors, body: dict | bytes) -> set[JobAnswer]:
    return {await doors.job(body) for _ in range(ASKS)}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roomy(tmp_path_factory, tiny_model_path) -> AsyncIterator[TwoDoors]:
    root = tmp_path_factory.mktemp("roomy")
    models = {
        "tiny": tiny_model_path,
        # A window of 4M tokens: max_tokens can ask for more KV than one request may hold here.
        "long": variant(tiny_model_path, root / "long", config={"max_position_embeddings": 4_194_304}),
        # A template that raises an error nobody expects: the template's failure (422).
        "bad-template": variant(tiny_model_path, root / "bad-template", write={"chat_template.jinja": "{{ 1 // 0 }}"}),
    }
    runtime = await start_runtime(root, models, **ROOMY)
    try:
        async with TwoDoors(runtime) as doors:
            yield doors
    finally:
        await runtime.aclose()
    assert len(runtime.ledger) == 0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def small(tmp_path_factory, tiny_model_path) -> AsyncIterator[TwoDoors]:
    runtime = await start_runtime(tmp_path_factory.mktemp("small"), {"tiny": tiny_model_path}, **SMALL)
    try:
        async with TwoDoors(runtime) as doors:
            yield doors
    finally:
        await runtime.aclose()
    assert len(runtime.ledger) == 0


# (kind, body, the local answer, the coordinator's frame)
ROOMY_CHAT = [
    ("unknown_model", chat("no/such-model"),
     LocalAnswer(404, "model_unavailable", None, None), JobAnswer(ERROR, 404, "model_unavailable", None, None)),
    ("over_context", {**chat("tiny"), "messages": OVER_CONTEXT},
     LocalAnswer(400, "invalid_request", "request_exceeds_context", None),
     JobAnswer(ERROR, 400, "invalid_request", "request_exceeds_context", None)),
    # KV for 2M tokens: more than one request may hold on this machine (half the hard cap). Never here:
    # the owner's server has no other node, so a 400 in numbers; the coordinator's door lets another
    # provider take it (request_exceeds_node_budget, which the coordinator reroutes).
    ("request_too_large", chat("long", max_tokens=2_000_000),
     LocalAnswer(400, "request_too_large", "request_exceeds_node_budget", None),
     JobAnswer(ERROR, 503, "capacity", "request_exceeds_node_budget", "token_budget")),
    ("bad_parameter", chat("tiny", temperature=5),
     LocalAnswer(400, "invalid_request", "client_error", None), JobAnswer(ERROR, 400, "invalid_request", "client_error", None)),
    ("not_json", b'{"model": "tiny", "messa',
     LocalAnswer(400, "invalid_request", "client_error", None), JobAnswer(ERROR, 400, "invalid_request", "client_error", None)),
    ("image_for_a_text_model", {**chat("tiny"), "messages": image_message(png_header(8, 8))},
     LocalAnswer(415, "unsupported_media", None, None), JobAnswer(ERROR, 415, "unsupported_media", None, None)),
    ("image_over_the_pixel_ceiling", {**chat("tiny"), "messages": image_message(png_header(100_000, 100_000))},
     LocalAnswer(400, "invalid_media", None, None), JobAnswer(ERROR, 400, "invalid_media", None, None)),
    ("image_that_is_not_an_image", {**chat("tiny"), "messages": image_message(b"not an image")},
     LocalAnswer(400, "invalid_media", None, None), JobAnswer(ERROR, 400, "invalid_media", None, None)),
    ("template_that_raises", chat("bad-template"),
     LocalAnswer(422, "template_render", "jinja_template", None), JobAnswer(ERROR, 422, "template_render", "jinja_template", None)),
    ("tools_for_a_model_without_tool_calling", chat("tiny", tools=TOOLS),
     LocalAnswer(400, "invalid_request", "client_error", None), JobAnswer(ERROR, 400, "invalid_request", "client_error", None)),
]

ROOMY_COMPLETIONS = [
    ("unknown_model", {"model": "no/such-model", "prompt": "hello"}, LocalAnswer(404, "model_unavailable", None, None)),
    ("ids_outside_the_vocabulary", {"model": "tiny", "prompt": [1, 2, 10**6]}, LocalAnswer(400, "invalid_request", "client_error", None)),
    ("over_context", {"model": "tiny", "prompt": "hello " * 3000},
     LocalAnswer(400, "invalid_request", "request_exceeds_context", None)),
    ("request_too_large", {"model": "long", "prompt": "hello", "max_tokens": 2_000_000},
     LocalAnswer(400, "request_too_large", "request_exceeds_node_budget", None)),
]

# A model that can never load here: a 400 in numbers on the owner's server, whatever else the request
# asks (a prompt over the window, tools, an image), since no answer about the request can help; the
# coordinator's door says request_exceeds_node (another provider may be larger).
NEVER_FITS_LOCAL = LocalAnswer(400, "model_too_large", "request_exceeds_node", None)
NEVER_FITS_JOB = JobAnswer(ERROR, 503, "capacity", "request_exceeds_node", "memory_cap")
SMALL_CHAT = [
    ("model_too_large", chat("tiny")),
    ("model_too_large_and_over_context", {**chat("tiny"), "messages": OVER_CONTEXT}),
    ("model_too_large_with_tools", chat("tiny", tools=TOOLS)),
    ("model_too_large_with_an_image", {**chat("tiny"), "messages": image_message(png_header(8, 8))}),
]
SMALL_COMPLETIONS = [
    ("model_too_large", {"model": "tiny", "prompt": "hello"}),
    ("model_too_large_and_over_context", {"model": "tiny", "prompt": "hello " * 3000}),
    ("model_too_large_as_ids", {"model": "tiny", "prompt": [1, 2, 3]}),
]


@pytest.mark.parametrize(("kind", "body", "local", "job"), ROOMY_CHAT, ids=[k[0] for k in ROOMY_CHAT])
async def test_a_chat_refusal_is_the_same_answer_every_time_on_both_doors(roomy, kind, body, local, job):
    assert await ask(roomy, body) == {local}
    assert await ask_job(roomy, body) == {job}


@pytest.mark.parametrize(("kind", "body", "local"), ROOMY_COMPLETIONS, ids=[k[0] for k in ROOMY_COMPLETIONS])
async def test_a_completion_refusal_is_the_same_answer_every_time(roomy, kind, body, local):
    assert await ask(roomy, body, "/v1/completions") == {local}


@pytest.mark.parametrize(("kind", "body"), SMALL_CHAT, ids=[k[0] for k in SMALL_CHAT])
async def test_a_model_that_never_fits_is_a_400_every_time_and_never_a_503(small, kind, body):
    assert await ask(small, body) == {NEVER_FITS_LOCAL}
    assert await ask_job(small, body) == {NEVER_FITS_JOB}
    assert model_loads(small.runtime, "loaded") == model_loads(small.runtime, "failed") == 0


@pytest.mark.parametrize(("kind", "body"), SMALL_COMPLETIONS, ids=[k[0] for k in SMALL_COMPLETIONS])
async def test_a_completion_for_a_model_that_never_fits_is_a_400_every_time(small, kind, body):
    assert await ask(small, body, "/v1/completions") == {NEVER_FITS_LOCAL}


async def test_the_numbers_of_a_model_that_never_fits_are_the_same_each_time(small):
    """The first ask and the later ones reach the answer from different checks; the words say the same."""
    replies = [await small.local_reply(chat("tiny")) for _ in range(3)]
    assert len({r.json()["error"]["message"] for r in replies}) == 1
    assert all(r.json()["error"]["param"] == "model" for r in replies)


async def test_while_draining_every_request_is_a_503_that_says_when_to_come_back(tmp_path, tiny_model_path):
    """The one refusal here that trying again can help: the same 503 with the same Retry-After each time."""
    runtime = await start_runtime(tmp_path, {"tiny": tiny_model_path}, **ROOMY)
    try:
        async with TwoDoors(runtime) as doors:
            runtime.manager.start_draining()
            assert await ask(doors, chat("tiny")) == {LocalAnswer(503, "capacity", "draining", "5")}
            assert await ask_job(doors, chat("tiny")) == {JobAnswer(ERROR, 503, "capacity", "draining", None)}
    finally:
        await runtime.aclose()
