"""Provider registry and routing, faithful to [A] where tests can tell (registry.go, scheduler.go).

A provider is routable for text when it registered with the configured backend, a valid standard-base64
32-byte ``public_key``, ``encrypted_response_chunks: true`` and the required privacy booleans, its trust
level ranks at least ``DoubleConfig.min_trust`` (``self_signed`` takes a valid registration attestation,
``attestation.py``), it passed a challenge within the freshness window (a valid attestation counts as one),
and is neither untrusted nor evicted. Among eligible providers for a
model (advertised, slot not crashed/reloading, thermal not critical, in-flight below [A]'s concurrency cap),
the double picks the fewest in flight, ties broken by registration order — [A] uses a cost model and a random
tie-break; a deterministic order lets tests decide which provider is tried first. With a model catalog
(``DoubleConfig.catalog``) a provider's models that it does not list are dropped, as [A] Registry.Register does;
[A]'s free-memory gate (``freeMemoryAdmits``, which reads the catalog sizes) is not modelled here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from protocol import AttestationChallenge, AttestationResponse, Heartbeat, Register
from protocol.crypto import InvalidKeyError, parse_public_key

from .attestation import PARSE_FAILED, TRUST_RANK, AttestationResult
from .config import REQUIRED_PRIVACY_FLAGS, DoubleConfig, max_concurrency
from .events import TrustLevel
from .pending import PendingRequest, RequestState

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection


class Unroutable(Enum):
    NOT_REGISTERED = "not_registered"
    DISCONNECTED = "disconnected"
    EVICTED = "evicted"
    UNTRUSTED = "untrusted"
    WRONG_BACKEND = "wrong_backend"
    NO_PUBLIC_KEY = "no_public_key"  # absent or invalid (cleared at registration)
    PLAINTEXT_RESPONSES = "plaintext_responses"  # encrypted_response_chunks not true
    PRIVACY_CAPABILITIES = "privacy_capabilities"
    TRUST_BELOW_MINIMUM = "trust_below_minimum"  # trust level ranks below DoubleConfig.min_trust
    CHALLENGE_NOT_PASSED = "challenge_not_passed"
    CHALLENGE_STALE = "challenge_stale"
    THERMAL_CRITICAL = "thermal_critical"
    DRAIN_FENCED = "drain_fenced"  # [N] the provider sent provider_drain on this socket


_UNSERVABLE_SLOT_STATES = frozenset({"crashed", "reloading"})


def valid_public_key(text: str) -> bool:
    try:
        parse_public_key(text)
    except InvalidKeyError:
        return False
    return True


@dataclass(eq=False)
class ProviderSession:
    """One provider socket and what it registered. A new socket is a new provider id, as in [A]."""

    provider_id: str
    ws: ServerConnection
    order: int
    connected: bool = True
    register: Register | None = None
    public_key: str = ""  # the registered key if valid, else "" ([A] clears an invalid key)
    attestation: AttestationResult | None = None  # what [A] stored for register.attestation (None: none/unparsed)
    last_heartbeat_at: float = 0.0  # loop time; set at registration, as [A] LastHeartbeat
    heartbeats: list[Heartbeat] = field(default_factory=list)
    warm_models: tuple[str, ...] = ()
    challenge_passed_at: float | None = None
    failed_challenges: int = 0
    challenges: dict[str, tuple[AttestationChallenge, asyncio.Future[AttestationResponse]]] = field(
        default_factory=dict
    )
    challenge_task: asyncio.Task[None] | None = None
    untrusted: bool = False
    evicted: bool = False
    drain_fenced: bool = False  # [N] provider_drain received: no new dispatch on this socket, ever
    pending: dict[str, PendingRequest] = field(default_factory=dict)
    closed: dict[str, RequestState] = field(default_factory=dict)

    catalog: frozenset[str] = frozenset()  # [A] Registry.Register: with a catalog, unlisted models are dropped

    @property
    def models(self) -> tuple[str, ...]:
        ids = tuple(m.id for m in self.register.models) if self.register else ()
        return tuple(i for i in ids if i in self.catalog) if self.catalog else ids

    @property
    def attested(self) -> bool:
        return self.attestation is not None and self.attestation.valid

    @property
    def trust_level(self) -> TrustLevel:
        return TrustLevel.NONE if self.attestation is None else self.attestation.trust_level

    @property
    def attestation_error(self) -> str | None:
        """Why [A] gave no trust for the blob register carried (None: valid, or no blob)."""
        if self.attestation is not None:
            return self.attestation.error
        return None if self.register is None or self.register.attestation is None else PARSE_FAILED

    @property
    def p256_key(self) -> str | None:
        """The key challenge signatures are checked with: a parsed blob's publicKey, valid or not."""
        return self.attestation.public_key if self.attestation is not None and self.attestation.public_key else None

    @property
    def last_heartbeat(self) -> Heartbeat | None:
        return self.heartbeats[-1] if self.heartbeats else None

    def backend_capacity(self):  # latest heartbeat that carried one ([A] replaces only when present)
        for beat in reversed(self.heartbeats):
            if beat.backend_capacity is not None:
                return beat.backend_capacity
        return None

    def max_concurrency(self) -> int:
        capacity = self.backend_capacity()
        if capacity is None:
            return max_concurrency(None)
        total = capacity.total_memory_gb or (self.register.hardware.memory_gb if self.register else 0)
        return max_concurrency(total)

    def unroutable(self, now: float, config: DoubleConfig) -> tuple[Unroutable, ...]:
        reasons: list[Unroutable] = []
        if not self.connected:
            reasons.append(Unroutable.DISCONNECTED)
        reg = self.register
        if reg is None:
            return (*reasons, Unroutable.NOT_REGISTERED)
        if self.evicted:
            reasons.append(Unroutable.EVICTED)
        if self.untrusted:
            reasons.append(Unroutable.UNTRUSTED)
        if self.drain_fenced:
            reasons.append(Unroutable.DRAIN_FENCED)
        if reg.backend != config.backend:
            reasons.append(Unroutable.WRONG_BACKEND)
        if not self.public_key:
            reasons.append(Unroutable.NO_PUBLIC_KEY)
        if not reg.encrypted_response_chunks:
            reasons.append(Unroutable.PLAINTEXT_RESPONSES)
        caps = reg.privacy_capabilities
        if caps is None or not all(getattr(caps, flag) for flag in REQUIRED_PRIVACY_FLAGS):
            reasons.append(Unroutable.PRIVACY_CAPABILITIES)
        if TRUST_RANK[self.trust_level] < TRUST_RANK[config.min_trust]:
            reasons.append(Unroutable.TRUST_BELOW_MINIMUM)
        if self.challenge_passed_at is None:
            reasons.append(Unroutable.CHALLENGE_NOT_PASSED)
        elif now - self.challenge_passed_at > config.challenge_freshness:
            reasons.append(Unroutable.CHALLENGE_STALE)
        beat = self.last_heartbeat
        if beat is not None and beat.system_metrics.thermal_state == "critical":
            reasons.append(Unroutable.THERMAL_CRITICAL)
        return tuple(reasons)

    def can_take(self, model: str) -> bool:
        """Model-level eligibility once routable: advertised, slot servable, a free concurrency slot."""
        if model not in self.models:
            return False
        capacity = self.backend_capacity()
        if capacity is not None:
            for slot in capacity.slots:
                if slot.model == model and slot.state in _UNSERVABLE_SLOT_STATES:
                    return False
        return len(self.pending) < self.max_concurrency()


@dataclass(frozen=True, slots=True)
class ProviderView:
    """A snapshot for tests (``double.providers``)."""

    provider_id: str
    connected: bool
    registered: bool
    routable: bool
    unroutable: tuple[Unroutable, ...]
    models: tuple[str, ...]
    public_key: str
    attested: bool
    trust_level: TrustLevel
    attestation_error: str | None  # why [A] gave no trust for the blob (None: valid, or no blob)
    backend: str | None
    challenge_passed: bool
    failed_challenges: int
    untrusted: bool
    evicted: bool
    in_flight: int
    max_concurrency: int
    heartbeat_count: int
    last_heartbeat: Heartbeat | None
    warm_models: tuple[str, ...]
    seconds_since_heartbeat: float | None


class Registry:
    """The providers of one coordinator run (a restart starts an empty one)."""

    def __init__(self, config: DoubleConfig) -> None:
        self.config = config
        self.sessions: dict[str, ProviderSession] = {}
        self._order = 0

    def add(self, provider_id: str, ws: ServerConnection) -> ProviderSession:
        self._order += 1
        session = ProviderSession(provider_id=provider_id, ws=ws, order=self._order,
                                  catalog=frozenset(i for i, _ in self.config.catalog))
        self.sessions[provider_id] = session
        return session

    def remove(self, session: ProviderSession) -> None:
        self.sessions.pop(session.provider_id, None)

    def routable(self, now: float) -> list[ProviderSession]:
        return [s for s in self.sessions.values() if not s.unroutable(now, self.config)]

    def pick(self, model: str, excluded: Iterable[str], now: float) -> ProviderSession | None:
        skip = set(excluded)
        candidates = [
            s for s in self.routable(now) if s.provider_id not in skip and s.public_key and s.can_take(model)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda s: (len(s.pending), s.order))

    def models(self) -> list[str]:
        """Models of registered, non-evicted providers (for GET /v1/models)."""
        seen: dict[str, None] = {}
        for session in self.sessions.values():
            if session.register is not None and not session.evicted:
                seen.update(dict.fromkeys(session.models))
        return list(seen)

    def view(self, session: ProviderSession, now: float) -> ProviderView:
        reasons = session.unroutable(now, self.config)
        return ProviderView(
            provider_id=session.provider_id,
            connected=session.connected,
            registered=session.register is not None,
            routable=not reasons,
            unroutable=reasons,
            models=session.models,
            public_key=session.public_key,
            attested=session.attested,
            trust_level=session.trust_level,
            attestation_error=session.attestation_error,
            backend=session.register.backend if session.register else None,
            challenge_passed=session.challenge_passed_at is not None,
            failed_challenges=session.failed_challenges,
            untrusted=session.untrusted,
            evicted=session.evicted,
            in_flight=len(session.pending),
            max_concurrency=session.max_concurrency(),
            heartbeat_count=len(session.heartbeats),
            last_heartbeat=session.last_heartbeat,
            warm_models=session.warm_models,
            seconds_since_heartbeat=(now - session.last_heartbeat_at) if session.register else None,
        )
