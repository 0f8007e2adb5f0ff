"""The one client of the running agent: its loopback server, found the same way by every command.

Where it answers (`agent_urls`): the local server the lock record of the state directory names
(`provider/state_lock.py`: whatever port that agent was started with), then the configured one.
`fetch_status` reads `GET /status`, `find_status` the first of those that answers (`status`, `ps`,
and `doctor`'s view of the running agent), `fetch_json` any other call (`unload` posts
`POST /control/unload`: loopback only; the server refuses a web page's request). Plain urllib is
enough: it is loopback.

Also the words of `darkbloom-provider ps` (`render_ps`, a table like `ollama ps`) and of `unload MODEL`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from provider.config import Settings
from provider.state_lock import AgentRecord, running_agent
from provider.units import human_bytes, table

TIMEOUT_S = 3.0
UNLOAD_TIMEOUT_S = 60.0  # an unload waits for the memory to settle


def agent_urls(settings: Settings) -> tuple[AgentRecord | None, list[str]]:
    """Where to ask: the local server of the agent running on this state directory (whatever port it
    was started with), then the configured one; with that agent's record (None when none runs)."""
    agent = running_agent(settings.state_dir)
    urls = [agent.local_url] if agent is not None and agent.local_url else []
    return agent, urls + [u for u in (settings.local_base_url,) if u not in urls]


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


def fetch_status(base_url: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The agent's `GET /status`. Raises `OSError` (nothing answers, a refusal) or `ValueError` (an
    answer that is not a status)."""
    code, status = fetch_json(base_url + "/status", timeout_s=timeout_s)
    if code != 200 or not isinstance(status, dict):
        raise ValueError(f"/status answered {code}")
    return status


def find_status(settings: Settings, timeout_s: float = TIMEOUT_S) -> tuple[str, dict[str, Any]] | None:
    """The first of `agent_urls` whose /status answers, and its answer; None when none does."""
    for url in agent_urls(settings)[1]:
        try:
            return url, fetch_status(url, timeout_s)
        except (OSError, ValueError):
            continue
    return None


def loaded_rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The models /status shows resident or on their way (loading, unloading)."""
    return [m for m in status.get("models", []) if m.get("state") in ("loaded", "loading", "unloading")]


def render_ps(status: dict[str, Any]) -> str:
    """A table like `ollama ps`: model, state, memory, requests running, idle for."""
    models = loaded_rows(status)
    if not models:
        return "no model is loaded"
    rows = [("MODEL", "STATE", "MEMORY", "REQUESTS", "IDLE")]
    for m in models:
        memory = human_bytes(m["resident_bytes"]) if m.get("resident_bytes") else "-"
        idle = _duration(m["idle_s"]) if m.get("idle_s") is not None else ("busy" if m.get("state") == "loaded" else "-")
        rows.append((str(m["id"]), str(m["state"]), memory, str(m.get("active_requests", 0)), idle))
    return "\n".join(table(rows))


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


__all__ = ["TIMEOUT_S", "UNLOAD_TIMEOUT_S", "UNLOAD_WORDS", "agent_urls", "fetch_json", "fetch_status", "find_status",
           "loaded_rows", "render_ps"]
