"""`darkbloom-provider serve --local`: the local OpenAI-compatible server, no coordinator.

Binds the loopback address only (`local_host`, validated by the config and checked again here).
SIGTERM or SIGINT: uvicorn stops accepting, in-flight requests finish, the engine closes, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn

from memory import Probe
from provider.config import Settings, _is_loopback
from provider.doctor import cap_figures, discover_models
from provider.local.app import create_app
from provider.local.backend import EngineBackend
from provider.metrics import Metrics
from provider.telemetry import get_logger

log = get_logger(__name__)


class NotLoopback(ValueError):
    """The local server refuses any address but a loopback one."""


class LocalServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful stop (exit 143). Here a drained stop is a clean
    exit 0, which launchd's `KeepAlive {SuccessfulExit: false}` and systemd's `Restart=on-failure` need."""

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


def uvicorn_config(app: object, settings: Settings) -> uvicorn.Config:
    if not _is_loopback(settings.local_host):
        raise NotLoopback(settings.local_host)
    # log_config=None: uvicorn's records go through our redacting handlers; no access log (paths only
    # anyway, but one line per request is noise in a service log).
    return uvicorn.Config(app, host=settings.local_host, port=settings.local_port, log_config=None,
                          access_log=False, lifespan="off", timeout_graceful_shutdown=int(settings.drain_timeout_s))


async def run_local(settings: Settings) -> None:
    inventory = await asyncio.to_thread(discover_models, settings)
    probe = Probe(settings.memory_limit_gb)
    figures = cap_figures(settings, probe.snapshot())
    metrics = Metrics()
    backend = EngineBackend(settings, inventory, probe=probe, figures=figures, metrics=metrics)
    app = create_app(backend, metrics, chat=True, mode="local")
    server = LocalServer(uvicorn_config(app, settings))
    log.info("local_server_starting", url=settings.local_base_url, models=backend.model_ids(),
             effective_cap_bytes=figures.effective_cap_bytes)
    try:
        await server.serve()
    finally:
        app.state.local.draining = True
        await backend.aclose()
        log.info("local_server_stopped")


def serve_local(settings: Settings) -> int:
    asyncio.run(run_local(settings))
    return 0
