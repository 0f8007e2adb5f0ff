"""`response_format` and `logprobs` in the one body parser (provider/request/body.py, response_format.py)."""

from __future__ import annotations

import dataclasses

import pytest

from provider.request.body import InvalidBody, parse_chat_body

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def body(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def refused(**extra) -> InvalidBody:
    with pytest.raises(InvalidBody) as caught:
        parse_chat_body(body(**extra))
    return caught.value


def test_text_or_nothing_is_no_constraint():
    assert parse_chat_body(body()).response_format is None
    assert parse_chat_body(body(response_format={"type": "text"})).response_format is None


def test_json_object_and_json_schema_become_grammars():
    plain = parse_chat_body(body(response_format={"type": "json_object"})).response_format
    schema = parse_chat_body(body(response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}})).response_format
    assert plain.kind == "json_object" and schema.kind == "json_schema" and plain.grammar != schema.grammar
    no_schema = parse_chat_body(body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}))
    assert no_schema.response_format.grammar == plain.grammar  # no schema: any object


@pytest.mark.parametrize(("response_format", "field"), [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [SCHEMA]}}, "response_format.json_schema.schema"),
])
def test_a_malformed_response_format_names_its_part(response_format, field):
    assert refused(response_format=response_format).field == field


def test_a_schema_the_engine_cannot_handle_is_a_400_naming_response_format_and_never_quoting_it():
    secret = "CANARY-schema-7f3a"
    caught = refused(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {secret: {"type": "strin"}}}}})
    assert caught.field == "response_format" and secret not in caught.message and "strin" not in caught.message
    assert caught.message == ("Invalid parameter 'response_format': must be a JSON schema the grammar engine "
                              "supports (json_schema.schema).")


def test_logprobs_and_top_logprobs():
    assert parse_chat_body(body()).top_logprobs is None
    assert parse_chat_body(body(logprobs=False)).top_logprobs is None
    assert parse_chat_body(body(logprobs=True)).top_logprobs == 0
    assert parse_chat_body(body(logprobs=True, top_logprobs=20)).top_logprobs == 20
    assert refused(top_logprobs=3).field == "top_logprobs"  # OpenAI: logprobs must be true with it
    assert refused(logprobs=True, top_logprobs=21).message == \
        "Invalid parameter 'top_logprobs': must be an integer from 0 to 20."
    assert refused(logprobs="yes").field == "logprobs"
    assert refused(logprobs=True, top_logprobs=2.0).field == "top_logprobs"


# -- the intake's output step (provider/request/output.py) ----------------------------------------

from intake_fakes import Manager, ledger_of  # noqa: E402
from memory import ReservationKind  # noqa: E402
from memory.grammar import grammar_bytes  # noqa: E402
from protocol.errors import RejectionReason  # noqa: E402
from provider.request import PromptCounter  # noqa: E402
from provider.request.intake import Intake, Refusal  # noqa: E402
from provider.request.lanes import BulkLane  # noqa: E402


@pytest.fixture
def intake_of(tiny_model_path):
    counters = []

    def make(ledger, vision=()):
        counter = PromptCounter({"m": tiny_model_path}, lane=BulkLane(max_waiting=1), vision=vision)
        counters.append(counter)
        return Intake(counter, ledger, Manager())

    yield make
    for c in counters:
        c.lane.close()


def schema_body(**extra):
    return parse_chat_body(body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                                **extra))


async def test_a_grammar_reserves_its_memory_until_whoever_holds_it_lets_go(intake_of):
    ledger = ledger_of(64)
    intake = intake_of(ledger)
    plan = await intake.output("r1", schema_body())
    table = intake.grammars.table("m")
    assert ledger.bytes_of("grammar:r1") == grammar_bytes(table.vocab_size)
    assert ledger.snapshot().bytes_by_kind[ReservationKind.GRAMMAR] == grammar_bytes(table.vocab_size)
    again = await intake.output("r2", schema_body())  # the same schema: a copy of the compiled grammar
    assert intake.grammars.cache.hits == 1 and again.constraint is not plan.constraint
    plan.release()
    plan.constraint.release()  # the engine and the front door may both let go: once is counted
    again.release()
    assert len(ledger) == 0


async def test_no_room_for_the_grammar_is_a_503_and_holds_nothing(intake_of):
    ledger = ledger_of(64)
    intake = intake_of(ledger)
    room = ledger.available_bytes()
    assert ledger.reserve("other", ReservationKind.PROMPT, room - grammar_bytes(2048) // 2).granted
    with pytest.raises(Refusal) as refused:
        await intake.output("r1", schema_body())
    assert refused.value.failure.rejection is RejectionReason.MEMORY_CAP and refused.value.failure.status_code == 503
    assert ledger.bytes_of("grammar:r1") is None and len(ledger) == 1


async def test_log_probabilities_need_no_reservation_but_the_vocabulary(intake_of):
    ledger = ledger_of(64)
    intake = intake_of(ledger)
    plan = await intake.output("r1", parse_chat_body(body(logprobs=True, top_logprobs=4)))
    assert (plan.constraint, plan.top_logprobs) == (None, 4) and len(ledger) == 0
    assert intake.grammars.table("m").token_bytes(intake.grammars.table("m").encode("hi")[0])
    assert (await intake.output("r2", parse_chat_body(body()))).top_logprobs is None


async def test_a_vision_model_takes_neither(intake_of):
    intake = intake_of(ledger_of(64), vision={"m"})
    with pytest.raises(InvalidBody) as caught:
        await intake.output("r1", schema_body())
    assert (caught.value.field, caught.value.rule) == ("response_format", "is not supported by this model")
    with pytest.raises(InvalidBody) as caught:
        await intake.output("r2", parse_chat_body(body(logprobs=True)))
    assert caught.value.field == "logprobs"


# --- a forced tool call: its grammar, compiled and reserved by the same step

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"]}}}


@pytest.fixture
def tools_intake(tiny_tools_model_path):
    counter = PromptCounter({"m": tiny_tools_model_path}, lane=BulkLane(max_waiting=1))
    yield Intake(counter, ledger_of(64), Manager())
    counter.lane.close()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_a_forced_call_is_a_grammar_reserved_like_any_other(tools_intake, choice):
    plan = await tools_intake.output("r1", parse_chat_body(body(tools=[TOOL], tool_choice=choice)))
    table = tools_intake.grammars.table("m")
    assert plan.constraint is not None and tools_intake.ledger.bytes_of("grammar:r1") == grammar_bytes(table.vocab_size)
    plan.release()
    assert len(tools_intake.ledger) == 0
    for free in ("auto", "none"):  # the model may answer freely: no grammar
        assert (await tools_intake.output("r2", parse_chat_body(body(tools=[TOOL], tool_choice=free)))).constraint is None


async def test_a_family_with_no_call_grammar_is_a_400_naming_tool_choice(tools_intake, monkeypatch):
    real = tools_intake.counter.tool_format

    async def pythonic(model_id):  # a family whose calls are Python expressions: no grammar for them here
        return dataclasses.replace(await real(model_id), name="pythonic")

    monkeypatch.setattr(tools_intake.counter, "tool_format", pythonic)
    with pytest.raises(InvalidBody) as caught:
        await tools_intake.output("r1", parse_chat_body(body(tools=[TOOL], tool_choice="required")))
    assert caught.value.field == "tool_choice" and len(tools_intake.ledger) == 0


async def test_parameters_the_grammar_engine_rejects_and_a_response_format_beside_are_400s(tools_intake):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "string"}}}}
    with pytest.raises(InvalidBody) as caught:
        await tools_intake.output("r1", parse_chat_body(body(tools=[bad], tool_choice="required")))
    assert caught.value.field == "tool_choice"
    with pytest.raises(InvalidBody) as caught:
        await tools_intake.output("r2", parse_chat_body(body(tools=[TOOL], tool_choice="required",
                                                              response_format={"type": "json_object"})))
    assert caught.value.field == "response_format" and len(tools_intake.ledger) == 0
