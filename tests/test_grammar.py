"""provider/grammar: response_format and forced tool calls as llguidance grammars, on a real tokenizer.

The walks choose at random among the tokens each mask allows (what random weights do), so every
output below is valid because of the grammar, whatever a model would prefer.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from grammar_walk import allowed, walk
from memory.grammar import grammar_bytes
from provider.grammar import (
    GrammarCache,
    GrammarRejected,
    TokenTable,
    ToolCallFormat,
    ToolGrammarUnsupported,
    grammar_for_tool_call,
    json_object_grammar,
    json_schema_grammar,
)
from provider.grammar.numbers import EXP, FRAC, INT, ZERO, E, NumberScan, NumberState, breaks

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def table(tiny_model_path) -> TokenTable:
    return TokenTable.of(load_tokenizer(tiny_model_path))


def text(table: TokenTable, tokens: list[int]) -> str:
    return b"".join(table.token_bytes(t) for t in tokens).decode()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_a_random_walk_through_a_schema_always_validates(table, seed):
    cache = GrammarCache()
    constraint = cache.constraint(table, json_schema_grammar(PERSON))
    tokens, ended = walk(constraint, table, seed)
    assert ended and constraint.accepting
    jsonschema.validate(json.loads(text(table, tokens)), PERSON)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_json_object_output_parses_as_an_object_wherever_it_may_stop(table, seed):
    """Any object is an unbounded language (a uniform walk rarely closes it), so: every point where
    the mask lets EOS through is a whole object."""
    constraint = GrammarCache().constraint(table, json_object_grammar())
    rng, tokens, stops = np.random.default_rng(seed), [], 0
    for _ in range(300):
        choices = allowed(constraint)
        if set(choices) & table.eos_ids:
            stops += 1
            assert constraint.accepting and isinstance(json.loads(text(table, tokens)), dict)
        rest = [t for t in choices if t not in table.eos_ids]
        if not rest:
            break  # a closed object: nothing but EOS
        token = int(rng.choice(rest))
        constraint.consume(token)
        tokens.append(token)
    assert tokens and not constraint.failed


def test_eos_is_allowed_only_where_the_language_may_end(table):
    constraint = GrammarCache().constraint(table, json_schema_grammar({"enum": ["ab"]}))
    assert not set(allowed(constraint)) & table.eos_ids  # nothing yet: EOS is not a sentence
    for token in table.encode('"ab"'):
        constraint.consume(token)
    assert set(allowed(constraint)) == table.eos_ids and constraint.accepting


def test_a_refused_token_leaves_only_eos(table):
    constraint = GrammarCache().constraint(table, json_schema_grammar({"type": "integer"}))
    constraint.consume(table.encode("x")[0])
    assert constraint.failed and set(allowed(constraint)) <= table.eos_ids


@pytest.mark.parametrize("schema", [
    {"type": "strin"},
    {"type": "string", "pattern": "(?<=a)b"},
    {"$ref": "#/definitions/nowhere"},
    {"not": {"type": "string"}},
    {"type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}}},
])
def test_a_schema_the_engine_cannot_handle_is_rejected_with_fixed_words(schema):
    with pytest.raises(GrammarRejected) as raised:
        json_schema_grammar(schema)
    assert str(raised.value) == "must be a JSON schema the grammar engine supports"


def test_compiled_grammars_are_cached_per_vocabulary_and_bounded(table, small_model_path):
    cache = GrammarCache(max_entries=2)
    grammars = [json_schema_grammar({"type": "integer", "maximum": n}) for n in range(3)]
    first = cache.constraint(table, grammars[0])
    second = cache.constraint(table, grammars[0])
    assert (cache.hits, cache.misses) == (1, 1) and first is not second  # each request its own matcher
    other = TokenTable.of(load_tokenizer(small_model_path))
    cache.constraint(other, grammars[0])  # another vocabulary: compiled again
    assert cache.misses == 2 and cache.cached(table, grammars[0]) and cache.cached(other, grammars[0])
    cache.constraint(table, grammars[1])  # a third entry: the least recently used one goes
    assert len(cache) == 2 and not cache.cached(table, grammars[0])


def test_a_matcher_copy_is_independent(table):
    cache = GrammarCache()
    grammar = json_schema_grammar({"type": "integer"})
    one, two = cache.constraint(table, grammar), cache.constraint(table, grammar)
    one.consume(table.encode("7")[0])
    assert one.accepting and not two.accepting


def test_release_runs_once_from_any_caller(table):
    calls = []
    constraint = GrammarCache().constraint(table, json_object_grammar(), release=lambda: calls.append(1))
    constraint.release()
    constraint.release()
    assert calls == [1]


def test_token_bytes_spell_the_tokens(table):
    ids = table.encode('{"a": 1}')
    assert b"".join(table.token_bytes(t) for t in ids) == b'{"a": 1}'
    assert table.token_bytes(table.vocab_size + 5) == b""


def test_the_grammar_figure_grows_with_the_vocabulary_and_is_bounded():
    assert grammar_bytes(150_000) > grammar_bytes(2048) > 16 * 2**20
    assert grammar_bytes(150_000) < 24 * 2**20


# -- forced tool calls ---------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["c", "f"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 12},
                                     "filters": {"type": "array", "maxItems": 2,
                                                 "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}},
                                                           "required": ["k"], "additionalProperties": False}}},
    "required": ["query"], "additionalProperties": False}}}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}
HERMES = ToolCallFormat("json_tools", "<tool_call>", "</tool_call>")


def hermes_calls(out: str) -> list[dict]:
    """What mlx-lm's json_tools parser reads: the JSON between each start and end marker."""
    from mlx_lm.tool_parsers import json_tools

    parts = [p.split("</tool_call>")[0] for p in out.split("<tool_call>")[1:]]
    assert out.endswith("</tool_call>") and parts
    return [json_tools.parse_tool_call(p) for p in parts]


def assert_valid_call(call: dict, tools: list[dict]) -> None:
    by_name = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    assert call["name"] in by_name
    jsonschema.validate(call["arguments"], by_name[call["name"]])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_required_forces_valid_calls_in_the_hermes_format(table, seed):
    tools = [WEATHER, SEARCH, NO_PARAMS]
    constraint = GrammarCache().constraint(table, grammar_for_tool_call(tools, "required", HERMES))
    tokens, ended = walk(constraint, table, seed, eos_weight=0.5)
    assert ended
    calls = hermes_calls(text(table, tokens))
    assert 1 <= len(calls) <= 8
    for call in calls:
        assert_valid_call(call, tools)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_a_named_function_forces_one_call_to_it(table, seed):
    choice = {"type": "function", "function": {"name": "search"}}
    constraint = GrammarCache().constraint(table, grammar_for_tool_call([WEATHER, SEARCH], choice, HERMES))
    tokens, ended = walk(constraint, table, seed, eos_weight=0.5)
    calls = hermes_calls(text(table, tokens))
    assert ended and len(calls) == 1 and calls[0]["name"] == "search"
    assert_valid_call(calls[0], [SEARCH])


def test_mistral_calls_are_a_json_list_after_the_marker(table):
    fmt = ToolCallFormat("mistral", "[TOOL_CALLS]", "")
    constraint = GrammarCache().constraint(table, grammar_for_tool_call([WEATHER], "required", fmt))
    tokens, ended = walk(constraint, table, 7, eos_weight=0.5)
    out = text(table, tokens)
    assert ended and out.startswith("[TOOL_CALLS]")
    for call in json.loads(out.removeprefix("[TOOL_CALLS]")):
        assert_valid_call(call, [WEATHER])


def test_tool_grammar_refusals():
    with pytest.raises(ToolGrammarUnsupported):
        grammar_for_tool_call([WEATHER], "required", ToolCallFormat("pythonic", "<|tool_call_start|>", "<|tool_call_end|>"))
    with pytest.raises(ValueError):
        grammar_for_tool_call([WEATHER], {"type": "function", "function": {"name": "nope"}}, HERMES)
    with pytest.raises(GrammarRejected):
        bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
        grammar_for_tool_call([bad], "required", HERMES)


def test_the_format_comes_from_mlx_lms_tokenizer(tiny_model_path):
    assert ToolCallFormat.of(load_tokenizer(tiny_model_path)) is None  # the tiny ChatML template has no tools


@pytest.fixture(scope="module")
def tools_wrapper(tiny_tools_model_path):
    return load_tokenizer(tiny_tools_model_path)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_markers_that_are_special_tokens_are_forced_as_those_tokens(tools_wrapper, seed):
    """The tools model's `<tool_call>` and `</tool_call>` are single special tokens, which the model writes:
    the grammar asks for them by id (llguidance would refuse the special token for the literal text)."""
    wrapper = tools_wrapper
    fmt = ToolCallFormat.of(wrapper)
    assert fmt is not None and (fmt.start_token, fmt.end_token) == (wrapper.tool_call_start_tokens[0],
                                                                    wrapper.tool_call_end_tokens[0])
    tools_table = TokenTable.of(wrapper)
    fmt = dataclasses.replace(fmt, parser="json_tools")
    constraint = GrammarCache().constraint(tools_table, grammar_for_tool_call([WEATHER, SEARCH], "required", fmt))
    tokens, ended = walk(constraint, tools_table, seed, eos_weight=0.5)
    assert ended and not constraint.failed and tokens[0] == fmt.start_token and tokens[-1] == fmt.end_token
    for call in hermes_calls(text(tools_table, tokens)):
        assert_valid_call(call, [WEATHER, SEARCH])


# --- numbers: at most what a double carries ----------------------------------------------------------

PLACE = {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
         "required": ["lat", "lon"], "additionalProperties": False}
NUMBER_TEXT = re.compile(rb"-?(\d+)(?:\.(\d+))?(?:[eE][+-]?(\d+))?")


def numbers_in(out: str) -> list[tuple[int, int]]:
    """(mantissa digits, a lone leading 0 not counted; exponent digits) of each number outside strings."""
    found, rest = [], re.sub(r'"(?:[^"\\]|\\.)*"', '""', out).encode()
    for m in NUMBER_TEXT.finditer(rest):
        whole, fraction, exponent = m.group(1), m.group(2) or b"", m.group(3) or b""
        found.append(((0 if whole == b"0" else len(whole)) + len(fraction), len(exponent)))
    return found


def test_numbers_of_a_schema_close_within_a_doubles_digits_however_a_random_model_writes(table):
    """A uniform walk among the allowed tokens mostly picks a digit inside a number: without the bound,
    6 of these 12 run past 200 tokens."""
    grammar = json_schema_grammar(PLACE)
    cache = GrammarCache()
    for seed in range(12):
        constraint = cache.constraint(table, grammar)
        tokens, ended = walk(constraint, table, seed, limit=200)
        out = text(table, tokens)
        assert ended and constraint.accepting, (seed, len(tokens))
        answer = json.loads(out)
        jsonschema.validate(answer, PLACE)
        assert all(d <= 17 and e <= 3 for d, e in numbers_in(out)), out


def test_a_forced_calls_number_arguments_close_too(table):
    move = {"type": "function", "function": {"name": "go", "parameters": PLACE}}
    grammar = grammar_for_tool_call([move], {"type": "function", "function": {"name": "go"}}, HERMES)
    cache = GrammarCache()
    for seed in range(12):
        constraint = cache.constraint(table, grammar)
        tokens, ended = walk(constraint, table, seed, limit=300)
        out = text(table, tokens)
        assert ended, (seed, len(tokens))
        [call] = hermes_calls(out)
        assert_valid_call(call, [move])
        assert all(d <= 17 and e <= 3 for d, e in numbers_in(out)), out


def test_numbers_of_any_json_object_are_bounded_too(table):
    """At the 17th digit, no digit more (nor a "." that would need one); the number may close or take
    an exponent of at most 3 digits."""
    constraint = GrammarCache().constraint(table, json_object_grammar())
    for token in table.encode('{"a": [12345678901234567'):
        constraint.consume(token)
    spelled = {table.token_bytes(t) for t in allowed(constraint)}
    assert b"," in spelled and b"]" in spelled and b"e" in spelled
    assert not any(s[:1].isdigit() or s.startswith(b".") for s in spelled)
    for token in table.encode("e-123"):
        constraint.consume(token)
    assert not any(s[:1].isdigit() for s in map(table.token_bytes, allowed(constraint)))
    assert not constraint.failed


@pytest.mark.parametrize("bounds", [{}, {"minimum": 0}, {"maximum": -5}])
def test_an_integer_without_both_bounds_takes_at_most_17_digits(table, bounds):
    schema = {"type": "object", "properties": {"n": {"type": "integer", **bounds}}, "required": ["n"],
              "additionalProperties": False}
    cache, grammar = GrammarCache(), json_schema_grammar(schema)
    for seed in range(6):
        constraint = cache.constraint(table, grammar)
        tokens, ended = walk(constraint, table, seed, limit=100)
        assert ended, seed
        value = json.loads(text(table, tokens))["n"]
        jsonschema.validate({"n": value}, schema)
        assert len(str(abs(value))) <= 17


def test_an_integer_schemas_own_bounds_rule_even_past_17_digits(table):
    """A minimum of 19 digits: the grammar then allows nothing but more digits, and gets them."""
    schema = {"type": "integer", "minimum": 10**18, "maximum": 10**18 + 5}
    grammar = json_schema_grammar(schema)
    for seed in range(4):
        constraint = GrammarCache().constraint(table, grammar)
        tokens, ended = walk(constraint, table, seed, limit=100)
        assert ended and 10**18 <= json.loads(text(table, tokens)) <= 10**18 + 5


def test_the_number_scan_reads_json_numbers_and_skips_strings():
    scan = NumberScan()
    scan.feed(b'{"a1": "x\\"9", "b": -12.5e+0')
    assert scan.number == NumberState(EXP, 0, 1)
    scan.feed(b"7")
    assert scan.number == NumberState(EXP, 0, 2)
    scan.feed(b', "c": 0')
    assert scan.number == NumberState(ZERO)
    scan.feed(b"]")
    assert scan.number is None
    scan.feed(b'"9')
    assert scan.number is None  # in a string


def test_what_breaks_the_bound():
    at_17 = NumberState(INT, 17)
    assert breaks(at_17, b"1") and breaks(at_17, b".") and not breaks(at_17, b"e5") and not breaks(at_17, b",")
    assert not breaks(NumberState(FRAC, 16), b"1,") and breaks(NumberState(FRAC, 16), b"12")
    assert breaks(NumberState(EXP, 0, 3), b"0") and not breaks(NumberState(E), b"-308")
    assert not breaks(NumberState(ZERO), b".12345678901234567") and breaks(NumberState(ZERO), b".123456789012345678")


OPEN_WEATHER = {"type": "object", "properties": {  # as most examples write it: no additionalProperties
    "city": {"type": "string", "maxLength": 8},
    "unit": {"enum": ["c", "f"]},
    "at": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}},
}, "required": ["city"]}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_objects_that_list_their_properties_take_only_those_so_the_answer_closes(table, seed):
    """An object schema with `properties` and no `additionalProperties` gets only the keys it lists (as
    OpenAI's strict mode asks and llama.cpp's grammars do): extra keys of any name and length would let
    a model write keys for ever. What comes out still validates against the schema as given."""
    constraint = GrammarCache().constraint(table, json_schema_grammar(OPEN_WEATHER))
    tokens, ended = walk(constraint, table, seed, limit=400)
    assert ended
    answer = json.loads(text(table, tokens))
    jsonschema.validate(answer, OPEN_WEATHER)
    assert set(answer) <= {"city", "unit", "at"} and set(answer.get("at", {})) <= {"hour"}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_a_forced_call_to_a_function_without_arguments_writes_empty_arguments(table, seed):
    noop = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
    choice = {"type": "function", "function": {"name": "noop"}}
    constraint = GrammarCache().constraint(table, grammar_for_tool_call([noop], choice, HERMES))
    tokens, ended = walk(constraint, table, seed, limit=400)
    assert ended and hermes_calls(text(table, tokens)) == [{"name": "noop", "arguments": {}}]


def test_objects_keep_extra_keys_where_the_schema_allows_them_or_lists_none():
    from provider.grammar.formats import closed_objects

    assert closed_objects({"type": "object"}) == {"type": "object"}  # any object stays any object
    allowed = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert closed_objects(allowed) == allowed
    merged = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_objects(merged) == merged  # closing a branch would refuse the other branch's keys
    nested = {"type": "array", "items": {"properties": {"a": {"properties": {}}}}}
    assert closed_objects(nested) == {"type": "array", "items": {"properties": {"a": {
        "properties": {}, "additionalProperties": False}}, "additionalProperties": False}}
