"""The engine's decode step (`provider.engine.decode`, issue 30 item 2) against mlx-lm's, on the tiny model.

Both generators get the same prompts (different lengths, so the batch is left-padded), a second
wave inserted while the first decodes, and sequences that end at different steps (the batch is
filtered under them); every sequence must get exactly the tokens mlx-lm's own `BatchGenerator`
gives it, step for step. The comparison is of one computation done twice with the same ops in the
same order (the engine's step reuses mlx-lm's arithmetic), so it is exact on any BLAS.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator

from provider.engine.decode import DecodeBatch, EngineBatchGenerator, PrefillBatch


def run(generator_class, model, first, second, max_tokens, prefill_step_size=2048, caches=None):
    """Every sequence's tokens; with `caches` (a dict), each finished sequence's returned cache in it by position."""
    generator = generator_class(model, completion_batch_size=8, prefill_batch_size=4,
                                prefill_step_size=prefill_step_size)
    out: dict[int, list[int]] = {}
    ended: dict[int, list] = {}
    uids = generator.insert(first, max_tokens=max_tokens[: len(first)])
    steps = 0
    while True:
        _, responses = generator.next()
        steps += 1
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                ended[r.uid] = r.prompt_cache
        if steps == 3:
            uids += generator.insert(second, max_tokens=max_tokens[len(first):])
        if steps > 3 and not responses and not generator._unprocessed_sequences \
                and not len(generator._prompt_batch) and not len(generator._generation_batch):
            break
    generator.close()
    if caches is not None:
        caches.update({i: ended[u] for i, u in enumerate(uids)})
    return [out[u] for u in uids]


def test_the_engines_decode_step_gives_mlx_lms_tokens(tiny_model_path):
    model, tokenizer = mlx_lm.load(str(tiny_model_path))
    prompts = [tokenizer.encode(text) for text in (
        "a river", "the mountain stream is quiet tonight", "seven", "batch of copper wire and salt stone",
        "north wind", "paper boat on a green lamp garden")]
    max_tokens = [12, 5, 9, 14, 3, 10]
    ours = run(EngineBatchGenerator, model, prompts[:4], prompts[4:], max_tokens)
    theirs = run(BatchGenerator, model, prompts[:4], prompts[4:], max_tokens)
    assert ours == theirs
    # Prompts prefilled a few tokens a step, joining while others decode, give the same tokens too.
    assert run(EngineBatchGenerator, model, prompts[:4], prompts[4:], max_tokens, prefill_step_size=3) \
        == run(BatchGenerator, model, prompts[:4], prompts[4:], max_tokens, prefill_step_size=3) == theirs
    assert [len(t) for t in ours] == max_tokens  # the tiny model's EOS never wins here: every length is reached


def test_a_finished_sequence_hands_back_mlx_lms_cache_and_the_batch_reads_its_padding_once(tiny_model_path,
                                                                                             monkeypatch):
    """Departures: each finished sequence's cache (its KV without the batch's padding) is mlx-lm's, to the
    bit, and the batch reads its left padding from the device at most once per change, not per layer."""
    model, tokenizer = mlx_lm.load(str(tiny_model_path))
    prompts = [tokenizer.encode(text) for text in (
        "a river", "the mountain stream is quiet tonight", "seven", "batch of copper wire and salt stone",
        "north wind", "paper boat on a green lamp garden")]
    max_tokens = [12, 5, 9, 14, 3, 10]
    reads = []
    read = DecodeBatch._left_padding

    def counted(self):
        before = self._padding_read[0]
        out = read(self)
        reads.append(before is not self._padding_read[0])
        return out

    monkeypatch.setattr(DecodeBatch, "_left_padding", counted)
    ours, theirs = {}, {}
    assert run(EngineBatchGenerator, model, prompts[:4], prompts[4:], max_tokens, caches=ours) \
        == run(BatchGenerator, model, prompts[:4], prompts[4:], max_tokens, caches=theirs)
    assert sorted(ours) == sorted(theirs) == list(range(6))
    for i in ours:
        assert len(ours[i]) == len(theirs[i]) == len(model.layers)
        for a, b in zip(ours[i], theirs[i], strict=True):
            assert a.offset == b.offset and a.keys.shape == b.keys.shape
            assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
    # Six departures, two joins (the waves): the padding is looked up for every departure, and read from
    # the device at most once per join (mlx-lm: twice per layer and departure).
    assert len(reads) >= 6 and 0 < sum(reads) <= 2


def test_the_generator_decodes_with_the_engines_batch(tiny_model_path):
    model, _ = mlx_lm.load(str(tiny_model_path))
    generator = EngineBatchGenerator(model)
    assert type(generator._generation_batch) is DecodeBatch and type(generator._prompt_batch) is PrefillBatch
    generator.close()


async def test_an_engine_gets_the_gil_back_within_half_a_millisecond(tiny_model_path):
    """CPython hands the GIL to a waiting thread after the switch interval (5 ms by default, a whole
    decode step on a GPU) while another thread runs Python; the engine asks for 0.5 ms, process-wide."""
    import sys

    from provider.engine import Engine
    from provider.engine.engine import GIL_SWITCH_INTERVAL_S

    sys.setswitchinterval(0.005)
    async with Engine():
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S) and GIL_SWITCH_INTERVAL_S <= 0.001
