"""The consumer-facing OpenAI shapes: request body forwarding (output bound injected), per-chunk SSE
checks, non-streaming reassembly ([A] handleNonStreamingResponseWithFirstChunk / extractMessage)."""

from __future__ import annotations

import json
from typing import Any

from protocol import Usage

from .events import Violation

_OUTPUT_BOUNDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_STRIPPED = ("provider_serial", "provider_serials")
_GO_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})
DONE_EVENT = b"data: [DONE]\n\n"


def forwarded_body(body: dict[str, Any], raw: bytes, default_max_tokens: int) -> bytes:
    """What the provider receives: the consumer's body, provider_serial(s) stripped and ``max_tokens``
    injected when no output bound is given; when modified, re-marshalled the way Go marshals a map
    (sorted keys, ``<``/``>``/``&`` escaped)."""
    modified = dict(body)
    for key in _STRIPPED:
        modified.pop(key, None)
    if not any(key in modified for key in _OUTPUT_BOUNDS):
        modified["max_tokens"] = default_max_tokens
    if modified == body:
        return raw
    text = json.dumps(modified, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.translate(_GO_ESCAPES).encode("utf-8")


def event_payload(event: bytes) -> bytes | None:
    """The bytes after ``data: `` of one event, without the trailing blank line; None if not a data event."""
    if not event.startswith(b"data: "):
        return None
    body = event[len(b"data: ") :]
    return body[:-2] if body.endswith(b"\n\n") else body


def check_event(event: bytes) -> Violation | None:
    """One chunk's plaintext must be exactly one ``data: `` line holding one JSON object: [A]
    writes it followed by ``\\n\\n`` and ends the stream with its own ``[DONE]``, so a trailing blank line or a
    ``[DONE]`` chunk reaches the consumer doubled."""
    payload = event_payload(event)
    if payload is None:
        return Violation.SSE_NOT_DATA
    if b"\n" in payload.rstrip(b"\n"):
        return Violation.SSE_MULTIPLE_EVENTS
    if payload.strip() == b"[DONE]":
        return Violation.SSE_DONE_CHUNK
    if event.endswith(b"\n"):
        return Violation.SSE_TRAILING_NEWLINE
    try:
        obj = json.loads(payload)
    except ValueError:
        return Violation.SSE_NOT_JSON
    return None if isinstance(obj, dict) else Violation.SSE_NOT_JSON


def as_stream_event(event: bytes) -> bytes:
    """What [A] writes to a streaming consumer for one chunk: its plaintext verbatim, then a blank line
    (``fmt.Fprintf(w, "%s\\n\\n", chunk)``), whatever the provider put at its end."""
    return event + b"\n\n"


def error_event(message: str, kind: str = "provider_error") -> bytes:
    return b"data: " + json.dumps({"error": {"message": message, "type": kind}}).encode() + b"\n\n"


def error_body(message: str, kind: str = "provider_error") -> dict[str, Any]:
    return {"error": {"type": kind, "message": message}}


def usage_object(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def reassemble(events: list[bytes], usage: Usage | None, model: str) -> dict[str, Any]:
    """A ``chat.completion`` from the chunks of one request. A single ``chat.completion`` object chunk is
    passed through; otherwise content, reasoning and tool calls are joined from the deltas and
    ``finish_reason`` is the last one given. ``usage`` always comes from ``inference_complete``; ``model``
    is the requested id, as in [A]. An event that is not one JSON object is skipped (it breaks [A] too)."""
    whole: dict[str, Any] | None = None
    meta: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    for event in events:
        payload = event_payload(event)
        if payload is None or payload.strip() == b"[DONE]":
            continue
        try:
            obj = json.loads(payload)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if obj.get("object") == "chat.completion":
            whole = obj
            continue
        meta.setdefault("id", obj.get("id"))
        meta.setdefault("created", obj.get("created"))
        for choice in obj.get("choices") or ():
            _merge_choice(choices, choice)
    usage_obj = usage_object(usage) if usage is not None else None
    if whole is not None:
        return {**whole, "model": model, "usage": usage_obj}
    return {
        "id": meta.get("id") or "chatcmpl-double",
        "object": "chat.completion",
        "created": meta.get("created") or 0,
        "model": model,
        "choices": [_finish_choice(index, state) for index, state in sorted(choices.items())]
        or [_finish_choice(0, _new_choice())],
        "usage": usage_obj,
    }


def _new_choice() -> dict[str, Any]:
    return {"content": [], "reasoning": [], "tool_calls": {}, "finish_reason": None}


def _merge_choice(choices: dict[int, dict[str, Any]], choice: Any) -> None:
    if not isinstance(choice, dict):
        return
    index = choice.get("index", 0)
    state = choices.setdefault(index if isinstance(index, int) else 0, _new_choice())
    delta = choice.get("delta") or {}
    if isinstance(delta.get("content"), str):
        state["content"].append(delta["content"])
    for key in ("reasoning_content", "reasoning"):
        if isinstance(delta.get(key), str):
            state["reasoning"].append(delta[key])
    for call in delta.get("tool_calls") or ():
        slot = state["tool_calls"].setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
        slot["id"] = call.get("id") or slot["id"]
        function = call.get("function") or {}
        slot["name"] += function.get("name") or ""
        slot["arguments"] += function.get("arguments") or ""
    if choice.get("finish_reason"):
        state["finish_reason"] = choice["finish_reason"]


def _finish_choice(index: int, state: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": "".join(state["content"])}
    if state["reasoning"]:
        message["reasoning_content"] = "".join(state["reasoning"])
    if state["tool_calls"]:
        message["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for _, call in sorted(state["tool_calls"].items())
        ]
    return {"index": index, "message": message, "finish_reason": state["finish_reason"]}
