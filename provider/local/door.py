"""Who may call the local server, decided before anything else runs (the app's outermost middleware).

* Host. A connection that arrived at a loopback address (the ASGI `server` of the connection, which
  uvicorn reads from the socket) must name a loopback host: `localhost`, `127.0.0.1` (any of
  127.0.0.0/8) or `[::1]`, on any port, or no Host at all (HTTP/1.0). Anything else is a web page
  that reached this machine through a name of its own (DNS rebinding): a browser then treats the
  server as that page's own origin, so no Origin header and no CORS would stop it. A connection at
  an address that is not loopback was exposed on purpose, and its Host names are not restricted.
* Origin. A request whose Origin is not one of `local_allowed_origins` is refused, whatever its
  method and body: a "simple" cross-origin POST (`text/plain`, a form) needs no preflight, so CORS
  only hides the answer from the page, after the work is done. Requests without Origin (curl, the
  SDKs, programs of this machine) are not affected. A refused origin's CORS preflight is still the
  400 that names the setting (`errors.Cors`), which a browser's console shows.

A refusal is OpenAI-shaped and a line of the request log (`request_refused`, status and code),
never with the Host or Origin asked for: the client chose that text.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from provider.local.errors import ORIGIN_NOT_LISTED, Cors, openai_error
from provider.telemetry import get_logger

log = get_logger(__name__)

HOST_NOT_LOOPBACK = ("This server listens on this machine's loopback address and answers requests addressed to it "
                     "by a loopback name only (localhost, 127.0.0.1 or [::1], any port): a request naming another "
                     "host is a web page that reached it through a name of its own.")
_PORT = re.compile(r"(?::[0-9]{0,5})?")


def loopback_address(text: str) -> bool:
    """An IP address of this machine's loopback (an IPv4 one mapped into IPv6 too, as a dual-stack socket
    reports it)."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback


def loopback_name(host: str) -> bool:
    """A Host header naming this machine's loopback: `localhost`, a loopback IPv4 address or a bracketed
    loopback IPv6 address, with or without a port."""
    host = host.lower()
    if host.startswith("["):
        name, bracket, port = host[1:].partition("]")
        return bool(bracket) and _PORT.fullmatch(port) is not None and ":" in name and loopback_address(name)
    name, colon, port = host.partition(":")
    if _PORT.fullmatch(colon + port) is None:
        return False
    return name == "localhost" or loopback_address(name)


def _at_loopback(scope: Scope) -> bool:
    server = scope.get("server")
    return bool(server) and isinstance(server[0], str) and loopback_address(server[0])


def _preflight(scope: Scope, headers: Headers) -> bool:
    return scope["method"] == "OPTIONS" and "access-control-request-method" in headers


class Door:
    """ASGI middleware, outermost: the Host and Origin checks, then CORS (`errors.Cors`) over `app`
    with the same list of origins."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...]) -> None:
        self.cors = Cors(app, origins=origins)

    def refusal(self, scope: Scope) -> tuple[str, str] | None:
        """(code, message) of the refusal, None when the request may go in."""
        headers = Headers(scope=scope)
        if _at_loopback(scope) and not all(loopback_name(h) for h in headers.getlist("host")):
            return "host_not_allowed", HOST_NOT_LOOPBACK
        origins = headers.getlist("origin")
        if origins and not _preflight(scope, headers) and not all(self.cors.is_allowed_origin(o) for o in origins):
            return "origin_not_allowed", ORIGIN_NOT_LISTED
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> Any:
        refused = self.refusal(scope) if scope["type"] == "http" else None
        if refused is None:
            await self.cors(scope, receive, send)
            return
        code, message = refused
        # 403 rather than 421 (misdirected): 421 invites a client to try again on another connection,
        # and any connection to this server would get the same answer.
        log.info("request_refused", status_code=403, code=code)
        await openai_error(403, message, code=code)(scope, receive, send)


__all__ = ["HOST_NOT_LOOPBACK", "Door", "loopback_address", "loopback_name"]
