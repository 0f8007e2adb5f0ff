"""``python -m provider.cli`` in a subprocess, for the tests that drive the command line.

``run_cli(*args)`` runs it with no ``DARKBLOOM_*`` variable from this process, ``env`` added, and
(``home``) the user's home and XDG folders in a temporary folder. ``closed_port()`` is a port on
127.0.0.1 that nothing listens on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

LOAD_BUDGET_ENV = "DARKBLOOM_LOAD_MEASURE_BUDGET_S"  # the one setting every process of the suite keeps (conftest)


def clean_env() -> dict[str, str]:
    """This process's environment without its DARKBLOOM_ settings, but for the suite's load budget
    (LOAD_BUDGET_ENV, set by conftest): what a process a test starts begins from."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DARKBLOOM_") or k == LOAD_BUDGET_ENV}


def run_cli(*args: str, env: dict[str, str] | None = None, home: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = clean_env()
    if home is not None:
        base.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"))
    base.update(env or {})
    return subprocess.run([sys.executable, "-m", "provider.cli", *args], env=base, capture_output=True, text=True,
                          timeout=timeout)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
