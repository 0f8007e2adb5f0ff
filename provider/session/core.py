"""The coordinator link as a sans-I/O state machine: feed a frame in, drain actions out.

Theory of operation. One ``SessionCore`` exists per WebSocket connection. It never awaits and never
touches a socket: the asyncio shell (``connection.py``) calls

* ``connection_made()`` once the socket is open — the only way ``register`` is produced, so every
  connection starts with exactly one ``register``;
* ``receive_text(frame)`` for every inbound frame — decoding happens here, so a malformed frame
  becomes a ``Log`` action instead of an exception in the shell (and an ``inference_request`` whose id
  can still be read gets its one 400 ``invalid_request``);
* ``job_finished(id)`` when a job task ends, ``start_draining()`` on SIGTERM, ``drain_barrier(id)``
  once the drain's terminal frames are queued, ``connection_lost()`` when the socket is gone;

and carries out the returned actions in order: ``Send`` (put the frame on the connection's send
queue), ``StartJob`` / ``CancelJob`` (start or cancel a job task), ``Log``, ``Note`` (update the
session status).

What the core decides:

* ``inference_request`` → ``StartJob``; while draining → a 503 ``draining`` fast reject instead.
  Exactly one terminal frame answers every request whose id can be read: the job's, or one the core
  sends itself. A frame that does not decode but whose id is readable → 400 ``invalid_request``; a
  replay of a recently finished id (``RecentRequestIds``, bounded, shared by the connections of a
  session) → 400 ``invalid_request``, not run again; a duplicate of a running id → nothing (the running
  job answers it). An id beyond the size rule (``protocol.to_provider.MAX_REQUEST_ID_CHARS``) cannot be
  echoed: refused before any work, logged, unanswered.
* ``cancel`` for a running job → ``CancelJob`` and nothing is sent for it (the coordinator has closed
  the request on its side and expects no more frames for it); for an unknown or finished id → nothing
  at all (the [A] coordinator cancels every request after it completes).
* ``attestation_challenge`` → ``Send(attestation_response)`` built by the injected answerer; an empty
  or over-long nonce (the size rule again) is logged and not answered.
* ``runtime_status`` → logged, naming each mismatched component; we stay connected.
* ``trust_status`` ([N], diagnostics only) → logged and noted for the status page; nothing else changes.
* ``drain_barrier(id)`` → ``Send(provider_drain)``, but only to a coordinator that has shown it speaks the
  newer protocol on this connection (it sent ``trust_status``, ``capacity_probe`` or a model directive,
  ``newer_protocol``): the April coordinator (e515244f) logs the frame as an unknown type and never
  acknowledges it, so to it nothing is sent and the shell closes at once (``barrier_pending`` stays
  false). The ``provider_drain_ack`` with that id → a ``Note`` (``BarrierAcked``) the shell waits on; an
  ack for any other id (stale, or never asked) is logged and ignored (protocol-messages.md "Provider
  lifecycle drain": only the current waiter consumes it).
* ``load_model``, ``prefetch_model``, ``desired_models`` → ``ModelDirective``: the agent's model handler
  answers them (``provider/directed``); while draining too (a load then fails with the drain's words).
* ``capacity_probe`` → ``Send(capacity_quote)`` built by the injected quoter (the read-only admission
  decision, ``provider.slots.quote``), at once; without a quoter (we report no ``capacity_seq``) it is
  ignored like any [N]-only frame.
* what the operator's status page shows (a challenge seen and answered, a ``runtime_status``
  verdict, a request the core refused itself) → a ``Note`` carrying a ``status`` event.
* unknown types, [N]-only types and undecodable frames → logged and ignored; the session goes on.

States: CONNECTING → REGISTERED → DRAINING → CLOSED (any state → CLOSED on ``connection_lost``).
Assigning ``state`` logs the transition; each entry point guards the states it is legal in and raises
``InvalidState`` (an ``AssertionError``: calling it wrong is a bug in the shell).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from types import MappingProxyType
from typing import Any

from protocol import (
    AttestationChallenge,
    AttestationResponse,
    Cancel,
    CapacityProbe,
    CapacityQuote,
    DesiredModels,
    InferenceRequest,
    LoadModel,
    Message,
    PrefetchModel,
    ProtocolError,
    ProviderDrain,
    ProviderDrainAck,
    ProviderMessage,
    Register,
    RuntimeStatus,
    TrustStatus,
    UnknownMessage,
    decode,
    readable_request_id,
)
from protocol.errors import Failure, inference_error_frame
from provider.config import LogLevel
from provider.session.status import (
    BarrierAcked,
    ChallengeSeen,
    RequestRefused,
    RuntimeVerdict,
    SessionEvent,
    TrustReport,
)
from provider.telemetry import get_logger

log = get_logger("provider.session")


class SessionState(IntEnum):
    CONNECTING = 0  # socket open, register not yet sent
    REGISTERED = 1  # register sent: serving
    DRAINING = 2  # shutting down: new requests get 503 draining, running jobs finish
    CLOSED = 3  # the socket is gone; this core is spent


class InvalidState(AssertionError):
    """An entry point was called in a state where it makes no sense (a bug in the caller)."""


# --- actions ------------------------------------------------------------------------------------------
# Frozen and slotted; the shell matches on them. Don't subclass these.


@dataclass(frozen=True, slots=True)
class Send:
    """Put one frame on this connection's send queue."""

    frame: ProviderMessage


@dataclass(frozen=True, slots=True)
class StartJob:
    """Start a job task for this request."""

    request: InferenceRequest


@dataclass(frozen=True, slots=True)
class CancelJob:
    """Cancel the job task of this request; nothing further is sent for it."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Log:
    """A log line; ``fields`` use only keys the redaction layer allows."""

    level: LogLevel
    event: str
    fields: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class Note:
    """Something the operator's status page shows (``provider.session.status``)."""

    event: SessionEvent


@dataclass(frozen=True, slots=True)
class ModelDirective:
    """Hand a coordinator-directed model frame (``load_model``, ``prefetch_model``, ``desired_models``)
    to the agent's model handler, which answers it with its own status frames."""

    message: LoadModel | PrefetchModel | DesiredModels


Action = Send | StartJob | CancelJob | Log | Note | ModelDirective

# Frames only the newer coordinator sends: one of them shows it knows the drain barrier.
_NEWER_ONLY = (TrustStatus, CapacityProbe, LoadModel, PrefetchModel, DesiredModels)

ChallengeAnswerer = Callable[[AttestationChallenge], AttestationResponse]
Quoter = Callable[[CapacityProbe], CapacityQuote]


def _log(level: LogLevel, event: str, **fields: Any) -> Log:
    return Log(level, event, MappingProxyType(fields))


MAX_LOGGED_TYPE_CHARS = 64  # an unknown frame type is the coordinator's string: log a bounded prefix


class RecentRequestIds:
    """The ids of the last ``capacity`` requests that finished (answered, failed, cancelled or refused),
    oldest forgotten first, so a replayed frame is refused instead of run again."""

    DEFAULT_CAPACITY = 4096  # ≤ 256 characters each: a few MiB at worst

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class SessionCore:
    """What to send, start and cancel for each event on one connection. No I/O, no awaits."""

    def __init__(self, *, register: Register, answer_challenge: ChallengeAnswerer,
                 recent: RecentRequestIds | None = None, quote: Quoter | None = None) -> None:
        self._register = register
        self._answer = answer_challenge
        self._quote = quote
        self._state = SessionState.CONNECTING
        self._jobs: set[str] = set()
        self._barrier: str | None = None  # the id of the provider_drain we wait on
        self._newer = False  # the coordinator sent a frame only the newer protocol has
        self.recent = recent if recent is not None else RecentRequestIds()

    # --- state ----------------------------------------------------------------------------------------

    @property
    def state(self) -> SessionState:
        return self._state

    @state.setter
    def state(self, new: SessionState) -> None:
        log.debug("session_state", from_state=self._state.name, to_state=new.name)
        self._state = new

    @property
    def newer_protocol(self) -> bool:
        """The coordinator has sent, on this connection, a frame only the newer protocol has
        (``trust_status``, ``capacity_probe``, ``load_model``, ``prefetch_model``, ``desired_models``)."""
        return self._newer

    @property
    def barrier_pending(self) -> bool:
        """A ``provider_drain`` went out and its ack has not come back."""
        return self._barrier is not None

    @property
    def active_jobs(self) -> frozenset[str]:
        """Request ids with a job task that has not finished or been cancelled."""
        return frozenset(self._jobs)

    def _guard(self, *allowed: SessionState) -> None:
        if self._state not in allowed:
            raise InvalidState(f"not allowed in state {self._state.name}")

    # --- entry points -------------------------------------------------------------------------------

    def connection_made(self) -> list[Action]:
        """The socket is open: the one ``register`` of this connection."""
        self._guard(SessionState.CONNECTING)
        self.state = SessionState.REGISTERED
        return [Send(self._register)]

    def receive_text(self, data: str | bytes) -> list[Action]:
        """One inbound frame, undecoded. A frame that does not decode is logged and dropped, unless it is an
        ``inference_request`` whose id can still be read: that request gets its one answer, a 400."""
        self._guard(SessionState.REGISTERED, SessionState.DRAINING)
        try:
            message = decode(data)
        except ProtocolError as exc:
            # ProtocolError texts name the problem, never the frame's content.
            rejected = _log(LogLevel.WARNING, "frame_rejected", reason=str(exc), size_bytes=len(data))
            request_id = readable_request_id(data)
            if request_id is None:
                return [rejected]
            return [rejected, *self._refuse_request(request_id, "undecodable_request")]
        return self.receive(message)

    def receive(self, message: Message) -> list[Action]:
        """One decoded inbound frame."""
        self._guard(SessionState.REGISTERED, SessionState.DRAINING)
        if isinstance(message, _NEWER_ONLY):
            self._newer = True
        match message:
            case InferenceRequest():
                return self._on_request(message)
            case Cancel(request_id=request_id):
                return self._on_cancel(request_id)
            case AttestationChallenge(nonce=""):
                return [_log(LogLevel.WARNING, "challenge_ignored", reason="empty_nonce"),
                        Note(ChallengeSeen(answered=False))]
            case AttestationChallenge():
                return [Send(self._answer(message)), _log(LogLevel.INFO, "challenge_answered"),
                        Note(ChallengeSeen(answered=True))]
            case RuntimeStatus():
                return self._on_runtime_status(message)
            case TrustStatus(trust_level=level, status=status, reason=reason):
                return [_log(LogLevel.INFO, "trust_status", state=level[:MAX_LOGGED_TYPE_CHARS],
                             status=status[:MAX_LOGGED_TYPE_CHARS]),
                        Note(TrustReport(level, status, reason))]
            case ProviderDrainAck(request_id=barrier) if barrier and barrier == self._barrier:
                self._barrier = None
                return [_log(LogLevel.INFO, "drain_acked"), Note(BarrierAcked(barrier))]
            case ProviderDrainAck():
                return [_log(LogLevel.WARNING, "frame_ignored", kind=message.type, reason="no_matching_barrier")]
            case LoadModel() | PrefetchModel() | DesiredModels():
                return [ModelDirective(message)]
            case CapacityProbe() if self._quote is not None:
                return [Send(self._quote(message))]
            case UnknownMessage(type=kind):
                return [_log(LogLevel.INFO, "frame_ignored", kind=kind[:MAX_LOGGED_TYPE_CHARS], reason="unknown_type")]
            case _:
                return [_log(LogLevel.DEBUG, "frame_ignored", kind=message.type, reason="not_handled")]

    def job_finished(self, request_id: str) -> None:
        """A job task ended (any way). Idempotent."""
        self._jobs.discard(request_id)
        self.recent.add(request_id)

    def start_draining(self) -> list[Action]:
        """From now on new requests are refused with 503 ``draining``; running jobs go on."""
        self._guard(SessionState.REGISTERED, SessionState.DRAINING)
        if self._state is SessionState.REGISTERED:
            self.state = SessionState.DRAINING
        return [_log(LogLevel.INFO, "session_draining", in_flight=len(self._jobs))]

    def drain_barrier(self, barrier_id: str) -> list[Action]:
        """Admission is closed and every accepted request's terminal frame is queued: the barrier that
        asks the coordinator to settle them before we disconnect (a later call replaces the waiter).
        Nothing is sent to a coordinator that has not shown the newer protocol: it would not answer."""
        self._guard(SessionState.DRAINING)
        if not self._newer:
            return [_log(LogLevel.INFO, "drain_barrier_skipped", reason="coordinator_without_drain_barrier")]
        self._barrier = barrier_id
        return [Send(ProviderDrain(request_id=barrier_id)), _log(LogLevel.INFO, "drain_barrier_sent")]

    def connection_lost(self) -> list[Action]:
        """The socket is gone: every running job is cancelled (nothing is resumed after a reconnect)."""
        if self._state is SessionState.CLOSED:
            return []
        self.state = SessionState.CLOSED
        actions: list[Action] = [CancelJob(rid) for rid in sorted(self._jobs)]
        for rid in self._jobs:
            self.recent.add(rid)
        self._jobs.clear()
        return actions

    # --- frame handlers -----------------------------------------------------------------------------

    def _on_request(self, request: InferenceRequest) -> list[Action]:
        rid = request.request_id
        if not rid:
            return [_log(LogLevel.WARNING, "frame_rejected", reason="inference_request without request_id")]
        if rid in self._jobs or rid in self.recent:
            return self._refuse_request(rid, "duplicate_request_id")
        if self._state is SessionState.DRAINING:
            self.recent.add(rid)
            return [
                Send(inference_error_frame(rid, Failure.draining())),
                _log(LogLevel.INFO, "request_rejected", request_id=rid, reason="draining"),
                Note(RequestRefused(Failure.draining())),
            ]
        self._jobs.add(rid)
        return [StartJob(request)]

    def _refuse_request(self, rid: str, reason: str) -> list[Action]:
        """A request we will not run. A running job with this id gives its one answer itself (answering
        here would end it on the coordinator's side); otherwise this is the one answer: 400."""
        if rid in self._jobs:
            return [_log(LogLevel.WARNING, "request_ignored", request_id=rid, reason=reason)]
        reason = "replayed_request_id" if rid in self.recent else reason
        self.recent.add(rid)
        return [
            Send(inference_error_frame(rid, Failure.invalid_request())),
            _log(LogLevel.WARNING, "request_rejected", request_id=rid, reason=reason),
            Note(RequestRefused(Failure.invalid_request())),
        ]

    def _on_cancel(self, request_id: str) -> list[Action]:
        if request_id not in self._jobs:
            return [_log(LogLevel.DEBUG, "cancel_ignored", request_id=request_id, reason="unknown_or_finished")]
        self._jobs.discard(request_id)
        self.recent.add(request_id)
        return [CancelJob(request_id), _log(LogLevel.INFO, "cancel_received", request_id=request_id)]

    def _on_runtime_status(self, status: RuntimeStatus) -> list[Action]:
        verdict = Note(RuntimeVerdict(status.verified, tuple(m.component for m in status.mismatches)))
        if status.verified:
            return [_log(LogLevel.INFO, "runtime_status", status="verified"), verdict]
        if not status.mismatches:
            return [_log(LogLevel.WARNING, "runtime_status", status="unverified"), verdict]
        return [
            *(_log(LogLevel.WARNING, "runtime_status", status="mismatch", kind=m.component)
              for m in status.mismatches),
            verdict,
        ]


__all__ = [
    "Action",
    "CancelJob",
    "ChallengeAnswerer",
    "Quoter",
    "InvalidState",
    "Log",
    "ModelDirective",
    "Note",
    "RecentRequestIds",
    "Send",
    "SessionCore",
    "SessionState",
    "StartJob",
]
