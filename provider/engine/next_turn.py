"""Next turn: the engine's idle time spent on a local conversation's likely follow-up.

A local conversation's follow-up repeats the finished prompt and the answer, but as the chat template
renders the answer text back, which often is not the tokens the model generated (a template that drops
thinking blocks or trims whitespace, a tokenizer that splits the text differently, a detokenizer that
drops the answer's leading space), so the cached sequence matches only up to the first token that
differs. For requests marked `prepare_next_turn` (the local front's), once the engine has been idle
for `NEXT_TURN_QUIET_S` (a client that sends its next request at once, a benchmark, an agent loop,
never meets a preparation) the engine renders the conversation with the answer appended, reuses the
longest cached prefix of those tokens and prefills the rest (at most `NEXT_TURN_MAX_TOKENS`) in
`NEXT_TURN_CHUNK`-token steps, then stores the result in the prefix cache: the next turn then prefills
only the new user message. KV is only ever computed for exactly the tokens it is stored under. Any
command is handled between two of these steps; a new request drops the preparation first. Its scratch
(a copy of the prefix plus the new tokens) stands in for a step's activations, which do not exist
while the engine is idle, so it is bounded by half the activation reserve (`scratch_bytes`); the
stored entry is reserved in the ledger like any other.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvcache import state
from kvcache.manager import ModelKvCache
from provider.engine.active import Slot
from provider.engine.reuse import PrefixReuse
from provider.engine.types import EngineError
from provider.engine.vision import Trace
from provider.telemetry import get_logger

log = get_logger("provider.engine")

NEXT_TURN_CHUNK = 64  # tokens per idle step of a next-turn preparation: what a new request may wait for
NEXT_TURN_QUIET_S = 0.25  # idle this long after an answer before preparing: a person takes longer to reply
NEXT_TURN_MAX_TOKENS = 1024  # tokens to prefill past the cached prefix; more is not a re-rendered answer


@dataclass(slots=True)
class NextTurn:
    """A finished conversation whose next prompt is being prepared."""

    model_id: str
    messages: Sequence[Mapping[str, object]]
    answer: str
    tools: Sequence[Mapping[str, object]] = ()  # the request's function tools, rendered as it was
    ids: list[int] = field(default_factory=list)  # the conversation with the answer rendered back
    cache: list | None = None  # the KV of ids[:done]
    done: int = 0
    extends: tuple[int, ...] | None = None  # the stored sequence it started from
    reused: int = 0  # how many of its tokens it starts from
    due: float = 0.0  # time.monotonic() after which it may start


class NextTurns:
    """The latest finished conversation of each model, newest last (it is prepared first)."""

    def __init__(self, scratch_bytes: int, reuse: PrefixReuse, trace: Trace | None = None) -> None:
        self.scratch_bytes = scratch_bytes  # 0: never prepare
        self._reuse = reuse
        self._trace = trace
        self._turns: dict[str, NextTurn] = {}

    def __bool__(self) -> bool:
        return bool(self._turns)

    def clear(self) -> None:
        """A request (or a load) never waits behind a guess: its scratch goes."""
        self._turns.clear()

    def finished(self, model_id: str, messages: Sequence[Mapping[str, object]], answer: str,
                 tools: Sequence[Mapping[str, object]]) -> None:
        self._turns.pop(model_id, None)
        self._turns[model_id] = NextTurn(model_id, messages, answer, tools=tools,
                                         due=time.monotonic() + NEXT_TURN_QUIET_S)

    def due_in(self) -> float | None:
        """Seconds until the newest preparation may run (0: now), None when there is none."""
        if not self._turns:
            return None
        return max(0.0, next(reversed(self._turns.values())).due - time.monotonic())

    def step(self, slots: Mapping[str, Slot]) -> None:
        """One idle step of the newest preparation, when it is due."""
        if not self._turns or next(reversed(self._turns.values())).due > time.monotonic():
            return
        model_id = next(reversed(self._turns))
        turn = self._turns[model_id]
        slot = slots.get(model_id)
        kv = self._reuse.kv(model_id)
        try:
            if slot is None or kv is None or (turn.cache is None and not self._start(slot, kv, turn)):
                del self._turns[model_id]
                return
            if self._trace is not None:
                self._trace(model_id, None, "next_turn")
            chunk = turn.ids[turn.done: turn.done + NEXT_TURN_CHUNK]
            slot.model(mx.array([chunk]), cache=turn.cache)
            mx.eval([c.state for c in turn.cache])
            turn.done += len(chunk)
            if turn.done == len(turn.ids):
                del self._turns[model_id]
                outcome = kv.store(turn.ids, turn.cache, extends=turn.extends, reused=turn.reused)
                if self._trace is not None:
                    self._trace(model_id, None, f"next_turn_{outcome.value}")
        except Exception:  # an edge: the preparation is an optimisation, never a reason to fail
            log.exception("next_turn_failed", model=model_id)
            self._turns.pop(model_id, None)

    def _start(self, slot: Slot, kv: ModelKvCache, turn: NextTurn) -> bool:
        """Render the conversation with the answer, and take a copy of its longest cached prefix."""
        messages = [*turn.messages, {"role": "assistant", "content": turn.answer}]
        try:
            ids = slot.render(messages, turn.tools, add_generation_prompt=False)
        except EngineError:
            return False
        ctx = slot.info.context_length
        if len(ids) < 2 or (ctx is not None and len(ids) >= ctx):
            return False
        matched = kv.longest_match(ids)
        if matched < 1 or matched >= len(ids) - 1 or len(ids) - matched > NEXT_TURN_MAX_TOKENS:
            # Nothing of it cached (a guess from scratch), all of it (the answer renders back as
            # generated: the next turn reuses it as it is), or too much for a re-rendered answer.
            return False
        reuse = kv.fetch(ids, count=False)
        if reuse.cache is None:
            return False
        per_token = state.cache_nbytes(reuse.cache) // reuse.matched
        if per_token * (len(ids) + KVCache.step) > self.scratch_bytes:
            return False  # the copy is dropped on return
        turn.ids, turn.cache, turn.done, turn.extends = ids, reuse.cache, reuse.matched, reuse.key
        turn.reused = reuse.matched
        return True


__all__ = ["NEXT_TURN_CHUNK", "NEXT_TURN_MAX_TOKENS", "NEXT_TURN_QUIET_S", "NextTurn", "NextTurns"]
