"""From request bytes to a validated chat body and its prompt ids, before any big allocation.

Both front doors (the coordinator's jobs and the local server) take a request through the same
steps (the request pipeline, `serving.Pipeline`, runs them for both), each cheap check before the
costly step it guards:

1. the body's size decides where it is read: up to `INLINE_BYTES` on the event loop (a few
   hundred microseconds), beyond that in the bulk lane (`lanes.BulkLane`), with its working memory
   reserved in the ledger first (`ReservationKind.PROMPT`: the body's copies while it is decrypted,
   parsed and rendered, and the tokenizer's per-token state, bounded by the context window because
   a longer prompt is given up early); no room → 503 at once;
2. `precheck` on the parsed JSON, before the full validation: a model every request for which is
   refused (its failed load is remembered, or it can never load here: `refuse_model`, asked again
   at each later step, so the answer does not depend on which step sees the request first), then a
   message list too long for the model's context window at its template's per-message cost, is
   refused without building a single message object;
3. the size bound (`bounds.TokenBounds.lower_bound`) is handed to admission by the caller, which
   refuses a prompt that surely exceeds the context (400) or what the ledger can give (503);
4. `PromptCounter.prompt_ids`: exact ids, short prompts inline, long ones in the lane;
5. `output` (`output.py`): a grammar's memory reserved and the grammar compiled, the
   vocabulary of log-probabilities built, before admission books the request.

The legacy completions endpoint's prompt (`completion_ids`) takes the same steps without a chat
template: the raw text tokenized (`PromptCounter.text_ids`), or the token ids it came as, checked.

A prompt over its model's context window is refused with its numbers (`OverContext`), for a front
door that shows them (the local server); the coordinator's keeps the fixed text.

`Ticket` holds the working-memory reservation from step 1 until every lane task it started has
finished on the thread (a cancelled caller does not free memory the thread still uses).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from memory import Ledger, Rejection, ReservationKind
from protocol.errors import ErrorReason, Failure, RejectionReason
from provider.request.body import ChatBody, CompletionBody, InvalidBody
from provider.request.bounds import countable_chars
from provider.request.lanes import LaneFull
from provider.request.output import Grammars, OutputPlan
from provider.request.tokens import (
    CHUNK_CHARS,
    PromptCounter,
    PromptError,
    PromptTooLong,
    ToolsUnsupported,
    UnknownModel,
)
from provider.telemetry import get_logger

T = TypeVar("T")
log = get_logger("provider.request.intake")

INLINE_BYTES = 64 * 1024  # bodies read on the loop (well under a millisecond); larger ones go to the bulk lane
BODY_COPIES = 4  # the sealed body, its plaintext, the parsed strings, the rendered prompt
TOKEN_WORKING_BYTES = 320  # per token while a tokenizer encodes (measured ~270 B with the id list)


@dataclass(frozen=True, slots=True)
class OverContext:
    """A prompt over its model's context window, in numbers (no text): for an error that gives them."""

    model_id: str  # one of ours: only a model whose window is known gets here
    prompt_tokens: int
    exact: bool  # False: the prompt has at least this many (counting stopped once it was surely over)
    context_length: int
    max_tokens: int | None  # what the request asked for, if it did


class Refusal(Exception):
    """Refuse before acceptance; `failure` becomes the error (protocol/errors); `over`: the numbers of
    a prompt too long for the context window; `model_id`: the model asked for, where the refusal is
    about it (not served here: the client's string, for an answer that names it, never for a log; or
    one of ours that can never serve this request); `prompt_tokens` (at least) and `max_tokens`: the
    request's numbers where admission refused it for its size."""

    def __init__(self, failure: Failure, over: OverContext | None = None, *, model_id: str | None = None,
                 prompt_tokens: int | None = None, max_tokens: int | None = None) -> None:
        super().__init__(failure.code.value)
        self.failure = failure
        self.over = over
        self.model_id = model_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


def over_context(model_id: str, prompt_tokens: int, exact: bool, context_length: int | None,
                 max_tokens: int | None) -> Refusal:
    """400 request_exceeds_context, with its numbers when the window is known."""
    over = None if context_length is None else OverContext(model_id, prompt_tokens, exact, context_length, max_tokens)
    return Refusal(Failure.request_exceeds_context(), over)


def working_bytes(body_bytes: int, max_context_tokens: int) -> int:
    """The working memory one large body may use while it is read and counted."""
    tokens = min(max(0, body_bytes), CHUNK_CHARS + max(0, max_context_tokens))
    return BODY_COPIES * max(0, body_bytes) + TOKEN_WORKING_BYTES * tokens


def lane_full() -> Failure:
    return Failure.capacity(RejectionReason.SLOT_STATE, reason=ErrorReason.QUEUE_FULL)


class Ticket:
    """One request's passage through the intake: runs its steps inline or in the lane."""

    def __init__(self, intake: Intake, request_id: str, inline: bool, body_bytes: int = 0) -> None:
        self._intake = intake
        self.request_id = request_id
        self.inline = inline
        self._body_bytes = body_bytes
        self._open_tasks = 0
        self._closed = False
        self._ledger_id = f"prompt:{request_id}"

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the body: on the loop for a small body, in the bulk lane for a large one."""
        if self.inline:
            return fn(*args)
        return await self.in_lane(fn, *args, size=self._body_bytes)

    async def in_lane(self, fn: Callable[..., T], *args: Any, size: int | None = None) -> T:
        """`fn(*args)` in the bulk lane, `size` the characters (or bytes) it works on (`BulkLane.run`);
        a large body's reservation outlives it until it ends."""
        track = not self.inline
        if track:
            self._open_tasks += 1
        lane = self._intake.counter.lane
        try:
            return await lane.run(fn, *args, on_done=self._task_done if track else None, size=size)
        except LaneFull:
            if track:
                self._open_tasks -= 1
            log.info("bulk_lane_full", request_id=self.request_id, queued=lane.busy)
            raise Refusal(lane_full()) from None

    async def prompt_ids(self, model_id: str, messages, *, tools=(), limit: int | None) -> list[int]:
        """Exact prompt ids (`PromptCounter.prompt_ids`); its lane work counts as this ticket's."""
        return await self._intake.counter.prompt_ids(model_id, messages, tools=tools, limit=limit, run=self.in_lane)

    def _task_done(self) -> None:
        self._open_tasks -= 1
        self._maybe_release()

    def _close(self) -> None:
        self._closed = True
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self._closed and self._open_tasks <= 0:
            self._intake.ledger.release(self._ledger_id)


class Admits(Protocol):
    """What the intake asks of the model manager (`provider.slots.ModelManager`)."""

    def model_refusal(self, model_id: str) -> Failure | None: ...

    def precheck(self, model_id: str, prompt_tokens: int, max_tokens: int | None = None, *,
                 queued: bool = False) -> Failure | None: ...

    def context_length(self, model_id: str) -> int | None: ...


class Intake:
    def __init__(self, counter: PromptCounter, ledger: Ledger, manager: Admits) -> None:
        self.counter = counter
        self.ledger = ledger
        self._manager = manager
        self._context_of = manager.context_length
        self.grammars = Grammars(counter, ledger)

    def max_context_tokens(self) -> int:
        return max((self._context_of(m) or 0 for m in self.counter.models()), default=0)

    @asynccontextmanager
    async def ticket(self, request_id: str, body_bytes: int) -> AsyncIterator[Ticket]:
        """A ticket for a body of `body_bytes`; a large one reserves its working memory first."""
        inline = body_bytes <= INLINE_BYTES
        ticket = Ticket(self, request_id, inline, body_bytes)
        if not inline:
            if not self.counter.lane.has_room(body_bytes):
                log.info("bulk_lane_full", request_id=request_id, queued=self.counter.lane.busy)
                raise Refusal(lane_full())
            nbytes = working_bytes(body_bytes, self.max_context_tokens())
            if isinstance(self.ledger.reserve(ticket._ledger_id, ReservationKind.PROMPT, nbytes), Rejection):
                raise Refusal(Failure.capacity(RejectionReason.MEMORY_CAP))
        try:
            yield ticket
        finally:
            if not inline:
                ticket._close()

    def precheck(self, data: Any) -> None:
        """Before validation: a prompt whose size alone (its text and its message count at the
        template's per-message cost) cannot fit the model's window is a 400 now, without building
        message objects or copying megabytes of text. Anything else is left to the validator."""
        if not isinstance(data, Mapping):
            return
        model, messages = data.get("model"), data.get("messages")
        if not isinstance(model, str) or not isinstance(messages, list) or not self.counter.knows(model):
            return
        self.refuse_model(model)
        context = self._context_of(model)
        if context is None:
            return
        lower = self.counter.bounds(model).lower_bound(countable_chars(messages), len(messages))
        if lower >= context:
            asked = data.get("max_completion_tokens") or data.get("max_tokens")
            raise over_context(model, lower, False, context, asked if type(asked) is int and asked > 0 else None)

    def refuse_model(self, model_id: str) -> None:
        """Raise the refusal every request for `model_id` gets whatever it asks (its failed load is
        remembered, or it can never load here), before anything about the request is checked: the
        same answer at every ask, whether or not the model's tokenizer bound is known yet (it is
        learned at the model's first request) and whichever check would refuse the request itself."""
        refused = self._manager.model_refusal(model_id)
        if refused is not None:
            raise Refusal(refused, model_id=model_id)

    def lower_bound(self, model_id: str, chars: int, messages: int) -> int:
        """Tokens the prompt has at least, from its size alone (0 when the tokenizer claims no bound)."""
        return self.counter.bounds(model_id).lower_bound(chars, messages)

    async def prompt_ids(self, ticket: Ticket, body: ChatBody, *, queued: bool = False) -> list[int]:
        """Steps 3 and 4: the size bound through admission (read-only), then the exact ids.
        Raises `Refusal`: 404 for a model that is not ours, 400 request_exceeds_context, 503 when
        even the bound does not fit (`queued`: not for room that requests in flight hold, which the
        booking waits for), 422 when the template cannot render the messages; `InvalidBody` naming
        `tools` when tools are offered to a model whose family has no tool calling."""
        if not self.counter.knows(body.model):
            raise Refusal(Failure.model_unavailable(), model_id=body.model)
        self.refuse_model(body.model)
        self._precheck_bound(body.model, self.lower_bound(body.model, body.chars, len(body.messages)),
                             body.max_tokens, queued)
        context = self._context_of(body.model)
        try:
            return await ticket.prompt_ids(body.model, body.messages, tools=body.offered_tools, limit=context)
        except ToolsUnsupported:
            raise InvalidBody("tools", "is not supported by this model: its chat template has no tool calling") from None
        except UnknownModel:
            raise Refusal(Failure.model_unavailable(), model_id=body.model) from None
        except PromptTooLong as too_long:
            raise over_context(body.model, too_long.tokens, too_long.exact, context, body.max_tokens) from None
        except PromptError:
            raise Refusal(Failure.template_render()) from None

    async def output(self, request_id: str, body: ChatBody) -> OutputPlan:
        """Step 5: the request's grammar (compiled, its memory reserved) and log-probabilities.
        Raises `InvalidBody` naming the parameter, or `Refusal` (503) when the grammar's memory does
        not fit. The caller releases the plan unless the engine got it (`OutputPlan.release`)."""
        return await self.grammars.plan(request_id, body, lambda failure: Refusal(failure))

    async def completion_ids(self, ticket: Ticket, body: CompletionBody, *, queued: bool = False) -> list[int]:
        """A legacy completions prompt's ids: its text tokenized without any chat template, or the ids
        it came as, checked against the tokenizer's vocabulary; the size bound through admission
        first, as for a chat prompt. Raises `Refusal` (404, 400 request_exceeds_context, 503) or
        `InvalidBody` naming `prompt` (empty, ids out of range, text the tokenizer cannot take) or
        `model` (a vision model: its processor renders messages, there is no raw prompt to give it)."""
        model = body.model
        if not self.counter.knows(model):
            raise Refusal(Failure.model_unavailable(), model_id=model)
        self.refuse_model(model)
        if self.counter.is_vision(model):
            raise InvalidBody("model", "is a vision model, served on /v1/chat/completions only")
        context = self._context_of(model)
        try:
            if isinstance(body.prompt, str):
                self._precheck_bound(model, self.lower_bound(model, len(body.prompt), 0), body.max_tokens, queued)
                ids = await self.counter.text_ids(model, body.prompt, limit=context, run=ticket.in_lane)
            else:
                vocabulary = await self.counter.vocabulary(model)
                if await ticket.run(max, body.prompt) >= vocabulary:
                    raise InvalidBody("prompt", f"token ids must be below {vocabulary}, the size of this model's vocabulary")
                ids = list(body.prompt)
                if context is not None and len(ids) >= context:
                    raise PromptTooLong(len(ids), exact=True)
        except UnknownModel:
            raise Refusal(Failure.model_unavailable(), model_id=model) from None
        except PromptTooLong as too_long:
            raise over_context(model, too_long.tokens, too_long.exact, context, body.max_tokens) from None
        except PromptError:
            raise InvalidBody("prompt", "must be text the model's tokenizer can encode") from None
        if not ids:
            raise InvalidBody("prompt", "must not be empty (this model's tokenizer adds no start token)")
        return ids

    def _precheck_bound(self, model_id: str, lower: int, max_tokens: int | None, queued: bool) -> None:
        """Admission's read-only answer for a prompt of at least `lower` tokens (nothing to ask at 0)."""
        if lower <= 0:
            return
        refused = self._manager.precheck(model_id, lower, max_tokens, queued=queued)
        if refused is None:
            return
        if refused.reason is ErrorReason.REQUEST_EXCEEDS_CONTEXT:
            raise over_context(model_id, lower, False, self._context_of(model_id), max_tokens)
        raise Refusal(refused, model_id=model_id, prompt_tokens=lower, max_tokens=max_tokens)


__all__ = ["INLINE_BYTES", "Intake", "OverContext", "PromptTooLong", "Refusal", "Ticket", "over_context",
           "working_bytes"]
