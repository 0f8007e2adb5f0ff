"""The consumer HTTP API: ``POST /v1/chat/completions`` (streaming and not), ``GET /v1/models`` and the
public ``GET /v1/models/catalog`` (``{"models": [{"id", "size_gb"}]}`` from ``DoubleConfig.catalog``).

Status and headers are only decided once the request is committed, so reroutes stay invisible to the
consumer. A streaming consumer gets each decrypted chunk verbatim followed by a blank line, then the
double's own ``data: [DONE]`` when ``inference_complete`` arrives (as [A] does: a provider's own ``[DONE]``
chunk or trailing blank line reaches the consumer doubled); a non-streaming one gets a reassembled
``chat.completion``. Either way the committed request id is in ``X-Inference-Job-ID``, the serving
provider's trust in ``X-Provider-Attested`` (``true`` for a valid registration attestation) and
``X-Provider-Trust-Level`` (as [A] sets them), and, when the handler returns, ``cancel`` goes to the
provider ([A]'s deferred ``sendProviderCancel``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import events as ev
from .chat_wire import DONE_EVENT, as_stream_event, error_body, error_event, forwarded_body, reassemble
from .dispatch import CommittedRequest, ConsumerGone, ConsumerLeft, FailedRequest, WindowClosed, dispatch, next_item
from .pending import AcceptedItem, ChunkItem, CompleteItem, ErrorItem

if TYPE_CHECKING:
    from .config import DoubleConfig
    from .server import CoordinatorDouble

JOB_HEADER = "X-Inference-Job-ID"
ATTESTED_HEADER = "X-Provider-Attested"
TRUST_LEVEL_HEADER = "X-Provider-Trust-Level"
CATALOG_PATH = "/v1/models/catalog"


def committed_headers(pending: Any) -> dict[str, str]:
    """[A] consumer.go: the committed request id and the serving provider's trust."""
    provider = pending.provider
    return {JOB_HEADER: pending.request_id, ATTESTED_HEADER: "true" if provider.attested else "false",
            TRUST_LEVEL_HEADER: provider.trust_level.value}


def catalog_document(config: DoubleConfig) -> dict[str, Any]:
    models: dict[str, dict[str, Any]] = {model_id: {"id": model_id, "size_gb": size} for model_id, size in config.catalog}
    for model_id, weight_hash in config.catalog_weight_hashes:
        models.setdefault(model_id, {"id": model_id})["weight_hash"] = weight_hash
    return {"models": list(models.values())}
CLIENT_CLOSED = 499


def build_app(double: CoordinatorDouble) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _ChatCompletion(double, request).run()

    @app.get(CATALOG_PATH)
    async def catalog() -> JSONResponse:
        return JSONResponse(catalog_document(double.config))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "darkbloom"} for m in double.registry.models()]
        return JSONResponse({"object": "list", "data": data})

    return app


async def _watch_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]], gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


class _ChatCompletion:
    def __init__(self, double: CoordinatorDouble, request: Request) -> None:
        self.double = double
        self.request = request
        self.consumer_id = double.next_consumer_id()
        self.stream = False
        self.model = ""

    def _finish(self, status: int, request_id: str | None, gone: bool = False) -> None:
        self.double.events.append(ev.ConsumerFinished(self.consumer_id, status, request_id, self.stream, gone))

    def _fail(self, status: int, body: dict[str, Any]) -> JSONResponse:
        self._finish(status, None)
        return JSONResponse(body, status_code=status)

    async def run(self) -> Response:
        raw = await self.request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return self._fail(400, error_body("request body is not valid JSON", "invalid_request_error"))
        if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
            return self._fail(400, error_body("model is required", "invalid_request_error"))
        self.model, self.stream = body["model"], body.get("stream") is True
        forwarded = forwarded_body(body, raw, self.double.config.default_max_tokens)
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(self.request.receive, gone))
        try:
            outcome = await dispatch(self.double, self.consumer_id, self.model, forwarded, gone)
            if isinstance(outcome, ConsumerGone):
                self._finish(CLIENT_CLOSED, None, gone=True)
                return Response(status_code=CLIENT_CLOSED)
            if isinstance(outcome, FailedRequest):
                return self._fail(outcome.status_code, outcome.body)
            if self.stream:
                watcher.cancel()  # from here Starlette's own listener watches for the disconnect
                return StreamingResponse(
                    self._stream(outcome),
                    media_type="text/event-stream",
                    headers={**committed_headers(outcome.pending), "Cache-Control": "no-cache"},
                )
            return await self._collect(outcome, gone)
        finally:
            watcher.cancel()

    async def _stream(self, committed: CommittedRequest) -> AsyncIterator[bytes]:
        pending = committed.pending
        config = self.double.config
        cause, status, gone = ev.CancelCause.FINISHED, 200, False
        item: Any = committed.first
        try:
            while True:
                if isinstance(item, ChunkItem):
                    yield as_stream_event(item.event)
                elif isinstance(item, CompleteItem):
                    yield DONE_EVENT
                    return
                elif isinstance(item, ErrorItem):
                    self._record_failure(pending, item)
                    status = item.status_code or 502
                    yield error_event(item.error)
                    return
                elif not isinstance(item, AcceptedItem):
                    raise TypeError(f"unexpected item {type(item).__name__}")
                try:
                    item = await asyncio.wait_for(pending.queue.get(), config.stream_idle_timeout)
                except TimeoutError:
                    self._timed_out(pending)
                    cause, status = ev.CancelCause.TIMEOUT, 504
                    yield error_event("inference timed out", "timeout")
                    return
        except (asyncio.CancelledError, GeneratorExit):
            cause, status, gone = ev.CancelCause.CONSUMER_GONE, CLIENT_CLOSED, True
            raise
        finally:
            # No await here: on a consumer disconnect this task is being cancelled.
            self.double.cancel(pending, cause)
            self._finish(status, pending.request_id, gone)

    async def _collect(self, committed: CommittedRequest, gone: asyncio.Event) -> Response:
        pending = committed.pending
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.double.config.stream_idle_timeout
        events: list[bytes] = []
        item: Any = committed.first
        headers = committed_headers(pending)
        try:
            while True:
                if isinstance(item, ChunkItem):
                    events.append(item.event)
                elif isinstance(item, CompleteItem):
                    result = reassemble(events, item.usage, self.model)
                    self._finish(200, pending.request_id)
                    return JSONResponse(result, headers=headers)
                elif isinstance(item, ErrorItem):
                    self._record_failure(pending, item)
                    status = item.status_code or 502
                    self._finish(status, pending.request_id)
                    return JSONResponse(error_body(item.error), status_code=status, headers=headers)
                item = await next_item(pending, max(deadline - loop.time(), 0.0), gone)
                if isinstance(item, ConsumerLeft):
                    self.double.cancel(pending, ev.CancelCause.CONSUMER_GONE)
                    self._finish(CLIENT_CLOSED, pending.request_id, gone=True)
                    return Response(status_code=CLIENT_CLOSED)
                if isinstance(item, WindowClosed):
                    self._timed_out(pending)
                    self.double.cancel(pending, ev.CancelCause.TIMEOUT)
                    self._finish(504, pending.request_id)
                    return JSONResponse(error_body("inference timed out", "timeout"), status_code=504, headers=headers)
        finally:
            self.double.cancel(pending, ev.CancelCause.FINISHED)  # no-op if a cancel was already sent

    def _record_failure(self, pending: Any, item: ErrorItem) -> None:
        self.double.events.append(
            ev.StreamFailed(self.consumer_id, pending.request_id, pending.provider.provider_id, item.status_code, item.internal)
        )

    def _timed_out(self, pending: Any) -> None:
        self.double.events.append(
            ev.TimedOut(self.consumer_id, pending.request_id, pending.provider.provider_id, ev.Window.STREAM_IDLE)
        )
