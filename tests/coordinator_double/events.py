"""What the double saw and did, as an append-only log of typed records, plus waiters on it.

Tests synchronise on events instead of sleeping::

    mark = double.events.mark()
    ...
    await double.wait_for(lambda e: isinstance(e, ChallengeResult) and e.ok, since=mark, timeout=5)

Records are frozen dataclasses; closed vocabularies are enums. Decrypted chunk text is kept (``ChunkReceived``)
because tests compare it with the engine's output; the double is test-only and never logs it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from protocol import Message, Usage


class InvalidKind(Enum):
    """Why a provider frame was dropped by the read loop ([A] providerReadLoop ``continue``)."""

    NOT_JSON = "not_json"
    NOT_AN_OBJECT = "not_an_object"
    SCHEMA = "schema"  # a field of the wrong type (a float in an int field, …) or a missing field
    UNKNOWN_TYPE = "unknown_type"  # not one of the seven [A] provider types


class DropReason(Enum):
    """A well-formed frame the coordinator ignores."""

    NOT_REGISTERED = "not_registered"  # before register on this socket
    EVICTED = "evicted"  # "heartbeat from unknown provider" after eviction
    UNKNOWN_REQUEST = "unknown_request"  # request id never dispatched on this socket
    REMOVED_REQUEST = "removed_request"  # request id the coordinator already dropped (cancel, timeout)
    UNSOLICITED_ATTESTATION = "unsolicited_attestation"  # nonce of no outstanding challenge


class Violation(Enum):
    """Contract breaches that do not drop the frame."""

    BINARY_FRAME = "binary_frame"
    DUPLICATE_REGISTER = "duplicate_register"
    ACCEPT_AFTER_CHUNK = "accept_after_chunk"
    DUPLICATE_ACCEPT = "duplicate_accept"
    SSE_NOT_DATA = "sse_not_data"  # chunk plaintext does not start with "data: "
    SSE_MULTIPLE_EVENTS = "sse_multiple_events"  # more than one SSE event in one chunk
    SSE_NOT_JSON = "sse_not_json"  # payload is not one JSON object
    SSE_TRAILING_NEWLINE = "sse_trailing_newline"  # [A] adds the blank line itself: the consumer gets two
    SSE_DONE_CHUNK = "sse_done_chunk"  # [A] adds its own [DONE]: the consumer gets two


class ChunkFault(Enum):
    """[A] decryptTextResponseChunk failures: each marks the provider untrusted and fails the request (502)."""

    PLAINTEXT = "plaintext"  # data set, no encrypted_data
    BOTH = "both"  # data and encrypted_data
    MISSING = "missing"  # neither
    WRONG_KEY = "wrong_key"  # ephemeral_public_key is not the registered public_key
    UNDECRYPTABLE = "undecryptable"  # bad base64, tampered, or sealed to another key


class ChallengeFailure(Enum):
    TIMEOUT = "timeout"
    PUBLIC_KEY_MISMATCH = "public_key_mismatch"
    EMPTY_SIGNATURE = "empty_signature"
    BAD_SIGNATURE = "bad_signature"  # attested provider, signature does not verify
    BAD_STATUS_SIGNATURE = "bad_status_signature"
    SIP_MISSING = "sip_missing"
    SIP_DISABLED = "sip_disabled"  # untrusted at once
    SECURE_BOOT_MISSING = "secure_boot_missing"
    SECURE_BOOT_DISABLED = "secure_boot_disabled"  # untrusted at once
    RDMA_MISSING = "rdma_missing"
    RDMA_ENABLED = "rdma_enabled"  # rdma_disabled false without hypervisor_active: untrusted at once


class TrustLevel(Enum):
    """[A] registry.go TrustLevel; routing skips a provider ranked below ``DoubleConfig.min_trust``."""

    NONE = "none"  # no valid registration attestation
    SELF_SIGNED = "self_signed"  # a valid registration attestation
    HARDWARE = "hardware"  # MDM / Apple device attestation: never given by the double


class SignatureCheck(Enum):
    VERIFIED = "verified"  # checked against the attestation blob's P-256 key
    PRESENT_UNVERIFIED = "present_unverified"  # no parsed attestation blob: [A] only requires it non-empty
    NOT_CHECKED = "not_checked"  # the answer failed before the signature step


class Window(Enum):
    FIRST_RESPONSE = "first_response"  # 10 s for accept or first chunk
    ACCEPTED = "accepted"  # 600 s for the first chunk after accept
    STREAM_IDLE = "stream_idle"  # 600 s between chunks once committed


class CancelCause(Enum):
    TIMEOUT = "timeout"
    CONSUMER_GONE = "consumer_gone"
    FINISHED = "finished"  # [A] deferred sendProviderCancel after every committed request


class RerouteCause(Enum):
    ERROR = "error"  # pre-first-chunk inference_error (any status) or an internal 502
    TIMEOUT = "timeout"
    WRITE_FAILED = "write_failed"


class Untrusted(Enum):
    CHUNK = "chunk"
    CHALLENGE = "challenge"


# --- records ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """Base of every record. ``at`` is ``time.monotonic()`` (the asyncio loop clock) when it was made."""

    at: float = field(default_factory=time.monotonic, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True, slots=True)
class DoubleStarted(Record):
    ws_url: str
    http_url: str
    generation: int


@dataclass(frozen=True, slots=True)
class DoubleKilled(Record):
    generation: int


@dataclass(frozen=True, slots=True)
class ProviderConnected(Record):
    provider_id: str


@dataclass(frozen=True, slots=True)
class Disconnected(Record):
    provider_id: str
    close_code: int | None  # None: no close frame (abrupt)


@dataclass(frozen=True, slots=True)
class FrameReceived(Record):
    provider_id: str
    message: Message
    size: int


@dataclass(frozen=True, slots=True)
class ModelStatus(Record):
    """A ``load_model_status`` or ``prefetch_model_status`` ([N]; directed.py)."""

    provider_id: str
    kind: str  # the frame type
    model_id: str
    status: str
    error: str = ""
    bytes_done: int = 0
    bytes_total: int = 0


@dataclass(frozen=True, slots=True)
class ModelsUpdated(Record):
    """A ``models_update`` replaced what the provider advertises ([N] MergeProviderModels)."""

    provider_id: str
    merged: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class InvalidFrame(Record):
    provider_id: str
    kind: InvalidKind
    detail: str  # field locations and error kinds only, never frame content
    size: int


@dataclass(frozen=True, slots=True)
class Dropped(Record):
    provider_id: str
    reason: DropReason
    frame_type: str
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class ProtocolViolation(Record):
    provider_id: str
    kind: Violation
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class Registered(Record):
    provider_id: str
    models: tuple[str, ...]
    public_key_valid: bool
    attested: bool  # the attestation blob verified (trust self_signed)
    reregister: bool
    trust_level: TrustLevel = TrustLevel.NONE
    attestation_error: str | None = None  # why [A] gave no trust for the blob (None: valid, or no blob)


@dataclass(frozen=True, slots=True)
class ChallengeSent(Record):
    provider_id: str
    nonce: str
    timestamp: str


@dataclass(frozen=True, slots=True)
class ChallengeResult(Record):
    provider_id: str
    nonce: str
    ok: bool
    failure: ChallengeFailure | None
    signature: SignatureCheck


@dataclass(frozen=True, slots=True)
class MarkedUntrusted(Record):
    provider_id: str
    cause: Untrusted


@dataclass(frozen=True, slots=True)
class Evicted(Record):
    provider_id: str


@dataclass(frozen=True, slots=True)
class Dispatched(Record):
    consumer_id: int
    request_id: str
    provider_id: str
    attempt: int
    session_public_key: str


@dataclass(frozen=True, slots=True)
class Accepted(Record):
    request_id: str
    provider_id: str


@dataclass(frozen=True, slots=True)
class ChunkReceived(Record):
    request_id: str
    provider_id: str
    event: bytes  # the decrypted SSE event, exactly as sealed


@dataclass(frozen=True, slots=True)
class ChunkRejected(Record):
    request_id: str
    provider_id: str
    fault: ChunkFault


@dataclass(frozen=True, slots=True)
class Committed(Record):
    consumer_id: int
    request_id: str
    provider_id: str


@dataclass(frozen=True, slots=True)
class Completed(Record):
    request_id: str
    provider_id: str
    usage: Usage


@dataclass(frozen=True, slots=True)
class Rejected(Record):
    """A pre-first-chunk failure: the provider's inference_error, or the double's internal 502."""

    consumer_id: int
    request_id: str
    provider_id: str
    status_code: int
    failure_code: str | None
    error_reason: str | None
    internal: bool


@dataclass(frozen=True, slots=True)
class StreamFailed(Record):
    """A failure after commit: surfaced to the consumer, never rerouted."""

    consumer_id: int
    request_id: str
    provider_id: str
    status_code: int
    internal: bool


@dataclass(frozen=True, slots=True)
class TimedOut(Record):
    consumer_id: int
    request_id: str
    provider_id: str
    window: Window


@dataclass(frozen=True, slots=True)
class Rerouted(Record):
    consumer_id: int
    request_id: str
    provider_id: str
    cause: RerouteCause


@dataclass(frozen=True, slots=True)
class CancelSent(Record):
    provider_id: str
    request_id: str
    cause: CancelCause
    delivered: bool


@dataclass(frozen=True, slots=True)
class AfterTerminal(Record):
    provider_id: str
    request_id: str
    frame_type: str


@dataclass(frozen=True, slots=True)
class ConsumerFinished(Record):
    consumer_id: int
    status_code: int
    request_id: str | None  # the committed request, if any
    stream: bool
    consumer_gone: bool = False


@dataclass(frozen=True, slots=True)
class DrainBarrier(Record):
    """[N] ``provider_drain``: the socket is fenced from new dispatch from here on."""

    provider_id: str
    request_id: str
    pending: int  # requests of this socket not yet settled when the barrier arrived


@dataclass(frozen=True, slots=True)
class DrainAckSent(Record):
    provider_id: str
    request_id: str
    delivered: bool


@dataclass(frozen=True, slots=True)
class TrustStatusSent(Record):
    provider_id: str
    trust_level: str
    status: str
    reason: str


@dataclass(frozen=True, slots=True)
class ClosedByDouble(Record):
    """The double closed a provider socket on purpose (e.g. 1013: state being restored)."""

    provider_id: str
    code: int
    reason: str


__all__ = [
    "Accepted",
    "AfterTerminal",
    "CancelCause",
    "CancelSent",
    "ChallengeFailure",
    "ChallengeResult",
    "ChallengeSent",
    "ChunkFault",
    "ChunkReceived",
    "ChunkRejected",
    "ClosedByDouble",
    "Committed",
    "Completed",
    "ConsumerFinished",
    "Disconnected",
    "Dispatched",
    "DoubleKilled",
    "DoubleStarted",
    "DrainAckSent",
    "DrainBarrier",
    "DropReason",
    "Dropped",
    "EventLog",
    "Evicted",
    "FrameReceived",
    "ModelStatus",
    "ModelsUpdated",
    "InvalidFrame",
    "InvalidKind",
    "MarkedUntrusted",
    "ProtocolViolation",
    "ProviderConnected",
    "Registered",
    "Record",
    "Rejected",
    "RerouteCause",
    "Rerouted",
    "SignatureCheck",
    "StreamFailed",
    "TimedOut",
    "TrustLevel",
    "TrustStatusSent",
    "Untrusted",
    "Violation",
    "Window",
]

Event = Any  # one of the records above
E = TypeVar("E")


class EventLog:
    """Append-only list of records with waiters. Single event loop, no locks needed."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._waiters: list[tuple[Callable[[Event], bool], asyncio.Future[Event]]] = []
        self._changed: list[asyncio.Future[None]] = []

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(list(self._events))

    def __getitem__(self, index: int) -> Event:
        return self._events[index]

    def mark(self) -> int:
        """Position to pass as ``since`` so a wait only sees later records."""
        return len(self._events)

    def of(self, cls: type[E], since: int = 0) -> list[E]:
        return [e for e in self._events[since:] if isinstance(e, cls)]

    def append(self, event: Event) -> None:
        self._events.append(event)
        still: list[tuple[Callable[[Event], bool], asyncio.Future[Event]]] = []
        for predicate, future in self._waiters:
            if future.done():
                continue
            try:
                matched = predicate(event)
            except Exception as exc:  # a broken predicate fails its waiter, never the double
                future.set_exception(exc)
                continue
            if matched:
                future.set_result(event)
            else:
                still.append((predicate, future))
        self._waiters = still
        for future in self._changed:
            if not future.done():
                future.set_result(None)
        self._changed = []

    async def wait_for(self, predicate: Callable[[Event], bool], *, timeout: float, since: int = 0) -> Event:
        """The first record at or after ``since`` matching ``predicate``, waiting up to ``timeout`` s."""
        for event in self._events[since:]:
            if predicate(event):
                return event
        future: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, future))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise TimeoutError(f"no matching event within {timeout} s; last events: {self._tail()}") from None

    async def wait_until(self, condition: Callable[[], bool], *, timeout: float) -> None:
        """Wait until ``condition()`` holds, re-checked after every new record. The double's own state only
        changes together with a record; a condition on anything else (a fake provider's inbox) is only
        re-checked when some record arrives, so wait on that thing's own signal instead."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not condition():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"condition not met within {timeout} s; last events: {self._tail()}")
            future: asyncio.Future[None] = loop.create_future()
            self._changed.append(future)
            try:
                await asyncio.wait_for(future, remaining)
            except TimeoutError:
                pass

    def _tail(self, n: int = 8) -> list[str]:
        return [type(e).__name__ for e in self._events[-n:]]
