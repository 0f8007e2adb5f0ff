"""A completion's text -> its content and the tool calls in it, as the text streams.

The engine emits text (`textstream.CompletionText`: detokenized, stop strings cut); when a request
offered tools, this reads the calls out of that text with what mlx-lm ships for the model's family
(`provider.models.tools.ToolFormat`): its call markers are found with mlx-lm's own
`TextStateMachine` (matched on text, so a marker split across deltas or tokens is held back, never
half-emitted), and each call's text is handed to the family's parser (`mlx_lm/tool_parsers/`). Pure:
no MLX, no I/O; one instance per completion, fed in order, then `finish()`ed.

What comes out (`feed` / `finish`, in order):

* content text, never holding a call's markers; whitespace right before a call, and at the end of
  an answer that made calls, is dropped (a model writes a newline between calls, which OpenAI's
  `content` does not carry), so the streamed content and the whole answer's agree;
* `ToolCall(index, id, name, arguments)` once a call's end marker is read (or the output ends
  inside a call, for a family whose calls run to the end), `index` 0, 1, ... across the answer,
  `arguments` the JSON text of an object, `id` the model's own where its family writes one, else
  ``call_<24 hex>``. A call the parser cannot read (cut short, or not a call at all) is content, its
  markers included, as the model wrote it — nothing the model said is dropped silently, except the
  calls after the first when the request asked for one (`parallel=False`), and what a forced answer
  (`forced`: `tool_choice` "required" or a named function, whose grammar allows calls and nothing
  else) did not finish: there only whole calls come out, and the text of a call cut short (by
  `max_tokens`, a stop string) or of a marker begun is dropped, never returned as content.

mlx-lm's parsers read a whole call, so a call's name and arguments are known together when it
closes: the stream sends them then (`openai.ChatChunks`), not token by token.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import TextStateMachine

from provider.models.tools import ToolFormat

_NORMAL, _CALL = "normal", "tool"


@dataclass(frozen=True, slots=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text of an object


Piece = str | ToolCall


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One completion's tool calls (see the module docstring)."""

    __slots__ = ("_format", "_tools", "_parallel", "_forced", "_machine", "_mode", "_call", "_space", "_before",
                 "calls")

    def __init__(self, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], *, parallel: bool = True,
                 forced: bool = False) -> None:
        self._format = fmt
        self._tools = [dict(t) for t in tools]  # what a family's parser may read argument types from
        self._parallel = parallel
        self._forced = forced  # the answer must be calls: text that is not a whole call is dropped
        machine = TextStateMachine({_NORMAL: [(fmt.start, _CALL)], _CALL: [(fmt.end, _NORMAL)] if fmt.end else []})
        self._machine = machine.make_state(_NORMAL)
        self._mode = _NORMAL
        self._call = ""  # the text of the call being read
        self._space = ""  # trailing whitespace held back: dropped if a call follows
        self._before = ""  # the whitespace before the call being read: content again if it is not one
        self.calls = 0  # calls read so far

    def feed(self, text: str) -> list[Piece]:
        self._machine, segments = TextStateMachine.split(self._machine, text)
        return self._read(segments)

    def finish(self) -> list[Piece]:
        """What is held back, once the text has ended: a partial marker is content; a call still open
        is read as it is (a family whose calls run to the end, or one cut short)."""
        self._machine, held, _ = TextStateMachine.flush(self._machine)
        out = self._read([(self._mode, held)])
        if self._mode == _CALL:
            out += self._close(complete=False)
            self._mode = _NORMAL
        if self._space and not self.calls:
            out.append(self._space)
        self._space = ""
        return out

    # -- internals -------------------------------------------------------------------------------

    def _read(self, segments: list[tuple[str, str]]) -> list[Piece]:
        out: list[Piece] = []
        for mode, text in segments:
            if mode != self._mode:
                if mode == _CALL:
                    self._before, self._space = self._space, ""  # not content, if a call follows
                else:
                    out += self._close(complete=True)
                self._mode = mode
            if mode == _CALL:
                self._call += text
            else:
                out += self._content(text)
        return out

    def _content(self, text: str) -> list[Piece]:
        if self._forced:
            return []
        held = self._space + text
        body = held.rstrip()
        self._space = held[len(body):]
        return [body] if body else []

    def _close(self, *, complete: bool) -> list[Piece]:
        text, self._call = self._call, ""
        before, self._before = self._before, ""
        calls = self._parse(text)
        if calls is None:  # not a call we can read: the model's text, as it wrote it
            raw = before + self._format.start + text + (self._format.end if complete else "")
            return self._content(raw)
        out: list[Piece] = []
        for call_id, name, arguments in calls:
            if self.calls and not self._parallel:
                break  # one call was asked for
            out.append(ToolCall(self.calls, call_id, name, arguments))
            self.calls += 1
        return out

    def _parse(self, text: str) -> list[tuple[str, str, str]] | None:
        try:
            parsed = self._format.parse(text, self._tools)
        except Exception:  # the family's parser on model output: anything it raises means "not a call"
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [_call(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return calls  # type: ignore[return-value]


def _call(item: Any) -> tuple[str, str, str] | None:
    """(id, name, arguments JSON) of one parsed call, or None if it is not one."""
    if not isinstance(item, Mapping):
        return None
    name, arguments = item.get("name"), item.get("arguments", {})
    if not isinstance(name, str) or not name:
        return None
    try:
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, Mapping):
            return None
        text = json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return None
    given = item.get("id")
    return (given if isinstance(given, str) and given else new_call_id()), name, text


def tool_calls_for(fmt: ToolFormat | None, tools: Sequence[Mapping[str, Any]], *,
                   parallel: bool = True, forced: bool = False) -> ToolCallStream | None:
    """The reader of a request's output: None when no tools were offered (its text is all content);
    `forced`: the request forced a call (its answer is whole calls only)."""
    return ToolCallStream(fmt, tools, parallel=parallel, forced=forced) if fmt is not None and tools else None


__all__ = ["Piece", "ToolCall", "ToolCallStream", "new_call_id", "tool_calls_for"]
