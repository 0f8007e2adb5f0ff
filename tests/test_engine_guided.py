"""Grammar masks and log-probabilities per row of the batched decode step (provider/engine/guided.py).

The tiny model's weights are random: whatever it prefers, a constrained row's output must parse
and validate, and a plain row beside it must get exactly the tokens it gets without it.
"""

from __future__ import annotations

import json
import math

import jsonschema
import mlx.core as mx
import mlx_lm
import pytest

from engine_arithmetic import assert_decisive_continuation
from provider.engine import ChatRequest, Engine, Finished, FinishReason, SamplingParams, TextDelta
from provider.engine.decode import EngineBatchGenerator
from provider.engine.guided import RowGuide
from provider.grammar import GrammarCache, TokenTable, json_object_grammar, json_schema_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -2, "maximum": 3, "multipleOf": 0.25},
        "kind": {"enum": ["cat", "dog", "eel"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "home": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 10, "maximum": 99}},
                 "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "kind", "home"],
    "additionalProperties": False,
}
ROOM = 300  # tokens: more than the schema's longest sentence (every string and array at its bound)
PROMPTS = ["a river", "the mountain stream is quiet tonight", "seven", "batch of copper wire and salt stone",
           "north wind", "paper boat on a green lamp garden"]


@pytest.fixture(scope="module")
def loaded(tiny_model_path):
    return mlx_lm.load(str(tiny_model_path))


@pytest.fixture(scope="module")
def table(loaded) -> TokenTable:
    return TokenTable.of(loaded[1])


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    return GrammarCache()


PLAIN_TOKENS = 40  # a plain row's length: no near-tie of two paths' arithmetic within it on these prompts


def generate(model, eos, prompts, max_tokens, guides, second=(), second_guides=()):
    """Every sequence's tokens from one EngineBatchGenerator, a second wave inserted at step 3; a
    constrained row may take `max_tokens`, a plain one PLAIN_TOKENS."""
    generator = EngineBatchGenerator(model, stop_tokens=[[t] for t in eos], completion_batch_size=8,
                                     prefill_batch_size=4)
    out: dict[int, list[int]] = {}
    finish: dict[int, str] = {}

    def insert(ps, gs):
        return generator.insert(ps, max_tokens=[max_tokens if g else PLAIN_TOKENS for g in gs],
                                logits_processors=[[g] if g else [] for g in gs])

    uids = insert(prompts, guides)
    steps = 0
    while True:
        _, responses = generator.next()
        steps += 1
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason:
                finish[r.uid] = r.finish_reason
        if steps == 3 and second:
            uids += insert(second, second_guides)
        if steps > 3 and len(finish) == len(uids):
            break
    generator.close()
    return [out[u] for u in uids], [finish[u] for u in uids]


def decoded(table: TokenTable, tokens: list[int]) -> str:
    return b"".join(table.token_bytes(t) for t in tokens if t not in table.eos_ids).decode()


def test_a_constrained_row_does_not_change_the_plain_rows_beside_it(loaded, table, cache):
    model, tokenizer = loaded
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    eos = sorted(table.eos_ids)
    grammar = json_schema_grammar(SCHEMA)
    guides = [None, RowGuide(cache.constraint(table, grammar)), None, RowGuide(cache.constraint(table, grammar))]
    second_guides = [RowGuide(cache.constraint(table, json_object_grammar()), top_logprobs=3), None]
    mixed, reasons = generate(model, eos, prompts[:4], ROOM, guides, prompts[4:], second_guides)
    alone, _ = generate(model, eos, [prompts[0], prompts[2]], ROOM, [None, None], [prompts[5]], [None])
    assert [mixed[0], mixed[2], mixed[5]] == alone
    for i in (0, 2, 5):  # the tokens compared must not hang on a near-tie of two paths' arithmetic
        assert_decisive_continuation(model, prompts[i], mixed[i], PROMPTS[i])
    for i in (1, 3):
        assert reasons[i] == "stop" and mixed[i][-1] in table.eos_ids
        jsonschema.validate(json.loads(decoded(table, mixed[i])), SCHEMA)
    assert reasons[4] == "length" or isinstance(json.loads(decoded(table, mixed[4])), dict)


def test_the_first_token_is_constrained_too(loaded, table, cache):
    """The prompt's own pass picks the first token: it must already be the grammar's."""
    model, tokenizer = loaded
    enum = {"enum": ["zebra", "yak"]}
    tokens, reasons = generate(model, sorted(table.eos_ids), [tokenizer.encode("hello")], 20,
                               [RowGuide(cache.constraint(table, json_schema_grammar(enum)))])
    assert reasons == ["stop"] and json.loads(decoded(table, tokens[0])) in enum["enum"]


def messages(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


async def collect(stream):
    text, deltas, done = [], [], None
    async for event in stream:
        match event:
            case TextDelta(t, logprobs):
                text.append(t)
                deltas.append(logprobs)
            case Finished() as done:
                pass
    return "".join(text), deltas, done


@pytest.mark.parametrize("solo_min_tokens", [0, 1])  # 0: prompts prefilled in the batch; 1: alone
async def test_the_engine_serves_constrained_and_plain_requests_together(tiny_model_path, loaded, table, cache,
                                                                        solo_min_tokens):
    released: list[str] = []
    grammar = json_schema_grammar(SCHEMA)
    async with Engine(solo_min_tokens=solo_min_tokens) as engine:
        await engine.load("tiny", tiny_model_path)
        streams = []
        for i, content in enumerate(PROMPTS):
            constraint = None
            if i % 2:
                constraint = cache.constraint(table, grammar, release=lambda rid=f"r{i}": released.append(rid))
            params = SamplingParams(max_tokens=ROOM, temperature=0.0 if i < 4 else 0.9, seed=i)
            streams.append(engine.submit("tiny", ChatRequest(f"r{i}", messages(content), params, constraint=constraint)))
        results = [await collect(s) for s in streams]
    for i, (text, _, done) in enumerate(results):
        if i % 2:
            assert done.reason is FinishReason.STOP
            jsonschema.validate(json.loads(text), SCHEMA)
    assert sorted(released) == ["r1", "r3", "r5"]  # each reservation given back once, by the engine


async def test_max_tokens_cuts_a_constrained_answer_with_length(tiny_model_path, table, cache):
    async with Engine() as engine:
        await engine.load("tiny", tiny_model_path)
        request = ChatRequest("r", messages("hi"), SamplingParams(max_tokens=4, temperature=0.0),
                              constraint=cache.constraint(table, json_schema_grammar(SCHEMA)))
        text, _, done = await collect(engine.submit("tiny", request))
    assert done.reason is FinishReason.LENGTH and done.usage.completion_tokens == 4
    assert text and (text.startswith('{"name": "') or '{"name": "'.startswith(text))  # the grammar's start, cut
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@pytest.mark.parametrize("solo_min_tokens", [0, 1])
async def test_log_probabilities_come_with_the_tokens_of_each_delta(tiny_model_path, loaded, solo_min_tokens):
    model, tokenizer = loaded
    async with Engine(solo_min_tokens=solo_min_tokens) as engine:
        await engine.load("tiny", tiny_model_path)
        asked = engine.submit("tiny", ChatRequest("a", messages("a river"), SamplingParams(max_tokens=12, temperature=0.0),
                                                  top_logprobs=5))
        none = engine.submit("tiny", ChatRequest("b", messages("a river"), SamplingParams(max_tokens=12, temperature=0.0)))
        zero = engine.submit("tiny", ChatRequest("c", messages("seven"), SamplingParams(max_tokens=12, temperature=0.7,
                                                                                         seed=3), top_logprobs=0))
        (text, deltas, done), (plain_text, plain_deltas, _), (_, zero_deltas, zero_done) = \
            [await collect(s) for s in (asked, none, zero)]
    assert text == plain_text and all(d == () for d in plain_deltas)  # asking changes nothing else
    entries = [e for d in deltas for e in d]
    assert [e.token for e in entries] == [t for t in done.completion_ids if t not in table_eos(tokenizer)]
    prompt = tokenizer.apply_chat_template(messages("a river"), add_generation_prompt=True)
    logits = model(mx.array([prompt + list(done.completion_ids[:-1])]))[0, len(prompt) - 1:]
    scores = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for step, entry in enumerate(entries):
        assert len(entry.top) == 5 and entry.top[0] == (entry.token, pytest.approx(entry.logprob))  # greedy
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        assert entry.logprob == pytest.approx(scores[step, entry.token].item(), abs=1e-4)
        assert sum(math.exp(v) for _, v in entry.top) <= 1 + 1e-5
    zero_entries = [e for d in zero_deltas for e in d]
    assert len(zero_entries) == len(zero_done.completion_ids) - (zero_done.completion_ids[-1] in table_eos(tokenizer))
    assert all(e.top == () and e.logprob <= 0 for e in zero_entries)


def table_eos(tokenizer) -> set[int]:
    return set(tokenizer.eos_token_ids)


async def test_constrained_log_probabilities_are_over_what_the_grammar_allows(tiny_model_path, table, cache):
    async with Engine() as engine:
        await engine.load("tiny", tiny_model_path)
        request = ChatRequest("r", messages("hi"), SamplingParams(max_tokens=40, temperature=0.0), top_logprobs=20,
                              constraint=cache.constraint(table, json_schema_grammar({"enum": ["yes", "no"]})))
        text, deltas, _ = await collect(engine.submit("tiny", request))
    first = deltas[0][0]
    assert json.loads(text) in ("yes", "no")
    assert all(table.token_bytes(t).startswith(b'"') for t, _ in first.top)  # only what the grammar allows
    assert sum(math.exp(v) for _, v in first.top) == pytest.approx(1.0, abs=1e-4)  # renormalized over them


async def test_a_vision_model_refuses_a_guide_and_gives_its_reservation_back(tiny_vlm_path, table, cache):
    released = []
    async with Engine() as engine:
        await engine.load("vlm", tiny_vlm_path, vision=True)
        request = ChatRequest("r", messages("hi"), SamplingParams(max_tokens=4),
                              constraint=cache.constraint(table, json_object_grammar(), release=lambda: released.append(1)))
        _, failed = await engine.submit("vlm", request).collect()
        _, failed_logprobs = await engine.submit("vlm", ChatRequest("q", messages("hi"), SamplingParams(max_tokens=4),
                                                                    top_logprobs=1)).collect()
    assert failed.code.value == failed_logprobs.code.value == "invalid_request" and released == [1]
