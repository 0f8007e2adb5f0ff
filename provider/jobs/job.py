"""One ``inference_request``, end to end: the coordinator's door onto the request pipeline.

    open encrypted_body ─▶ the pipeline (`provider.request.serving`): parse, size bound, images'
      headers, exact prompt count, output plan ─▶ admission + booking
      ─▶ inference_accepted ─▶ the pipeline serves: wait for the model, submit ─▶ stream: one sealed
      ``data:`` line per chunk ─▶ inference_complete (exact usage; the coordinator then ends the
      consumer's stream with [DONE])

The pipeline is the local server's too; what this module adds is the coordinator's framing: the
body decrypted, the job's lifecycle, the accept between booking and serving, the first-content
deadline, and every answer sealed. Before any big allocation: a large body is opened, parsed and
counted in the bulk lane with its working memory reserved, never on the loop; a prompt whose size
alone proves it too long for the context (400) or for the room the ledger has (503) is refused
before it is tokenized; admission books the request's KV (and a cold model's load) in the ledger
in the same step as it decides, so what is accepted is what the memory can hold.

Every frame goes out through ``_emit``, which steps the job's ``JobLifecycle`` first: a frame the
transition table does not allow raises instead of being sent, so each request gets exactly one
terminal frame and nothing after it.

* Before the accept, any refusal is an ``inference_error`` alone (a fast reject the coordinator
  reroutes): 400 ``invalid_request`` for a missing/undecryptable/unparsable body, 404 for a model we
  do not serve, 503 capacity from admission.
* The accept goes out as soon as admission says yes — before any model load.
* The role delta is sent together with the first real output, so a request that fails before
  producing anything is still rerouted by the coordinator (it has not committed).
* ``first_content_budget_ms``, anchored at frame receipt: already spent at admission → 503
  ``deadline_unreachable`` without an accept; no content by then → the same error instead of content
  (before any output, so the coordinator reroutes without counting it against us).
* An engine failure is answered from the one table both doors read (`provider.response.failures`).
* Cancellation (``cancel`` from the coordinator, or a lost connection) cancels the job's task: the
  engine stream is closed, the manager releases the KV reservation, and nothing more is sent.
  A drain that runs out cancels it too, with ``DRAIN_EXPIRED`` as the message: the coordinator still
  waits for this request, so it gets its one terminal frame, 503 ``draining``.

Privacy: no prompt or completion text and no exception text is logged; ``request_id`` and ``model``
are bound in structlog's context for the job's lifetime.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from structlog.contextvars import bound_contextvars

from protocol import InferenceAccepted, InferenceComplete, InferenceRequest, ProviderMessage, Usage, encode
from protocol.crypto import CryptoError, ProviderIdentity, RequestBox
from protocol.errors import Failure, inference_error_frame
from protocol.sse import data_line
from provider.engine import Failed, Finished, RequestStream, TextDelta
from provider.engine.types import EngineTimes
from provider.jobs.lifecycle import JobEvent, JobLifecycle, JobState
from provider.jobs.stats import ServingStats
from provider.metrics import Metrics, RequestOutcome
from provider.request.body import ChatBody, InvalidBody
from provider.request.intake import Intake, Refusal
from provider.request.media import MediaRefused
from provider.request.serving import ModelManager, Pipeline, Prepared, json_body
from provider.request.tokens import PromptCounter
from provider.response.failures import engine_failure, exception_failure
from provider.response.openai import ChatChunks
from provider.response.toolcalls import ToolCallStream, tool_calls_for
from provider.session.connection import DRAIN_EXPIRED
from provider.session.status import RequestTally
from provider.slots.leases import Booking
from provider.slots.rates import RateBook
from provider.telemetry import get_logger, request_timings

log = get_logger("provider.jobs")

CHAT_ENDPOINT = "/v1/chat/completions"


class JobOutcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"  # accepted, then ended by an inference_error
    REJECTED = "rejected"  # inference_error without an accept
    CANCELLED = "cancelled"


# --- the job ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class JobContext:
    """What every job shares (one per agent)."""

    identity: ProviderIdentity
    manager: ModelManager
    counter: PromptCounter
    stats: ServingStats
    metrics: Metrics | None = None
    requests: RequestTally | None = None  # the session status's tally (accepted, refused/failed by reason)
    clock: Callable[[], float] = time.time  # the chunks' `created`
    monotonic: Callable[[], float] = time.monotonic  # budgets and durations
    intake: Intake | None = None  # default: on the counter and the manager's ledger
    resolve_model: Callable[[str], str] | None = None  # a public name -> the build to run (desired_models)
    rates: RateBook | None = None  # each completed request's rates (heartbeat evidence, quotes)
    pipeline: Pipeline | None = None  # default: on the intake, the manager and the stats

    def __post_init__(self) -> None:
        if self.intake is None:
            self.intake = Intake(self.counter, self.manager.ledger, self.manager)
        if self.pipeline is None:
            self.pipeline = Pipeline(self.intake, self.manager, self.stats, resolve_model=self.resolve_model)


class _Unanswerable(Refusal):
    """Internal: a refusal the job decides itself (a body it cannot open, a deadline already spent),
    not one of admission's: it is answered, but not counted among the rejects."""


class _EncryptionFailed(Exception):
    """Internal: a chunk could not be sealed (502 ``encryption_failure``)."""

    failure = Failure.encryption_failed()


class Job:
    """Runs one request; ``send`` puts an encoded frame on the connection's send queue."""

    def __init__(self, request: InferenceRequest, ctx: JobContext, send: Callable[[str], None]) -> None:
        self.request_id = request.request_id
        self._request = request
        self._ctx = ctx
        self._send = send
        self.lifecycle = JobLifecycle()
        self._started = ctx.monotonic()  # frame receipt: the anchor of first_content_budget_ms
        self._first_output: float | None = None
        budget_ms = request.first_content_budget_ms
        self._content_deadline = self._started + budget_ms / 1000 if budget_ms > 0 else None
        self._deadline_guard: asyncio.Timeout | None = None
        self._box: RequestBox | None = None  # the request's box, once its body is opened
        self._alone = False  # no other request in flight from submit to first output: an isolated prefill

    @property
    def state(self) -> JobState:
        return self.lifecycle.state

    async def run(self) -> JobOutcome:
        with bound_contextvars(request_id=self.request_id):
            try:
                return await self._run()
            except asyncio.CancelledError as cancel:
                if DRAIN_EXPIRED in cancel.args and not self.lifecycle.terminal:
                    return self._drain_expired()
                self._cancelled()
                raise
            except Exception as exc:  # the edge of a job: even a bug leaves the request its one answer
                if self.lifecycle.terminal:
                    raise
                log.error("job_crashed", exc_info=exc)
                rejected = self.lifecycle.state < JobState.ACCEPTED
                self._fail(Failure.internal())
                return JobOutcome.REJECTED if rejected else JobOutcome.FAILED

    async def _run(self) -> JobOutcome:
        """Every refusal before the accept is answered here, with no accept before it."""
        try:
            sealed = self._request.encrypted_body
            if sealed is None:
                raise _Unanswerable(Failure.invalid_request())
            pipeline = self._ctx.pipeline
            assert pipeline is not None
            async with pipeline.chat(self.request_id, len(sealed.ciphertext), self._open) as request:
                with bound_contextvars(model=request.body.model):
                    return await self._admit_and_serve(request)
        except _Unanswerable as unanswerable:
            failure = unanswerable.failure
        except InvalidBody as exc:  # what the body asks, or asks of this model, it cannot have
            log.info("request_refused", reason="invalid_body", kind=exc.field)
            failure = Failure.invalid_request()
        except (Refusal, MediaRefused) as refused:  # an image by its headers; the intake; admission
            failure = refused.failure
            self._count_rejection(failure)
        self._fail(failure)
        return JobOutcome.REJECTED

    # --- before the accept --------------------------------------------------------------------------

    def _open(self) -> Any:
        """Decrypt the body and read its JSON (on the loop for a small body, in the bulk lane for a large one)."""
        sealed = self._request.encrypted_body
        assert sealed is not None
        try:
            self._box, plaintext = self._ctx.identity.open_request(sealed)
        except CryptoError:
            log.info("request_undecryptable")
            raise _Unanswerable(Failure.invalid_request()) from None
        data = json_body(plaintext)
        if isinstance(data, dict) and data.get("endpoint", CHAT_ENDPOINT) != CHAT_ENDPOINT:
            log.info("request_refused", reason="unsupported_endpoint")
            raise _Unanswerable(Failure.invalid_request())
        return data

    def _count_rejection(self, failure: Failure) -> None:
        if self._ctx.metrics is not None:
            self._ctx.metrics.rejected(failure.rejection or failure.reason or failure.code)

    async def _admit_and_serve(self, request: Prepared[ChatBody]) -> JobOutcome:
        booked = await request.book()
        try:
            if self._content_deadline is not None and self._ctx.monotonic() >= self._content_deadline:
                raise _Unanswerable(Failure.deadline_unreachable())
            self.lifecycle.step(JobEvent.ADMIT)
            self._emit(JobEvent.ACCEPT, InferenceAccepted(request_id=self.request_id))
        except BaseException:
            booked.release()
            raise
        if self._ctx.requests is not None:
            self._ctx.requests.accept()
        # max_tokens: the request's own, or the model's default, clamped to the context
        log.info("request_accepted", prompt_tokens=request.prompt_tokens, max_tokens=booked.kv.max_tokens)
        return await self._serve(request, booked)

    # --- after the accept ---------------------------------------------------------------------------

    async def _serve(self, request: Prepared[ChatBody], booking: Booking) -> JobOutcome:
        body, box = request.body, self._box
        assert box is not None
        tools = tool_calls_for(self._ctx.counter.tool_format_now(body.model), body.offered_tools,
                               parallel=body.parallel_tool_calls, forced=body.tool_choice.forces_a_call)
        remaining = None if self._content_deadline is None else self._content_deadline - self._ctx.monotonic()
        try:
            # first_content_budget_ms: no content by then → give up before any output (rerouted, neutral).
            async with asyncio.timeout(remaining) as self._deadline_guard:
                async with request.serve(booking) as stream:
                    self._alone = len(self._ctx.stats.in_flight) == 1
                    return await self._stream(box, body, stream, tools)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            if self.lifecycle.terminal or self._first_output is not None:
                raise
            log.info("request_deadline_missed", budget_ms=self._request.first_content_budget_ms)
            self._fail(Failure.deadline_unreachable())
            return JobOutcome.FAILED
        except Exception as exc:  # the edge of a job: every failure becomes its one error frame
            if self.lifecycle.terminal:
                raise  # a frame already ended the job: this is a bug, not a request failure
            failure = exception_failure(exc)
            if failure is None:
                log.error("job_crashed", exc_info=exc)
                failure = Failure.internal()
            self._fail(failure)
            return JobOutcome.FAILED

    async def _stream(self, box: RequestBox, body: ChatBody, stream: RequestStream,
                      tools: ToolCallStream | None) -> JobOutcome:
        # With tools, a delta inside a call gives no chunk yet: the role delta still goes out with it.
        # A request that asked for log-probabilities had its model's spelling built at intake.
        table = self._ctx.intake.grammars.table(body.model) if body.top_logprobs is not None else None
        chunks = ChatChunks(f"chatcmpl-{self.request_id}", body.model, created=int(self._ctx.clock()), tools=tools,
                            token_bytes=None if table is None else table.token_bytes)
        async for item in stream:
            match item:
                case TextDelta():
                    self._output(box, chunks)
                    for chunk in chunks.for_event(item):
                        self._chunk(box, data_line(chunk))
                case Finished(usage=usage, cached_tokens=cached):
                    self._output(box, chunks)
                    for chunk in chunks.for_event(item):  # the last one carries finish_reason and usage
                        self._chunk(box, data_line(chunk))
                    self._emit(JobEvent.COMPLETE, InferenceComplete(
                        request_id=self.request_id,
                        usage=Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)))
                    self._completed(usage.prompt_tokens, usage.completion_tokens, item.times)
                    self._measured(body.model, usage.prompt_tokens, usage.completion_tokens, cached)
                    return JobOutcome.COMPLETED
                case Failed(code=code):
                    if self.lifecycle.state is JobState.STREAMING:
                        self._ctx.stats.generation_errors_after_output += 1
                    self._fail(engine_failure(code))
                    return JobOutcome.FAILED
        # The stream ended with no terminal event: someone closed it (engine.cancel) — a cancellation.
        raise asyncio.CancelledError

    def _output(self, box: RequestBox, chunks: ChatChunks) -> None:
        """Before the first output: the role delta, so it is always the first chunk."""
        if self._first_output is None:
            self._first_output = self._ctx.monotonic()
            self._alone = self._alone and len(self._ctx.stats.in_flight) == 1
            if self._deadline_guard is not None:
                self._deadline_guard.reschedule(None)  # content is here: the budget is met
            self._chunk(box, data_line(chunks.role()))

    def _measured(self, model_id: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """The request's rates into the model's evidence: prefill from the frame's receipt to its first
        output (what the coordinator waits for after dispatch: decryption, tokenizing and admission
        included, the network not), decode from there to the end."""
        if self._ctx.rates is None or self._first_output is None:
            return
        self._ctx.rates.served(model_id, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                               submitted=self._started, first_token=self._first_output,
                               ended=self._ctx.monotonic(), isolated=self._alone,
                               ttft_s=self._first_output - self._started, cached_tokens=cached_tokens)

    # --- frames ---------------------------------------------------------------------------------------

    def _chunk(self, box: RequestBox, line: bytes) -> None:
        """One chunk: one SSE ``data:`` line, sealed (no blank line after it: the coordinator adds it)."""
        try:
            frame = box.seal_chunk(self.request_id, line)
        except CryptoError:
            raise _EncryptionFailed() from None
        self._emit(JobEvent.CHUNK, frame)

    def _emit(self, step: JobEvent, frame: ProviderMessage) -> None:
        """Encode, step the lifecycle (raises on an illegal frame), then send."""
        text = encode(frame)  # before the step: an unencodable frame leaves the state unchanged
        self.lifecycle.step(step)
        self._send(text)

    def _fail(self, failure: Failure) -> None:
        rejected = self.lifecycle.state < JobState.ACCEPTED  # no accept went out: a fast reject
        self._emit(JobEvent.FAIL, inference_error_frame(self.request_id, failure))
        outcome = RequestOutcome.REJECTED if rejected else RequestOutcome.FAILED
        if self._ctx.metrics is not None:
            self._ctx.metrics.request_finished(outcome)
        if self._ctx.requests is not None:
            (self._ctx.requests.refuse if rejected else self._ctx.requests.fail)(failure)
        log.info("request_failed" if not rejected else "request_rejected", status_code=failure.status_code,
                 failure_code=failure.code, error_reason=failure.reason, rejection_reason=failure.rejection)

    def _completed(self, prompt_tokens: int, completion_tokens: int, times: EngineTimes | None = None) -> None:
        self._ctx.stats.completed(completion_tokens)
        if self._ctx.requests is not None:
            self._ctx.requests.complete()
        if self._ctx.metrics is not None:
            self._ctx.metrics.request_finished(RequestOutcome.COMPLETED)
            self._ctx.metrics.add_tokens(prompt=prompt_tokens, completion=completion_tokens)
        log.info("request_completed", outcome="completed", prompt_tokens=prompt_tokens,
                 completion_tokens=completion_tokens,
                 **request_timings(started=self._started, first_output=self._first_output,
                                   ended=self._ctx.monotonic(), completion_tokens=completion_tokens,
                                   # the engine's times are time.monotonic(): only on the same clock
                                   engine=times if self._ctx.monotonic is time.monotonic else None))

    def _drain_expired(self) -> JobOutcome:
        """The drain ran out: end the request with its terminal frame (the task's cancel ends here)."""
        rejected = self.lifecycle.state < JobState.ACCEPTED
        asyncio.current_task().uncancel()
        log.info("request_drain_expired", phase="before_output" if self._first_output is None else "streaming")
        self._fail(Failure.draining())
        return JobOutcome.REJECTED if rejected else JobOutcome.FAILED

    def _cancelled(self) -> None:
        if self.lifecycle.terminal:
            return  # the job had already ended; a late cancel changes nothing
        before_output = self._first_output is None
        self.lifecycle.step(JobEvent.CANCEL)
        self._ctx.stats.cancellations_received += 1
        if before_output:
            self._ctx.stats.cancellations_before_output += 1
        if self._ctx.requests is not None:
            self._ctx.requests.cancel()
        if self._ctx.metrics is not None:
            self._ctx.metrics.request_finished(RequestOutcome.CANCELLED)
        log.info("request_cancelled", phase="before_output" if before_output else "streaming")


async def run_job(request: InferenceRequest, ctx: JobContext, send: Callable[[str], None]) -> JobOutcome:
    """Run one request to its terminal frame (or its cancellation)."""
    return await Job(request, ctx, send).run()


__all__ = ["CHAT_ENDPOINT", "Job", "JobContext", "JobOutcome", "run_job"]
