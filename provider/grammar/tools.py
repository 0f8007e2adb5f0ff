"""The grammar of a forced tool call (`tool_choice: "required"` or a named function).

`grammar_for_tool_call(tools, choice, fmt)` is the language of "one call (or, for `required` with
parallel calls, one or more) to one of these functions, its arguments valid against that function's
`parameters` schema", written the way the model's tool parser reads it back (`fmt`, from mlx-lm's
`tool_parsers`):

* `json_tools` (Hermes / Qwen 2.5 style): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
  parallel calls one after the other, a newline between; each marker is its special token's id where
  the vocabulary has it as one (a literal would be spelled in plain tokens, and the model writes the
  special one: llguidance does not take it for the literal);
* `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (the list form its parser reads;
  `[TOOL_CALLS]` is the special token's id where the vocabulary has it).

Any other parser raises `ToolGrammarUnsupported` (the caller's 400 names `tool_choice`), as does a
parameters schema the grammar engine cannot compile (`GrammarRejected`). Pure: no tokenizer is
needed to build or check the grammar; the engine compiles it against the model's vocabulary like
any other (`compiled.GrammarCache`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from provider.grammar.formats import JSON_OPTIONS, GrammarRejected, check, closed_objects

MAX_PARALLEL_CALLS = 8  # `required` with parallel calls: a random model stops within this many
_EMPTY_OBJECT = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolGrammarUnsupported(ValueError):
    """The model's tool-call format has no grammar here."""


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How the model writes a tool call: its mlx-lm parser's name and markers."""

    parser: str  # mlx-lm's tool parser module, e.g. "json_tools"
    start: str  # tool_call_start, e.g. "<tool_call>"
    end: str  # tool_call_end ("" for mistral)
    start_token: int | None = None  # the start marker's id where it is one special token
    end_token: int | None = None  # the end marker's, likewise

    @classmethod
    def of(cls, wrapper: Any) -> ToolCallFormat | None:
        """From mlx-lm's `TokenizerWrapper`; None for a model with no tool parser."""
        start = getattr(wrapper, "tool_call_start", None)
        if not getattr(wrapper, "has_tool_calling", False) or start is None:
            return None
        from provider.mlxlm import unwrapped  # imports mlx-lm, which a wrapper's owner has imported

        hf = unwrapped(wrapper)
        parser = str(getattr(hf, "init_kwargs", {}).get("tool_parser_type") or "")
        starts = getattr(wrapper, "tool_call_start_tokens", None) or ()
        ends = getattr(wrapper, "tool_call_end_tokens", None) or ()
        return cls(parser, start, getattr(wrapper, "tool_call_end", "") or "",
                   starts[0] if len(starts) == 1 else None, ends[0] if len(ends) == 1 else None)


def grammar_for_tool_call(tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any],
                          fmt: ToolCallFormat, *, parallel: bool = True) -> str:
    """The grammar of a forced call. `tools`: OpenAI's `tools` list (`{"type": "function", "function":
    {"name", "parameters"}}`); `choice`: "required" or `{"type": "function", "function": {"name": ...}}`.
    Raises `ToolGrammarUnsupported`, `GrammarRejected`, or `ValueError` for a named function that is
    not among `tools`."""
    functions = _functions(tools)
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name")
        functions = [f for f in functions if f[0] == name]
        if not functions:
            raise ValueError("tool_choice names a function that is not in tools")
        calls = 1
    elif choice == "required":
        if not functions:
            raise ValueError("tool_choice required with no tools")
        calls = MAX_PARALLEL_CALLS if parallel else 1
    else:
        raise ValueError("tool_choice must be 'required' or a named function")
    call = {"anyOf": [_call_schema(n, p) for n, p in functions]} if len(functions) > 1 else _call_schema(*functions[0])
    call["x-guidance"] = dict(JSON_OPTIONS)
    body = json.dumps(call)
    if fmt.parser == "json_tools":
        more = f' ("\\n" call){{0,{calls - 1}}}' if calls > 1 else ""
        start, end = _marker(fmt.start, fmt.start_token), _marker(fmt.end, fmt.end_token)
        lark = (f"start: call{more}\n"
                f"call: {start} \"\\n\" json \"\\n\" {end}\n"
                f"json: %json {body}\n")
    elif fmt.parser == "mistral":
        start = _marker(fmt.start, fmt.start_token)
        more = f' (", " json){{0,{calls - 1}}}' if calls > 1 else ""
        lark = (f"start: {start} \"[\" json{more} \"]\"\n"
                f"json: %json {body}\n")
    else:
        raise ToolGrammarUnsupported(fmt.parser)
    grammar = LLMatcher.grammar_from_lark(lark)
    check(grammar)
    return grammar


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError("each tool must be a function with a name")
        params = function.get("parameters")
        out.append((function["name"], params if isinstance(params, Mapping) else _EMPTY_OBJECT))
    return out


def _call_schema(name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": closed_objects(parameters)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _marker(text: str, token: int | None) -> str:
    """A call marker in the grammar: its special token where it is one, else its text."""
    return f"<[{token}]>" if token is not None else _literal(text)


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON string


__all__ = ["MAX_PARALLEL_CALLS", "GrammarRejected", "ToolCallFormat", "ToolGrammarUnsupported",
           "grammar_for_tool_call"]
