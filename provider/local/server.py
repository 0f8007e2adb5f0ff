"""The local HTTP server on the loopback address, in its two roles.

* `serve_local(settings)`: `darkbloom-provider serve --local`, no coordinator. An OpenAI-compatible
  server over the shared `provider.runtime.Runtime` (same admission and memory policy as the
  agent), with the idle reaper running. SIGTERM or SIGINT: new requests get 503 `draining`,
  uvicorn stops accepting, in-flight requests get `drain_timeout_s` to finish, then every model is
  unloaded (its prefix cache purged), the engine closes, exit 0.
* `StatusEndpoint`: `/healthz`, `/status`, `/metrics` beside the coordinator session (`serve`), so
  `darkbloom-provider status` can ask a running agent. It leaves signals to the agent.

Binds the loopback address only (`local_host`, validated by the config and checked again here).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn

from provider.config import Settings, _is_loopback
from provider.local.app import create_app
from provider.local.backend import RuntimeBackend
from provider.runtime import Runtime
from provider.telemetry import get_logger

log = get_logger(__name__)


class NotLoopback(ValueError):
    """The local server refuses any address but a loopback one."""


class LocalServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful stop (exit 143). Here a drained stop is a clean
    exit 0, which launchd's `KeepAlive {SuccessfulExit: false}` and systemd's `Restart=on-failure` need.
    `on_exit` runs at the first signal (the drain starts there)."""

    def __init__(self, config: uvicorn.Config, *, on_exit=None) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame) -> None:
        if self._on_exit is not None and not self.should_exit:
            self._on_exit()
        super().handle_exit(sig, frame)

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
    return uvicorn.Config(app, host=settings.local_host, port=settings.local_port, log_config=None,
                          access_log=False, lifespan="off", timeout_graceful_shutdown=int(settings.drain_timeout_s))


async def run_local(settings: Settings) -> None:
    runtime = await Runtime.start(settings)
    app = create_app(RuntimeBackend(runtime), runtime.metrics, chat=True, mode="local")

    def begin_drain() -> None:
        log.info("local_server_draining")
        app.state.local.draining = True
        runtime.manager.start_draining()

    server = LocalServer(uvicorn_config(app, settings), on_exit=begin_drain)
    reaper = asyncio.create_task(runtime.manager.run_idle_reaper(), name="local-idle-reaper")
    log.info("local_server_starting", url=settings.local_base_url, models=list(runtime.servable),
             effective_cap_bytes=runtime.ledger.figures.effective_cap_bytes)
    try:
        await server.serve()
    finally:
        app.state.local.draining = True
        reaper.cancel()
        await asyncio.gather(reaper, return_exceptions=True)
        await runtime.aclose()
        log.info("local_server_stopped")


def serve_local(settings: Settings) -> int:
    asyncio.run(run_local(settings))
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
        app = create_app(RuntimeBackend(runtime), runtime.metrics, chat=False, mode=mode)
        config = uvicorn_config(app, settings)
        family = socket.AF_INET6 if ":" in settings.local_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((settings.local_host, settings.local_port))
            sock.listen(128)  # from now on a client is queued, not refused, while uvicorn starts
        except OSError as exc:  # the agent serves the coordinator without it; say why once
            sock.close()
            log.warning("status_endpoint_unavailable", host=settings.local_host, port=settings.local_port,
                        exc_type=type(exc).__name__)
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
