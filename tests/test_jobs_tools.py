"""Tools through the coordinator's front door: a decrypted job body's `tools` reach
the chat template (counted for admission, rendered for the engine), a tool turn round-trips, and a
model without tool calling refuses them before any accept. No tool text in the logs."""

from __future__ import annotations

import json

import pytest
from mlx_lm.utils import load_tokenizer

from job_harness import Harness, sse_json
from provider.engine import Engine
from provider.jobs import JobOutcome
from provider.models.template import render_ids
from provider.telemetry import capture_redacted_logs
from settings_for import settings_for

CANARY = "CANARY-tools-51ac-SECRET"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": f"The weather {CANARY}",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TURNS = [{"role": "user", "content": "the weather in Oslo?"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": f"seven {CANARY}"}]


@pytest.fixture
async def harness(tiny_model_path, tiny_tools_model_path, tmp_path):
    engine = Engine()
    h = Harness(settings_for(tmp_path, {"tiny": tiny_model_path, "tools": tiny_tools_model_path}), engine)
    yield h
    await h.manager.unload_all()
    await engine.aclose()
    assert len(h.ledger) == 0


def request(model: str, messages: list[dict], **extra) -> dict:
    return {"model": model, "messages": messages, "max_tokens": 3, "temperature": 0, **extra}


async def test_a_tool_turn_reaches_the_template_and_is_counted(harness, tiny_tools_model_path):
    with capture_redacted_logs() as logs:
        outcome = await harness.run(harness.coordinator.request("t1", request("tools", TURNS, tools=[WEATHER])))
        bare = await harness.run(harness.coordinator.request("t2", request("tools", TURNS)))
    assert outcome is bare is JobOutcome.COMPLETED
    usage, bare_usage = harness.of("t1")[-1]["usage"], harness.of("t2")[-1]["usage"]
    # What the template renders (the bounded renderer), with the call's arguments as an object.
    template_turns = [TURNS[0], {"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}, TURNS[2]]
    tokenizer = load_tokenizer(tiny_tools_model_path)
    expected = render_ids(tokenizer, template_turns, add_generation_prompt=True, tools=[WEATHER])
    assert usage["prompt_tokens"] == len(expected) > bare_usage["prompt_tokens"]
    text = tokenizer.decode(expected)
    assert f'"description": "The weather {CANARY}"' in text and "<tool_response>\nseven" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    chunks = [sse_json(e) for e in harness.events("t1")]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    assert logs and CANARY not in json.dumps(logs, default=str)


async def test_tools_to_a_model_without_tool_calling_are_refused_before_the_accept(harness):
    with capture_redacted_logs() as logs:
        outcome = await harness.run(harness.coordinator.request("p1", request("tiny", TURNS, tools=[WEATHER])))
        plain = await harness.run(harness.coordinator.request("p2", request("tiny", TURNS, tools=[WEATHER],
                                                                            tool_choice="none")))
    assert outcome is JobOutcome.REJECTED and plain is JobOutcome.COMPLETED
    (frame,) = harness.of("p1")
    assert (frame["type"], frame["status_code"], frame["failure_code"]) == ("inference_error", 400, "invalid_request")
    assert any(e["event"] == "request_refused" and e.get("kind") == "tools" for e in logs)
    assert CANARY not in json.dumps(logs, default=str)


async def test_a_forced_call_reaches_the_engine_as_its_hook(harness):
    """`required` / a named function: the engine request names the call it must be (constrained
    decoding enforces it); the tools are offered as for `auto`."""
    submitted = []
    submit = harness.engine.submit
    harness.engine.submit = lambda model_id, request, **kw: submitted.append(request) or submit(model_id, request, **kw)
    body = request("tools", TURNS, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert await harness.run(harness.coordinator.request("f1", body)) is JobOutcome.COMPLETED
    (sent,) = submitted
    assert sent.tools == (WEATHER,) and sent.tool_call.format == "json_tools"
    assert sent.tool_call.functions == (WEATHER["function"],) and sent.tool_call.start == "<tool_call>"


async def test_a_forced_answer_cut_by_max_tokens_sends_its_whole_calls_and_never_the_rest_as_content(harness):
    """`required` with parallel calls (the default), cut by max_tokens: the calls that closed go out,
    the one cut is dropped (no markup in `content`), and the finish reason says `length`."""
    time = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    shapes = set()
    for seed in range(12):
        body = request("tools", [{"role": "user", "content": "the weather?"}], tools=[time, WEATHER],
                       tool_choice="required", max_tokens=60, temperature=1.0, seed=seed)
        assert await harness.run(harness.coordinator.request(f"c{seed}", body)) is JobOutcome.COMPLETED
        chunks = [sse_json(e) for e in harness.events(f"c{seed}")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
        assert not any(d.get("content") for d in deltas), seed
        streamed: dict[int, list[str]] = {}
        for part in (p for d in deltas for p in d.get("tool_calls") or ()):
            call = streamed.setdefault(part["index"], ["", ""])
            call[0] += part["function"].get("name") or ""
            call[1] += part["function"].get("arguments") or ""
        calls = [(name, json.loads(arguments)) for name, arguments in streamed.values()]
        assert all(name in ("get_time", "get_weather") and isinstance(args, dict) for name, args in calls)
        finish = chunks[-1]["choices"][0]["finish_reason"]
        cut = chunks[-1]["usage"]["completion_tokens"] == 60
        assert finish == ("length" if cut or not calls else "tool_calls"), seed
        shapes.add((len(calls) > 0, finish))
    assert {(False, "length"), (True, "length")} <= shapes  # the first call cut, and one after a whole call


async def test_a_malformed_tool_choice_is_a_400_before_the_accept(harness):
    body = request("tools", TURNS, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert await harness.run(harness.coordinator.request("m1", body)) is JobOutcome.REJECTED
    (frame,) = harness.of("m1")
    assert (frame["status_code"], frame["failure_code"]) == (400, "invalid_request")
