"""The intake's last step (issue 31): what the request asks of its output besides text.

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
from provider.grammar import Constraint, GrammarCache, GrammarRejected, TokenTable, VocabUnavailable
from provider.grammar.formats import REJECTED_RULE
from provider.request.body import ChatBody, InvalidBody
from provider.request.tokens import PromptCounter

UNSUPPORTED_RULE = "is not supported by this model"


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
        if body.response_format is None and body.top_logprobs is None:
            return NO_PLAN
        param = body.response_format.param if body.response_format is not None else "logprobs"
        if self._counter.is_vision(body.model):
            raise InvalidBody(param, UNSUPPORTED_RULE)
        try:
            table = await self._table(body.model)
        except VocabUnavailable:
            raise InvalidBody(param, UNSUPPORTED_RULE) from None
        if body.response_format is None:
            return OutputPlan(None, body.top_logprobs)
        lease = f"grammar:{request_id}"
        if isinstance(self._ledger.reserve(lease, ReservationKind.GRAMMAR, grammar_bytes(table.vocab_size)), Rejection):
            raise fail(Failure.capacity(RejectionReason.MEMORY_CAP))
        grammar = body.response_format.grammar
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


__all__ = ["NO_PLAN", "UNSUPPORTED_RULE", "Grammars", "OutputPlan"]
