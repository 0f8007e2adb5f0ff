"""The intake's last step: what the request asks of its output besides text.

After the prompt is counted, before admission books anything, for a request with a
`response_format` (a grammar) or `logprobs`:

* the model's vocabulary as llguidance reads it (`grammar.TokenTable`), built once per model in a
  thread from the counter's tokenizer; the front doors read it back (`table`) to spell the tokens
  of log-probabilities;
* for a grammar, its memory reserved (`ReservationKind.GRAMMAR`, `memory.grammar.grammar_bytes`: no
  room is a 503 at once), then the grammar compiled against the vocabulary (cached: a repeat is a
  copy, taken on the loop; a new one compiles in a thread) into the request's `Constraint`. The
  engine gives the reservation back when the request leaves it; a request that never reaches the
  engine gives it back through `OutputPlan.release` (idempotent: both may run).

A forced tool call (`tool_choice` "required" or a named function, `ChatBody.tool_call`) is a grammar
like any other: `provider.grammar.grammar_for_tool_call` writes the call in the model's family's
format (mlx-lm's parser, `ToolFormat`), so what the engine lets out is one call (or, for "required"
with parallel calls, several) that the family's parser reads back, its arguments valid against the
function's `parameters`. It is compiled, cached and reserved as above; its refusals name
`tool_choice` (a family with no call grammar here, parameters the grammar engine cannot handle). With
a `response_format` as well, the two would ask for different outputs: a 400 naming `response_format`.

A vision model's requests are served by mlx-vlm's own loop, which takes neither: they are a 400
naming the parameter, as is a model whose tokenizer llguidance cannot read.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

from memory import Ledger, Rejection, ReservationKind
from memory.grammar import grammar_bytes
from protocol.errors import Failure, RejectionReason
from provider.engine import ToolCallConstraint
from provider.grammar import (
    Constraint,
    GrammarCache,
    GrammarRejected,
    TokenTable,
    ToolCallFormat,
    ToolGrammarUnsupported,
    VocabUnavailable,
    grammar_for_tool_call,
)
from provider.grammar.formats import REJECTED_RULE
from provider.request.body import ChatBody
from provider.request.errors import InvalidBody
from provider.request.response_format import ResponseFormat
from provider.request.tokens import PromptCounter

UNSUPPORTED_RULE = "is not supported by this model"
NO_CALL_GRAMMAR_RULE = ("is not supported by this model: a forced call needs constrained decoding, which has no "
                        "grammar for its family's tool-call format (send auto or none)")
BOTH_RULE = "cannot be combined with a forced tool_choice (required or a named function)"


@dataclass(slots=True)
class OutputPlan:
    """What the engine gets besides the prompt: the grammar's matcher, how many log-probabilities."""

    constraint: Constraint | None = None
    top_logprobs: int | None = None

    def release(self) -> None:
        """Give the grammar's reservation back (a request that never reached the engine); idempotent."""
        if self.constraint is not None:
            self.constraint.release()


NO_PLAN = OutputPlan()


class Grammars:
    """Per model, its token table; for every model, the compiled grammars (`GrammarCache`)."""

    def __init__(self, counter: PromptCounter, ledger: Ledger, cache: GrammarCache | None = None) -> None:
        self._counter = counter
        self._ledger = ledger
        self.cache = cache if cache is not None else GrammarCache()
        self._tables: dict[str, TokenTable] = {}
        self._building: dict[str, asyncio.Future[TokenTable]] = {}

    def table(self, model_id: str) -> TokenTable | None:
        """The model's token table if a request has built it (every request that asked for
        log-probabilities has, before it was admitted)."""
        return self._tables.get(model_id)

    async def plan(self, request_id: str, body: ChatBody, fail: Callable[[Failure], Exception]) -> OutputPlan:
        """The request's `OutputPlan`. Raises `InvalidBody` (a 400 naming the parameter), or `fail(Failure)`
        when the grammar's memory does not fit now."""
        forced = await self._forced_call(body)
        if forced is not None and body.response_format is not None:
            raise InvalidBody("response_format", BOTH_RULE)
        output = forced or body.response_format
        if output is None and body.top_logprobs is None:
            return NO_PLAN
        param = output.param if output is not None else "logprobs"
        if self._counter.is_vision(body.model):
            raise InvalidBody(param, UNSUPPORTED_RULE)
        try:
            table = await self._table(body.model)
        except VocabUnavailable:
            raise InvalidBody(param, UNSUPPORTED_RULE) from None
        if output is None:
            return OutputPlan(None, body.top_logprobs)
        lease = f"grammar:{request_id}"
        if isinstance(self._ledger.reserve(lease, ReservationKind.GRAMMAR, grammar_bytes(table.vocab_size)), Rejection):
            raise fail(Failure.capacity(RejectionReason.MEMORY_CAP))
        grammar = output.grammar
        release = functools.partial(self._ledger.release, lease)  # idempotent: the engine or the front door
        try:
            if self.cache.cached(table, grammar):
                constraint = self.cache.constraint(table, grammar, release)
            else:  # compiling takes milliseconds to hundreds of them (it drops the GIL)
                constraint = await asyncio.to_thread(self.cache.constraint, table, grammar, release)
        except GrammarRejected:
            release()
            raise InvalidBody(param, REJECTED_RULE) from None
        except BaseException:
            release()  # cancelled while compiling: the matcher, if any, is dropped with the thread's result
            raise
        return OutputPlan(constraint, body.top_logprobs)

    async def _forced_call(self, body: ChatBody) -> ResponseFormat | None:
        """The grammar of the call the output must be (None: the model may answer freely)."""
        if not body.tool_choice.forces_a_call or not body.tools:
            return None
        call = body.tool_call(await self._counter.tool_format(body.model))
        if call is None:  # no tool calling at all: the prompt step refused its tools already
            raise InvalidBody("tools", UNSUPPORTED_RULE)
        tokenizer = await self._counter.tokenizer(body.model)
        choice = ("required" if body.tool_choice.mode == "required"
                  else {"type": "function", "function": {"name": body.tool_choice.name}})
        try:  # a Lark grammar around each function's schema, checked (no vocabulary): a thread's work
            grammar = await asyncio.to_thread(grammar_for_tool_call, _tools(call), choice,
                                              _call_format(call, tokenizer), parallel=call.parallel)
        except ToolGrammarUnsupported:
            raise InvalidBody("tool_choice", NO_CALL_GRAMMAR_RULE) from None
        except GrammarRejected:
            raise InvalidBody("tool_choice", f"{REJECTED_RULE} (the function's parameters)") from None
        return ResponseFormat("tool_call", grammar)

    async def _table(self, model_id: str) -> TokenTable:
        table = self._tables.get(model_id)
        if table is not None:
            return table
        task = self._building.get(model_id)
        if task is None:  # one build per model; a caller being cancelled does not cancel it for the others
            task = asyncio.ensure_future(self._build(model_id))
            self._building[model_id] = task
        return await asyncio.shield(task)

    async def _build(self, model_id: str) -> TokenTable:
        try:
            tokenizer = await self._counter.tokenizer(model_id)
            table = await asyncio.to_thread(TokenTable.of, tokenizer)
        finally:
            self._building.pop(model_id, None)
        self._tables[model_id] = table
        return table


def _tools(call: ToolCallConstraint) -> list[dict[str, object]]:
    return [{"type": "function", "function": function} for function in call.functions]


def _call_format(call: ToolCallConstraint, tokenizer: object) -> ToolCallFormat:
    """The call's format for its grammar: each marker's id where it is one special token (mlx-lm's)."""
    starts = getattr(tokenizer, "tool_call_start_tokens", None) or ()
    ends = getattr(tokenizer, "tool_call_end_tokens", None) or ()
    return ToolCallFormat(call.format, call.start, call.end, starts[0] if len(starts) == 1 else None,
                          ends[0] if len(ends) == 1 else None)


__all__ = ["BOTH_RULE", "NO_CALL_GRAMMAR_RULE", "NO_PLAN", "UNSUPPORTED_RULE", "Grammars", "OutputPlan"]
