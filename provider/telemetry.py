"""Logging: structlog with an allow-list redaction step. This module is global state; keep it here.

The pipeline is one list (:func:`pre_render_processors`), then a renderer:

    merge_contextvars -> logger name -> level -> ISO timestamp -> Redact -> JSON lines | console

``Redact`` is an allow-list: a key survives only if it is known to carry no user text (ids,
reasons, codes, states, counts, sizes, durations). Anything else -- ``prompt``, ``messages``,
``content``, ``body``, a stray ``error=str(exc)`` -- is removed and counted in ``redacted``.
Exceptions keep their type name and ``file:line`` frames, never their message (it may quote the
prompt). Allowed string values are length-capped.

Convention for callers: the event is a fixed string literal (``log.info("model_loaded", model=...)``),
never an f-string with data in it; bind ``request_id`` and ``model`` once per job with
``structlog.contextvars.bound_contextvars``.

Records from other libraries (websockets, uvicorn, mlx-lm) go through the same steps; their event is
the format string *before* ``%`` arguments are applied, so their arguments never reach a log line.
The exception is a short list of (logger, format) pairs whose arguments are known to be harmless
(uvicorn's "Started server process [%d]"...): :class:`FormatKnownForeign` applies those, so the log
does not show raw placeholders.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path, PurePath
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import urlsplit

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from provider.config import LogFormat, LogLevel

if TYPE_CHECKING:
    from provider.engine.types import EngineTimes

# Keys whose values are safe to log: identifiers, closed vocabularies, numbers, states.
SAFE_KEYS: frozenset[str] = frozenset(
    {
        # structlog's own
        "event", "level", "timestamp", "logger",
        # identities (never user text)
        "request_id", "job_id", "provider_id", "model", "model_id", "models", "backend", "version",
        "key_fingerprint",
        # outcomes and closed vocabularies
        "status", "status_code", "code", "reason", "failure_code", "error_reason", "rejection_reason",
        "outcome", "result", "cause", "kind", "figure", "verdict", "pressure", "signal",
        "error_type", "exc_type", "exc_frames", "exc_chain",
        # state machines and retries
        "state", "from_state", "to_state", "phase", "attempt", "attempts",
        # plain numbers
        "tokens", "prompt_tokens", "completion_tokens", "cached_tokens", "max_tokens", "count",
        "slots", "in_flight", "queued", "pid", "port",
        # where (no user content): hosts, file paths of models/state, URL reduced to its origin
        "host", "url", "path", "platform",
        # operator settings: the variable's name (the values go under SHORT_KEYS)
        "variable",
        # advice for the operator: always a literal written in our code
        "hint",
        # how a model was loaded (model_loaded): closed vocabularies and flags
        "solo_from", "rates_from", "transposed_weights", "cpu_attention", "activation_from",
    }
)
# Keys whose value is a number, or a string shown at most this long: what an operator set
# (`given`) and what was used instead (`used`). Setting values are not private, but a value that is
# not a number is shown truncated, in case someone pasted something long into a variable.
SHORT_KEYS: dict[str, int] = {"given": 16, "used": 16}
# Any key with one of these suffixes is allowed when its value is a number: a number cannot
# carry prompt text, and sizes/durations/rates are most of what we log.
NUMERIC_SUFFIXES: tuple[str, ...] = (
    "_bytes", "_gb", "_gib", "_mb", "_s", "_ms", "_seconds", "_count", "_tokens", "_total", "_tps",
    "_ratio", "_fraction", "_pct", "_gbs",
)
MAX_STRING = 200  # characters kept of an allowed string value
MAX_ITEMS = 32  # items kept of an allowed list value
MAX_FRAMES = 12  # innermost traceback frames kept
_FIRST_KEYS = ("timestamp", "level", "logger", "event")  # reading order of a JSON line
_META_KEYS = frozenset({"_record", "_from_structlog"})  # ProcessorFormatter plumbing, removed before render


class Redact:
    """Allow-list processor: drop every key not known to be safe; exceptions become type + frames."""

    __slots__ = ("_safe", "_suffixes", "_max_string", "_short")

    def __init__(
        self,
        safe_keys: frozenset[str] = SAFE_KEYS,
        numeric_suffixes: tuple[str, ...] = NUMERIC_SUFFIXES,
        max_string: int = MAX_STRING,
        short_keys: dict[str, int] = SHORT_KEYS,
    ) -> None:
        self._safe = safe_keys
        self._suffixes = numeric_suffixes
        self._max_string = max_string
        self._short = short_keys

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        exc_info = event_dict.pop("exc_info", None)
        out: EventDict = {}
        dropped = 0
        ordered = [k for k in _FIRST_KEYS if k in event_dict] + [k for k in event_dict if k not in _FIRST_KEYS]
        for key in ordered:
            value = event_dict[key]
            if key in _META_KEYS and isinstance(value, (logging.LogRecord, bool)):
                out[key] = value  # ProcessorFormatter's own plumbing, removed before rendering
            elif key in self._safe:
                out[key] = self._clean(key, value)
            elif key.endswith(self._suffixes) and _is_number(value):
                out[key] = value
            elif key in self._short and (_is_number(value) or isinstance(value, str)):
                limit = self._short[key]
                out[key] = value if not isinstance(value, str) or len(value) <= limit else value[:limit] + "…"
            else:
                dropped += 1
        if exc_info:
            out.update(_describe_exception(exc_info))
        if dropped:
            out["redacted"] = dropped
        return out

    def _clean(self, key: str, value: Any) -> Any:
        if isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)[:MAX_ITEMS]
            return [self._scalar(key, v) for v in items]
        return self._scalar(key, value)

    def _scalar(self, key: str, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, BaseException):
            return type(value).__name__
        if isinstance(value, Enum):
            value = value.value
            if isinstance(value, (bool, int, float)):
                return value
        if isinstance(value, PurePath):
            value = str(value)
        if not isinstance(value, str):
            return f"<{type(value).__name__}>"  # str() of an arbitrary object may hold anything
        if key == "url":
            value = _url_origin(value)
        return value if len(value) <= self._max_string else value[: self._max_string] + "…"


# Foreign records whose arguments carry no user data: (logger, format) -> the type of each argument.
# uvicorn's lifecycle lines: a pid, the listening scheme/host/port from our own config, a task count.
SAFE_FOREIGN_FORMATS: dict[tuple[str, str], tuple[type, ...]] = {
    ("uvicorn.error", "Started server process [%d]"): (int,),
    ("uvicorn.error", "Finished server process [%d]"): (int,),
    ("uvicorn.error", "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)"): (str, str, int),
    ("uvicorn.error", "Uvicorn running on %s://[%s]:%d (Press CTRL+C to quit)"): (str, str, int),
    ("uvicorn.error", "Uvicorn running on socket %s (Press CTRL+C to quit)"): (tuple,),
    ("uvicorn.error", "Cancel %s running task(s), timeout graceful shutdown exceeded"): (int,),
    ("uvicorn.error", "Maximum request limit of %d exceeded. Terminating process."): (int,),
}

# Libraries whose info lines are noise in the agent's log: the HTTP clients' one line per request (a
# download's every file), a raw format with nothing in it. Their warnings and errors still come through.
QUIET_FOREIGN_LOGGERS = ("httpx", "httpx2")


class FormatKnownForeign:
    """Foreign-record step: apply the ``%`` arguments of the formats in ``SAFE_FOREIGN_FORMATS``
    (checked by type, so an unexpected argument never reaches the line); drop them otherwise."""

    __slots__ = ("_formats",)

    def __init__(self, formats: dict[tuple[str, str], tuple[type, ...]] = SAFE_FOREIGN_FORMATS) -> None:
        self._formats = formats

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        args = event_dict.pop("positional_args", ())
        record = event_dict.get("_record")
        if not args or not isinstance(record, logging.LogRecord) or not isinstance(record.msg, str):
            return event_dict
        types = self._formats.get((record.name, record.msg))
        if types is not None and isinstance(args, tuple) and len(args) == len(types) and all(
                type(a) is t for a, t in zip(args, types, strict=True)):
            event_dict["event"] = record.msg % args
        return event_dict


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _url_origin(url: str) -> str:
    """scheme://host:port only: paths and queries can carry data, userinfo can carry secrets."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<url>"
    return f"{parts.scheme}://{host}{port}" if parts.scheme else "<url>"


ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]


def _as_exc_info(exc_info: Any) -> ExcInfo | None:
    if isinstance(exc_info, BaseException):
        return type(exc_info), exc_info, exc_info.__traceback__
    if isinstance(exc_info, tuple) and len(exc_info) == 3 and exc_info[0] is not None:
        return exc_info  # type: ignore[return-value]
    if exc_info is True:
        current = sys.exc_info()
        return current if current[0] is not None else None  # type: ignore[return-value]
    return None


def _type_name(tp: type[BaseException]) -> str:
    return tp.__qualname__ if tp.__module__ == "builtins" else f"{tp.__module__}.{tp.__qualname__}"


def _describe_exception(exc_info: Any) -> dict[str, Any]:
    info = _as_exc_info(exc_info)
    if info is None:
        return {}
    tp, exc, tb = info
    frames = [
        f"{'/'.join(PurePath(f.filename).parts[-2:])}:{f.lineno} in {f.name}"
        for f in traceback.extract_tb(tb)[-MAX_FRAMES:]
    ]
    chain: list[str] = []
    seen = exc.__cause__ or exc.__context__
    while seen is not None and len(chain) < 5:
        chain.append(_type_name(type(seen)))
        seen = seen.__cause__ or seen.__context__
    described: dict[str, Any] = {"exc_type": _type_name(tp), "exc_frames": frames}
    if chain:
        described["exc_chain"] = chain
    return described


def pre_render_processors() -> list[Processor]:
    """Every step before rendering; what a captured (test) event has been through."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        Redact(),
    ]


def _renderer(fmt: LogFormat, stream: TextIO) -> Processor:
    if fmt is LogFormat.AUTO:
        fmt = LogFormat.CONSOLE if _isatty(stream) else LogFormat.JSON
    if fmt is LogFormat.JSON:
        return structlog.processors.JSONRenderer()
    # Redact has already turned exc_info into plain fields; plain_traceback is a second belt.
    return structlog.dev.ConsoleRenderer(colors=_isatty(stream), exception_formatter=structlog.dev.plain_traceback)


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


_HANDLER_NAME = "darkbloom"
# A log file (the `log_file` setting; what the launchd agent writes) rotates at this size, keeping
# this many older files: provider.log, provider.log.1 ... provider.log.3, at most ~40 MiB in all.
LOG_FILE_MAX_BYTES = 10 * 2**20
LOG_FILE_BACKUPS = 3


def configure_logging(
    level: LogLevel | str = LogLevel.INFO,
    fmt: LogFormat | str = LogFormat.AUTO,
    *,
    stream: TextIO | None = None,
    log_file: Path | None = None,
    max_bytes: int = LOG_FILE_MAX_BYTES,
    backups: int = LOG_FILE_BACKUPS,
) -> None:
    """Route structlog and stdlib logging through the redacting pipeline to ``stream`` (stderr), or
    to ``log_file``, rotated by size (``max_bytes``, ``backups`` older files kept; JSON lines)."""
    level, fmt = LogLevel(level), LogFormat(fmt)
    handler: logging.Handler
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(log_file, maxBytes=max_bytes, backupCount=backups,
                                                       encoding="utf-8")
        stream = handler.stream
    else:
        stream = sys.stderr if stream is None else stream
        handler = logging.StreamHandler(stream)
    numeric = logging.getLevelNamesMapping()[level.value.upper()]

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[FormatKnownForeign(), *pre_render_processors()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _renderer(fmt, stream)],
        use_get_message=False,  # foreign records: the format string; % arguments only for SAFE_FOREIGN_FORMATS
        pass_foreign_args=True,  # ... which FormatKnownForeign reads and always removes
    )
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
        if isinstance(old, logging.FileHandler):
            old.close()
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in QUIET_FOREIGN_LOGGERS:
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))

    structlog.configure(
        processors=[*pre_render_processors(), structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,  # so reconfiguring (tests, CLI flags) reaches every logger
    )
    # An uncaught exception would otherwise print its message to stderr through Python's default hook.
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def request_timings(*, started: float, first_output: float | None, ended: float,
                    completion_tokens: int, engine: EngineTimes | None = None) -> dict[str, float]:
    """The numbers of a request's one served line (monotonic seconds in): time to first output,
    duration, and the decode rate after the first token (what `mlx_lm.server` and Ollama print).
    With the engine's times (a finished request), the time to first output split in four: arrival to
    the engine thread (parsing, template, admission), waiting there for a place, prefill to the first
    token, and that token's way to the client."""
    first = ended if first_output is None else first_output
    decode_s = ended - first
    rate = (completion_tokens - 1) / decode_s if completion_tokens > 1 and decode_s > 0 else 0.0
    out = {"ttft_ms": _ms(first - started), "duration_s": round(ended - started, 4), "tokens_per_s": round(rate, 2)}
    if engine is not None:
        out |= {"to_engine_ms": _ms(engine.received - started), "engine_queue_ms": _ms(engine.started - engine.received),
                "prefill_ms": _ms(engine.first_token - engine.started), "to_client_ms": _ms(first - engine.first_token)}
    return out


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def get_logger(name: str) -> Any:
    """A structlog logger named ``name``; configures the redacting pipeline first if nobody has."""
    if not structlog.is_configured():
        configure_logging()
    return structlog.get_logger(name)


def _log_uncaught(tp: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    structlog.get_logger("provider").critical("uncaught_exception", exc_info=(tp, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    structlog.get_logger("provider").critical(
        "uncaught_exception_in_thread", exc_info=(args.exc_type, args.exc_value, args.exc_traceback)
    )


@contextmanager
def capture_redacted_logs() -> Iterator[list[EventDict]]:
    """Like ``structlog.testing.capture_logs`` but the events have been through the real pipeline.

    ``capture_logs()`` alone disables every processor, Redact included, so it shows what callers
    passed, not what would be written. Not thread-safe (neither is ``capture_logs``).
    """
    if not structlog.is_configured():
        configure_logging()
    capture = structlog.testing.LogCapture()
    processors = structlog.get_config()["processors"]
    saved = list(processors)
    # Mutate the configured list in place (as capture_logs does): bound loggers hold a reference to it.
    processors[:] = [*pre_render_processors(), capture]
    structlog.configure(processors=processors)
    try:
        yield capture.entries
    finally:
        processors[:] = saved
        structlog.configure(processors=processors)


__all__ = [
    "request_timings",
    "SHORT_KEYS",
    "SAFE_FOREIGN_FORMATS",
    "FormatKnownForeign",
    "MAX_STRING",
    "NUMERIC_SUFFIXES",
    "SAFE_KEYS",
    "Redact",
    "capture_redacted_logs",
    "configure_logging",
    "get_logger",
    "pre_render_processors",
]
