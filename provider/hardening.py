"""Process hardening: what the agent makes of its own process at start (stdlib only, so that
``doctor`` can run the very same steps in a throwaway child process, ``probe_hardening``).

``harden_process``: core dumps off (``RLIMIT_CORE`` 0/0), not dumpable on Linux
(``prctl(PR_SET_DUMPABLE, 0)``, which also blocks ptrace attach by other users' and non-root
processes) or ``ptrace(PT_DENY_ATTACH)`` on macOS, and the environment scrubbed of injection hooks
and secrets (``LD_PRELOAD``, ``DYLD_*``, ``PYTHONSTARTUP``, anything named like a token/secret/key).
Each flag of the returned ``Hardening`` is true only when its step was carried out and verified.

``probe_hardening()`` runs ``python -m provider.hardening`` — the same function in a child, which
prints its result as JSON — so a report can say what the agent will report without hardening the
reporting process itself (and scrubbing its environment).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import resource
import subprocess
import sys
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass

_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3
_PT_DENY_ATTACH = 31
_PROBE_TIMEOUT_S = 20.0

# Removed from os.environ by harden_process: injection hooks, then anything that looks like a secret.
SCRUBBED_NAMES = frozenset({
    "LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "DYLD_INSERT_LIBRARIES", "DYLD_LIBRARY_PATH",
    "DYLD_FRAMEWORK_PATH", "DYLD_FALLBACK_LIBRARY_PATH", "PYTHONSTARTUP", "PYTHONINSPECT",
    "PYTHONBREAKPOINT", "SSH_AUTH_SOCK",
})
_SECRET_WORDS = frozenset({"TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "CREDENTIAL",
                           "CREDENTIALS", "APIKEY"})
_SECRET_PAIRS = ("API_KEY", "PRIVATE_KEY", "ACCESS_KEY", "SECRET_KEY")
_SECRET_PREFIXES = ("AWS_", "DYLD_")


@dataclass(frozen=True, slots=True)
class Hardening:
    core_dumps_disabled: bool
    anti_debug_enabled: bool
    env_scrubbed: bool
    scrubbed_count: int = 0


NO_HARDENING = Hardening(core_dumps_disabled=False, anti_debug_enabled=False, env_scrubbed=False)


def harden_process(*, platform: str = sys.platform, environ: MutableMapping[str, str] | None = None) -> Hardening:
    """Apply every hardening step we can and report each one that verifiably took effect."""
    environ = os.environ if environ is None else environ
    scrubbed = scrub_environment(environ)
    return Hardening(
        core_dumps_disabled=_disable_core_dumps(),
        anti_debug_enabled=_deny_debuggers(platform),
        env_scrubbed=not any(_is_sensitive(name) for name in environ),
        scrubbed_count=scrubbed,
    )


def scrub_environment(environ: MutableMapping[str, str]) -> int:
    """Remove injection hooks and secret-looking variables; returns how many were removed."""
    names = [name for name in environ if _is_sensitive(name)]
    for name in names:
        del environ[name]
    return len(names)


def _is_sensitive(name: str) -> bool:
    """Whole words only: HF_TOKEN and DARKBLOOM_AUTH_TOKEN go, TOKENIZERS_PARALLELISM stays."""
    upper = name.upper()
    return (name in SCRUBBED_NAMES or upper.startswith(_SECRET_PREFIXES)
            or any(pair in upper for pair in _SECRET_PAIRS)
            or not _SECRET_WORDS.isdisjoint(upper.split("_")))


def _disable_core_dumps() -> bool:
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        return resource.getrlimit(resource.RLIMIT_CORE) == (0, 0)
    except (ValueError, OSError):
        return False


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


def _deny_debuggers(platform: str) -> bool:
    libc = _libc()
    if libc is None:
        return False
    if platform.startswith("linux"):
        prctl = libc.prctl
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        prctl.restype = ctypes.c_int
        return prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0 and prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 0
    if platform == "darwin":
        ptrace = libc.ptrace
        ptrace.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        ptrace.restype = ctypes.c_int
        return ptrace(_PT_DENY_ATTACH, 0, None, 0) == 0
    return False


def probe_hardening(timeout_s: float = _PROBE_TIMEOUT_S) -> Hardening | None:
    """What ``harden_process`` achieves on this machine, measured in a child process; None if the
    child could not run or said nothing usable."""
    try:
        done = subprocess.run([sys.executable, "-m", "provider.hardening"], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        fields = json.loads(done.stdout)
        return Hardening(**{k: fields[k] for k in ("core_dumps_disabled", "anti_debug_enabled", "env_scrubbed",
                                                    "scrubbed_count")})
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return None


__all__ = ["NO_HARDENING", "SCRUBBED_NAMES", "Hardening", "harden_process", "probe_hardening", "scrub_environment"]


if __name__ == "__main__":  # the probe's child: harden this process, say what took effect
    print(json.dumps(asdict(harden_process())))
