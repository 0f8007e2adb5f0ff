"""A client that hangs up on a request that is not streamed stops its generation: the engine stops, the
request's KV is released, and the request log says `request_cancelled` (the tokens would go nowhere)."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from local_server import MODEL, running_server

MAX_TOKENS = 100_000  # clamped to the context window: far more than the test waits for


@pytest.fixture
def server(tmp_path, tiny_noeos_model_path):
    with running_server(tmp_path, tiny_noeos_model_path) as server:
        yield server


def in_flight(server) -> int:
    return httpx.get(server.base_url + "/status", timeout=10).json()["in_flight"]


def ended(server) -> list[dict]:
    events = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
    return [e for e in events if e["event"] in ("request_cancelled", "request_completed", "request_failed")]


def test_a_client_that_leaves_a_request_that_is_not_streamed_stops_its_generation(server):
    body = json.dumps({"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "messages": [{"role": "user", "content": "tell me a long story"}]}).encode()
    address = urlsplit(server.base_url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while in_flight(server) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)  # across processes there is no event: poll /status with a deadline
        assert in_flight(server) == 1
    deadline = time.monotonic() + 30  # the socket is closed: the server sees the client leave
    while not ended(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    (line,) = ended(server)
    assert line["event"] == "request_cancelled", line
    assert in_flight(server) == 0
    ledger = httpx.get(server.base_url + "/status", timeout=10).json()["ledger"]["count_by_kind"]
    assert ledger.get("request_kv", 0) == 0
