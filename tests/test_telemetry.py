"""provider/telemetry: the Redact processor and the whole pipeline never let user text through."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from provider.telemetry import (
    MAX_STRING,
    SAFE_KEYS,
    Redact,
    capture_redacted_logs,
    configure_logging,
    get_logger,
)

CANARY = "CANARY-7f3a-do-not-log"


class Phase(Enum):
    PREFILL = "prefill"


class Leaky:
    def __str__(self) -> str:
        return CANARY

    __repr__ = __str__


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    saved_config = structlog.get_config()
    saved_hooks = (sys.excepthook, threading.excepthook)
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    yield
    structlog.configure(**saved_config)
    sys.excepthook, threading.excepthook = saved_hooks
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)


def failing_request() -> None:
    """Stands in for a job that fails with the prompt inside its exception message."""
    try:
        {}["x"]
    except KeyError as inner:
        raise ValueError(f"tokenizer choked on {CANARY!r}") from inner


def redact(**event: object) -> dict:
    return Redact()(None, "info", dict(event))


# --- the processor


def test_unknown_and_content_keys_are_dropped_and_counted() -> None:
    out = redact(event="job_failed", request_id="r1", prompt=CANARY, messages=[{"content": CANARY}],
                 content=CANARY, body=CANARY, error=CANARY)
    assert out == {"event": "job_failed", "request_id": "r1", "redacted": 5}


def test_exception_becomes_type_chain_and_frames_only() -> None:
    try:
        failing_request()
    except ValueError as exc:
        by_instance = redact(event="e", exc_info=exc)
        by_flag = redact(event="e", exc_info=True)
        by_tuple = redact(event="e", exc_info=(type(exc), exc, exc.__traceback__))
    for out in (by_instance, by_flag, by_tuple):
        assert CANARY not in repr(out)
        assert out["exc_type"] == "ValueError"
        assert out["exc_chain"] == ["KeyError"]
        assert "exc_info" not in out
        assert any(f.startswith("tests/test_telemetry.py:") and f.endswith("in failing_request")
                   for f in out["exc_frames"])


def test_exc_info_true_outside_an_except_block_adds_nothing() -> None:
    assert redact(event="e", exc_info=True) == {"event": "e"}


def test_allowed_keys_cannot_smuggle_text_through_objects() -> None:
    out = redact(event="e", reason=ValueError(CANARY), state=Leaky(), model=["a", Leaky()],
                 phase=Phase.PREFILL, path=Path("/models/x"))
    assert CANARY not in repr(out)
    assert out == {"event": "e", "reason": "ValueError", "state": "<Leaky>", "model": ["a", "<Leaky>"],
                   "phase": "prefill", "path": "/models/x"}


def test_event_that_is_not_a_string_is_cleaned() -> None:
    assert redact(event=RuntimeError(CANARY)) == {"event": "RuntimeError"}


def test_numeric_suffixes_pass_numbers_only() -> None:
    out = redact(event="e", freed_bytes=10, settle_s=0.5, prompt_tokens=3, odd_bytes=CANARY, flag_s=True)
    assert out == {"event": "e", "freed_bytes": 10, "settle_s": 0.5, "prompt_tokens": 3, "redacted": 2}


def test_long_strings_are_capped_and_urls_reduced_to_origin() -> None:
    out = redact(event="x" * 1000, url=f"wss://user:pw@coord.example:8443/ws?q={CANARY}", host="h")
    assert out["event"] == "x" * MAX_STRING + "…"
    assert out["url"] == "wss://coord.example:8443"


def test_event_reads_in_a_stable_order() -> None:
    out = Redact()(None, "info", {"model": "m", "event": "e", "level": "info", "timestamp": "t", "logger": "l"})
    assert list(out) == ["timestamp", "level", "logger", "event", "model"]


@settings(max_examples=150, deadline=None)
@given(
    extra=st.dictionaries(
        st.text(min_size=1, max_size=12).filter(lambda k: k not in SAFE_KEYS),
        st.one_of(st.text(max_size=20), st.lists(st.text(max_size=5), max_size=3)).map(lambda v: [CANARY, v]),
        max_size=6,
    ),
    safe=st.dictionaries(st.sampled_from(sorted(SAFE_KEYS - {"event"})), st.just(Leaky()), max_size=4),
)
def test_property_no_canary_survives_whatever_the_keys(extra: dict, safe: dict) -> None:
    out = Redact()(None, "info", {"event": "e", **extra, **safe})
    assert CANARY not in json.dumps(out, default=repr)


# --- the pipeline


def test_capture_logs_sees_raw_events_and_redact_cleans_them() -> None:
    """capture_logs() bypasses every processor; what it shows is what call sites pass in."""
    configure_logging("debug", "json", stream=io.StringIO())
    log = get_logger("provider.jobs")
    with structlog.testing.capture_logs() as raw:
        log.info("request_open", request_id="r1", prompt=CANARY)
        try:
            failing_request()
        except ValueError as exc:
            log.error("request_failed", request_id="r1", exc_info=exc)
    assert CANARY in repr(raw)  # proves the canary really was handed to the logger
    cleaned = [Redact()(None, e["log_level"], dict(e)) for e in raw]
    assert CANARY not in repr(cleaned)
    assert cleaned[1]["exc_type"] == "ValueError"


def test_capture_redacted_logs_runs_the_real_chain() -> None:
    configure_logging("info", "json", stream=io.StringIO())
    log = get_logger("provider.jobs")
    with structlog.contextvars.bound_contextvars(request_id="r9", model="tiny", messages=[CANARY]):
        with capture_redacted_logs() as events:
            log.info("request_open", content=CANARY, prompt_tokens=12)
            log.debug("below_level", prompt_tokens=1)
            try:
                failing_request()
            except ValueError:
                log.exception("request_failed")
    assert CANARY not in repr(events)
    assert [e["event"] for e in events] == ["request_open", "request_failed"]
    first = events[0]
    assert (first["request_id"], first["model"], first["prompt_tokens"], first["redacted"]) == ("r9", "tiny", 12, 2)
    assert first["level"] == "info" and first["logger"] == "provider.jobs" and first["timestamp"].endswith("Z")
    assert events[1]["exc_type"] == "ValueError"


def test_rendered_json_lines_never_contain_the_canary() -> None:
    stream = io.StringIO()
    configure_logging("debug", "auto", stream=stream)  # StringIO is not a terminal: JSON
    log = get_logger("provider.jobs")
    log.info("request_open", request_id="r1", prompt=CANARY, messages=[{"role": "user", "content": CANARY}])
    try:
        failing_request()
    except ValueError as exc:
        log.error("request_failed", request_id="r1", reason=exc, exc_info=True)
    logging.getLogger("websockets.client").debug("< TEXT %r", CANARY)  # a library passing data as args
    try:
        failing_request()
    except ValueError:
        logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
    text = stream.getvalue()
    assert CANARY not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert [line["event"] for line in lines] == [
        "request_open", "request_failed", "< TEXT %r", "Exception in ASGI application",
    ]
    assert lines[0]["redacted"] == 2
    assert lines[1]["reason"] == "ValueError" and lines[1]["exc_type"] == "ValueError"
    assert lines[2]["logger"] == "websockets.client" and lines[2]["level"] == "debug"
    assert lines[3]["exc_type"] == "ValueError" and "Traceback" not in text


def test_console_rendering_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    configure_logging("info", "auto", stream=stream)
    log = get_logger("provider.session")
    log.info("connected", host="coord.example", content=CANARY)
    try:
        failing_request()
    except ValueError:
        log.exception("session_error")
    text = stream.getvalue()
    assert CANARY not in text
    assert "connected" in text and "coord.example" in text and "session_error" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_level_filter_applies_to_both_structlog_and_stdlib() -> None:
    stream = io.StringIO()
    configure_logging("warning", "json", stream=stream)
    get_logger("provider.x").info("quiet")
    logging.getLogger("lib").info("quiet too")
    get_logger("provider.x").warning("loud")
    assert [json.loads(line)["event"] for line in stream.getvalue().splitlines()] == ["loud"]


def test_reconfiguring_replaces_the_handler_instead_of_adding_one() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", "json", stream=first)
    configure_logging("info", "json", stream=second)
    logging.getLogger("lib").warning("once")
    assert first.getvalue() == "" and len(second.getvalue().splitlines()) == 1


def test_uncaught_exceptions_are_logged_redacted() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    try:
        failing_request()
    except ValueError:
        sys.excepthook(*sys.exc_info())

    def worker() -> None:
        failing_request()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    text = stream.getvalue()
    assert CANARY not in text
    events = [json.loads(line) for line in text.splitlines()]
    assert [e["event"] for e in events] == ["uncaught_exception", "uncaught_exception_in_thread"]
    assert all(e["exc_type"] == "ValueError" and e["level"] == "critical" for e in events)


def test_get_logger_configures_redaction_when_nobody_did(capsys: pytest.CaptureFixture[str]) -> None:
    structlog.reset_defaults()
    assert not structlog.is_configured()
    get_logger("provider.early").warning("early", prompt=CANARY)
    assert structlog.is_configured()
    err = capsys.readouterr().err
    assert "early" in err and CANARY not in err


def test_formatter_plumbing_keys_cannot_carry_text() -> None:
    record = logging.LogRecord("lib", logging.INFO, __file__, 1, "msg", None, None)
    out = redact(event="e", _record=record, _from_structlog=False)
    assert out["_record"] is record and out["_from_structlog"] is False
    assert redact(event="e", _record=CANARY, _from_structlog=CANARY) == {"event": "e", "redacted": 2}


# --- foreign records whose arguments are known to be safe


@pytest.fixture
def uvicorn_logger() -> Iterator[logging.Logger]:
    """uvicorn.error at the root's level (an in-process uvicorn elsewhere in the suite may have set its own)."""
    uv = logging.getLogger("uvicorn.error")
    saved = uv.level
    uv.setLevel(logging.NOTSET)
    yield uv
    uv.setLevel(saved)


def test_uvicorn_lifecycle_lines_are_formatted_not_raw_placeholders(uvicorn_logger) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    uv = uvicorn_logger
    uv.info("Started server process [%d]", 4242)
    uv.info("Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", "http", "127.0.0.1", 8484)
    uv.info("Finished server process [%d]", 4242)
    uv.error("Cancel %s running task(s), timeout graceful shutdown exceeded", 3)
    uv.info("Some future line with %s", CANARY)  # not on the list: its argument never shows
    events = [json.loads(line)["event"] for line in stream.getvalue().splitlines()]
    assert events == [
        "Started server process [4242]",
        "Uvicorn running on http://127.0.0.1:8484 (Press CTRL+C to quit)",
        "Finished server process [4242]",
        "Cancel 3 running task(s), timeout graceful shutdown exceeded",
        "Some future line with %s",
    ]
    assert CANARY not in stream.getvalue()


def test_a_listed_format_from_another_logger_or_with_odd_arguments_stays_unformatted(uvicorn_logger) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    logging.getLogger("someone.else").info("Started server process [%d]", 1)  # same text, other logger
    logging.getLogger("uvicorn.error").error(  # a string where a count goes
        "Cancel %s running task(s), timeout graceful shutdown exceeded", CANARY)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["event"] for line in lines] == [
        "Started server process [%d]", "Cancel %s running task(s), timeout graceful shutdown exceeded"]
    assert CANARY not in stream.getvalue() and not any("redacted" in line for line in lines)


def test_the_http_clients_request_lines_stay_out_of_an_info_log() -> None:
    """huggingface_hub's HTTP client logs every request at info as a raw format ("HTTP Request: %s %s ..."):
    one placeholder line per file of a download. Its warnings still come through."""
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).info('HTTP Request: %s %s "%s %d %s"', "GET", CANARY, "HTTP/1.1", 200, "OK")
        logging.getLogger(name).warning("something to know")
    events = [json.loads(line)["event"] for line in stream.getvalue().splitlines()]
    assert events == ["something to know", "something to know"]
