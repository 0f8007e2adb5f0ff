"""Short host commands (``sysctl``, ``csrutil``, ``system_profiler``, ``notifyutil`` ...): one runner.

The readers of the host (``session/posture``, ``hardware``, ``session/thermal``) take a ``Runner`` so
tests feed them recorded output; this module is the real one. A command gets a minimal environment
(``PATH`` of the system directories, ``LANG=C`` so tools that honour it print English) and a short
timeout; anything that goes wrong is ``None`` ("could not read"), never an exception, so a reader
can say "unknown" instead of guessing.

``sysctl_values`` parses the ``name: value`` lines ``sysctl NAME ...`` prints (the form every public
sample shows); a name the kernel does not know is simply absent from the result.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence

COMMAND_TIMEOUT_S = 5.0
_ENV = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C"}

Runner = Callable[[Sequence[str]], str | None]  # argv -> stdout, None when it cannot run


def run_command(argv: Sequence[str]) -> str | None:
    """stdout of a short system command, or None if it is missing, fails or hangs."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                              check=False, env=dict(_ENV))
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def sysctl_values(output: str | None) -> dict[str, str]:
    """``{name: value}`` from ``sysctl NAME ...`` output (``hw.perflevel0.name: Super``)."""
    values: dict[str, str] = {}
    for line in (output or "").splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() and " " not in name.strip():
            values[name.strip()] = value.strip()
    return values


def read_sysctl(run: Runner, *names: str) -> dict[str, str]:
    """The named sysctl values, one ``sysctl`` per name: an unknown name fails its own command only
    (``sysctl a b`` exits non-zero when either is unknown, and the other would be lost with it)."""
    values: dict[str, str] = {}
    for name in names:
        values.update(sysctl_values(run(["sysctl", name])))
    return values


__all__ = ["COMMAND_TIMEOUT_S", "Runner", "read_sysctl", "run_command", "sysctl_values"]
