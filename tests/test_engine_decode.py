"""The engine's decode step and prefill schedule (`provider.engine.decode`) against mlx-lm's, on the tiny model.

Both generators get the same prompts (different lengths, so the batch is left-padded), a second
wave inserted while the first decodes, and sequences that end at different steps (the batch is
filtered under them); every sequence must get the tokens mlx-lm's own `BatchGenerator` gives it.
The engine's schedule puts other prompts into a pass, and moves them to decoding a call sooner, so
a batch's shapes differ from mlx-lm's at some steps: tokens are compared exactly and each choice is
checked to be no near-tie (tests/engine_arithmetic.py). Departures are compared bit for bit with
mlx-lm's own departure code on the same schedule (one computation done twice with the same ops).
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch

from engine_arithmetic import assert_decisive_continuation
from provider.engine.decode import DecodeBatch, EngineBatchGenerator, PrefillBatch
from provider.mlxlm import generation_batch, holds_sequences, prompt_batch

TEXTS = ("a river", "the mountain stream is quiet tonight", "seven", "batch of copper wire and salt stone",
         "north wind", "paper boat on a green lamp garden")
MAX_TOKENS = [12, 5, 9, 14, 3, 10]


def run(generator_class, model, first, second, max_tokens, prefill_step_size=2048, caches=None, calls=None,
        **kwargs):
    """Every sequence's tokens; with `caches` (a dict), each finished sequence's returned cache in it by
    position; with `calls` (a list), per `next()` call the uids whose first token it returned."""
    generator = generator_class(model, completion_batch_size=8, prefill_batch_size=4,
                                prefill_step_size=prefill_step_size, **kwargs)
    out: dict[int, list[int]] = {}
    ended: dict[int, list] = {}
    uids = generator.insert(first, max_tokens=max_tokens[: len(first)])
    steps = 0
    while True:
        _, responses = generator.next()
        steps += 1
        if calls is not None:
            calls.append({r.uid for r in responses if r.uid not in out})
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                ended[r.uid] = r.prompt_cache
        if steps == 3:
            uids += generator.insert(second, max_tokens=max_tokens[len(first):])
        if steps > 3 and not responses and not holds_sequences(generator):
            break
    generator.close()
    if caches is not None:
        caches.update({i: ended[u] for i, u in enumerate(uids)})
    return [out[u] for u in uids]


@pytest.fixture(scope="module")
def loaded(tiny_model_path):
    model, tokenizer = mlx_lm.load(str(tiny_model_path))
    return model, [tokenizer.encode(text) for text in TEXTS]


def test_the_engines_schedule_and_decode_step_give_mlx_lms_tokens(loaded):
    model, prompts = loaded
    theirs = run(BatchGenerator, model, prompts[:4], prompts[4:], MAX_TOKENS)
    for prompt, tokens in zip(prompts, theirs):
        assert_decisive_continuation(model, prompt, tokens, "mlx-lm's BatchGenerator")
    assert run(EngineBatchGenerator, model, prompts[:4], prompts[4:], MAX_TOKENS) == theirs
    # Prompts prefilled a few tokens a pass, joining while others decode; and passes of a few tokens
    # each, so a wave is cut short by the budget: the same tokens.
    assert run(EngineBatchGenerator, model, prompts[:4], prompts[4:], MAX_TOKENS, prefill_step_size=3) == theirs
    assert run(EngineBatchGenerator, model, prompts[:4], prompts[4:], MAX_TOKENS, prefill_tokens=8) == theirs
    assert [len(t) for t in theirs] == MAX_TOKENS  # the tiny model's EOS never wins here: every length is reached


def test_a_wave_is_every_waiting_prompt_and_decodes_from_the_next_call(loaded):
    """mlx-lm prefills at most `prefill_batch_size` prompts a call and moves them to decoding a call
    later; the engine's schedule prefills every waiting prompt that fits its token budget in one pass and
    the next call returns their first tokens."""
    model, prompts = loaded
    ours, theirs = [], []  # six prompts: more than mlx-lm's prefill_batch_size (4 here) takes at once
    run(EngineBatchGenerator, model, prompts, [], [3] * 6, calls=ours)
    run(BatchGenerator, model, prompts, [], [3] * 6, calls=theirs)
    assert not ours[0] and ours[1] == set(range(6))  # one wave, every first token from call 2
    # mlx-lm: the one-token prompt (2) from call 2, three more from call 3, then one a call.
    assert theirs[:5] == [set(), {2}, {0, 1, 3}, {4}, {5}]
    # A budget that the fourth prompt would overflow (4 rows x its 15 tokens): it takes the next pass.
    assert [len(p) - 1 for p in prompts[:4]] == [1, 11, 0, 15]
    cut = []
    run(EngineBatchGenerator, model, prompts[:4], [], [3] * 4, calls=cut, prefill_tokens=36)
    assert cut[:3] == [set(), {0, 1, 2}, {3}]


class MlxLmDepartures(DecodeBatch):
    """The engine's decode step with mlx-lm's own departure code (extract and filter), for comparison."""

    extract_cache = GenerationBatch.extract_cache
    filter = GenerationBatch.filter


class MlxLmDeparturesGenerator(EngineBatchGenerator):
    def __init__(self, model, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.generation_batch = MlxLmDepartures.empty(self.model, self.sampler)

    def _to_decoding(self):
        before = self.generation_batch
        out = super()._to_decoding()
        assert self.generation_batch is before  # extended in place: still the comparison's class
        return out


def test_a_finished_sequence_hands_back_mlx_lms_cache_and_the_batch_reads_its_padding_once(loaded, monkeypatch):
    """Departures: each finished sequence's cache (its KV without the batch's padding) is what mlx-lm's
    departure code gives on the same schedule, to the bit, and the batch reads its left padding from the
    device at most once per change, not per layer."""
    model, prompts = loaded
    reads = []
    read = DecodeBatch._left_padding

    def counted(self):
        before = self._padding_read[0]
        out = read(self)
        reads.append(before is not self._padding_read[0])
        return out

    monkeypatch.setattr(DecodeBatch, "_left_padding", counted)
    ours, theirs = {}, {}
    assert run(EngineBatchGenerator, model, prompts[:4], prompts[4:], MAX_TOKENS, caches=ours) \
        == run(MlxLmDeparturesGenerator, model, prompts[:4], prompts[4:], MAX_TOKENS, caches=theirs)
    assert sorted(ours) == sorted(theirs) == list(range(6))
    for i in ours:
        assert len(ours[i]) == len(theirs[i]) == len(model.layers)
        for a, b in zip(ours[i], theirs[i], strict=True):
            assert a.offset == b.offset and a.keys.shape == b.keys.shape
            assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
    # Six departures, two joins (the waves): the padding is looked up for every departure, and read from
    # the device at most once per join (mlx-lm: twice per layer and departure).
    assert len(reads) >= 6 and 0 < sum(reads) <= 2


def test_the_generator_decodes_with_the_engines_batch(loaded):
    model, _ = loaded
    generator = EngineBatchGenerator(model)
    assert type(generation_batch(generator)) is DecodeBatch and type(prompt_batch(generator)) is PrefillBatch
    generator.close()
    with pytest.raises(ValueError):
        EngineBatchGenerator(model, prefill_tokens=0)


async def test_an_engine_gets_the_gil_back_within_half_a_millisecond(tiny_model_path):
    """CPython hands the GIL to a waiting thread after the switch interval (5 ms by default, a whole
    decode step on a GPU) while another thread runs Python; the engine asks for 0.5 ms, process-wide."""
    import sys

    from provider.engine import Engine
    from provider.engine.engine import GIL_SWITCH_INTERVAL_S

    sys.setswitchinterval(0.005)
    async with Engine():
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S) and GIL_SWITCH_INTERVAL_S <= 0.001
