"""``CoordinatorDouble``: a protocol-faithful stand-in for the [A] coordinator, for tests only.

Two listeners on 127.0.0.1: a ``websockets`` server for ``/ws/provider`` (a real WebSocket, 10 MiB read
limit, no pings, no compression, as the Go coordinator) and a uvicorn/FastAPI server for the consumer API.
The read loop of each socket is synchronous, like Go's single reader: every frame is decoded with
``protocol.decode`` (which already refuses a float in an int field, as Go does) and either handled or
recorded and dropped. Everything the double sees or does goes to ``events`` (see ``events.py``).

Stricter than Go, on purpose: a provider frame missing a field that our ``protocol`` models require is
dropped as ``InvalidFrame(SCHEMA)`` (Go would read a zero value); [N]-only frame types are dropped as
``UNKNOWN_TYPE`` because [A] does not know them, except the [N] lifecycle, which is additive
(docs/reference/protocol-messages.md): ``provider_drain`` fences the socket and is answered with
``provider_drain_ack`` once its pending requests are settled (``DoubleConfig.drain_ack=False``: never);
an attested registration gets ``trust_status`` (self_signed, online), and ``send_trust_status`` sends any
other; ``DoubleConfig.newer_protocol=False`` is the April [A] coordinator itself, which sends none of
these and drops every [N] provider frame as an unknown type; ``DoubleConfig.restore_pending_registrations`` closes the first registrations with 1013 (state being
restored: try again later), and ``close_provider`` closes a socket with any code;
the [N] answers about models likewise (``directed.py``).

The provider listener also answers the public ``GET /v1/models/catalog`` (the [A] coordinator serves the
provider socket and its HTTP API on one port, so a provider derives the catalog URL from its own).

Lifecycle: ``async with CoordinatorDouble(config) as double`` starts both listeners; ``kill()`` aborts every
socket without a close handshake (providers and consumers), forgets all state but the event log;
``restart()`` starts again on the same ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any

import uvicorn
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from protocol import (
    AttestationResponse,
    Cancel,
    CapacityQuote,
    Heartbeat,
    InferenceAccepted,
    InferenceComplete,
    InferenceError,
    InferenceResponseChunk,
    ProtocolError,
    ProviderDrain,
    ProviderDrainAck,
    Register,
    TrustStatus,
    UnknownMessage,
    decode,
    encode,
)
from protocol.crypto import DecryptError

from . import events as ev
from .attestation import IMMEDIATELY_UNTRUSTED, Verdict, new_challenge, verify_challenge, verify_registration
from .capacity import QUOTE_WINDOW_S, QuoteBook, QuoteReceived
from .chat_wire import check_event, error_body
from .config import DoubleConfig
from .consumer_api import CATALOG_PATH, build_app, catalog_document
from .directed import MODEL_REPLY_TYPES, desired_models, on_model_reply
from .dispatch import ConsumerGone, FailedRequest
from .hostile import HostileCase
from .pending import (
    PROVIDER_DISCONNECTED,
    AcceptedItem,
    ChunkItem,
    CompleteItem,
    ErrorItem,
    PendingRequest,
    RequestState,
)
from .routing import ProviderSession, ProviderView, Registry, valid_public_key

WS_PATH = "/ws/provider"
# The seven provider frame types [A] ProviderMessage.UnmarshalJSON knows; any other type is rejected.
_A_TYPES = (Register, Heartbeat, InferenceAccepted, InferenceResponseChunk, InferenceComplete, InferenceError, AttestationResponse)
# [N] frames the double also knows: the lifecycle drain barrier (additive; an [A] coordinator drops it).
_N_TYPES = (ProviderDrain,)
TRY_AGAIN_LATER = 1013  # [N] registration whose durable state is still being restored
RESTORE_PENDING_REASON = "provider state restore pending"
_UNTRUSTED_CHUNK = ErrorItem(502, "provider response could not be verified", internal=True)

ProviderRef = str | int | ProviderView


class _HttpServer(uvicorn.Server):
    """uvicorn without its signal handlers: the test process owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    return socket.create_server((host, port))  # SO_REUSEADDR on POSIX: a restart can rebind at once


def chunk_fault(chunk: InferenceResponseChunk, registered_key: str) -> ev.ChunkFault | None:
    """[A] decryptTextResponseChunk's checks before decryption."""
    if chunk.encrypted_data is None:
        return ev.ChunkFault.PLAINTEXT if chunk.data else ev.ChunkFault.MISSING
    if chunk.data:
        return ev.ChunkFault.BOTH
    if chunk.encrypted_data.ephemeral_public_key != registered_key:
        return ev.ChunkFault.WRONG_KEY
    return None


class CoordinatorDouble:
    def __init__(self, config: DoubleConfig | None = None) -> None:
        self.config = config or DoubleConfig()
        self.events = ev.EventLog()
        self.registry = Registry(self.config)
        self.quotes = QuoteBook(self.events)  # [N] capacity probes and quotes (capacity.py)
        self.errors: list[BaseException] = []  # exceptions inside the double itself: a test should see none
        self._ws_port = self.config.ws_port
        self._http_port = self.config.http_port
        self._ws_server: Server | None = None
        self._http_server: _HttpServer | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._queued: Counter[str] = Counter()
        self._consumer_ids = itertools.count(1)
        self._generation = 0
        self._restores_left = self.config.restore_pending_registrations
        self.running = False

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def __aenter__(self) -> CoordinatorDouble:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def ws_url(self) -> str:
        return f"ws://{self.config.host}:{self._ws_port}{WS_PATH}"

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self._http_port}"

    async def start(self) -> None:
        if self.running:
            raise RuntimeError("the coordinator double is already running")
        self.registry = Registry(self.config)
        self._queued.clear()
        ws_sock = _listen(self.config.host, self._ws_port)
        http_sock = _listen(self.config.host, self._http_port)
        self._ws_port, self._http_port = ws_sock.getsockname()[1], http_sock.getsockname()[1]
        self._ws_server = await serve(
            self._ws_handler,
            sock=ws_sock,
            max_size=self.config.max_provider_frame_bytes,
            compression=None,
            ping_interval=None,
            process_request=self._check_path,
        )
        uv_config = uvicorn.Config(
            build_app(self), lifespan="off", http="h11", ws="none", log_level="warning", access_log=False,
            log_config=None,  # keep logging as the test process set it up (uvicorn's dictConfig would not)
        )
        self._http_server = _HttpServer(uv_config)
        # The socket already listens: consumers that connect before uvicorn starts wait in the backlog.
        self._http_task = asyncio.create_task(self._http_server.serve(sockets=[http_sock]))
        self._spawn(self._eviction_loop())
        self.running = True
        self._generation += 1
        self.events.append(ev.DoubleStarted(self.ws_url, self.http_url, self._generation))

    async def stop(self) -> None:
        """Orderly stop: providers get a close frame; consumers still connected are cut off."""
        await self._shutdown(abrupt=False)

    async def kill(self) -> None:
        """Abrupt stop: every socket is aborted without a close handshake, in-flight consumers fail."""
        await self._shutdown(abrupt=True)
        self.events.append(ev.DoubleKilled(self._generation))

    async def restart(self) -> None:
        """A fresh coordinator on the same ports (empty registry; the event log is kept)."""
        if self.running:
            await self.kill()
        await self.start()

    async def _shutdown(self, *, abrupt: bool) -> None:
        if not self.running:
            return
        self.running = False
        assert self._ws_server is not None and self._http_server is not None and self._http_task is not None
        if abrupt:
            self._ws_server.close(close_connections=False)
            for connection in list(self._ws_server.connections):
                connection.transport.abort()
        else:
            self._ws_server.close()
        http = self._http_server
        http.should_exit = http.force_exit = True
        for connection in list(http.server_state.connections):
            connection.transport.abort()  # type: ignore[union-attr]
        await self._ws_server.wait_closed()
        await self._http_task
        leftovers = list(http.server_state.tasks)
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.registry = Registry(self.config)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())  # type: ignore[arg-type]

    # --- views and waiters for tests -----------------------------------------------------------------------

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    @property
    def providers(self) -> list[ProviderView]:
        """Current provider sockets in connection order (a disconnected provider leaves the list)."""
        now = self.now()
        return [self.registry.view(s, now) for s in sorted(self.registry.sessions.values(), key=lambda s: s.order)]

    def provider(self, ref: ProviderRef) -> ProviderView:
        return self.registry.view(self._session(ref), self.now())

    def routable(self, model: str | None = None) -> list[ProviderView]:
        return [p for p in self.providers if p.routable and (model is None or model in p.models)]

    def anomalies(self, since: int = 0) -> list[Any]:
        """Every record of something a correct provider never causes."""
        kinds = (ev.InvalidFrame, ev.ProtocolViolation, ev.AfterTerminal, ev.ChunkRejected, ev.MarkedUntrusted)
        return [e for e in self.events[since:] if isinstance(e, kinds)]

    def mark(self) -> int:
        return self.events.mark()

    async def wait_for(self, predicate: Callable[[Any], bool], *, timeout: float, since: int = 0) -> Any:
        return await self.events.wait_for(predicate, timeout=timeout, since=since)

    async def wait_until(self, condition: Callable[[], bool], *, timeout: float) -> None:
        await self.events.wait_until(condition, timeout=timeout)

    async def wait_routable(self, count: int = 1, *, model: str | None = None, timeout: float = 10.0) -> list[ProviderView]:
        await self.wait_until(lambda: len(self.routable(model)) >= count, timeout=timeout)
        return self.routable(model)

    # --- injection -----------------------------------------------------------------------------------------

    async def send_raw(self, ref: ProviderRef, data: str | bytes) -> None:
        """Send any frame to a provider: ``str`` as a text frame, ``bytes`` as a binary frame."""
        await self._session(ref).ws.send(data)

    async def send_hostile(self, ref: ProviderRef, cases: Iterable[HostileCase]) -> int:
        """Hostile mode: send each case's frame to a provider, in order, as fast as the socket takes them
        (cases from ``hostile.hostile_cases``; check the answers with ``hostile.HostileReport``)."""
        ws = self._session(ref).ws
        sent = 0
        for case in cases:
            await ws.send(case.payload)
            sent += 1
        return sent

    async def send_frame(self, ref: ProviderRef, frame: Any) -> None:
        """Send one coordinator frame (a ``protocol`` model, e.g. ``directed.load_model("m")``) to a provider."""
        await self._session(ref).ws.send(encode(frame))

    async def probe(self, ref: ProviderRef, *, model: str, prompt_tokens: int, max_output_tokens: int,
                    requires_vision: bool = False, vision_image_count: int = 0, deadline_remaining_ms: int = 0,
                    window_s: float = QUOTE_WINDOW_S) -> QuoteReceived | None:
        """[N] one ``capacity_probe``; the quote if it came inside the window (capacity.py)."""
        session = self._session(ref)
        return await self.quotes.probe(session, session.ws.send, model=model, prompt_tokens=prompt_tokens,
                                       max_output_tokens=max_output_tokens, requires_vision=requires_vision,
                                       vision_image_count=vision_image_count,
                                       deadline_remaining_ms=deadline_remaining_ms, window_s=window_s)

    async def send_challenge(self, ref: ProviderRef) -> ev.ChallengeResult:
        """One challenge now (besides the periodic ones); returns its recorded result."""
        return await self._challenge(self._session(ref))

    async def send_trust_status(self, ref: ProviderRef | ProviderSession, trust_level: str, status: str,
                                reason: str) -> None:
        """[N] ``trust_status`` (diagnostics for the provider's operator), as sendTrustStatus sends it."""
        session = ref if isinstance(ref, ProviderSession) else self._session(ref)
        frame = TrustStatus(trust_level=trust_level, status=status, reason=reason)
        if session.connected and await self.send(session, encode(frame), self.config.control_write_timeout):
            self.events.append(ev.TrustStatusSent(session.provider_id, trust_level, status, reason))

    async def close_provider(self, ref: ProviderRef | ProviderSession, code: int, reason: str) -> None:
        """Close a provider socket with ``code`` (a close handshake, unlike ``kill``)."""
        session = ref if isinstance(ref, ProviderSession) else self._session(ref)
        self.events.append(ev.ClosedByDouble(session.provider_id, code, reason))
        await session.ws.close(code, reason)

    def _session(self, ref: ProviderRef) -> ProviderSession:
        if isinstance(ref, ProviderView):
            ref = ref.provider_id
        if isinstance(ref, int):
            return sorted(self.registry.sessions.values(), key=lambda s: s.order)[ref]
        return self.registry.sessions[ref]

    # --- used by dispatch and the consumer API -------------------------------------------------------------

    def next_consumer_id(self) -> int:
        return next(self._consumer_ids)

    async def send(self, session: ProviderSession, text: str, timeout: float) -> bool:
        try:
            await asyncio.wait_for(session.ws.send(text), timeout)
        except (ConnectionClosed, TimeoutError, OSError):
            return False
        return True

    def cancel(self, pending: PendingRequest, cause: ev.CancelCause) -> None:
        """Drop the request and send ``cancel`` once. Synchronous: safe in a cancelled task's ``finally``."""
        pending.close(RequestState.REMOVED)
        if pending.cancel_sent:
            return
        pending.cancel_sent = True
        self._spawn(self._send_cancel(pending.provider, pending.request_id, cause))

    async def _send_cancel(self, session: ProviderSession, request_id: str, cause: ev.CancelCause) -> None:
        delivered = session.connected and await self.send(
            session, encode(Cancel(request_id=request_id)), self.config.cancel_write_timeout
        )
        self.events.append(ev.CancelSent(session.provider_id, request_id, cause, delivered))

    async def queue_for_provider(
        self, model: str, excluded: list[str], gone: asyncio.Event
    ) -> ProviderSession | FailedRequest | ConsumerGone:
        """[A] attempt 0 with no free provider: wait in the model's queue (bounded size and time)."""
        if self._queued[model] >= self.config.queue_limit_per_model:
            return FailedRequest(503, error_body("request queue is full", "model_not_available"))
        self._queued[model] += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.queue_timeout
        try:
            while not gone.is_set():
                session = self.registry.pick(model, excluded, self.now())
                if session is not None:
                    return session
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                # Any record may free a slot or add a provider; a consumer leaving records nothing, so race it.
                mark = self.events.mark()
                waiter = asyncio.ensure_future(self.events.wait_for(lambda e: True, since=mark, timeout=remaining))
                leaver = asyncio.ensure_future(gone.wait())
                try:
                    await asyncio.wait({waiter, leaver}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                    leaver.cancel()
                    await asyncio.gather(waiter, leaver, return_exceptions=True)
        finally:
            self._queued[model] -= 1
        if gone.is_set():
            return ConsumerGone()
        return FailedRequest(503, error_body(f"no provider available for model {model}", "model_not_available"))

    # --- provider sockets ----------------------------------------------------------------------------------

    def _check_path(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == CATALOG_PATH:  # [A] serves /ws/provider and the HTTP API on one port
            response = connection.respond(200, json.dumps(catalog_document(self.config)))
            response.headers["Content-Type"] = "application/json"
            return response
        if request.path != WS_PATH:
            return connection.respond(404, "not found\n")
        return None

    async def _ws_handler(self, ws: ServerConnection) -> None:
        session = self.registry.add(str(uuid.uuid4()), ws)
        self.events.append(ev.ProviderConnected(session.provider_id))
        try:
            async for frame in ws:
                try:
                    self._on_frame(session, frame)
                except Exception as exc:  # a bug in the double: record it, keep the socket like Go would
                    self.errors.append(exc)
        except ConnectionClosed:
            pass
        finally:
            received = ws.protocol.close_rcvd
            self._disconnect(session, received.code if received is not None else None)

    def _disconnect(self, session: ProviderSession, close_code: int | None) -> None:
        session.connected = False
        if session.challenge_task is not None:
            session.challenge_task.cancel()
        self._fail_pending(session)
        self.registry.remove(session)
        self.events.append(ev.Disconnected(session.provider_id, close_code))

    def _fail_pending(self, session: ProviderSession) -> None:
        """[A] Registry.Disconnect: every pending request fails with an internal 502 (rerouted if uncommitted)."""
        for pending in list(session.pending.values()):
            pending.deliver(PROVIDER_DISCONNECTED)
            pending.close(RequestState.REMOVED)

    def _on_frame(self, session: ProviderSession, frame: str | bytes) -> None:
        pid = session.provider_id
        if isinstance(frame, bytes):
            self.events.append(ev.ProtocolViolation(pid, ev.Violation.BINARY_FRAME))
        try:
            message = decode(frame)
        except ProtocolError as exc:
            self.events.append(ev.InvalidFrame(pid, _classify(frame), str(exc), len(frame)))
            return
        if isinstance(message, CapacityQuote) and session.register is not None:  # [N] (capacity.py)
            self.events.append(ev.FrameReceived(pid, message, len(frame)))
            self.quotes.received(session, message)
            return
        known = _A_TYPES + _N_TYPES + MODEL_REPLY_TYPES if self.config.newer_protocol else _A_TYPES
        if isinstance(message, UnknownMessage) or not isinstance(message, known):
            detail = f"type {message.type[:64]!r} is not an [A] provider frame"
            self.events.append(ev.InvalidFrame(pid, ev.InvalidKind.UNKNOWN_TYPE, detail, len(frame)))
            return
        self.events.append(ev.FrameReceived(pid, message, len(frame)))
        if isinstance(message, Register):
            self._on_register(session, message)
        elif session.register is None and not isinstance(message, AttestationResponse):
            self.events.append(ev.Dropped(pid, ev.DropReason.NOT_REGISTERED, message.type))
        elif isinstance(message, Heartbeat):
            self._on_heartbeat(session, message)
        elif isinstance(message, AttestationResponse):
            self._on_attestation_response(session, message)
        elif isinstance(message, ProviderDrain):
            self._on_drain(session, message)
        elif isinstance(message, MODEL_REPLY_TYPES):
            on_model_reply(session, message, self.events)
        else:
            pending = self._pending_for(session, message)
            if pending is not None:
                self._on_request_frame(session, pending, message)

    def _on_register(self, session: ProviderSession, message: Register) -> None:
        reregister = session.register is not None
        if reregister:
            self.events.append(ev.ProtocolViolation(session.provider_id, ev.Violation.DUPLICATE_REGISTER))
            if session.challenge_task is not None:
                session.challenge_task.cancel()
        # [A] builds a fresh Provider object: trust, challenge and eviction state start over.
        session.register = message
        self.quotes.registered(session)
        session.public_key = message.public_key if valid_public_key(message.public_key) else ""
        session.attestation = verify_registration(message.attestation, message.public_key)
        session.last_heartbeat_at = self.now()
        session.heartbeats.clear()
        session.warm_models = ()
        # [A] verifyProviderAttestation: a valid blob counts as a passed challenge (routable at once).
        session.challenge_passed_at = self.now() if session.attested else None
        session.failed_challenges = 0
        session.untrusted = session.evicted = False
        self.events.append(
            ev.Registered(session.provider_id, session.models, bool(session.public_key), session.attested, reregister,
                          session.trust_level, session.attestation_error)
        )
        session.challenge_task = self._spawn(self._challenge_loop(session))
        if self._restores_left > 0:  # [N] verifyProviderAttestation: restore failed after bounded retries
            self._restores_left -= 1
            self._spawn(self.close_provider(session, TRY_AGAIN_LATER, RESTORE_PENDING_REASON))
        elif session.attested and self.config.newer_protocol:  # [N] sendTrustStatus after a verified attestation
            self._spawn(self.send_trust_status(session, "self_signed", "online",
                                               "SE attestation verified, awaiting MDM verification"))
        if self.config.desired_models is not None:  # [N]: the build map follows register at once
            frame = encode(desired_models(dict(self.config.desired_models)))
            self._spawn(self.send(session, frame, self.config.control_write_timeout))

    def _on_heartbeat(self, session: ProviderSession, message: Heartbeat) -> None:
        if session.evicted:
            self.events.append(ev.Dropped(session.provider_id, ev.DropReason.EVICTED, message.type))
            return
        if not self.quotes.heartbeat(session, message):
            return  # [N]: a stale or reordered capacity snapshot is not applied
        session.heartbeats.append(message)
        session.last_heartbeat_at = self.now()
        if message.warm_models:  # [A] cannot clear the list
            session.warm_models = tuple(message.warm_models)

    def _on_drain(self, session: ProviderSession, message: ProviderDrain) -> None:
        """[N] providerDrainAcker: fence the socket from new dispatch, then acknowledge once every request
        pending on it is settled (its terminal frame handled, or removed). ``drain_ack=False``: never."""
        session.drain_fenced = True
        self.events.append(ev.DrainBarrier(session.provider_id, message.request_id, len(session.pending)))
        if self.config.drain_ack:
            self._spawn(self._ack_drain(session, message.request_id))

    async def _ack_drain(self, session: ProviderSession, request_id: str) -> None:
        with contextlib.suppress(TimeoutError):  # a dead or stuck socket never gets the ack
            await self.wait_until(lambda: not session.pending or not session.connected,
                                  timeout=self.config.stream_idle_timeout)
        if not session.connected or session.pending:
            return
        delivered = await self.send(session, encode(ProviderDrainAck(request_id=request_id)),
                                    self.config.control_write_timeout)
        self.events.append(ev.DrainAckSent(session.provider_id, request_id, delivered))

    def _pending_for(self, session: ProviderSession, message: Any) -> PendingRequest | None:
        request_id = message.request_id
        pending = session.pending.get(request_id)
        if pending is not None:
            return pending
        state = session.closed.get(request_id)
        if state is RequestState.TERMINATED:
            self.events.append(ev.AfterTerminal(session.provider_id, request_id, message.type))
        else:
            reason = ev.DropReason.REMOVED_REQUEST if state is RequestState.REMOVED else ev.DropReason.UNKNOWN_REQUEST
            self.events.append(ev.Dropped(session.provider_id, reason, message.type, request_id))
        return None

    def _on_request_frame(self, session: ProviderSession, pending: PendingRequest, message: Any) -> None:
        pid, rid = session.provider_id, pending.request_id
        if isinstance(message, InferenceAccepted):
            if pending.chunks:
                self.events.append(ev.ProtocolViolation(pid, ev.Violation.ACCEPT_AFTER_CHUNK, rid))
            elif pending.accepted:
                self.events.append(ev.ProtocolViolation(pid, ev.Violation.DUPLICATE_ACCEPT, rid))
            pending.accepted = True
            self.events.append(ev.Accepted(rid, pid))
            pending.deliver(AcceptedItem())
        elif isinstance(message, InferenceResponseChunk):
            self._on_chunk(session, pending, message)
        elif isinstance(message, InferenceComplete):
            self.events.append(ev.Completed(rid, pid, message.usage))
            pending.deliver(CompleteItem(message.usage))
            pending.close(RequestState.TERMINATED)
        elif isinstance(message, InferenceError):
            failure = message.failure_code.value if message.failure_code else None
            reason = message.error_reason.value if message.error_reason else None
            pending.deliver(ErrorItem(message.status_code, message.error, failure, reason))
            pending.close(RequestState.TERMINATED)

    def _on_chunk(self, session: ProviderSession, pending: PendingRequest, chunk: InferenceResponseChunk) -> None:
        pid, rid = session.provider_id, pending.request_id
        fault = chunk_fault(chunk, session.public_key)
        plaintext = b""
        if fault is None:
            assert chunk.encrypted_data is not None
            try:
                plaintext = pending.box.open(chunk.encrypted_data.ciphertext)
            except DecryptError:
                fault = ev.ChunkFault.UNDECRYPTABLE
        if fault is not None:
            # [A] handleChunk: MarkUntrusted and fail the request with an internal 502.
            self.events.append(ev.ChunkRejected(rid, pid, fault))
            if not session.untrusted:
                session.untrusted = True
                self.events.append(ev.MarkedUntrusted(pid, ev.Untrusted.CHUNK))
            pending.deliver(_UNTRUSTED_CHUNK)
            pending.close(RequestState.REMOVED)
            return
        violation = check_event(plaintext)
        if violation is not None:
            self.events.append(ev.ProtocolViolation(pid, violation, rid))
        pending.chunks += 1
        self.events.append(ev.ChunkReceived(rid, pid, plaintext))
        pending.deliver(ChunkItem(plaintext))

    # --- challenges ----------------------------------------------------------------------------------------

    async def _challenge_loop(self, session: ProviderSession) -> None:
        while True:
            await self._challenge(session)
            await asyncio.sleep(self.config.challenge_interval)

    async def _challenge(self, session: ProviderSession) -> ev.ChallengeResult:
        challenge = new_challenge()
        answer: asyncio.Future[AttestationResponse] = asyncio.get_running_loop().create_future()
        session.challenges[challenge.nonce] = (challenge, answer)
        self.events.append(ev.ChallengeSent(session.provider_id, challenge.nonce, challenge.timestamp))
        try:
            sent = await self.send(session, encode(challenge), self.config.control_write_timeout)
            response = await asyncio.wait_for(answer, self.config.challenge_response_timeout) if sent else None
        except TimeoutError:
            response = None
        finally:
            session.challenges.pop(challenge.nonce, None)
        if response is None:
            verdict = Verdict(ev.ChallengeFailure.TIMEOUT, ev.SignatureCheck.NOT_CHECKED)
        else:
            verdict = verify_challenge(
                response,
                challenge,
                registered_key=session.public_key,
                p256_key=session.p256_key,
                require_secure_boot_present=self.config.require_secure_boot_present,
            )
        return self._record_challenge(session, challenge.nonce, verdict)

    def _record_challenge(self, session: ProviderSession, nonce: str, verdict: Verdict) -> ev.ChallengeResult:
        if verdict.ok:
            session.challenge_passed_at = self.now()
            session.failed_challenges = 0
        else:
            session.failed_challenges += 1
            too_many = session.failed_challenges >= self.config.max_failed_challenges
            if (verdict.failure in IMMEDIATELY_UNTRUSTED or too_many) and not session.untrusted:
                session.untrusted = True
                self.events.append(ev.MarkedUntrusted(session.provider_id, ev.Untrusted.CHALLENGE))
        result = ev.ChallengeResult(session.provider_id, nonce, verdict.ok, verdict.failure, verdict.signature)
        self.events.append(result)
        return result

    def _on_attestation_response(self, session: ProviderSession, message: AttestationResponse) -> None:
        entry = session.challenges.get(message.nonce)
        if entry is None or entry[1].done():
            self.events.append(ev.Dropped(session.provider_id, ev.DropReason.UNSOLICITED_ATTESTATION, message.type))
            return
        entry[1].set_result(message)

    # --- eviction ------------------------------------------------------------------------------------------

    async def _eviction_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.eviction_sweep_interval)
            self.evict_stale()

    def evict_stale(self) -> list[str]:
        """One sweep ([A] evictStale): providers silent for longer than the timeout are removed from routing;
        their sockets stay open."""
        now, evicted = self.now(), []
        for session in list(self.registry.sessions.values()):
            if session.register is None or session.evicted:
                continue
            if now - session.last_heartbeat_at > self.config.eviction_timeout:
                session.evicted = True
                self._fail_pending(session)
                self.events.append(ev.Evicted(session.provider_id))
                evicted.append(session.provider_id)
        return evicted


def _classify(frame: str | bytes) -> ev.InvalidKind:
    try:
        value = json.loads(frame)
    except (ValueError, RecursionError):
        return ev.InvalidKind.NOT_JSON
    return ev.InvalidKind.SCHEMA if isinstance(value, dict) else ev.InvalidKind.NOT_AN_OBJECT
