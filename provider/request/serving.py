"""One OpenAI request served, below both front doors: written once, framed twice.

    Pipeline.chat(request_id, size, read)  (async with → `Prepared`)
      read the body (the door's `read`, which returns its JSON: on the loop for a small body, in the
      bulk lane with its working memory reserved for a large one) ─▶ size precheck ─▶ parse
      ─▶ the images' headers (nothing decoded) ─▶ the exact prompt ids ─▶ the output plan
    Prepared.book()          admission books the request's KV and a cold model's load, in one step
    Prepared.serve(booking)  (async with → the engine's stream) wait for the model, submit the
                             engine's `ChatRequest`; leaving the block cancels it if still running

`Pipeline.completion` is the legacy completions endpoint's: the same steps but for the prompt (its
text tokenized without the chat template, or its ids as given), no images and no output plan.

The doors keep only their framing. The coordinator's (`provider.jobs`): decrypting the body, the job
lifecycle (accept between booking and serving, a deadline for the first content) and sealed
``data:`` lines. The local server's (`provider.local`): HTTP, SSE, and refusals in OpenAI's error
shape with this request's numbers. Each turns what this module raises into its own answer:

* `InvalidBody` naming the parameter (a 400);
* `Refusal` (`provider.request.intake`): a `Failure` before anything is booked; `over` has the
  numbers of a prompt over the context window, `model_id` the model asked for when it is not ours;
* `MediaRefused`: an image refused by its headers (before booking) or, inside `serve`, at decoding;
* inside `serve`, what the model manager raises (`SlotRefused`) and the engine's `EngineError`,
  which `provider.response.failures` puts in the protocol's vocabulary for both doors.

The grammar's reservation (the output plan) goes back when the engine is done with the request, or
when the `async with` of `chat` ends for a request that never reached the engine.

Privacy: a log line here names its kind and counts, never the body's text; the model is bound into
the log context only once it names one of ours.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager, nullcontext
from typing import Any, Generic, Protocol, TypeVar

from structlog.contextvars import bound_contextvars

from protocol.errors import ErrorReason, Failure
from provider.engine import ChatRequest, RequestStream
from provider.request.body import (
    ChatBody,
    CompletionBody,
    InvalidBody,
    log_unknown_fields,
    parse_chat_body,
    parse_completion_body,
)
from provider.request.intake import Intake, OverContext, Refusal
from provider.request.media import NO_MEDIA, MediaPlan, MediaRefused, inspect_images
from provider.request.output import NO_PLAN, OutputPlan
from provider.slots.admission import Refused
from provider.slots.leases import Booking
from provider.telemetry import get_logger

log = get_logger("provider.request")

B = TypeVar("B", ChatBody, CompletionBody)


# --- what the pipeline needs from the model manager (provider.slots.ModelManager) --------------------


class Slot(Protocol):
    def submit(self, request: ChatRequest) -> RequestStream: ...


class ModelManager(Protocol):
    def precheck(self, model_id: str, prompt_tokens: int, max_tokens: int | None = None, *,
                 queued: bool = False) -> Failure | None: ...

    async def book_when_released(self, request_id: str, model_id: str, prompt_tokens: int,
                                 max_tokens: int | None = None, *, media: MediaPlan | None = None,
                                 queue_s: float = 0.0) -> Booking | Refused: ...

    def context_length(self, model_id: str) -> int | None: ...

    def serve(self, request_id: str, model_id: str, prompt_tokens: int, max_tokens: int | None = None, *,
              booking: Booking | None = None) -> AbstractAsyncContextManager[Slot]: ...


class Tally(Protocol):
    """The requests being served (`provider.jobs.stats.ServingStats`: the heartbeat and status read it)."""

    def accepted(self, request_id: str, model_id: str) -> None: ...

    def ended(self, request_id: str) -> None: ...


# --- the pipeline --------------------------------------------------------------------------------------


def json_body(raw: bytes | str) -> Any:
    """A body's JSON; `InvalidBody` naming the body as a whole when it is not JSON."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidBody("body", "is not valid JSON") from None


class Pipeline:
    """Serves requests on one intake and one model manager (one per agent or local server).

    `queue_s`: how long a booking refused for room waits for a request in flight to end (the owner's
    server, which has no other node to send a client to; 0 on the network: a fast refusal).
    `next_turn`: ask the engine to prepare a conversation's next turn (one user's conversations come
    back to the same server). `resolve_model`: a public model name -> the build that serves it."""

    def __init__(self, intake: Intake, manager: ModelManager, tally: Tally, *, queue_s: float = 0.0,
                 next_turn: bool = False, resolve_model: Callable[[str], str] | None = None) -> None:
        self.intake = intake
        self.manager = manager
        self.tally = tally
        self.queue_s = queue_s
        self.next_turn = next_turn
        self.resolve_model = resolve_model

    @asynccontextmanager
    async def chat(self, request_id: str, size: int, read: Callable[[], Any]) -> AsyncIterator[Prepared[ChatBody]]:
        """A chat request read, counted and planned; `size`: the body's bytes (where it is read),
        `read()`: its JSON. Raises before yielding (see the module doc); on exit, an output plan the
        engine never got is released."""
        intake = self.intake
        async with intake.ticket(request_id, size) as ticket:
            body = await ticket.run(_parse_chat, intake, read)
            body = self._resolved(request_id, body)
            with self._model_logged(body.model):
                media = await ticket.run(_inspect, request_id, body.images) if body.images else NO_MEDIA
                prompt_ids = await intake.prompt_ids(ticket, body, queued=self.queue_s > 0)
        with self._model_logged(body.model):
            output = await intake.output(request_id, body)
        prepared = Prepared(self, request_id, body, prompt_ids, media, output)
        try:
            yield prepared
        finally:
            if not prepared.submitted:
                output.release()

    @asynccontextmanager
    async def completion(self, request_id: str, size: int,
                         read: Callable[[], Any]) -> AsyncIterator[Prepared[CompletionBody]]:
        """A legacy completions request read and counted, as `chat`."""
        intake = self.intake
        async with intake.ticket(request_id, size) as ticket:
            body = await ticket.run(_parse_completion, read)
            body = self._resolved(request_id, body)
            with self._model_logged(body.model):
                prompt_ids = await intake.completion_ids(ticket, body, queued=self.queue_s > 0)
        yield Prepared(self, request_id, body, prompt_ids, NO_MEDIA, NO_PLAN)

    def _resolved(self, request_id: str, body: B) -> B:
        log_unknown_fields(body, request_id=request_id)
        if self.resolve_model is None:
            return body
        return dataclasses.replace(body, model=self.resolve_model(body.model))

    def _model_logged(self, model_id: str) -> AbstractContextManager[Any]:
        """The model in the log context, once it names one of ours (until then it is the client's string)."""
        if self.intake.counter.knows(model_id):
            return bound_contextvars(model=model_id)
        return nullcontext()


class Prepared(Generic[B]):
    """One request read and counted, ready to book: its body, exact prompt ids, checked images and
    output plan."""

    __slots__ = ("_pipeline", "body", "media", "output", "prompt_ids", "request_id", "submitted")

    def __init__(self, pipeline: Pipeline, request_id: str, body: B, prompt_ids: list[int], media: MediaPlan,
                 output: OutputPlan) -> None:
        self._pipeline = pipeline
        self.request_id = request_id
        self.body = body
        self.prompt_ids = prompt_ids
        self.media = media
        self.output = output
        self.submitted = False  # the engine has it (and gives the grammar's reservation back)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    async def book(self) -> Booking:
        """Admission, which reserves: the request's KV and, for a model that is not resident, its
        load's claim. Raises `Refusal` with admission's failure (and, for a prompt over the context
        window, its exact numbers). Hand the booking to `serve`, or release it."""
        pipeline, body = self._pipeline, self.body
        booked = await pipeline.manager.book_when_released(self.request_id, body.model, self.prompt_tokens,
                                                           body.max_tokens, media=self.media,
                                                           queue_s=pipeline.queue_s)
        if not isinstance(booked, Refused):
            return booked
        over = None
        if booked.failure.reason is ErrorReason.REQUEST_EXCEEDS_CONTEXT:
            context = pipeline.manager.context_length(body.model)
            if context is not None:
                over = OverContext(body.model, self.prompt_tokens, True, context, body.max_tokens)
        raise Refusal(booked.failure, over)

    @asynccontextmanager
    async def serve(self, booking: Booking) -> AsyncIterator[RequestStream]:
        """Wait for the model (its load, any unload the booking waits on), pin it, submit the
        request; yields the engine's event stream, which is closed on the way out (a cancel, unless
        it had ended)."""
        pipeline, body = self._pipeline, self.body
        pipeline.tally.accepted(self.request_id, body.model)
        try:
            async with pipeline.manager.serve(self.request_id, body.model, self.prompt_tokens, body.max_tokens,
                                              booking=booking) as slot:
                stream = slot.submit(self.engine_request(booking))
                self.submitted = True
                try:
                    yield stream
                finally:
                    await stream.aclose()  # no-op after a terminal event; a cancel otherwise
        finally:
            pipeline.tally.ended(self.request_id)

    def engine_request(self, booking: Booking) -> ChatRequest:
        """The engine's request: `max_tokens` the request's own, or the model's default, as admission
        sized it."""
        body, sampling = self.body, self.body.sampling(booking.kv.max_tokens)
        if isinstance(body, CompletionBody):
            return ChatRequest(self.request_id, (), sampling, prompt_ids=self.prompt_ids)
        # A vision model's processor places the image tokens itself: it gets the messages, not ids.
        ids = self.prompt_ids if booking.reservation is not None else None
        tool_format = self._pipeline.intake.counter.tool_format_now(body.model)
        return ChatRequest(self.request_id, body.messages, sampling, prompt_ids=ids,
                           prepare_next_turn=self._pipeline.next_turn, tools=body.offered_tools,
                           tool_call=body.tool_call(tool_format), constraint=self.output.constraint,
                           top_logprobs=self.output.top_logprobs)


def _parse_chat(intake: Intake, read: Callable[[], Any]) -> ChatBody:
    """The door's JSON, the message-count precheck, then the one validator (`InvalidBody` names the field)."""
    data = read()
    intake.precheck(data)
    return parse_chat_body(data)


def _parse_completion(read: Callable[[], Any]) -> CompletionBody:
    return parse_completion_body(read())


def _inspect(request_id: str, images: tuple[str, ...]) -> MediaPlan:
    """The images' headers only (nothing decoded); a refusal names its kind, never the data."""
    try:
        return inspect_images(images)
    except MediaRefused as refused:
        log.info("request_refused", request_id=request_id, reason="media", kind=refused.kind)
        raise


__all__ = ["ModelManager", "Pipeline", "Prepared", "Slot", "Tally", "json_body"]
