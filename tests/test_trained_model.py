"""The trained model (SmolLM2-135M-Instruct, float32) through `serve --local`: what random weights cannot
show. Its answers are sentences that end at EOS, its logits have real margins, so the server's greedy
answers must be mlx-lm's own, token for token, however the requests are batched; a schema's answer is
valid JSON of it; a stop string, a stream, logprobs and a prefix-cache hit change nothing they should not."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import mlx_lm
import pytest

from local_server import running_server
from trained_reference import PROMPTS, greedy

MODEL = "demo/tiny"  # local_server's alias, here for the trained model
GREEDY_PROMPTS = 6  # of PROMPTS; benchmarks/trained_bench.py compares all 20
MAX_TOKENS = 16
BATCH = 8  # the server's max_batch_size: a burst of BATCH is a full batch


@pytest.fixture(scope="module")
def server(tmp_path_factory, trained_model_path):
    with running_server(tmp_path_factory.mktemp("trained"), trained_model_path,
                        "--max-batch-size", str(BATCH)) as running:
        yield running


@pytest.fixture(scope="module")
def reference(trained_model_path):
    return mlx_lm.load(str(trained_model_path))


def _status(server) -> dict:
    with urllib.request.urlopen(server.base_url + "/status", timeout=10) as response:
        return json.loads(response.read())


def _ask(client, content: str, **extra):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, **extra)


def test_greedy_answers_are_mlx_lm_s_own_token_for_token_in_one_batch(server, reference):
    model, tokenizer = reference
    prompts = PROMPTS[:min(GREEDY_PROMPTS, BATCH)]
    client = server.client()
    with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: one batch, rows ending at EOS at their own steps
        sent = [pool.submit(_ask, client, p, max_tokens=MAX_TOKENS) for p in prompts]
        wanted = [greedy(model, tokenizer, [{"role": "user", "content": p}], MAX_TOKENS) for p in prompts]
        answers = [f.result() for f in sent]
    finished = {}
    for prompt, answer, want in zip(prompts, answers, wanted):
        text = answer.choices[0].message.content
        same = tokenizer.decode(want.tokens[:want.comparable()])
        assert text.startswith(same), (prompt, text, same)
        if want.comparable() == len(want.tokens):
            assert text == tokenizer.decode(want.tokens), prompt
            assert answer.choices[0].finish_reason == want.finish_reason
            assert answer.usage.completion_tokens == len(want.tokens) + (want.finish_reason == "stop")
        finished.setdefault(answer.choices[0].finish_reason, set()).add(answer.usage.completion_tokens)
    assert "Paris" in answers[0].choices[0].message.content
    assert len(finished.get("stop", ())) >= 2  # ended at EOS, at different steps


def test_a_json_schema_answer_is_valid_json_of_it(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 30}},
              "required": ["name", "age"]}
    answer = _ask(server.client(), "Describe a cat with a name and an age, as JSON.", max_tokens=48,
                  response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    assert answer.choices[0].finish_reason == "stop"


def test_a_stop_string_cuts_the_greedy_answer_where_it_appears(server):
    client = server.client()
    count = "Count from 1 to 10, separated by commas."
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(_ask, client, count, max_tokens=24)
        cut = pool.submit(_ask, client, count, max_tokens=24, stop=[", 5"])
        whole, cut = whole.result().choices[0].message.content, cut.result().choices[0]
    assert ", 5" in whole, whole
    assert cut.message.content == whole[:whole.index(", 5")] and cut.finish_reason == "stop"


def test_the_streamed_text_is_the_whole_text(server):
    client = server.client()
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(_ask, client, "Name three colors.", max_tokens=24)
        stream = _ask(client, "Name three colors.", max_tokens=24, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == whole.result().choices[0].message.content


def test_under_greedy_the_chosen_token_is_the_top_logprob(server):
    answer = _ask(server.client(), "What do bees make?", max_tokens=12, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert content
    for position in content:
        best = max(position.top_logprobs, key=lambda t: t.logprob)
        assert position.token == best.token and position.logprob == pytest.approx(best.logprob)


def test_a_second_turn_from_the_prefix_cache_is_the_cold_answer(server, reference):
    model, tokenizer = reference
    client = server.client()
    # Long enough that what the second turn shares with it is worth reusing (kvcache.manager.REUSE_MIN_TOKENS).
    first = [{"role": "user", "content": "I am planning a trip to Asia next spring and would like to visit a few "
                                         "big cities, see old temples and eat good food. What is the capital of "
                                         "Japan?"}]
    answer = client.chat.completions.create(model=MODEL, messages=first, temperature=0, max_tokens=MAX_TOKENS)
    second = [*first, {"role": "assistant", "content": answer.choices[0].message.content},
              {"role": "user", "content": "And of Italy?"}]
    reused = _status(server)["prefix_cache"]["reused_tokens"]
    warm = client.chat.completions.create(model=MODEL, messages=second, temperature=0, max_tokens=MAX_TOKENS)
    assert _status(server)["prefix_cache"]["reused_tokens"] > reused  # the first turn's KV was reused
    cold = greedy(model, tokenizer, second, MAX_TOKENS)  # mlx-lm from nothing
    text = warm.choices[0].message.content
    assert text.startswith(tokenizer.decode(cold.tokens[:cold.comparable()]))
    if cold.comparable() == len(cold.tokens):
        assert text == tokenizer.decode(cold.tokens)


QUESTIONS = ("Reply with one word: yes or no. Is Paris in France?", "What is 3 plus 4?", "Name one color.",
             "Say hello.", "Is water wet? Answer yes or no.", "What is the capital of Italy?",
             "Count from 1 to 5.", "Name a large animal.")


def test_bursts_that_end_at_eos_at_different_steps_leave_room_for_a_full_batch(server):
    """Requests ending at EOS leave the batch at their own steps (the greedy test's burst did too);
    after them nothing stays reserved, and a whole batch (BATCH requests at once) is admitted without a
    refusal."""
    client = server.client()

    def one(i: int):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], temperature=0,
            max_tokens=6 + (i % 3) * 12)

    with ThreadPoolExecutor(BATCH) as pool:
        answers = list(pool.map(one, range(BATCH)))  # a 503 raises: none may be refused
    ends = {a.usage.completion_tokens for a in answers if a.choices[0].finish_reason == "stop"}
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    assert len(ends) >= 2, ends  # ended at EOS at different steps
    assert _status(server)["ledger"]["count_by_kind"]["request_kv"] == 0
