"""The request pipeline below both front doors (provider/request/serving.py), and the one table that
turns an engine failure into the answer both doors give (provider/response/failures.py).

The doors are driven in one process over one `Runtime` on the tiny model: the coordinator's through
`run_job` with a sealed request, the local server's through its ASGI app. An engine failure is made
real: the engine's own `interrupt` ends the request's stream with `Failed(code)` right after submit
(the path a drain takes), or `submit` raises the engine's `EngineError(code)`."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from nacl.public import Box, PrivateKey, PublicKey

from protocol import EncryptedPayload, InferenceRequest
from protocol.crypto import ProviderIdentity
from protocol.errors import Failure
from provider.config import Settings
from provider.engine import EngineError, EngineFailure
from provider.jobs import JobContext, JobOutcome, run_job
from provider.local.app import create_app
from provider.local.backend import RuntimeBackend
from provider.request.body import InvalidBody
from provider.request.serving import json_body
from provider.response.failures import ENGINE_FAILURES, engine_failure, exception_failure
from provider.runtime import Runtime
from provider.slots import SlotRefused

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
        "temperature": 0}


# --- the table ----------------------------------------------------------------------------------------


def test_the_table_has_a_row_for_every_engine_failure():
    assert set(ENGINE_FAILURES) == set(EngineFailure)
    for code in EngineFailure:
        assert isinstance(engine_failure(code), Failure)


@pytest.mark.parametrize(("code", "status", "failure_code", "reason"), [
    (EngineFailure.REQUEST_EXCEEDS_CONTEXT, 400, "invalid_request", "request_exceeds_context"),
    (EngineFailure.INVALID_REQUEST, 400, "invalid_request", "client_error"),
    (EngineFailure.MODEL_NOT_LOADED, 503, "model_unavailable", "model_load"),
    (EngineFailure.MODEL_UNLOADED, 503, "model_unavailable", "model_load"),
    (EngineFailure.LOAD_FAILED, 503, "model_unavailable", "model_load"),
    (EngineFailure.ENGINE_CLOSED, 503, "capacity", "draining"),
    (EngineFailure.MODEL_ALREADY_LOADED, 500, "internal_failure", None),
    (EngineFailure.INTERNAL_ERROR, 500, "generation_failure", None),
])
def test_each_engine_failure_maps_to_one_wire_failure(code, status, failure_code, reason):
    failure = engine_failure(code)
    assert (failure.status_code, failure.code.value, failure.reason and failure.reason.value) == \
        (status, failure_code, reason)


def test_raised_failures_map_through_the_same_table_and_a_bug_maps_to_nothing():
    assert exception_failure(EngineError(EngineFailure.MODEL_UNLOADED)) == Failure.model_unloaded()
    assert exception_failure(SlotRefused(Failure.draining())) == Failure.draining()
    assert exception_failure(ValueError("a prompt fragment")) is None


def test_a_body_that_is_not_json_names_the_body_never_its_text():
    with pytest.raises(InvalidBody) as invalid:
        json_body(b'{"messages": "CANARY-not-json')
    assert invalid.value.field == "body" and "CANARY" not in str(invalid.value.message)
    assert json_body(b'{"model": "tiny"}') == {"model": "tiny"}


# --- both doors, one runtime ----------------------------------------------------------------------------


class Doors:
    """The coordinator's door (sealed requests in, frames out) and the local app, on one runtime;
    `fail(code, raised)` makes the engine fail the next requests with `code`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        identity = ProviderIdentity.generate()
        self.session = PrivateKey.generate()
        self.box = Box(self.session, PublicKey(base64.b64decode(identity.public_key_b64)))
        self.ctx = JobContext(identity=identity, manager=runtime.manager, counter=runtime.counter,
                              stats=runtime.stats, metrics=runtime.metrics)
        self.app = create_app(RuntimeBackend(runtime), runtime.metrics)
        self.frames: list[dict] = []
        engine = runtime.engine
        self._submit = engine.submit
        self.failing: tuple[EngineFailure, bool] | None = None
        self.submitted = 0

        def submit(model_id, request, **hooks):
            self.submitted += 1
            if self.failing is not None and self.failing[1]:
                raise EngineError(self.failing[0])
            stream = self._submit(model_id, request, **hooks)
            if self.failing is not None:
                assert engine.interrupt(request.request_id, self.failing[0])
            return stream

        engine.submit = submit

    async def job(self, rid: str) -> tuple[JobOutcome, list[dict]]:
        sealed = base64.b64encode(self.box.encrypt(json.dumps(BODY).encode())).decode()
        request = InferenceRequest(request_id=rid, encrypted_body=EncryptedPayload(
            ephemeral_public_key=base64.b64encode(bytes(self.session.public_key)).decode(), ciphertext=sealed))
        outcome = await run_job(request, self.ctx, lambda text: self.frames.append(json.loads(text)))
        return outcome, [f for f in self.frames if f.get("request_id") == rid]


@pytest.fixture
async def doors(tmp_path, tiny_model_path) -> AsyncIterator[Doors]:
    (tmp_path / "hub").mkdir()
    runtime = await Runtime.start(Settings(state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "hub",
                                           model_aliases={"tiny": tiny_model_path}, idle_timeout_mins=0,
                                           kv_ssd_budget_gb=0), hash_weights=False)
    try:
        yield Doors(runtime)
    finally:
        await runtime.aclose()
    assert len(runtime.ledger) == 0, "every reservation released, on every path"


def _local_answer(reply: httpx.Response) -> tuple[int, str, str | None, str]:
    error = reply.json()["error"]
    return reply.status_code, error["code"], error["reason"], error["message"]


async def test_both_doors_give_the_same_failure_for_the_same_engine_failure(doors):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=doors.app), base_url="http://local") as client:
        # Served as usual first: the model is loaded, and both doors complete.
        assert (await doors.job("warm"))[0] is JobOutcome.COMPLETED
        assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200
        for raised in (False, True):
            for code in EngineFailure:
                doors.failing = (code, raised)
                before = doors.submitted
                outcome, frames = await doors.job(f"{code.value}-{raised}")
                assert outcome is JobOutcome.FAILED
                assert [f["type"] for f in frames] == ["inference_accepted", "inference_error"]
                error = frames[-1]
                job = (error["status_code"], error["failure_code"], error.get("error_reason"), error["error"])
                whole = await client.post("/v1/chat/completions", json=BODY)
                streamed = await client.post("/v1/chat/completions", json={**BODY, "stream": True})
                assert doors.submitted == before + 3  # the engine failed each of the three
                expected = engine_failure(code)
                assert job == (expected.status_code, expected.code.value, expected.reason and expected.reason.value,
                               expected.message), (code, raised)
                assert _local_answer(whole) == job, (code, raised)
                assert _local_answer(streamed) == job, (code, raised)
                retry = whole.headers.get("retry-after")
                assert (retry is not None) == (job[0] == 503), (code, raised)  # a 503 says when to come back
        # The engine failure the two doors used to answer differently: 503 model_load on both.
        assert engine_failure(EngineFailure.MODEL_NOT_LOADED) == Failure.model_unloaded()
        doors.failing = None
        assert (await doors.job("after"))[0] is JobOutcome.COMPLETED
        assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200
