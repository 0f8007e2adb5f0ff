"""The local HTTP server on the loopback address, in its two roles.

* `serve_local(settings)`: `darkbloom-provider serve --local`, no coordinator. An OpenAI-compatible
  server over the shared `provider.runtime.Runtime` (same admission and memory policy as the
  agent), with the idle reaper running. SIGTERM or SIGINT: the listener stays open and new requests
  and `/healthz` get 503 `draining`; in-flight requests get `drain_timeout_s` to finish, and any
  still running then ends with an error event (`draining`) and `[DONE]`; then uvicorn closes, every
  model is unloaded (its prefix cache purged), the engine closes, exit 0. A second signal stops now.
* `StatusEndpoint`: `/healthz`, `/status`, `/metrics` beside the coordinator session (`serve`), so
  `darkbloom-provider status` can ask a running agent. It leaves signals to the agent.

Binds the loopback address only (`local_host`, validated by the config and checked again here).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from provider.config import Settings, _is_loopback, env_name, flag_name
from provider.local.app import LocalState, create_app
from provider.local.backend import RuntimeBackend
from provider.models.searched import say_if_no_models
from provider.runtime import Runtime
from provider.telemetry import get_logger

log = get_logger(__name__)
EXPIRED_GRACE_S = 5.0  # after the drain: time for the ended responses to reach their clients


class NotLoopback(ValueError):
    """The local server refuses any address but a loopback one."""


class CannotListen(Exception):
    """The local address cannot be listened on; the message says why and which setting to change."""


_WHY = {
    errno.EADDRINUSE: ("the port is in use (another agent, or another program, listens there)", "local_port"),
    errno.EACCES: ("this user may not listen on that port (ports below 1024 need privileges)", "local_port"),
    errno.EADDRNOTAVAIL: ("that address is not one of this machine's", "local_host"),
}


def listening_socket(settings: Settings) -> socket.socket:
    """A socket bound to `local_host:local_port` and listening (a client is queued from here on, not
    refused, while the server starts); `CannotListen` in words naming the setting otherwise."""
    if not _is_loopback(settings.local_host):
        raise NotLoopback(settings.local_host)
    family = socket.AF_INET6 if ":" in settings.local_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.local_host, settings.local_port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        why, field = _WHY.get(exc.errno or 0, (os.strerror(exc.errno) if exc.errno else type(exc).__name__, "local_port"))
        raise CannotListen(f"the local server cannot listen on {settings.local_host}:{settings.local_port}: {why}; "
                           f"choose another with the setting {field} ({flag_name(field)}, {env_name(field)}, "
                           "or the configuration file)") from exc
    return sock


class LocalServer(uvicorn.Server):
    """uvicorn, with the agent's drain in place of uvicorn's graceful stop.

    At the first SIGTERM or SIGINT uvicorn is *not* told to exit: `on_signal` starts the drain on the
    loop while the listener stays open (new requests and `/healthz` get 503 `draining`); the drain
    sets `should_exit` when it is over. A second SIGINT or SIGTERM stops now (`force_exit`).
    uvicorn re-raises the signal after its own stop (exit 143); here a stop is a clean exit 0, which
    launchd's `KeepAlive {SuccessfulExit: false}` and systemd's `Restart=on-failure` need."""

    def __init__(self, config: uvicorn.Config, *, on_signal: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self.signalled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signalled or self._on_signal is None or self._loop is None:
            if self.signalled:
                log.warning("local_server_stopping_now", signal=signal.Signals(sig).name)
            self.force_exit = True
            self.should_exit = True
            return
        self.signalled = True
        self._loop.call_soon_threadsafe(self._on_signal)  # a signal handler runs between bytecodes

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its host (the agent)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def uvicorn_config(app: object, settings: Settings) -> uvicorn.Config:
    if not _is_loopback(settings.local_host):
        raise NotLoopback(settings.local_host)
    # log_config=None: uvicorn's records go through our redacting handlers; no access log (paths only
    # anyway, but one line per request is noise in a service log).
    # The drain happens before uvicorn is told to stop (LocalServer); what is left for uvicorn's
    # graceful stop is closing idle connections and writing responses that already ended.
    return uvicorn.Config(app, host=settings.local_host, port=settings.local_port, log_config=None,
                          access_log=False, lifespan="off", timeout_graceful_shutdown=int(EXPIRED_GRACE_S))


async def run_local(settings: Settings, sock: socket.socket | None = None) -> None:
    """Serve until stopped; `sock`: the listening socket (`listening_socket`), else bound here."""
    sock = sock if sock is not None else listening_socket(settings)
    runtime = await Runtime.start(settings, hash_weights=False)  # nothing advertised: listen without hashing
    say_if_no_models(runtime.inventory)  # every request would be a 404: the owner reads why on stderr
    app = create_app(RuntimeBackend(runtime), runtime.metrics, chat=True, mode="local",
                     allowed_origins=settings.local_allowed_origins)
    state = app.state.local
    drain: asyncio.Task[None] | None = None

    def begin_drain() -> None:
        nonlocal drain
        state.draining = True
        runtime.manager.start_draining()
        drain = asyncio.create_task(_drain(server, state, settings.drain_timeout_s), name="local-drain")

    server = LocalServer(uvicorn_config(app, settings), on_signal=begin_drain)
    reaper = asyncio.create_task(runtime.manager.run_idle_reaper(), name="local-idle-reaper")
    log.info("local_server_starting", url=settings.local_base_url, models=list(runtime.servable),
             effective_cap_bytes=runtime.ledger.figures.effective_cap_bytes)
    try:
        await server.serve(sockets=[sock])
    finally:
        state.draining = True
        state.requests.expire()  # a forced stop: whatever still runs ends with its error event
        for task in (reaper, drain):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (reaper, drain) if t is not None), return_exceptions=True)
        await runtime.aclose()
        log.info("local_server_stopped")


async def _drain(server: LocalServer, state: LocalState, timeout_s: float) -> None:
    """Let the requests in flight finish for `timeout_s`, end the rest with an error event, then let
    uvicorn close (it waits for those responses to be written, `EXPIRED_GRACE_S` at most)."""
    in_flight = len(state.requests)
    log.info("local_server_draining", in_flight=in_flight, timeout_s=timeout_s,
             hint="press Ctrl-C again to stop now")
    if in_flight and not await state.requests.wait_idle(timeout_s):
        log.warning("local_drain_expired", in_flight=state.requests.expire(), timeout_s=timeout_s)
        await state.requests.wait_idle(EXPIRED_GRACE_S)
    server.should_exit = True


def serve_local(settings: Settings) -> int:
    """`serve --local`: 0 after a stop; `os.EX_CONFIG` (78), in one sentence on stderr, when the address
    cannot be listened on, found before anything is loaded."""
    try:
        sock = listening_socket(settings)
    except CannotListen as exc:
        print(f"darkbloom-provider: {exc}", file=sys.stderr)
        return os.EX_CONFIG
    try:
        asyncio.run(run_local(settings, sock))
    finally:
        sock.close()
    return 0


class StatusEndpoint:
    """`/healthz`, `/status`, `/metrics` for a running agent (chat off), on `local_host:local_port`.

        endpoint = StatusEndpoint.start(runtime, settings)   # None-safe: a busy port only logs
        endpoint.draining()                                  # /healthz answers 503 from here on
        await endpoint.aclose()
    """

    def __init__(self, server: _QuietServer | None, task: asyncio.Task | None, app) -> None:
        self._server = server
        self._task = task
        self._app = app

    @classmethod
    def start(cls, runtime: Runtime, settings: Settings, *, mode: str = "coordinator") -> StatusEndpoint:
        app = create_app(RuntimeBackend(runtime), runtime.metrics, chat=False, mode=mode,
                         allowed_origins=settings.local_allowed_origins)
        config = uvicorn_config(app, settings)
        try:
            sock = listening_socket(settings)
        except CannotListen as exc:  # the agent serves the coordinator without it; say why once
            log.warning("status_endpoint_unavailable", host=settings.local_host, port=settings.local_port,
                        exc_type=type(exc.__cause__).__name__)
            return cls(None, None, app)
        server = _QuietServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name="status-endpoint")
        log.info("status_endpoint_started", url=settings.local_base_url)
        return cls(server, task, app)

    @property
    def serving(self) -> bool:
        return self._task is not None

    def draining(self) -> None:
        self._app.state.local.draining = True

    async def aclose(self) -> None:
        self.draining()
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
