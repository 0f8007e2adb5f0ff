"""Strict types and the parameters this provider cannot honour, in the one body
validator both front doors use (provider/request/body.py, provider/request/params.py): a wrong JSON
type or an unsupported parameter is an `InvalidBody` naming it, never coerced, never ignored."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from provider.request.body import (
    COMPLETION_MAX_TOKENS,
    InvalidBody,
    ToolChoice,
    log_unknown_fields,
    parse_chat_body,
    parse_completion_body,
)
from provider.request.params import IGNORED, NEUTRAL, REFUSED, Endpoint
from provider.telemetry import capture_redacted_logs

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "once upon"}
PARSERS = {Endpoint.CHAT: (parse_chat_body, CHAT), Endpoint.COMPLETIONS: (parse_completion_body, COMPLETION)}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)


def refused(parse, body: dict) -> InvalidBody:
    with pytest.raises(InvalidBody) as caught:
        parse(body)
    return caught.value


WRONG_TYPES = [  # what OpenAI answers with a 400 naming the parameter; lax pydantic would have coerced these
    ("stream", "yes"), ("stream", 1), ("stream", "true"),
    ("temperature", "0.5"), ("temperature", True),
    ("top_p", "1"), ("top_p", False),
    ("max_tokens", "5"), ("max_tokens", 5.0), ("max_tokens", True),
    ("seed", "7"), ("seed", 7.5), ("seed", True),
    ("stop", 3), ("stop", ["a", 1]),
    ("model", 12),
]


@pytest.mark.parametrize("endpoint", list(Endpoint))
@pytest.mark.parametrize("name, value", WRONG_TYPES, ids=[f"{n}={v!r}" for n, v in WRONG_TYPES])
def test_a_wrong_json_type_is_named_never_coerced(endpoint, name, value):
    parse, base = PARSERS[endpoint]
    assert refused(parse, {**base, name: value}).field == name


@pytest.mark.parametrize("extra, field", [
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"max_completion_tokens": "5"}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": "hi"}, "messages"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tool_choice": "maybe"}, "tool_choice"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_chat_only_parameters_have_strict_types_too(extra, field):
    assert refused(parse_chat_body, {**CHAT, **extra}).field == field


def test_ints_are_numbers_where_openai_takes_a_number():
    body = parse_chat_body({**CHAT, "temperature": 1, "top_p": 1, "max_tokens": 5, "seed": -3})
    assert (body.temperature, body.top_p, body.max_tokens, body.seed) == (1.0, 1.0, 5, -3)


@pytest.mark.parametrize("name", [n for n, rule in REFUSED.items() if Endpoint.CHAT in rule.endpoints])
@given(value=json_values.filter(lambda v: v is not None))
@settings(max_examples=15, deadline=None)
def test_a_parameter_we_cannot_honour_is_refused_at_any_value(name, value):
    error = refused(parse_chat_body, {**CHAT, name: value})
    assert error.field == name and "not supported" in error.rule


@pytest.mark.parametrize("endpoint", list(Endpoint))
@pytest.mark.parametrize("name", list(NEUTRAL))
def test_a_neutral_parameter_is_refused_at_any_other_value(endpoint, name):
    parse, base = PARSERS[endpoint]
    if endpoint not in NEUTRAL[name].endpoints:
        return  # not a parameter of this endpoint: covered by the other one
    for value in (2, 0.5, -1, "0", True, {"7": 1}, ["audio"], "text"):
        if not NEUTRAL[name].accepts(value):
            assert refused(parse, {**base, name: value}).field == name


@pytest.mark.parametrize("extra", [
    {"n": 1}, {"n": None}, {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"logit_bias": {}},
    {"modalities": ["text"]}, {"top_k": None},
])
def test_the_neutral_value_is_what_we_do_anyway(extra):
    assert parse_chat_body({**CHAT, **extra}) == parse_chat_body(CHAT)


@pytest.mark.parametrize("extra", [{"best_of": 1}, {"echo": False}, {"suffix": ""}, {"suffix": None}, {"logprobs": None},
                                   {"tools": None}, {"tool_choice": None}, {"response_format": None}])
def test_the_neutral_value_of_a_completions_parameter(extra):
    assert parse_completion_body({**COMPLETION, **extra}) == parse_completion_body(COMPLETION)


@pytest.mark.parametrize("extra", [{"tools": []}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
                                   {"tool_choice": "none"}, {"response_format": {"type": "text"}},
                                   {"response_format": {"type": "json_object"}}])
def test_chats_output_controls_are_refused_on_completions(extra):
    """A legacy completion cannot call tools nor follow a format: the 400 names the parameter."""
    with pytest.raises(InvalidBody) as caught:
        parse_completion_body({**COMPLETION, **extra})
    assert caught.value.field == next(iter(extra)) and "/v1/completions" in caught.value.rule


def test_parallel_tool_calls_null_is_not_sent():
    tool = {"type": "function", "function": {"name": "f"}}
    assert parse_chat_body({**CHAT, "tools": [tool], "parallel_tool_calls": None}).parallel_tool_calls is True


@pytest.mark.parametrize("endpoint", list(Endpoint))
@given(ignored=st.dictionaries(st.sampled_from(sorted(IGNORED)), json_values, max_size=3))
@settings(max_examples=30, deadline=None)
def test_an_ignored_parameter_changes_nothing_at_any_value(endpoint, ignored):
    parse, base = PARSERS[endpoint]
    assert parse({**base, **ignored}) == parse(base)


def test_keys_outside_openais_api_are_ignored_as_the_coordinator_needs():
    """The coordinator adds `endpoint` and metadata keys of its own."""
    assert parse_chat_body({**CHAT, "endpoint": "/v1/chat/completions", "tool_schema_metadata_protocol": 1,
                            "stream_options": {"include_usage": True, "include_obfuscation": False}}).include_usage


@pytest.mark.parametrize("endpoint, name, meant", [
    (Endpoint.CHAT, "max_token", "max_tokens"), (Endpoint.CHAT, "response_fromat", "response_format"),
    (Endpoint.CHAT, "temprature", "temperature"), (Endpoint.CHAT, "stream_option", "stream_options"),
    (Endpoint.CHAT, "logprob", "logprobs"), (Endpoint.CHAT, "parallel_tool_call", "parallel_tool_calls"),
    (Endpoint.COMPLETIONS, "max_token", "max_tokens"), (Endpoint.COMPLETIONS, "promt", "prompt"),
])
def test_a_misspelt_parameter_is_refused_naming_it_and_the_one_meant(endpoint, name, meant):
    parse, base = PARSERS[endpoint]
    invalid = refused(parse, {**base, name: {"x": "CANARY-value"}})
    assert invalid.field == name and f"did you mean '{meant}'" in invalid.rule and "CANARY" not in invalid.message


VENDOR = {"max_new_tokens": 5, "top_n": 2, "chat_template": "x", "cache_prompt": True, "user_id": "u",
          "stop_token_ids": [1], "repetition_penalty_range": 3, "x-trace": "t", "max_output_tokens": 9}


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_other_vendors_fields_are_accepted_and_kept_by_name(endpoint):
    parse, base = PARSERS[endpoint]
    body = parse({**base, **VENDOR, "endpoint": "/v1/chat/completions", "tool_schema_metadata_protocol": 1,
                  "user": "u"})
    assert body.unknown_fields == tuple(VENDOR)  # not the coordinator's keys, not a table's
    assert parse(base).unknown_fields == ()


def test_the_warning_names_the_unknown_fields_never_their_values():
    body = parse_chat_body({**CHAT, "cache_prompt": "CANARY-value", "a key with spaces": 1, "x" * 65: 2})
    with capture_redacted_logs() as logs:
        log_unknown_fields(body, request_id="r1")
    [warning] = [e for e in logs if e["event"] == "request_unknown_fields"]
    assert warning["log_level"] == "warning" and warning["kind"] == ["cache_prompt"] and warning["count"] == 3
    assert warning["request_id"] == "r1" and "CANARY" not in repr(logs) and "spaces" not in repr(logs)
    with capture_redacted_logs() as logs:
        log_unknown_fields(parse_chat_body(CHAT))
    assert logs == []


def test_the_issue_31_parameters_are_parsed_for_their_implementations():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = parse_chat_body({**CHAT, "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
                            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}},
                            "logprobs": True, "top_logprobs": 3})
    assert body.tools == (tool,) and body.tool_choice == ToolChoice("required") and body.parallel_tool_calls is False
    assert body.response_format is not None and body.response_format.kind == "json_schema"
    assert body.logprobs is True and body.top_logprobs == 3
    plain = parse_chat_body(CHAT)
    assert (plain.tools, plain.tool_choice, plain.response_format, plain.logprobs) == (
        (), ToolChoice("none"), None, False)


# --- the legacy completions prompt

@pytest.mark.parametrize("prompt, parsed", [
    ("once upon", "once upon"),
    ("", ""),
    (["once upon"], "once upon"),
    ([5, 6, 7], (5, 6, 7)),
    ([[5, 6, 7]], (5, 6, 7)),
])
def test_a_prompt_is_a_string_or_token_ids(prompt, parsed):
    assert parse_completion_body({**COMPLETION, "prompt": prompt}).prompt == parsed


@pytest.mark.parametrize("prompt, rule", [
    (["a", "b"], "one prompt"),
    ([[1], [2]], "one prompt"),
    ([], "string or an array of token ids"),
    ([1, "a"], "string or an array of token ids"),
    ([True, 2], "string or an array of token ids"),
    ([1.0, 2], "string or an array of token ids"),
    ([-1, 2], "integers >= 0"),
    ({"text": "x"}, "string or an array of token ids"),
    (None, "is required"),
])
def test_a_prompt_we_cannot_run_is_named(prompt, rule):
    error = refused(parse_completion_body, {**COMPLETION, "prompt": prompt})
    assert error.field == "prompt" and rule in error.rule


def test_a_completion_without_max_tokens_gets_openais_default():
    assert parse_completion_body(COMPLETION).max_tokens == COMPLETION_MAX_TOKENS == 16
    assert parse_completion_body({**COMPLETION, "max_tokens": 40}).max_tokens == 40
    assert refused(parse_completion_body, {"model": "m"}).field == "prompt"


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_up_to_four_stop_sequences_are_kept_and_a_fifth_is_refused_not_dropped(endpoint):
    parse, base = PARSERS[endpoint]
    assert parse({**base, "stop": ["a", "b", "c", "k"]}).stop == ("a", "b", "c", "k")
    error = refused(parse, {**base, "stop": ["a", "b", "c", "d", "k"]})
    assert error.field == "stop" and "at most 4" in error.message


def test_a_misspelt_stream_option_is_refused_naming_stream_options_not_the_key():
    error = refused(parse_chat_body, {**CHAT, "stream": True, "stream_options": {"include_usge": True}})
    assert error.field == "stream_options" and "include_usage" in error.message and "usge" not in error.message
    body = parse_chat_body({**CHAT, "stream": True, "stream_options": {"include_usage": True,
                                                                        "include_obfuscation": False}})
    assert body.include_usage
