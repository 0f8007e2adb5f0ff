"""Every error the local server answers, in OpenAI's shape: `{"error": {"message", "type", "param",
"code"}}` (plus our `reason`), never FastAPI's `{"detail": ...}` nor a plain-text body.

* a `protocol.errors.Failure` (admission, the engine): its fixed text, its status, `Retry-After` on a 503;
* a bad body (`InvalidBody`): the parameter and its rule in `message`, the parameter in `param`;
* a refusal explained with this request's numbers and model ids (`backend.Explained`);
* an unknown route (404, naming the routes served), a wrong method (405 with `Allow`), a request that
  does not match a route's declared parameters (400), a CORS preflight this server refuses (400);
* a caller the door refuses (`provider.local.door`): a web page of an origin not listed (403), a
  request naming a host that is not this machine's loopback name (403).

Messages are fixed words, numbers, our own route and parameter names and model ids: never a value
of the request (it may be prompt text) and never an exception's text.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from protocol.errors import Failure
from provider.local.backend import Explained
from provider.request.body import InvalidBody
from provider.telemetry import get_logger

log = get_logger(__name__)


def openai_error_body(status: int, message: str, *, code: str | None, param: str | None = None,
                      reason: str | None = None) -> dict[str, Any]:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code, "reason": reason}}


def openai_error(status: int, message: str, *, code: str | None, param: str | None = None,
                 reason: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(openai_error_body(status, message, code=code, param=param, reason=reason),
                        status_code=status, headers=headers)


def error_body(failure: Failure) -> dict[str, Any]:
    """A failure as OpenAI's error object (also the last event of a stream that fails)."""
    kind = "server_error" if failure.status_code >= 500 else "invalid_request_error"
    return {"error": {"message": failure.message, "type": kind, "param": None, "code": failure.code.value,
                      "reason": failure.reason.value if failure.reason else None}}


def error_response(failure: Failure, retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_body(failure), status_code=failure.status_code, headers=headers)


def invalid_body_response(invalid: InvalidBody) -> JSONResponse:
    """400: the message names the parameter and its rule, `param` names the parameter (null for the
    body as a whole); the value is never echoed."""
    failure = Failure.invalid_request()
    return openai_error(400, invalid.message, code=failure.code.value,
                        param=None if invalid.field == "body" else invalid.field,
                        reason=failure.reason.value if failure.reason else None)


def explained_response(refused: Explained) -> JSONResponse:
    """A refusal whose message gives the numbers (no Retry-After: trying again cannot help)."""
    reason = refused.failure.reason.value if refused.failure.reason else None
    return openai_error(refused.status_code, refused.message, code=refused.code, param=refused.param, reason=reason)


def _routes(app: FastAPI) -> list[str]:
    """`METHOD /path` of every route the app serves, in the order they were added."""
    return [f"{method} {route.path_format}" for route in app.routes if isinstance(route, Route)
            for method in sorted(route.methods or ()) if method != "HEAD"]


_HTTP_CODES = {404: "unknown_route", 405: "method_not_allowed"}


def install_error_handlers(app: FastAPI) -> None:
    """Starlette's 404 and 405 and FastAPI's validation errors, in OpenAI's shape."""

    async def http_error(request: Request, exc: HTTPException) -> Response:
        headers = dict(exc.headers or {})
        # In the request log like every answered request: the status and our code, never the path asked for.
        log.info("request_not_routed", status_code=exc.status_code, code=_HTTP_CODES.get(exc.status_code))
        if exc.status_code == 404:
            return openai_error(404, "Unknown route. This server serves " + ", ".join(_routes(app)) + ".",
                                code=_HTTP_CODES[404], headers=headers)
        if exc.status_code == 405:
            # Starlette joins a route's methods from a set: the order changes from one process to the next.
            allowed = headers["Allow"] = ", ".join(sorted(m.strip() for m in headers.get("Allow", "").split(",") if m.strip()))
            return openai_error(405, f"Method not allowed on this route: use {allowed}.", code=_HTTP_CODES[405],
                                headers=headers)
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else "Error"
        return openai_error(exc.status_code, f"{phrase}.", code=None, headers=headers)

    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        names = [p for p in exc.errors()[0].get("loc", ()) if isinstance(p, str)][1:]  # drop "query", "path"...
        param = ".".join(names) or None  # a parameter this app declares: our name, never the value
        message = f"Invalid parameter '{param}': is not valid." if param else "The request is not valid."
        log.info("request_invalid", status_code=400, reason=param)
        return openai_error(400, message, code="invalid_request", param=param)

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)


ORIGIN_NOT_LISTED = ("This origin may not call this server from a browser: the owner lists the web origins that "
                     "may in the setting local_allowed_origins (by default the pages of http://localhost:* and "
                     "http://127.0.0.1:*).")


class Cors(CORSMiddleware):
    """Starlette's CORS for the owner's `local_allowed_origins` (`scheme://host:*`: the host on any port,
    or none), its refused preflight answered in OpenAI's shape (Starlette's is plain text) with the
    setting that would allow it. Installed with no origin listed too: a browser's preflight then gets
    that answer, not a 405. A listed origin may reach a loopback server from a public page (Chrome's
    Private Network Access asks first)."""

    def __init__(self, app: Any, origins: tuple[str, ...]) -> None:
        exact = tuple(o for o in origins if not o.endswith(":*"))
        any_port = [re.escape(o.removesuffix(":*")) + r"(?::[0-9]{1,5})?" for o in origins if o.endswith(":*")]
        super().__init__(app, allow_origins=exact, allow_origin_regex="|".join(any_port) or None,
                         allow_methods=("GET", "POST"), allow_headers=("*",), allow_private_network=True,
                         expose_headers=("Retry-After",))

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        if not self.is_allowed_origin(origin=request_headers["origin"]):
            code, message = "cors_origin_not_allowed", ORIGIN_NOT_LISTED
        else:
            code, message = "cors_method_not_allowed", "Cross-origin requests to this server may use GET and POST only."
        log.info("request_refused", status_code=400, code=code)  # never the origin: the page chose it
        return openai_error(400, message, code=code)


__all__ = ["ORIGIN_NOT_LISTED", "Cors", "error_body", "error_response", "explained_response", "install_error_handlers",
           "invalid_body_response", "openai_error", "openai_error_body"]
