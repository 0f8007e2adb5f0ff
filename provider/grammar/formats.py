"""What a request asks its output to be, as an llguidance grammar. Pure: no tokenizer.

`json_object` is any JSON object; `json_schema` is llguidance's compilation of the schema. JSON is
generated compact (no whitespace but ", " and ": ", as `json.dumps` writes it): whitespace a random
model could add forever is no longer part of the language, so a grammar's output ends as soon as
its value does.

`check` validates a grammar without a tokenizer (llguidance builds its lexer and parser): a schema it
cannot handle (an unknown type, a look-around pattern, `not`, a dangling `$ref`...) is refused here,
at parse time, before anything is admitted. llguidance's own messages quote the schema, so they are
never kept: `GrammarRejected` carries a fixed rule.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llguidance import LLMatcher, LLParserLimits

from memory.grammar import MAX_LEXER_STATES

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
REJECTED_RULE = "must be a JSON schema the grammar engine supports"


class GrammarRejected(ValueError):
    """The grammar engine cannot compile this grammar. The text is fixed: the schema is never quoted."""

    def __init__(self) -> None:
        super().__init__(REJECTED_RULE)


def limits() -> LLParserLimits:
    """The parser limits every grammar is compiled under: the lexer bounded as `memory.grammar` counts it,
    and errors without the grammar's text in them."""
    return LLParserLimits(max_lexer_states=MAX_LEXER_STATES, verbose_errors=False)


def json_object_grammar() -> str:
    """Any JSON object."""
    return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """The language of JSON values that validate against `schema`, objects closed as `closed_objects`
    says. Raises `GrammarRejected`."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(closed_objects(schema)), overrides=JSON_OPTIONS)
    except (TypeError, ValueError, RecursionError):
        raise GrammarRejected() from None
    check(grammar)
    return grammar


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else")


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object that lists its `properties` and
    says nothing of other keys, as OpenAI's strict mode requires and llama.cpp's grammars assume. Open,
    such an object lets a model add keys of any name and length for ever, so a constrained answer may
    never close; closed, every answer still validates against the schema as given. A schema with
    `allOf` anywhere is left as it is (its branches' keys add up: closing one would refuse the other's),
    and so is an object that says `additionalProperties` or `unevaluatedProperties` itself."""
    if not isinstance(schema, Mapping) or '"allOf"' in json.dumps(schema):
        return schema
    return _closed(schema)


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMAS):
        if key in out:
            out[key] = _closed(out[key])
    if isinstance(out.get("properties"), Mapping) and not {"additionalProperties", "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def check(grammar: str) -> None:
    """Raise `GrammarRejected` unless llguidance can compile `grammar`."""
    is_error, _messages = LLMatcher.validate_grammar_with_warnings(grammar, None, limits=limits())
    if is_error:  # warnings (an ignored keyword) leave a grammar that still holds to the schema it can read
        raise GrammarRejected()


__all__ = ["JSON_OPTIONS", "GrammarRejected", "check", "closed_objects", "json_object_grammar", "json_schema_grammar", "limits"]
