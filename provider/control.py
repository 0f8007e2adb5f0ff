"""`darkbloom-provider ps` and `unload MODEL`: what the running agent has loaded now, and unloading one.

Both ask the running agent's local server, found as `status` finds it (the lock record of the state
directory names its URL, `provider/state_lock.py`, then the configured one): `ps` reads `GET /status`,
`unload` posts `POST /control/unload` (loopback only; the server refuses a web page's request).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

TIMEOUT_S = 3.0
UNLOAD_TIMEOUT_S = 60.0  # an unload waits for the memory to settle


def fetch_json(url: str, *, body: dict[str, Any] | None = None, timeout_s: float = TIMEOUT_S) -> tuple[int, Any]:
    """GET (or, with `body`, POST as JSON) on the agent's loopback server: status code and JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"} if body is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 4xx: the answer is still JSON
        with err:
            return err.code, json.loads(err.read() or b"null")


def loaded_rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The models /status shows resident or on their way (loading, unloading)."""
    return [m for m in status.get("models", []) if m.get("state") in ("loaded", "loading", "unloading")]


def render_ps(status: dict[str, Any]) -> str:
    """A table like `ollama ps`: model, state, memory, requests running, idle for."""
    from provider.doctor import human_bytes

    rows = loaded_rows(status)
    if not rows:
        return "no model is loaded"
    table = [("MODEL", "STATE", "MEMORY", "REQUESTS", "IDLE")]
    for m in rows:
        memory = human_bytes(m["resident_bytes"]) if m.get("resident_bytes") else "-"
        idle = _duration(m["idle_s"]) if m.get("idle_s") is not None else ("busy" if m.get("state") == "loaded" else "-")
        table.append((str(m["id"]), str(m["state"]), memory, str(m.get("active_requests", 0)), idle))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


UNLOAD_WORDS = {
    "unloaded": "unloaded",
    "not_loaded": "is not loaded",
    "busy": "is serving requests; left loaded (try again when it is idle)",
    "unknown_model": "is not a model of this agent",
}


__all__ = ["TIMEOUT_S", "UNLOAD_TIMEOUT_S", "UNLOAD_WORDS", "fetch_json", "loaded_rows", "render_ps"]
