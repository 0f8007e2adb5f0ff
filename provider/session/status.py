"""What the coordinator link is doing, for the operator: one small object the shell updates and
``/status``, ``darkbloom-provider status`` and ``/metrics`` read.

``SessionStatus`` holds the link state (``LinkState``: connecting → registered → draining, or backing
off between attempts), the coordinator URL without secrets, when the current connection registered,
counters (connect attempts and failures, registrations, connection losses, heartbeats, challenges), the times of
the last challenge received and answered, the last ``runtime_status`` verdict with the names of the
mismatching components, the last ``trust_status`` (trust level, status, reason: diagnostics only), how
the last connection ended (close code, reason, cause; a 1013 "state being restored" close is a wait, not a
loss, and counts apart), the last drain barrier (acknowledged or not), the backoff delay
before the next attempt, and the requests of this process (``RequestTally``: accepted, completed,
cancelled, refused and failed by reason).

Only the asyncio shell (``connection.py``) writes the link fields, from the core's ``Note`` actions
and its own events; jobs write the request tally. Everything runs on the event loop. ``view()`` is a
frozen copy for readers; ``wait_for(predicate)`` lets a test wait for a state without polling.

Times are wall-clock Unix seconds (what an operator compares with a log line); the coordinator's
strings (close reason, component names) are cut to a bounded length before they are kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from protocol.errors import Failure

MAX_TEXT = 64  # characters kept of a string the coordinator chose (close reason, component name)
MAX_COMPONENTS = 16


class LinkState(StrEnum):
    CONNECTING = "connecting"  # a connect attempt is under way (or about to start)
    REGISTERED = "registered"  # register sent on an open socket: serving
    DRAINING = "draining"  # shutting down: new requests refused, running ones finish
    BACKING_OFF = "backing_off"  # waiting `backoff_delay_s` before the next attempt
    STOPPED = "stopped"  # the session returned (drained, or a URL that can never work)


class CloseCause(StrEnum):
    """Why a connection ended, from the shell's side."""

    CLOSED_BY_COORDINATOR = "closed_by_coordinator"  # a close frame came from the coordinator
    CONNECTION_LOST = "connection_lost"  # no close handshake (1006): network, coordinator killed
    CLOSED_BY_PROVIDER = "closed_by_provider"  # we closed it (e.g. 1009: a frame over our inbound limit)
    STALL = "stall"  # our heartbeats were further apart than the eviction window: re-register
    CLOCK_JUMP = "clock_jump"  # the machine slept
    DRAINED = "drained"  # we closed it on shutdown
    STATE_RESTORING = "state_restoring"  # 1013: the coordinator is restoring our state; reconnect later


def failure_reason(failure: Failure) -> str:
    """The most specific closed-vocabulary name of a failure: rejection, else error reason, else code."""
    return (failure.rejection or failure.reason or failure.code).value


def public_url(url: str) -> str:
    """``url`` without user info, query or fragment: nothing in it can be a credential."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def trust_line(trust: Mapping[str, Any] | None, now: float) -> str:
    """The ``trust`` of ``/status`` (the coordinator's last ``trust_status``) in one line, for
    `darkbloom-provider status` and `doctor`."""
    if not trust:
        return "trust_status: none received (an [A] coordinator never sends it)"
    reason = f": {trust['reason']}" if trust.get("reason") else ""
    at = trust.get("at")
    ago = "" if at is None else f" ({max(0.0, now - at):.0f} s ago)"
    return f"trust_status: {trust.get('trust_level') or '?'}, {trust.get('status') or '?'}{reason}{ago}"


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


# --- what the core reports (carried by ``core.Note``) -----------------------------------------------------
# Frozen and slotted; don't subclass these.


@dataclass(frozen=True, slots=True)
class ChallengeSeen:
    """An ``attestation_challenge`` arrived; ``answered``: our answer went on the send queue."""

    answered: bool


@dataclass(frozen=True, slots=True)
class RuntimeVerdict:
    """A ``runtime_status``: verified, or the names of the components that did not match."""

    verified: bool
    components: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestRefused:
    """The core answered a request itself (draining, replayed or undecodable) without running it."""

    failure: Failure


@dataclass(frozen=True, slots=True)
class TrustReport:
    """A ``trust_status``: the coordinator's trust level, status and reason for this provider (bounded
    strings; diagnostics only, it changes nothing the agent does)."""

    trust_level: str
    status: str
    reason: str


@dataclass(frozen=True, slots=True)
class BarrierAcked:
    """The coordinator acknowledged our ``provider_drain`` barrier."""

    request_id: str


SessionEvent = ChallengeSeen | RuntimeVerdict | RequestRefused | TrustReport | BarrierAcked


# --- requests ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestTally:
    """The coordinator's requests in this process. ``refused``: answered with an error before
    ``inference_accepted`` (a fast reject, rerouted); ``failed``: accepted, then ended by an error."""

    accepted: int = 0
    completed: int = 0
    cancelled: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)

    def accept(self) -> None:
        self.accepted += 1

    def complete(self) -> None:
        self.completed += 1

    def cancel(self) -> None:
        self.cancelled += 1

    def refuse(self, failure: Failure) -> None:
        reason = failure_reason(failure)
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def fail(self, failure: Failure) -> None:
        reason = failure_reason(failure)
        self.failed[reason] = self.failed.get(reason, 0) + 1


# --- the status ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LastClose:
    code: int | None  # the close code the socket ended with (1006 when there was no close frame)
    reason: str  # the close frame's reason, bounded; "" when none
    cause: CloseCause
    at: float


@dataclass(frozen=True, slots=True)
class LastTrust:
    trust_level: str
    status: str
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class LastDrain:
    acked: bool  # the coordinator acknowledged the barrier before we closed
    waited_s: float  # how long we waited for the acknowledgement
    at: float


@dataclass(frozen=True, slots=True)
class SessionView:
    """A frozen copy of ``SessionStatus`` (what ``/status`` and ``/metrics`` read)."""

    state: LinkState
    url: str
    connected_since: float | None
    connect_attempts: int
    connect_failures: int
    last_connect_error: str | None
    connects: int
    registrations: int
    connection_losses: int
    heartbeats_sent: int
    last_heartbeat_at: float | None
    challenges_received: int
    challenges_answered: int
    last_challenge_received_at: float | None
    last_challenge_answered_at: float | None
    runtime_verified: bool | None  # None until the coordinator says
    runtime_mismatches: tuple[str, ...]
    runtime_status_at: float | None
    last_close: LastClose | None
    trust: LastTrust | None  # None until the coordinator sends a trust_status ([N] only)
    restore_waits: int  # connections the coordinator closed with 1013 (state being restored)
    last_drain: LastDrain | None
    backoff_delay_s: float | None
    next_attempt_at: float | None
    accepted: int
    completed: int
    cancelled: int
    refused: Mapping[str, int]
    failed: Mapping[str, int]

    def as_json(self) -> dict[str, Any]:
        """The ``session`` section of ``/status`` (a stable shape: keys are only ever added)."""
        close = self.last_close
        return {
            "state": self.state.value,
            "url": self.url,
            "connected_since": self.connected_since,
            "connect_attempts": self.connect_attempts,
            "connect_failures": self.connect_failures,
            "last_connect_error": self.last_connect_error,
            "registrations": self.registrations,
            "reconnects": self.connection_losses,
            "heartbeats_sent": self.heartbeats_sent,
            "last_heartbeat_at": self.last_heartbeat_at,
            "challenges": {"received": self.challenges_received, "answered": self.challenges_answered,
                           "last_received_at": self.last_challenge_received_at,
                           "last_answered_at": self.last_challenge_answered_at},
            "runtime_status": {"verified": self.runtime_verified, "mismatches": list(self.runtime_mismatches),
                               "at": self.runtime_status_at},
            "last_close": None if close is None else {"code": close.code, "reason": close.reason,
                                                      "cause": close.cause.value, "at": close.at},
            "trust": None if self.trust is None else {"trust_level": self.trust.trust_level,
                                                      "status": self.trust.status, "reason": self.trust.reason,
                                                      "at": self.trust.at},
            "restore_waits": self.restore_waits,
            "last_drain": None if self.last_drain is None else {"acked": self.last_drain.acked,
                                                                "waited_s": self.last_drain.waited_s,
                                                                "at": self.last_drain.at},
            "backoff_delay_s": self.backoff_delay_s,
            "next_attempt_at": self.next_attempt_at,
            "requests": {"accepted": self.accepted, "completed": self.completed, "cancelled": self.cancelled,
                         "refused": dict(self.refused), "failed": dict(self.failed)},
        }


class SessionStatus:
    """The live record. The shell calls the transition methods; ``requests`` is the jobs' tally."""

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time) -> None:
        self.url = public_url(url)
        self._clock = clock
        self.state = LinkState.CONNECTING
        self.connected_since: float | None = None
        self.connect_attempts = 0
        self.connect_failures = 0
        self.last_connect_error: str | None = None  # the exception's type name, never its text
        self.connects = 0
        self.registrations = 0
        self.connection_losses = 0
        self.heartbeats_sent = 0
        self.last_heartbeat_at: float | None = None
        self.challenges_received = 0
        self.challenges_answered = 0
        self.last_challenge_received_at: float | None = None
        self.last_challenge_answered_at: float | None = None
        self.runtime_verified: bool | None = None
        self.runtime_mismatches: tuple[str, ...] = ()
        self.runtime_status_at: float | None = None
        self.last_close: LastClose | None = None
        self.trust: LastTrust | None = None  # kept across connections: the last word the operator saw
        self.restore_waits = 0
        self.last_drain: LastDrain | None = None
        self.backoff_delay_s: float | None = None
        self.next_attempt_at: float | None = None
        self.requests = RequestTally()
        self._changed = asyncio.Event()

    # --- the shell's transitions --------------------------------------------------------------------

    def connecting(self) -> None:
        self.connect_attempts += 1
        self.backoff_delay_s = self.next_attempt_at = None
        self._set(LinkState.CONNECTING)

    def connect_failed(self, error_type: str) -> None:
        """An attempt that never opened a socket (refused, DNS, TLS, a rejected handshake)."""
        self.connect_failures += 1
        self.last_connect_error = _bounded(error_type)
        self._touch()

    def registered(self) -> None:
        """A socket opened and ``register`` went out on it."""
        self.connects += 1
        self.registrations += 1
        self.connected_since = self._clock()
        self.runtime_verified, self.runtime_mismatches, self.runtime_status_at = None, (), None  # per connection
        self._set(LinkState.REGISTERED)

    def draining(self) -> None:
        self._set(LinkState.DRAINING)

    def connection_ended(self, *, code: int | None, reason: str | None, cause: CloseCause) -> None:
        if cause is CloseCause.STATE_RESTORING:
            self.restore_waits += 1  # the coordinator asked us to come back later: not a failure
        elif cause is not CloseCause.DRAINED:
            self.connection_losses += 1
        self.connected_since = None
        self.last_close = LastClose(code, _bounded(reason or ""), cause, self._clock())
        self._touch()

    def backing_off(self, delay_s: float) -> None:
        self.backoff_delay_s = delay_s
        self.next_attempt_at = self._clock() + delay_s
        self._set(LinkState.BACKING_OFF)

    def stopped(self) -> None:
        self.connected_since = None
        self.backoff_delay_s = self.next_attempt_at = None
        self._set(LinkState.STOPPED)

    def drain_barrier_ended(self, *, acked: bool, waited_s: float) -> None:
        self.last_drain = LastDrain(acked, round(waited_s, 3), self._clock())
        self._touch()

    def heartbeat_sent(self) -> None:
        self.heartbeats_sent += 1
        self.last_heartbeat_at = self._clock()
        self._touch()

    def note(self, event: SessionEvent) -> None:
        """An event the core reported."""
        now = self._clock()
        match event:
            case ChallengeSeen(answered=answered):
                self.challenges_received += 1
                self.last_challenge_received_at = now
                if answered:
                    self.challenges_answered += 1
                    self.last_challenge_answered_at = now
            case RuntimeVerdict(verified=verified, components=components):
                self.runtime_verified = verified
                self.runtime_mismatches = tuple(_bounded(c) for c in components[:MAX_COMPONENTS])
                self.runtime_status_at = now
            case RequestRefused(failure=failure):
                self.requests.refuse(failure)
            case TrustReport(trust_level=level, status=status, reason=reason):
                self.trust = LastTrust(_bounded(level), _bounded(status), _bounded(reason), now)
            case BarrierAcked():
                pass  # the shell records the barrier's outcome (drain_barrier_ended)
        self._touch()

    # --- readers ------------------------------------------------------------------------------------

    def view(self) -> SessionView:
        r = self.requests
        return SessionView(
            state=self.state, url=self.url, connected_since=self.connected_since,
            connect_attempts=self.connect_attempts, connect_failures=self.connect_failures,
            last_connect_error=self.last_connect_error, connects=self.connects, registrations=self.registrations,
            connection_losses=self.connection_losses, heartbeats_sent=self.heartbeats_sent,
            last_heartbeat_at=self.last_heartbeat_at, challenges_received=self.challenges_received,
            challenges_answered=self.challenges_answered,
            last_challenge_received_at=self.last_challenge_received_at,
            last_challenge_answered_at=self.last_challenge_answered_at,
            runtime_verified=self.runtime_verified, runtime_mismatches=self.runtime_mismatches,
            runtime_status_at=self.runtime_status_at, last_close=self.last_close, trust=self.trust,
            restore_waits=self.restore_waits, last_drain=self.last_drain,
            backoff_delay_s=self.backoff_delay_s, next_attempt_at=self.next_attempt_at,
            accepted=r.accepted, completed=r.completed, cancelled=r.cancelled,
            refused=MappingProxyType(dict(r.refused)), failed=MappingProxyType(dict(r.failed)),
        )

    async def wait_for(self, predicate: Callable[[SessionStatus], bool], *, timeout: float) -> None:
        """Until ``predicate(self)`` holds (checked at each change); TimeoutError after ``timeout``."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                changed = self._changed
                await changed.wait()

    # --- internals ----------------------------------------------------------------------------------

    def _set(self, state: LinkState) -> None:
        self.state = state
        self._touch()

    def _touch(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


__all__ = [
    "BarrierAcked",
    "ChallengeSeen",
    "CloseCause",
    "LastClose",
    "LastDrain",
    "LastTrust",
    "LinkState",
    "RequestRefused",
    "RequestTally",
    "RuntimeVerdict",
    "SessionEvent",
    "SessionStatus",
    "SessionView",
    "TrustReport",
    "failure_reason",
    "public_url",
    "trust_line",
]
