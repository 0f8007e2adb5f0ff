"""[N] capacity probes and quotes, as the newest coordinator runs them (Layr-Labs/d-inference
coordinator/protocol/capacity.go, docs/architecture/routing.md "dispatch-plan probing").

* A connection becomes quote-capable once a heartbeat's ``backend_capacity.capacity_seq`` is > 0;
  only then is it probed (``QuoteBook.probe`` refuses otherwise, as the coordinator never sends one).
* Snapshots apply by sequence: a heartbeat whose ``capacity_seq`` is not above the accepted one is
  stale or reordered and is not applied (``CapacitySnapshotStale``).
* A probe carries a random, request-local ``quote_id`` (never the request id), the prompt estimate
  rounded UP to a multiple of 512, ``max_output_tokens``, the vision shape only when there is one,
  and ``deadline_remaining_ms``.
* A quote counts only inside the response window (250 ms) and only if it names the probe's id; its
  ``rejection_reason`` is set exactly when ``admissible_now`` is false; a quote from a snapshot older
  than the accepted ``capacity_seq`` is stale evidence. Every problem is recorded, never raised.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from protocol import CapacityProbe, CapacityQuote, Heartbeat, encode

from . import events as ev

if TYPE_CHECKING:
    from .routing import ProviderSession

PROMPT_BUCKET_TOKENS = 512  # CapacityProbePromptBucketTokens
QUOTE_WINDOW_S = 0.25  # the dispatch plan's probe window


class QuoteProblem(Enum):
    LATE = "late"  # after the window: the coordinator has moved on
    UNKNOWN_QUOTE_ID = "unknown_quote_id"
    REASON_MISMATCH = "reason_mismatch"  # rejection_reason set iff not admissible_now
    STALE_SEQ = "stale_seq"  # computed from a snapshot older than the accepted capacity_seq
    UNSEQUENCED = "unsequenced"  # capacity_seq 0 on a quote


@dataclass(frozen=True, slots=True)
class ProbeSent(ev.Record):
    provider_id: str
    probe: CapacityProbe


@dataclass(frozen=True, slots=True)
class QuoteReceived(ev.Record):
    provider_id: str
    quote: CapacityQuote
    latency_s: float | None  # probe sent → quote read; None for a quote of no probe
    problems: tuple[QuoteProblem, ...]

    @property
    def valid(self) -> bool:
        return not self.problems


@dataclass(frozen=True, slots=True)
class CapacitySnapshotStale(ev.Record):
    provider_id: str
    capacity_seq: int
    accepted_seq: int


@dataclass(slots=True)
class _Outstanding:
    sent_at: float
    future: asyncio.Future[QuoteReceived]


@dataclass(slots=True)
class QuoteState:
    """Per connection."""

    capacity_seq: int = 0  # the accepted snapshot's
    outstanding: dict[str, _Outstanding] = field(default_factory=dict)


def bucket(prompt_tokens: int) -> int:
    return max(1, -(-max(0, prompt_tokens) // PROMPT_BUCKET_TOKENS)) * PROMPT_BUCKET_TOKENS


class QuoteBook:
    def __init__(self, events: ev.EventLog) -> None:
        self._events = events
        self._states: dict[str, QuoteState] = {}

    def state(self, session: ProviderSession) -> QuoteState:
        return self._states.setdefault(session.provider_id, QuoteState())

    def quote_capable(self, session: ProviderSession) -> bool:
        return self.state(session).capacity_seq > 0

    def registered(self, session: ProviderSession) -> None:
        """A new register on the socket: the sequence starts over (capacity_seq is per connection)."""
        self._states[session.provider_id] = QuoteState()

    def heartbeat(self, session: ProviderSession, message: Heartbeat) -> bool:
        """Whether the heartbeat's capacity snapshot applies (False: stale or reordered)."""
        seq = message.backend_capacity.capacity_seq if message.backend_capacity is not None else 0
        state = self.state(session)
        if seq == 0:
            return True  # a legacy snapshot: last write wins
        if seq <= state.capacity_seq:
            self._events.append(CapacitySnapshotStale(session.provider_id, seq, state.capacity_seq))
            return False
        state.capacity_seq = seq
        return True

    async def probe(self, session: ProviderSession, send, *, model: str, prompt_tokens: int,
                    max_output_tokens: int, requires_vision: bool = False, vision_image_count: int = 0,
                    deadline_remaining_ms: int = 0, window_s: float = QUOTE_WINDOW_S) -> QuoteReceived | None:
        """One probe; the quote if it came inside the window, else None (recorded either way)."""
        if not self.quote_capable(session):
            raise ValueError("the coordinator probes only connections that reported capacity_seq > 0")
        probe = CapacityProbe(quote_id=uuid.uuid4().hex, model=model, prompt_tokens_bucket=bucket(prompt_tokens),
                              max_output_tokens=max_output_tokens, requires_vision=requires_vision,
                              vision_image_count=vision_image_count if requires_vision else 0,
                              deadline_remaining_ms=deadline_remaining_ms)
        state = self.state(session)
        future: asyncio.Future[QuoteReceived] = asyncio.get_running_loop().create_future()
        state.outstanding[probe.quote_id] = _Outstanding(time.monotonic(), future)
        self._events.append(ProbeSent(session.provider_id, probe))
        try:
            await send(encode(probe))
            return await asyncio.wait_for(asyncio.shield(future), window_s)
        except TimeoutError:
            return None
        finally:
            if not future.done():  # late: a quote after this is recorded as such
                future.cancel()

    def received(self, session: ProviderSession, quote: CapacityQuote) -> None:
        state = self.state(session)
        outstanding = state.outstanding.pop(quote.quote_id, None)
        problems: list[QuoteProblem] = []
        latency = None
        if outstanding is None:
            problems.append(QuoteProblem.UNKNOWN_QUOTE_ID)
        else:
            latency = time.monotonic() - outstanding.sent_at
            if outstanding.future.done():
                problems.append(QuoteProblem.LATE)
        if (quote.rejection_reason is None) != quote.admissible_now:
            problems.append(QuoteProblem.REASON_MISMATCH)
        if quote.capacity_seq == 0:
            problems.append(QuoteProblem.UNSEQUENCED)
        elif quote.capacity_seq < state.capacity_seq:
            problems.append(QuoteProblem.STALE_SEQ)
        record = QuoteReceived(session.provider_id, quote, latency, tuple(problems))
        self._events.append(record)
        if outstanding is not None and not outstanding.future.done():
            outstanding.future.set_result(record)


__all__ = ["PROMPT_BUCKET_TOKENS", "QUOTE_WINDOW_S", "CapacitySnapshotStale", "ProbeSent", "QuoteBook",
           "QuoteProblem", "QuoteReceived", "bucket"]
