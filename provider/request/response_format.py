"""`response_format` -> the grammar the output must follow, checked at parse time.

OpenAI's three types: `text` (no constraint), `json_object` (any JSON object), `json_schema`
(`{"name", "description"?, "schema"?, "strict"?}`: a value valid against `schema`; no schema means
any JSON object). The schema is compiled and checked here, without a tokenizer, so a schema the
grammar engine cannot handle is a 400 naming `response_format` before anything is counted or
admitted. `strict: false` is served as strictly as `true`: the grammar cannot half-apply.

The grammar text holds the schema: it is never logged, and errors name only the parameter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from provider.grammar import GrammarRejected, json_object_grammar, json_schema_grammar
from provider.grammar.formats import REJECTED_RULE
from provider.request.errors import InvalidBody

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TYPES_RULE = "must be one of text, json_object, json_schema"


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """The grammar the output must follow. `tool_call`: a forced call (`tool_choice` "required" or a
    named function, `provider.grammar.grammar_for_tool_call`), which the tools front puts here so the
    intake compiles and reserves it like any other (its errors then name `tool_choice`)."""

    kind: Literal["json_object", "json_schema", "tool_call"]
    grammar: str = ""  # llguidance's grammar (holds the schema: never logged)

    @property
    def param(self) -> str:
        """The parameter a refusal names."""
        return "tool_choice" if self.kind == "tool_call" else "response_format"


def parse_response_format(value: Any) -> ResponseFormat | None:
    """None for no constraint; raises `InvalidBody` naming the part of `response_format` at fault."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidBody("response_format", "must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", json_object_grammar())
    if kind != "json_schema":
        raise InvalidBody("response_format.type", TYPES_RULE)
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InvalidBody("response_format.json_schema", "must be an object with a name and a schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidBody("response_format.json_schema.name",
                          "must be 1 to 64 letters, digits, underscores or dashes")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise InvalidBody("response_format.json_schema.strict", "must be a boolean")
    schema = spec.get("schema")
    if schema is None:
        return ResponseFormat("json_schema", json_object_grammar())
    if not isinstance(schema, Mapping):
        raise InvalidBody("response_format.json_schema.schema", "must be a JSON schema object")
    try:
        return ResponseFormat("json_schema", json_schema_grammar(schema))
    except GrammarRejected:
        raise InvalidBody("response_format", f"{REJECTED_RULE} (json_schema.schema)") from None


__all__ = ["ResponseFormat", "parse_response_format"]
