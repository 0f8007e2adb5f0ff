"""`serve --local` in a subprocess, for the tests that drive the local server over HTTP.

``start_server(tmp, model, *flags)`` runs ``python -m provider.cli serve --local`` on a free port with
``MODEL`` aliased to ``model``, a clean ``DARKBLOOM_*`` environment, JSON logs in ``tmp``, and returns once
the server answers. ``CANARY`` is a prompt fragment the log must never hold.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai

from cli_runner import clean_env
from provider.demo import free_port, wait_ready

CANARY = "CANARY-7f3a9c-do-not-log"
MODEL = "demo/tiny"


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="local", max_retries=0, timeout=60)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        return code, self.log_path.read_text()


def start_server(tmp: Path, model: Path, *flags: str, env_extra: dict[str, str] | None = None) -> Server:
    port = free_port()
    (tmp / "hub").mkdir(exist_ok=True)
    env = clean_env()
    env.update(env_extra or {})
    env.update(HOME=str(tmp), DARKBLOOM_LOG_FORMAT="json", DARKBLOOM_HF_CACHE_DIR=str(tmp / "hub"))
    log_path = tmp / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "provider.cli", "serve", "--local", "--local-port", str(port),
             "--model-aliases", f"{MODEL}={model}", *flags],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    wait_ready(server.base_url, proc, timeout_s=60)
    return server


@contextlib.contextmanager
def running_server(tmp: Path, model: Path, *flags: str, env_extra: dict[str, str] | None = None) -> Iterator[Server]:
    """`start_server`, stopped at the end unless a test stopped it already."""
    server = start_server(tmp, model, *flags, env_extra=env_extra)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()
