"""The asyncio shell around ``SessionCore``: one WebSocket to the coordinator, forever.

It only moves frames, runs timers and reconnects; every decision about a frame is the core's.

Per connection:
* the ``websockets`` client with an inbound limit above ``MAX_INBOUND_FRAME_BYTES`` (32 MiB),
  compression off, and its own keepalive: a ping every 10 s, the connection dropped when a pong is
  30 s late;
* one send queue and one writer task, so the frames of concurrent jobs interleave whole;
* a reader task feeding the core, a heartbeat task, and a clock watchdog that drops the connection
  when the wall clock jumps (the machine slept: the socket is dead even if nothing said so yet);
* the heartbeat task also drops the connection when two consecutive heartbeats (or the register and
  the first heartbeat) are further apart (monotonic) than the coordinator's eviction window (``eviction_window_s``, [A]: 90 s). The process
  was stalled (SIGSTOP, a debugger, swap): the coordinator has evicted us and ignores the heartbeats
  of this socket for good, though it stays open, so only a fresh ``register`` makes us routable again.
  The clock watchdog cannot see this: under a stall both clocks advance together;
* redirects of the upgrade are never followed: ``register`` carries the auth token and posture
  claims, and only the configured URL was checked against the URL rules.

Across connections: reconnect with ``backoff_delays()`` (1 s → 30 s, jittered), starting over only
after a session that stayed registered ≥ 30 s. Every connection gets a fresh core, hence exactly one
``register``. When a connection is lost every job of it is cancelled and awaited, so every
reservation is released before the next connection starts.

Drain (``stop`` set): new requests get 503 ``draining``, heartbeats say ``draining``, running jobs get
``drain_timeout_s`` to finish; after it each is cancelled with ``DRAIN_EXPIRED`` as the message, which
a job answers with its one terminal frame (503 ``draining``) instead of going silent. Then the lifecycle
barrier ([N] protocol-messages.md "Provider lifecycle drain"): ``provider_drain`` with a random id goes
out behind those terminal frames, and we wait up to ``drain_ack_timeout_s`` for its
``provider_drain_ack`` (the coordinator has settled every request of ours: billing included). No ack in
time is logged and recorded, never taken for success. A coordinator that has not shown the newer
protocol on this connection (the core's ``newer_protocol``: the April [A] coordinator never does, and
drops the frame as an unknown type) gets no barrier and costs no wait. Either way queued frames are
flushed, then the socket is closed with 1000 and ``run`` returns.

A close with 1013 (try again later: [N] closes a registration whose durable state it is still
restoring) is a wait, not a failure: recorded apart (``restore_waits``), not counted as a lost
connection, and followed by the ordinary backoff (never reset by it).

The shell keeps ``Session.status`` (``status.SessionStatus``) up to date: link state, attempts,
registrations, how each connection ended (close code and reason, and whose doing), the backoff
delay, heartbeats sent, and what the core's ``Note`` actions report.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from protocol import (
    MAX_INBOUND_FRAME_BYTES,
    CapacityQuote,
    EncodeError,
    Heartbeat,
    InferenceRequest,
    ModelsUpdate,
    Register,
    encode,
)
from provider.session.backoff import backoff_delays, clock_jumped, is_retryable, should_reset_backoff
from provider.session.core import (
    Action,
    CancelJob,
    ChallengeAnswerer,
    Log,
    ModelDirective,
    Note,
    Quoter,
    RecentRequestIds,
    Send,
    SessionCore,
    StartJob,
)
from provider.session.status import BarrierAcked, CloseCause, SessionStatus
from provider.telemetry import get_logger

log = get_logger("provider.session")

PING_INTERVAL_S = 10.0
PING_TIMEOUT_S = 30.0
OPEN_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 5.0
MAX_FRAME_BYTES = MAX_INBOUND_FRAME_BYTES + (1 << 20)  # the largest request plus room for its envelope
ABNORMAL_CLOSURE = 1006  # RFC 6455: the socket ended without a close frame
DRAIN_CLOSE_REASON = "provider shutting down"
RECONNECT_CLOSE_REASON = "reconnecting"
# The cancel message of a job the drain ran out on: unlike a coordinator's cancel or a lost
# connection, the coordinator still waits for this request's terminal frame, and the socket is open.
DRAIN_EXPIRED = "drain_expired"
DRAIN_ACK_TIMEOUT_S = 5.0  # how long a planned shutdown waits for provider_drain_ack
TRY_AGAIN_LATER = 1013  # RFC 6455 close code; [N]: state being restored, reconnect later
COORDINATOR_EVICTION_WINDOW_S = 90.0  # [A] StartEvictionLoop(ctx, 90*time.Second); [N] evicts later (~120 s)


class Transport(Protocol):
    """What the shell uses of a ``websockets`` client connection (tests may inject another)."""

    def __aiter__(self) -> Any: ...

    async def send(self, message: str) -> None: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...


ConnectFactory = Callable[[str], Awaitable[Transport]]
JobRunner = Callable[[InferenceRequest, Callable[[str], None]], Awaitable[object]]
HeartbeatBuilder = Callable[[bool], Heartbeat]  # draining -> frame
# A coordinator-directed model frame and this connection's send: the agent's model handler (provider/directed).
DirectiveRunner = Callable[[Any, Callable[[str], None]], Awaitable[object]]


class RedirectRefused(InvalidStatus):
    """The coordinator URL answered the upgrade with a redirect, which we never follow."""


class NoRedirectConnect(ws_connect):
    """The ``websockets`` client with redirects refused: following one would send ``register`` (auth token,
    posture claims) and challenge answers to a URL nobody checked against our URL rules, possibly over
    cleartext or to another host."""

    def process_redirect(self, exc: Exception) -> Exception | str:
        if isinstance(exc, InvalidStatus) and 300 <= exc.response.status_code < 400:
            return RedirectRefused(exc.response)
        return exc


def websocket_connect(*, ping_interval_s: float = PING_INTERVAL_S, ping_timeout_s: float = PING_TIMEOUT_S,
                      open_timeout_s: float = OPEN_TIMEOUT_S, max_size: int = MAX_FRAME_BYTES) -> ConnectFactory:
    """The production connect factory: the ``websockets`` asyncio client, configured for the coordinator
    (and refusing redirects)."""

    async def connect(url: str) -> Transport:
        return await NoRedirectConnect(
            url,
            max_size=max_size,
            ping_interval=ping_interval_s,
            ping_timeout=ping_timeout_s,
            open_timeout=open_timeout_s,
            close_timeout=CLOSE_TIMEOUT_S,
            compression=None,  # the coordinator does not negotiate it; frames are mostly ciphertext anyway
            user_agent_header=None,
        )

    return connect


@dataclass(frozen=True, slots=True)
class SessionConfig:
    url: str
    heartbeat_interval_s: float = 5.0
    drain_timeout_s: float = 30.0
    drain_ack_timeout_s: float = DRAIN_ACK_TIMEOUT_S
    eviction_window_s: float = COORDINATOR_EVICTION_WINDOW_S  # a longer gap between heartbeats: reconnect
    clock_check_interval_s: float = PING_INTERVAL_S
    stable_after_s: float = 30.0
    dev_posture: bool = False  # warn at every connect
    backoff: Callable[[], Iterator[float]] = field(default=backoff_delays)


class Session:
    """Keeps one coordinator connection alive until ``stop`` is set, then drains and returns."""

    def __init__(
        self,
        config: SessionConfig,
        *,
        build_register: Callable[[], Register],
        answer_challenge: ChallengeAnswerer,
        build_heartbeat: HeartbeatBuilder,
        run_job: JobRunner,
        connect: ConnectFactory | None = None,
        status: SessionStatus | None = None,
        run_directive: DirectiveRunner | None = None,
        quote: Quoter | None = None,
        build_models_update: Callable[[], ModelsUpdate] | None = None,
    ) -> None:
        self.config = config
        self._quote = quote
        self._build_models_update = build_models_update
        self._build_register = build_register
        self._answer = answer_challenge
        self._build_heartbeat = build_heartbeat
        self._run_job = run_job
        self._run_directive = run_directive
        self._connect = connect or websocket_connect()
        self.status = status if status is not None else SessionStatus(config.url)
        self.recent = RecentRequestIds()  # finished request ids, across connections: replays are refused
        self.registered = asyncio.Event()  # set while a connection is registered (tests wait on it)
        self._capacity_changed = asyncio.Event()

    @property
    def counters(self) -> SessionStatus:
        """The status's counters (``connects``, ``registrations``, ``connection_losses``)."""
        return self.status

    def capacity_changed(self) -> None:
        """A model was loaded or unloaded: the next heartbeat goes out now, not at the next tick, so
        the coordinator does not route on a `reloading` slot for up to an interval."""
        self._capacity_changed.set()

    # --- forever -----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, serve, reconnect with backoff; return after a drain once ``stop`` is set."""
        try:
            await self._run(stop)
        finally:
            self.status.stopped()

    async def _run(self, stop: asyncio.Event) -> None:
        delays = self.config.backoff()
        attempt = 0
        while not stop.is_set():
            attempt += 1
            self.status.connecting()
            log.info("coordinator_connecting", url=self.config.url, attempt=attempt)
            try:
                transport = await _until_stopped(self._connect(self.config.url), stop)
            except Exception as exc:
                if not is_retryable(exc):
                    log.error("coordinator_unreachable", error_type=type(exc).__name__)
                    raise
                if isinstance(exc, RedirectRefused):
                    log.warning("coordinator_redirect_refused", status_code=exc.response.status_code)
                else:
                    log.warning("coordinator_connect_failed", error_type=type(exc).__name__)
                self.status.connect_failed(type(exc).__name__)
                transport = None
            if transport is None and stop.is_set():
                return
            if transport is not None:
                registered_for = await self._serve(transport, stop)
                if stop.is_set():
                    return
                if should_reset_backoff(registered_for, stable_after_s=self.config.stable_after_s):
                    delays, attempt = self.config.backoff(), 0
            delay = next(delays)
            self.status.backing_off(delay)
            log.info("coordinator_reconnect_scheduled", delay_s=round(delay, 3))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    # --- one connection ----------------------------------------------------------------------------

    async def _serve(self, transport: Transport, stop: asyncio.Event) -> float | None:
        """Serve one open connection until it is lost or drained; returns how long it stayed registered."""
        conn = _Connection(self, transport)
        registered_at = time.monotonic()
        conn.apply(conn.core.connection_made())
        self.status.registered()
        self.registered.set()
        log.info("coordinator_registered")
        if self.config.dev_posture:
            log.warning("dev_posture_active", reason="reporting dev posture to a loopback coordinator")
        tasks = {
            asyncio.create_task(conn.reader(), name="session-reader"),
            asyncio.create_task(conn.writer(), name="session-writer"),
            asyncio.create_task(conn.heartbeats(since=registered_at), name="session-heartbeat"),
            asyncio.create_task(conn.clock_watchdog(), name="session-clock"),
        }
        stopping = asyncio.create_task(stop.wait(), name="session-stop")
        ended: set[asyncio.Task[None]] = set()
        try:
            done, _ = await asyncio.wait({*tasks, stopping}, return_when=asyncio.FIRST_COMPLETED)
            ended = done & tasks
            if stopping in done and not ended:
                await conn.drain(tasks)
        finally:
            self.registered.clear()
            stopping.cancel()
            code, reason, cause = (1000, DRAIN_CLOSE_REASON, CloseCause.DRAINED) if conn.drained \
                else _how_it_ended(transport, {t.get_name() for t in ended})
            await conn.close(tasks)
            self.status.connection_ended(code=code, reason=reason, cause=cause)
            if cause is CloseCause.STATE_RESTORING:
                log.info("coordinator_state_restoring", code=code)
            elif not conn.drained:
                log.warning("coordinator_connection_lost", in_flight=len(conn.jobs), cause=cause, code=code)
        return time.monotonic() - registered_at


_WAKE = "\x00wake"  # queued after a frame sent ahead: the writer looks at `ahead` first


class _Connection:
    """The live state of one connection: its core, send queue and job tasks."""

    def __init__(self, session: Session, transport: Transport) -> None:
        self.session = session
        self.transport = transport
        register = session._build_register()
        self.core = SessionCore(register=register, answer_challenge=session._answer,
                                recent=session.recent, quote=session._quote)
        self.advertised = tuple(m.id for m in register.models)  # what the coordinator was last told we serve
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.ahead: deque[str] = deque()  # capacity quotes: sent before anything queued (250 ms window)
        self.jobs: dict[str, asyncio.Task[object]] = {}
        self.directives: set[asyncio.Task[object]] = set()  # model handler tasks, cancelled with the connection
        self.drained = False
        self._closed = False
        self.barrier_acked = asyncio.Event()

    # --- actions -----------------------------------------------------------------------------------

    def apply(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Send(frame=frame):
                    try:
                        text = encode(frame)
                    except EncodeError:  # the core's size rules should make this impossible: a bug
                        log.error("frame_not_encodable", kind=frame.type)
                        continue
                    if isinstance(frame, CapacityQuote):
                        self.send_ahead(text)
                    else:
                        self.send(text)
                case StartJob(request=request):
                    self._start_job(request)
                case CancelJob(request_id=request_id):
                    task = self.jobs.get(request_id)
                    if task is not None:
                        task.cancel()
                case Log(level=level, event=event, fields=fields):
                    getattr(log, level.value)(event, **fields)
                case Note(event=event):
                    self.session.status.note(event)
                    if isinstance(event, BarrierAcked):
                        self.barrier_acked.set()
                case ModelDirective(message=message):
                    self._start_directive(message)

    def send(self, text: str) -> None:
        if not self._closed:
            self.queue.put_nowait(text)

    def send_ahead(self, text: str) -> None:
        """Ahead of the queued frames: a quote is worth something only inside the coordinator's probe
        window, and a chunk held back by one small frame loses nothing."""
        if not self._closed:
            self.ahead.append(text)
            self.queue.put_nowait(_WAKE)

    def _start_job(self, request: InferenceRequest) -> None:
        rid = request.request_id
        task = asyncio.create_task(self.session._run_job(request, self.send), name=f"job-{rid}")
        self.jobs[rid] = task
        task.add_done_callback(lambda t, rid=rid: self._job_done(rid, t))

    def _start_directive(self, message: Any) -> None:
        runner = self.session._run_directive
        if runner is None:
            log.debug("frame_ignored", kind=message.type, reason="not_handled")
            return
        task = asyncio.create_task(runner(message, self.send), name=f"directive-{message.type}")
        self.directives.add(task)
        task.add_done_callback(self._directive_done)

    def _directive_done(self, task: asyncio.Task[object]) -> None:
        self.directives.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("directive_task_failed", exc_info=task.exception())

    def _job_done(self, rid: str, task: asyncio.Task[object]) -> None:
        self.jobs.pop(rid, None)
        self.core.job_finished(rid)
        if not task.cancelled() and task.exception() is not None:
            log.error("job_task_failed", request_id=rid, exc_info=task.exception())

    # --- tasks -------------------------------------------------------------------------------------

    async def reader(self) -> None:
        try:
            async for frame in self.transport:
                self.apply(self.core.receive_text(frame))
        except ConnectionClosed:
            pass

    async def writer(self) -> None:
        while True:
            while self.ahead:
                await self.transport.send(self.ahead.popleft())
            text = await self.queue.get()
            if text is None:
                return
            if text is not _WAKE:
                await self.transport.send(text)

    async def heartbeats(self, draining: bool = False, since: float | None = None) -> None:
        """Every interval (or at once on a capacity change) until the gap since the last one shows a stall
        longer than the eviction window: then return, which ends this connection. ``since`` (monotonic) is
        when ``register`` was queued: the coordinator counts from it, so a stall before the first heartbeat
        counts too."""
        interval = self.session.config.heartbeat_interval_s
        window = self.session.config.eviction_window_s
        changed = self.session._capacity_changed
        last = time.monotonic() if since is None else since
        while True:
            now = time.monotonic()
            if now - last > window:
                log.warning("stall_detected", gap_s=round(now - last, 3), window_s=window)
                return
            last = now
            changed.clear()
            self.send_heartbeat(draining)
            with contextlib.suppress(TimeoutError):  # the interval, or sooner when capacity changed
                await asyncio.wait_for(changed.wait(), interval)

    def send_heartbeat(self, draining: bool) -> None:
        if not draining:
            self.send_models_update()
        self.send(encode(self.session._build_heartbeat(draining)))
        self.session.status.heartbeat_sent()

    def send_models_update(self) -> None:
        """Before a heartbeat: when the models we would advertise now differ from what this connection
        last told the coordinator (a model whose failed load is remembered leaves, and comes back once
        it may load again), a ``models_update`` with them, which [N] takes as our whole inventory. Only
        to a coordinator that has shown the newer protocol (``SessionCore.newer_protocol``): [A] drops
        the frame as an unknown type, and learns at the next ``register``."""
        build = self.session._build_models_update
        if build is None or not self.core.newer_protocol:
            return
        update = build()
        ids = tuple(m.id for m in update.models)
        if ids != self.advertised:
            self.advertised = ids
            self.send(encode(update))
            log.info("models_update_sent", models=list(ids))

    async def _later_heartbeats(self) -> None:
        await asyncio.sleep(self.session.config.heartbeat_interval_s)
        await self.heartbeats(draining=True)

    async def clock_watchdog(self) -> None:
        interval = self.session.config.clock_check_interval_s
        wall, mono = time.time(), time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now_wall, now_mono = time.time(), time.monotonic()
            if clock_jumped(now_wall - wall, now_mono - mono, interval):
                log.warning("clock_jump_detected", gap_s=round(now_wall - wall, 3))
                return
            wall, mono = now_wall, now_mono

    # --- ending ------------------------------------------------------------------------------------

    async def drain(self, tasks: set[asyncio.Task[None]]) -> None:
        """Refuse new work, let running jobs finish (bounded), flush, close with 1000."""
        self.apply(self.core.start_draining())
        self.session.status.draining()
        for task in tasks:
            if task.get_name() == "session-heartbeat":
                task.cancel()
        self.send_heartbeat(draining=True)  # at once: [N] stops routing to us on this status
        heartbeat = asyncio.create_task(self._later_heartbeats(), name="session-heartbeat")
        tasks.add(heartbeat)
        link = {t for t in tasks if t.get_name() in ("session-reader", "session-writer")}
        timeout = self.session.config.drain_timeout_s
        if self.jobs:
            log.info("drain_waiting", in_flight=len(self.jobs), timeout_s=timeout)
            waiting = asyncio.create_task(_wait_all(list(self.jobs.values())))
            done, _ = await asyncio.wait({waiting, *link}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if link & done:
                return  # the connection died while draining: close() cancels what is left
        if self.jobs:
            log.warning("drain_timeout", in_flight=len(self.jobs))
            await self._cancel_jobs(DRAIN_EXPIRED)
        if not await self._barrier(link):
            return
        heartbeat.cancel()
        self.queue.put_nowait(None)  # the writer sends everything queued, then stops
        writer = next(t for t in tasks if t.get_name() == "session-writer")
        with contextlib.suppress(TimeoutError, ConnectionClosed):
            await asyncio.wait_for(asyncio.shield(writer), FLUSH_TIMEOUT_S)
        with contextlib.suppress(ConnectionClosed, OSError):
            await self.transport.close(1000, DRAIN_CLOSE_REASON)
        self.drained = True
        log.info("drained")

    async def _barrier(self, link: set[asyncio.Task[None]]) -> bool:
        """Send ``provider_drain`` behind every terminal frame and wait (bounded) for its ack. False when the
        connection died meanwhile. Nothing to wait for when the core sent none (an older coordinator)."""
        self.apply(self.core.drain_barrier("drain-" + secrets.token_hex(8)))
        if not self.core.barrier_pending:
            return True
        timeout = self.session.config.drain_ack_timeout_s
        started = time.monotonic()
        acked = asyncio.create_task(self.barrier_acked.wait())
        done, _ = await asyncio.wait({acked, *link}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        acked.cancel()
        waited = time.monotonic() - started
        self.session.status.drain_barrier_ended(acked=self.barrier_acked.is_set(), waited_s=waited)
        if not self.barrier_acked.is_set():
            log.warning("drain_ack_missing", waited_s=round(waited, 3), timeout_s=timeout)
        return not (link & done) or self.barrier_acked.is_set()

    async def close(self, tasks: set[asyncio.Task[None]]) -> None:
        """Connection over (lost or drained): cancel every job and task, and wait for them."""
        self._closed = True
        self.apply(self.core.connection_lost())
        await self._cancel_jobs()
        for task in list(self.directives):  # a load they started goes on (shielded); only the answer is dropped
            task.cancel()
        await asyncio.gather(*self.directives, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled() and not isinstance(task.exception(), ConnectionClosed | None):
                log.error("session_task_failed", kind=task.get_name(), exc_info=task.exception())
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not self.drained:
            with contextlib.suppress(ConnectionClosed, OSError):
                await self.transport.close(1000, RECONNECT_CLOSE_REASON)

    async def _cancel_jobs(self, message: str | None = None) -> None:
        pending = list(self.jobs.values())
        for task in pending:
            task.cancel(message)
        await asyncio.gather(*pending, return_exceptions=True)


def _how_it_ended(transport: Transport, ended: set[str]) -> tuple[int | None, str, CloseCause]:
    """Close code, reason and cause of a connection that ended without a drain. A task of ours that
    returned (the stall or clock check) ended it; else the socket's closing handshake says who closed
    it (websockets keeps both close frames), and no close frame at all is 1006."""
    if "session-heartbeat" in ended:
        return 1000, RECONNECT_CLOSE_REASON, CloseCause.STALL
    if "session-clock" in ended:
        return 1000, RECONNECT_CLOSE_REASON, CloseCause.CLOCK_JUMP
    protocol = getattr(transport, "protocol", None)
    received = getattr(protocol, "close_rcvd", None)
    sent = getattr(protocol, "close_sent", None)
    if received is not None and (sent is None or getattr(protocol, "close_rcvd_then_sent", True)):
        cause = CloseCause.STATE_RESTORING if received.code == TRY_AGAIN_LATER else CloseCause.CLOSED_BY_COORDINATOR
        return int(received.code), received.reason, cause
    if sent is not None:
        return int(sent.code), sent.reason, CloseCause.CLOSED_BY_PROVIDER
    return ABNORMAL_CLOSURE, "", CloseCause.CONNECTION_LOST


async def _wait_all(tasks: list[asyncio.Task[object]]) -> None:
    await asyncio.gather(*(asyncio.shield(t) for t in tasks), return_exceptions=True)


async def _until_stopped(awaitable: Awaitable[Transport], stop: asyncio.Event) -> Transport | None:
    """``awaitable``'s result, or None when ``stop`` is set first (the attempt is abandoned)."""
    attempt = asyncio.ensure_future(awaitable)
    stopping = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({attempt, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if attempt in done:
        return attempt.result()
    attempt.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        transport = await attempt
        await transport.close(1000, "provider shutting down")
    return None


__all__ = [
    "CLOSE_TIMEOUT_S",
    "COORDINATOR_EVICTION_WINDOW_S",
    "DRAIN_ACK_TIMEOUT_S",
    "DRAIN_EXPIRED",
    "MAX_FRAME_BYTES",
    "PING_INTERVAL_S",
    "PING_TIMEOUT_S",
    "TRY_AGAIN_LATER",
    "ConnectFactory",
    "DirectiveRunner",
    "RedirectRefused",
    "HeartbeatBuilder",
    "JobRunner",
    "NoRedirectConnect",
    "Session",
    "SessionConfig",
    "Transport",
    "websocket_connect",
]
