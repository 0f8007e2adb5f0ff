"""Who may make `serve --local` work: a web page of an origin the owner did not list (a "simple"
cross-origin POST needs no preflight, so CORS alone would let it run), a page that reached the
loopback server through a name of its own (DNS rebinding: a foreign Host header), a body that is
not JSON (what a page can send without a preflight). Each is refused before any work, in OpenAI's
error shape, and is a line of the request log that never holds the Host or Origin asked for.
Against a real server in a subprocess (the default `local_allowed_origins`), and the door alone
in-process for an address that is not loopback."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from local_server import CANARY, MODEL, Server, running_server

EVIL = "http://evil.example"
REBOUND = "evil.example:8485"  # a name of the attacker's that now points at 127.0.0.1
PAGE = "http://localhost:3000"  # a page of this machine: allowed by default


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("origin"), tiny_model_path) as srv:
        yield srv


def chat_body(content: str = "hi") -> str:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2})


def openai_error(response: httpx.Response) -> dict:
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error) and error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    return error


def events(server: Server) -> list[dict]:
    return [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]


def completed(server: Server) -> int:
    return sum(e["event"] == "request_completed" for e in events(server))


def post(server: Server, path: str, content: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=60)


# --- Origin: the pages the owner listed, and requests without one


@pytest.mark.parametrize("kind", ["text/plain", "application/json"])
def test_a_simple_post_from_another_origin_is_refused_before_any_work(server, kind):
    before = completed(server)
    reply = post(server, "/v1/chat/completions", chat_body(CANARY), {"Origin": EVIL, "Content-Type": kind})
    assert reply.status_code == 403 and "access-control-allow-origin" not in reply.headers
    error = openai_error(reply)
    assert error["code"] == "origin_not_allowed" and "local_allowed_origins" in error["message"]
    assert "choices" not in reply.text and CANARY not in reply.text
    assert completed(server) == before  # nothing was generated


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/status"), ("GET", "/metrics"),
    ("GET", "/healthz"), ("POST", "/control/unload"), ("GET", "/v1/nope")])
def test_every_route_refuses_another_origin(server, method, path):
    for origin in (EVIL, "null", "https://localhost:3000", "http://localhost.evil.example"):
        reply = httpx.request(method, server.base_url + path, headers={"Origin": origin}, timeout=10)
        assert reply.status_code == 403, (path, origin)
        assert openai_error(reply)["code"] == "origin_not_allowed"


def test_an_allowed_page_and_a_client_without_origin_are_served(server):
    page = post(server, "/v1/chat/completions", chat_body(), {"Origin": PAGE, "Content-Type": "application/json"})
    assert page.status_code == 200 and page.headers["access-control-allow-origin"] == PAGE
    assert page.json()["choices"]
    sdk = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
    assert sdk.choices
    assert httpx.get(server.base_url + "/status", timeout=10).status_code == 200


def test_a_refused_origins_preflight_is_still_the_400_naming_the_setting(server):
    preflight = httpx.options(server.base_url + "/v1/chat/completions", timeout=10,
                              headers={"Origin": EVIL, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 400
    assert "local_allowed_origins" in openai_error(preflight)["message"]
    allowed = httpx.options(server.base_url + "/v1/chat/completions", timeout=10,
                            headers={"Origin": PAGE, "Access-Control-Request-Method": "POST",
                                     "Access-Control-Request-Headers": "content-type"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == PAGE


# --- the body's type: what a page can send without a preflight is not JSON


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/control/unload"])
@pytest.mark.parametrize("kind", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_declared_json_is_a_415(server, path, kind):
    before = completed(server)
    reply = post(server, path, chat_body(CANARY), {"Content-Type": kind})
    assert reply.status_code == 415
    error = openai_error(reply)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert CANARY not in reply.text and completed(server) == before


@pytest.mark.parametrize("headers", [{"Content-Type": "application/json; charset=utf-8"},
                                     {"Content-Type": "Application/JSON"}, {}])
def test_json_or_no_declared_type_is_read(server, headers):
    reply = post(server, "/v1/chat/completions", chat_body(), headers)
    assert reply.status_code == 200 and reply.json()["choices"]


# --- Host: DNS rebinding


def test_a_rebound_name_reaches_nothing(server):
    server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    rebound = {"Host": REBOUND, "Origin": f"http://{REBOUND}"}
    for method, path, body in [("POST", "/v1/chat/completions", chat_body(CANARY)), ("GET", "/status", None),
                               ("GET", "/healthz", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
                               ("POST", "/control/unload", json.dumps({"model": MODEL}))]:
        for headers in (rebound, {"Host": REBOUND}):  # a same-origin GET carries no Origin
            reply = httpx.request(method, server.base_url + path, content=body, timeout=30,
                                  headers={**headers, "Content-Type": "application/json"})
            assert reply.status_code == 403, (path, headers)
            assert openai_error(reply)["code"] == "host_not_allowed"
            assert CANARY not in reply.text
    models = httpx.get(server.base_url + "/status", timeout=10).json()["models"]
    assert any(m["id"] == MODEL and m["state"] == "loaded" for m in models)  # the unload did not happen


def test_loopback_names_on_any_port_are_this_machine(server):
    port = server.base_url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", "localhost", f"127.0.0.1:{port}", "127.0.0.1", f"[::1]:{port}", "[::1]",
                 f"LOCALHOST:{port}", "127.0.0.2:1"):
        assert httpx.get(server.base_url + "/healthz", headers={"Host": host}, timeout=10).status_code == 200, host
    for host in ("evil.example", "localhost.evil.example", f"127.0.0.1.nip.io:{port}", "localhost:x", "::1",
                 "[::1", "10.0.0.1", "[::1]x", "localhost:123456"):
        reply = httpx.get(server.base_url + "/healthz", headers={"Host": host}, timeout=10)
        assert reply.status_code == 403, host


def test_an_http_1_0_request_without_host_is_served(server):
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") or answer.startswith(b"HTTP/1.0 200"), answer[:100]


# --- /control: the same error shape as the rest


def test_control_errors_are_openai_shaped(server):
    page = post(server, "/control/unload", json.dumps({"model": MODEL}),
                {"Origin": PAGE, "Content-Type": "application/json"})  # an allowed page: still not a program
    assert page.status_code == 403 and openai_error(page)["code"] == "control_not_allowed"
    for body in ('{"nope": 1}', "[1]", "not json", json.dumps({"model": ""}), json.dumps({"model": "x" * 300})):
        bad = post(server, "/control/unload", body, {"Content-Type": "application/json"})
        assert bad.status_code == 400, body
        error = openai_error(bad)
        assert error["param"] == "model" and error["code"] == "invalid_request"
    unknown = post(server, "/control/unload", json.dumps({"model": "org/nothing"}), {"Content-Type": "application/json"})
    assert unknown.status_code == 404
    answer = unknown.json()
    assert answer["outcome"] == "unknown_model"  # what `darkbloom-provider unload` reads
    assert answer["error"]["code"] == "unknown_model" and answer["error"]["type"] == "invalid_request_error"


# --- the request log


def test_every_refusal_is_in_the_request_log_without_the_names_asked_for(server):
    marker = "qzxw-marker"
    post(server, "/v1/chat/completions", chat_body(), {"Origin": f"http://{marker}.example", "Content-Type": "text/plain"})
    httpx.get(server.base_url + "/status", headers={"Host": f"{marker}.example:8485"}, timeout=10)
    httpx.options(server.base_url + "/v1/chat/completions", timeout=10,
                  headers={"Origin": f"http://{marker}.example", "Access-Control-Request-Method": "POST"})
    httpx.options(server.base_url + "/v1/chat/completions", timeout=10,
                  headers={"Origin": PAGE, "Access-Control-Request-Method": "DELETE"})
    post(server, "/v1/chat/completions", chat_body(), {"Content-Type": "text/plain"})
    post(server, "/control/unload", json.dumps({"model": MODEL}), {"Origin": PAGE, "Content-Type": "application/json"})
    post(server, "/control/unload", '{"nope": 1}', {"Content-Type": "application/json"})
    refused = {(e.get("status_code"), e.get("code")) for e in events(server) if e["event"] == "request_refused"}
    assert {(403, "origin_not_allowed"), (403, "host_not_allowed"), (400, "cors_origin_not_allowed"),
            (400, "cors_method_not_allowed"), (415, "unsupported_media_type"),
            (403, "control_not_allowed")} <= refused, refused
    assert any(e["event"] == "request_invalid" and e.get("reason") == "model" for e in events(server))
    log = server.log_path.read_text()
    assert marker not in log and "evil.example" not in log and CANARY not in log


# --- an address that is not loopback: the owner exposed it, the Origin rule stays


def _door(base_url: str) -> TestClient:
    from provider.local.door import Door

    async def ok(request):
        return JSONResponse({"ok": True})

    # The test client's connection arrives at the address of `base_url`, as uvicorn's at the socket's.
    return TestClient(Door(Starlette(routes=[Route("/status", ok)]), origins=("http://localhost:*",)),
                      base_url=base_url)


def test_on_an_address_that_is_not_loopback_any_host_but_still_only_the_listed_origins():
    exposed = _door("http://192.168.1.5:8484")
    assert exposed.get("/status", headers={"Host": "box.lan:8484"}).status_code == 200
    assert exposed.get("/status", headers={"Origin": "http://localhost:5173"}).status_code == 200
    assert exposed.get("/status", headers={"Origin": EVIL}).status_code == 403
    loopback = _door("http://127.0.0.1:8484")
    assert loopback.get("/status", headers={"Host": "box.lan:8484"}).status_code == 403
    assert loopback.get("/status", headers={"Host": "localhost:8484"}).status_code == 200
