"""The local HTTP app (FastAPI), loopback only.

    POST /v1/chat/completions   OpenAI chat completions, streaming (SSE) or not   [chat=True only]
    POST /v1/completions        the legacy prompt API, same engine and admission  [chat=True only]
    GET  /v1/models             the servable model ids, each with its              [chat=True only]
                                `capabilities` (`tools`: whether it calls tools)
    GET  /v1/models/{model}     one of them, as listed (404 for any other id)      [chat=True only]
    GET  /healthz               200 {"status": "ok"} while serving, 503 while draining
    GET  /status                JSON: mode, models and their states, in-flight requests, ledger bytes
                                by kind, pressure, cap figures, prefix-cache stats
    GET  /metrics               Prometheus text (provider.metrics.Metrics.render)
    POST /control/unload        {"model": id}: unload an idle loaded model now (`darkbloom-provider unload`);
                                from a loopback client without an Origin header only (no web page)

Every error is OpenAI-shaped (`provider.local.errors`): a failure's fixed text, a bad body's
parameter and rule, a refusal explained in numbers and model ids, an unknown route or method, the
/control endpoints' refusals; a capacity refusal is a 503 with `Retry-After`. No response and no log
line carries request text. An unexpected exception anywhere in a request is the JSON
`internal_failure` 500 (`JsonServerErrors`), never a plain-text "Internal Server Error"; once a
stream has started, it ends with an error event instead. `allowed_origins` (the
`local_allowed_origins` setting: by default the pages this machine serves, `http://localhost:*` and
`http://127.0.0.1:*`) are the web origins whose pages may call it: CORS lets them read the answers,
any other origin's preflight is an OpenAI-shaped 400 that names the setting, and any other origin's
request a 403 before anything runs (`provider.local.door`, which also refuses a Host that is not a
loopback name). A POST body declared as anything but `application/json` is a 415, never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memory import CapFigures
from protocol import sse
from protocol.errors import Failure
from protocol.sse import DONE
from provider.engine import EngineFailure, Event, Failed, Finished, RequestStream, TextDelta, TokenLogprob, Usage
from provider.engine.types import EngineTimes
from provider.local.backend import Explained, Refused, unknown_model
from provider.local.door import Door, loopback_address
from provider.local.drain import InFlight
from provider.local.errors import (
    error_body,
    error_response,
    explained_response,
    install_error_handlers,
    invalid_body_response,
    openai_error,
    openai_error_body,
)
from provider.metrics import CONTENT_TYPE, CapFigure, Metrics, RequestOutcome
from provider.models.tools import ToolFormat
from provider.request.body import ChatBody, CompletionBody, InvalidBody
from provider.response.failures import engine_failure
from provider.response.openai import (
    ChatChunks,
    TextChunks,
    chat_completion,
    choice_logprobs,
    completion_usage,
    text_completion,
)
from provider.response.toolcalls import ToolCallStream, tool_calls_for
from provider.telemetry import get_logger, request_timings

log = get_logger(__name__)


T = TypeVar("T")
MAX_CONTROL_MODEL_CHARS = 256
_UNLOAD_STATUS = {"unknown_model": 404, "not_loaded": 409, "busy": 409}
_UNLOAD_WORDS = {  # the error of an unload that did not happen (the model asked for is not repeated)
    "unknown_model": "This agent serves no model of that id.",
    "not_loaded": "That model is not loaded.",
    "busy": "That model is serving requests and stays loaded: try again when it is idle.",
}
NOT_JSON = "This server reads a JSON body: send it with the header Content-Type: application/json."
CONTROL_NOT_ALLOWED = ("The control endpoints answer the programs of this machine only: a request from another "
                       "address, or from a web page (a request with an Origin header), is refused.")


def _not_json(request: Request) -> JSONResponse | None:
    """The 415 of a POST whose body is declared as anything but JSON; None for JSON or no declared type.
    What a web page may send without a CORS preflight (`text/plain`, a form) is never JSON, and it is
    never read as JSON here: a page's request that was not preflighted cannot make this server work."""
    kind = request.headers.get("content-type")
    if kind is None or kind.partition(";")[0].strip().lower() == "application/json":
        return None
    log.info("request_refused", status_code=415, code="unsupported_media_type")
    return openai_error(415, NOT_JSON, code="unsupported_media_type")


class Backend(Protocol):
    """What the app needs from whatever holds the models (see backend.RuntimeBackend)."""

    @property
    def figures(self) -> CapFigures: ...

    def model_ids(self) -> list[str]: ...
    def tool_format(self, model_id: str) -> ToolFormat | None: ...
    def open(self, request_id: str, raw: bytes) -> Any: ...  # async context manager -> (ChatBody, RequestStream)
    def token_bytes(self, model_id: str) -> Callable[[int], bytes] | None: ...  # log-probabilities' spelling
    def open_completion(self, request_id: str, raw: bytes) -> Any: ...  # -> (CompletionBody, RequestStream)
    def status(self) -> dict[str, Any]: ...
    def refresh_metrics(self) -> None: ...
    async def unload(self, model_id: str) -> str: ...  # an UnloadOutcome value


class JsonServerErrors:
    """ASGI middleware, innermost of Starlette's own error handling: an exception that escapes a
    route becomes the closed-vocabulary JSON 500 (`Failure.internal()`), logged once with its type
    and frames (never its message). If the response had already started there is nothing left to
    replace; the exception is logged and the response ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # the edge: nothing below may turn into a plain-text 500
            log.error("request_unexpected_error", phase="streaming" if started else "before_response", exc_info=exc)
            if not started:
                await error_response(Failure.internal())(scope, receive, send)


def cap_metric_figures(cap: CapFigures) -> dict[CapFigure, int]:
    return {
        CapFigure.PHYSICAL: cap.physical_bytes,
        CapFigure.HARD_CAP: cap.hard_cap_bytes,
        CapFigure.EFFECTIVE_CAP: cap.effective_cap_bytes,
        CapFigure.LOAD_RESERVE: cap.load_reserve_bytes,
        CapFigure.ACTIVATION_RESERVE: cap.activation_reserve_bytes,
    }


class LocalState:
    """Mutable bits of the running server: draining flag, start time, the chat requests in flight."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.draining = False
        self.started = time.monotonic()
        self.requests = InFlight()


@dataclass(frozen=True, slots=True)
class _Endpoint:
    """How one generation endpoint opens a request and writes its answer."""

    id_prefix: str  # "chatcmpl-", "cmpl-": OpenAI's
    open: Callable[[str, bytes], Any]  # Backend.open or .open_completion
    # (id, body, text, its tokens' log-probabilities, finished) -> the non-streamed object
    whole: Callable[[str, Any, str, list[TokenLogprob], Finished], Any]
    chunks: Callable[[str, Any], ChatChunks | TextChunks]  # (id, body) -> the stream's chunk builder


def _model_object(model_id: str, tools: ToolFormat | None) -> dict[str, Any]:
    """A served model as /v1/models lists it; `capabilities.tools`: whether it calls tools (`tools`: its format)."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "darkbloom-provider",
            "capabilities": {"tools": tools is not None}}


def create_app(backend: Backend, metrics: Metrics, *, chat: bool = True, mode: str = "local",
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The app; `chat=False` serves only /healthz, /status and /metrics (the coordinator agent's case);
    `allowed_origins`: the web origins whose pages may call it (CORS; `scheme://host:*` for any port)."""
    app = FastAPI(title="darkbloom-provider (local)", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(JsonServerErrors)
    # Outermost: a foreign Host or a page of an origin not allowed is refused before anything runs;
    # then CORS, so a 500 or a 503 is readable by an allowed page too. With no origin allowed it
    # still answers a preflight, with the setting that would allow it.
    app.add_middleware(Door, origins=tuple(allowed_origins))
    install_error_handlers(app)
    state = LocalState(mode)
    app.state.local = state
    metrics.set_cap_figures(cap_metric_figures(backend.figures))

    @app.api_route("/healthz", methods=["GET", "HEAD"])  # HEAD: what load balancers and uptime checks send
    async def healthz() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/status")
    async def status() -> JSONResponse:
        body = {"mode": state.mode, "draining": state.draining,
                "uptime_s": round(time.monotonic() - state.started, 3), **backend.status()}
        body["cap"] = asdict(backend.figures)
        return JSONResponse(body)

    @app.post("/control/unload")
    async def control_unload(request: Request) -> JSONResponse:
        # Loopback only, and never from a web page: a browser sends Origin on every cross-site POST.
        client = request.client.host if request.client is not None else ""
        if "origin" in request.headers or not loopback_address(client):
            log.info("request_refused", status_code=403, code="control_not_allowed")
            return openai_error(403, CONTROL_NOT_ALLOWED, code="control_not_allowed")
        if (not_json := _not_json(request)) is not None:
            return not_json
        try:
            model = json.loads(await request.body()).get("model")
        except (ValueError, AttributeError, RecursionError):
            model = None
        if not isinstance(model, str) or not model or len(model) > MAX_CONTROL_MODEL_CHARS:
            log.info("request_invalid", status_code=400, reason="model")
            return invalid_body_response(InvalidBody(
                "model", f"must be a model id (a string of 1 to {MAX_CONTROL_MODEL_CHARS} characters)"))
        outcome = await backend.unload(model)
        status = _UNLOAD_STATUS.get(outcome, 200)
        if status == 200:
            return JSONResponse({"model": model, "outcome": outcome})
        log.info("request_refused", status_code=status, code=outcome)  # the id asked for is not logged
        # `model` and `outcome` as on a success (what `darkbloom-provider unload` reads), with the error object.
        error = openai_error_body(status, _UNLOAD_WORDS.get(outcome, "The model was not unloaded."), code=outcome)
        return JSONResponse({"model": model, "outcome": outcome, **error}, status_code=status)

    @app.get("/metrics")
    async def prometheus() -> Response:
        backend.refresh_metrics()  # the sampled gauges: ledger bytes, prefix cache
        metrics.set_cap_figures(cap_metric_figures(backend.figures))  # the activation reserve in force moves
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if not chat:
        return app

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_object(i, backend.tool_format(i))
                                                        for i in backend.model_ids()]})

    @app.get("/v1/models/{model:path}")  # ids have slashes (org/name); the SDK sends them as %2F
    async def model(model: str) -> JSONResponse:
        served = backend.model_ids()
        if model in served:
            return JSONResponse(_model_object(model, backend.tool_format(model)))
        log.info("request_refused", code="model_unavailable", status_code=404)  # the id asked for is not logged
        return explained_response(unknown_model(model, served))

    def tools_of(body: ChatBody) -> ToolCallStream | None:
        """A fresh reader of the answer's tool calls, when the request offered tools to a model that calls them."""
        return tool_calls_for(backend.tool_format(body.model), body.offered_tools, parallel=body.parallel_tool_calls,
                              forced=body.tool_choice.forces_a_call)

    def spelling(body: ChatBody) -> Callable[[int], bytes] | None:
        """The request asked for log-probabilities (the intake built its model's spelling)."""
        return backend.token_bytes(body.model) if body.top_logprobs is not None else None

    def chat_whole(request_id: str, body: ChatBody, text: str, entries: list[TokenLogprob],
                   finished: Finished) -> sse.ChatCompletion:
        spell = spelling(body)
        return chat_completion(request_id, body.model, text, finished, tools=tools_of(body),
                               logprobs=None if spell is None else choice_logprobs(entries, spell))

    def chat_chunks(request_id: str, body: ChatBody) -> ChatChunks:
        return ChatChunks(request_id, body.model, tools=tools_of(body), token_bytes=spelling(body))

    def text_whole(request_id: str, body: CompletionBody, text: str, entries: list[TokenLogprob],
                   finished: Finished) -> sse.TextCompletion:
        return text_completion(request_id, body.model, text, finished)

    def text_chunks(request_id: str, body: CompletionBody) -> TextChunks:
        return TextChunks(request_id, body.model)

    chat_endpoint = _Endpoint("chatcmpl-", backend.open, chat_whole, chat_chunks)
    legacy_endpoint = _Endpoint("cmpl-", backend.open_completion, text_whole, text_chunks)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, chat_endpoint)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, legacy_endpoint)

    async def _generate(request: Request, endpoint: _Endpoint) -> Response:
        if (not_json := _not_json(request)) is not None:
            return not_json
        request_id = f"{endpoint.id_prefix}{uuid.uuid4().hex[:24]}"
        started = time.monotonic()
        raw = await request.body()
        if state.draining:
            return error_response(Failure.draining(), 5)
        state.requests.begin(request_id)
        handed_over = False  # to the streaming response, which ends the request when it is over
        try:
            opened = endpoint.open(request_id, raw)
            try:
                body, stream = await state.requests.unless_expired(opened.__aenter__())
            except InvalidBody as exc:
                _forget_frames(exc)
                log.info("request_invalid", request_id=request_id, reason=exc.field)
                metrics.request_finished(RequestOutcome.REJECTED)
                return invalid_body_response(exc)
            except (Refused, Explained) as refused:
                _forget_frames(refused)
                failure = refused.failure
                log.info("request_refused", request_id=request_id, code=failure.code,
                         reason=failure.reason, rejection_reason=failure.rejection)
                if failure.rejection is not None:
                    metrics.rejected(failure.rejection)
                metrics.request_finished(RequestOutcome.REJECTED)
                if isinstance(refused, Explained):
                    return explained_response(refused)
                return error_response(failure, refused.retry_after_s)
            state.requests.attach(request_id, stream)
            served = _Served(request_id, body.model, started, metrics)
            if not body.stream:
                try:
                    answer = await _unless_gone(_complete(stream, endpoint, body, served), request)
                    if answer is None:  # the client left: its tokens would go nowhere, the engine stops
                        served.end(RequestOutcome.CANCELLED)
                        return error_response(Failure.cancelled())
                    return answer
                finally:
                    await opened.__aexit__(None, None, None)
            # The 200 goes out with the first output: anything that fails before it (a load, the
            # engine) is still a plain HTTP error a client or balancer can retry elsewhere, and in
            # a storm the refusals are never answered later than the work that was admitted.
            first = await _first_event(stream, request)
            served.output()
            if first is None or isinstance(first, Failed):
                await opened.__aexit__(None, None, None)
                if first is None:
                    served.end(RequestOutcome.CANCELLED)
                    return error_response(Failure.cancelled())
                served.end(RequestOutcome.FAILED, code=first.code)
                failure = engine_failure(first.code)
                return error_response(failure, Refused(failure).retry_after_s)
            handed_over = True
            chunks = endpoint.chunks(request_id, body)
            return StreamingResponse(_sse(opened, stream, chunks, body.include_usage, served, first,
                                          ended=lambda: state.requests.end(request_id)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finally:
            if not handed_over:
                state.requests.end(request_id)

    return app


def _forget_frames(refusal: Exception) -> None:
    """Clear the locals of the finished frames a refusal passed through: they hold the request's
    body (megabytes), and one of them (`InFlight.unless_expired`'s, which holds the task that holds
    this exception) closes a reference cycle, which would keep the body until the next full garbage
    collection instead of freeing it with the answer. A refusal is answered, never logged with its
    traceback."""
    traceback.clear_frames(refusal.__traceback__)


@dataclass(slots=True)
class _Served:
    """An admitted request's end: its outcome in the metrics and its one log line (numbers, never text)."""

    request_id: str
    model: str  # one of ours: the request was admitted
    started: float  # monotonic, at arrival
    metrics: Metrics
    first_output: float | None = None

    def output(self) -> None:
        if self.first_output is None:
            self.first_output = time.monotonic()

    def end(self, outcome: RequestOutcome, usage: Usage | None = None, code: EngineFailure | None = None,
            times: EngineTimes | None = None) -> None:
        self.metrics.request_finished(outcome)
        tokens = {} if usage is None else {"prompt_tokens": usage.prompt_tokens,
                                           "completion_tokens": usage.completion_tokens}
        if usage is not None:
            self.metrics.add_tokens(completion=usage.completion_tokens)
        log.info(f"request_{outcome.value}", request_id=self.request_id, model=self.model, outcome=outcome.value,
                 **({} if code is None else {"code": code}), **tokens,
                 **request_timings(started=self.started, first_output=self.first_output, ended=time.monotonic(),
                                   completion_tokens=0 if usage is None else usage.completion_tokens, engine=times))


async def _complete(stream: RequestStream, endpoint: _Endpoint, body: ChatBody | CompletionBody,
                    served: _Served) -> Response:
    parts: list[str] = []
    entries: list[TokenLogprob] = []
    async for event in stream:
        served.output()
        match event:
            case TextDelta(text, logprobs):
                parts.append(text)
                entries.extend(logprobs)
            case Finished(usage=usage) as done:
                served.end(RequestOutcome.COMPLETED, usage, times=done.times)
                completion = endpoint.whole(served.request_id, body, "".join(parts), entries, done)
                return Response(completion.__pydantic_serializer__.to_json(completion),
                                media_type="application/json")
            case Failed(code):
                served.end(RequestOutcome.FAILED, code=code)
                failure = engine_failure(code)
                return error_response(failure, Refused(failure).retry_after_s)
    served.end(RequestOutcome.CANCELLED)
    return error_response(Failure.cancelled())


async def _first_event(stream: RequestStream, request: Request) -> Event | None:
    """The stream's first event, or None when the client leaves (or the stream is closed) first."""
    return await _unless_gone(anext(stream, None), request)


async def _unless_gone(work: Awaitable[T], request: Request) -> T | None:
    """What `work` gives, or None when the client leaves first (`work` is then cancelled)."""
    done = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not done.done():
        done.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await done
        return None
    return done.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(first: Event, stream: RequestStream) -> AsyncIterator[Event]:
    yield first
    if not isinstance(first, Finished | Failed):
        async for event in stream:
            yield event


async def _sse(opened: Any, stream: RequestStream, chunks: ChatChunks | TextChunks, include_usage: bool,
               served: _Served, first: Event, ended: Callable[[], None]) -> AsyncIterator[bytes]:
    outcome, usage, code = RequestOutcome.CANCELLED, None, None  # the client left, unless a terminal event came
    times = None
    try:
        for chunk in chunks.start():
            yield _event(chunk)
        async for event in _events(first, stream):
            match event:
                case TextDelta(text, logprobs):
                    for chunk in chunks.delta(text, logprobs):
                        yield _event(chunk)
                case Finished(usage=usage) as done:
                    outcome, times = RequestOutcome.COMPLETED, done.times
                    for chunk in _ending(chunks, done, include_usage):
                        yield _event(chunk)
                case Failed(code=code):
                    outcome = RequestOutcome.FAILED
                    yield _event(error_body(engine_failure(code)))
        yield DONE
    except Exception as exc:  # mid-stream the status is sent: the error becomes the last event
        log.error("request_unexpected_error", request_id=served.request_id, phase="streaming", exc_info=exc)
        outcome = RequestOutcome.FAILED
        yield _event(error_body(Failure.internal()))
        yield DONE
    finally:
        served.end(outcome, usage, code, times)
        try:
            await opened.__aexit__(None, None, None)
        finally:
            ended()


def _ending(chunks: ChatChunks | TextChunks, done: Finished,
            include_usage: bool) -> list[sse.ChatCompletionChunk] | list[sse.TextCompletion]:
    """What ends a stream; with `include_usage`, the usage in a last chunk of its own with no choices, as
    OpenAI sends it (a chat stream's builder puts it on the finish chunk, where the coordinator reads it)."""
    if isinstance(chunks, TextChunks) or not include_usage:
        return chunks.end(done, include_usage)
    ending = chunks.end(done, include_usage=False)
    last = ending[-1]
    usage = sse.ChatCompletionChunk(id=last.id, created=last.created, model=last.model, choices=(),
                                    usage=completion_usage(done.usage))
    return [*ending, usage]


def _event(obj: sse.ChatCompletionChunk | sse.TextCompletion | dict[str, Any]) -> bytes:
    if isinstance(obj, dict):  # an OpenAI-style error object
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return sse.event(obj)
