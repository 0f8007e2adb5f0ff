"""Structured output and log-probabilities through the coordinator's front door (provider/jobs):
the same parser, intake and engine as `serve --local`, the chunks sealed to the consumer."""

from __future__ import annotations

import json

import jsonschema

from job_harness import Harness, chat, sse_json
from provider.engine import Engine
from provider.jobs import JobOutcome
from settings_for import settings_for

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]},
    "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
              "required": ["name"], "additionalProperties": False}},
    "required": ["kind", "legs", "owner"], "additionalProperties": False}


async def test_a_job_with_a_json_schema_streams_valid_json_with_log_probabilities(tiny_model_path, tmp_path):
    engine = Engine()
    h = Harness(settings_for(tmp_path, {"tiny": tiny_model_path}), engine, eos=None)  # the model's own EOS: a grammar ends there
    try:
        body = chat("describe a pet", max_tokens=200, logprobs=True, top_logprobs=2,
                    response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
        assert await h.run(h.coordinator.request("r1", body)) is JobOutcome.COMPLETED
        chunks = [sse_json(e) for e in h.events("r1")]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        entries = [e for c in chunks if "logprobs" in c["choices"][0] for e in c["choices"][0]["logprobs"]["content"]]
        # Where the grammar allows one token only, it is the only alternative (the rest have probability 0).
        assert entries and all(1 <= len(e["top_logprobs"]) <= 2 and e["logprob"] <= 0 for e in entries)
        assert b"".join(bytes(e["bytes"]) for e in entries).decode().removeprefix(" ") == text

        bad = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
        assert await h.run(h.coordinator.request("r2", bad)) is JobOutcome.REJECTED
        (error,) = h.of("r2")
        assert error["type"] == "inference_error" and error["status_code"] == 400
    finally:
        await h.manager.unload_all()
        await engine.aclose()
    assert len(h.ledger) == 0  # the grammar's reservation given back
