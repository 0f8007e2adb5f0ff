"""Quantized KV inside the running batch (kvcache/quantized.py), on the tiny model.

The engine's generator runs prompts of different lengths (left-padded rows), a second wave joining
while the first decodes and rows leaving at different steps, with every layer's KV quantized. Each
row's quantized KV is the same whatever batch it is in, so a batch must give each sequence the
tokens it gets decoding alone at the same setting (compared exactly, each choice checked to be no
near-tie), every finished sequence's cache must be its own quantized KV, and the batch must hold the
quantized bytes, not the model dtype's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from engine_arithmetic import StepLogits, assert_decisive
from engine_reference import messages
from kvcache.bits import KvBits
from kvcache.quantized import BatchQuantizedKVCache, PromptQuantizedKVCache, make_quantized_cache, quantizable
from provider.engine import ChatRequest, Engine, EngineError, EngineFailure, Finished, SamplingParams, loading
from provider.engine.decode import EngineBatchGenerator
from provider.mlxlm import generation_batch, holds_sequences
from provider.models.kv import kv_quantization_bits, quantized_bytes_per_element

Q8, Q4 = KvBits(8, 8), KvBits(8, 4)  # the settings' forms: keys at 8 bits, values at 8 (q8) or 4 (q4), groups of 32

TEXTS = ("a river", "the mountain stream is quiet tonight", "seven", "batch of copper wire and salt stone",
         "north wind", "paper boat on a green lamp garden")
MAX_TOKENS = [12, 5, 9, 14, 3, 10]


@pytest.fixture(scope="module")
def loaded(tiny_model_path):
    model, tokenizer = mlx_lm.load(str(tiny_model_path))
    return model, [tokenizer.encode(text) for text in TEXTS]


def run(model, bits, first, second, max_tokens, seen=None, ended=None, logits=None):
    """Every sequence's tokens; `seen` gets the decode batch's first layer cache at every step; with
    `logits` (a list), each sequence's step logits (`StepLogits`) are kept in it."""
    generator = EngineBatchGenerator(model, stop_tokens=None, completion_batch_size=8, prefill_batch_size=8)

    def insert(prompts, limits):
        caches = [make_quantized_cache(model, bits) for _ in prompts] if bits else None
        processors = None
        if logits is not None:
            logits.extend(StepLogits() for _ in prompts)
            processors = [[p] for p in logits[-len(prompts):]]
        return generator.insert(prompts, max_tokens=limits, caches=caches, logits_processors=processors)

    out: dict[int, list[int]] = {}
    uids = insert(first, max_tokens[: len(first)])
    steps = 0
    while True:
        _, responses = generator.next()
        steps += 1
        if seen is not None and generation_batch(generator).prompt_cache:
            seen.append(generation_batch(generator).prompt_cache[0])
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None and ended is not None:
                ended[r.uid] = r.prompt_cache
        if steps == 3 and second:
            uids += insert(second, max_tokens[len(first):])
        if steps > 3 and not responses and not holds_sequences(generator):
            break
    generator.close()
    return [out[u] for u in uids], uids


@pytest.mark.parametrize("setting", ["q8", "q4"])
def test_a_quantized_batch_gives_each_sequence_its_tokens_alone(loaded, setting):
    model, prompts = loaded
    bits = kv_quantization_bits(setting)
    seen, ended = [], {}
    batched, uids = run(model, bits, prompts[:4], prompts[4:], MAX_TOKENS, seen=seen, ended=ended)
    alone = []
    for p, n in zip(prompts, MAX_TOKENS):
        steps = []
        (tokens,), _ = run(model, bits, [p], [], [n], logits=steps)
        assert_decisive(steps[0].scores(), tokens, f"{setting} alone")  # the batch computes it another way
        alone.append(tokens)
    assert batched == alone
    assert [len(t) for t in batched] == MAX_TOKENS
    assert seen and all(type(c) is BatchQuantizedKVCache and c.kv_bits == bits for c in seen)
    # Each finished sequence hands back its own quantized KV: exactly prompt + completion - 1 tokens.
    for uid, prompt, tokens in zip(uids, prompts, batched):
        cache = ended[uid]
        assert all(type(c) is PromptQuantizedKVCache and c.kv_bits == bits for c in cache)
        assert cache[0].offset == cache[0].keys[0].shape[2] == len(prompt) + len(tokens)


def test_the_batch_holds_quantized_bytes(loaded):
    model, prompts = loaded
    sizes = {}
    for setting in ("none", "q8", "q4"):
        seen = []
        run(model, kv_quantization_bits(setting), prompts[:4], [], MAX_TOKENS[:4], seen=seen)
        sizes[setting] = max(c.nbytes for c in seen)
    dtype_bytes = 4  # the tiny model is float32
    for setting in ("q8", "q4"):
        expected = quantized_bytes_per_element(kv_quantization_bits(setting), dtype_bytes) / dtype_bytes
        assert sizes[setting] / sizes["none"] == pytest.approx(expected, rel=0.02)


def test_a_sequences_cache_merges_into_a_batch_as_it_was(loaded):
    """A prompt's quantized KV (as the prefix cache or a solo prefill hands it over) joins a batch
    right-aligned, its values as they were, and comes back out unchanged; KV of other bits never joins."""
    model, prompts = loaded
    caches = []
    for p in prompts[:3]:
        cache = make_quantized_cache(model, Q4)
        model(mx.array([p]), cache=cache)
        caches.append(cache)
    layer = BatchQuantizedKVCache.merge([c[0] for c in caches])
    lengths = [len(p) for p in prompts[:3]]
    assert layer.left_padding.tolist() == [max(lengths) - n for n in lengths]
    for i, c in enumerate(caches):
        back = layer.extract(i)
        assert back.offset == c[0].offset
        for a, b in zip((*back.keys, *back.values), (*c[0].keys, *c[0].values)):
            assert mx.array_equal(a, b[..., : c[0].offset, :]).item()
    other = make_quantized_cache(model, Q8)
    model(mx.array([prompts[3]]), cache=other)
    with pytest.raises(ValueError):
        BatchQuantizedKVCache.merge([caches[0][0], other[0]])
    with pytest.raises(ValueError):
        layer.extend(BatchQuantizedKVCache.merge([other[0]]))


def test_settings_and_figures():
    assert [kv_quantization_bits(s) for s in ("none", "q8", "q4")] == [None, Q8, Q4]
    with pytest.raises(ValueError):
        kv_quantization_bits("q6")
    # bfloat16, a row of 64: a key at 8 bits 64 + 2 groups x (scale + bias) x 2 bytes = 72 bytes, a value
    # at 4 bits 40, where each was 128
    assert quantized_bytes_per_element(Q8, 2) == pytest.approx(72 / 64)
    assert quantized_bytes_per_element(Q4, 2) == pytest.approx((72 + 40) / 128)
    assert issubclass(PromptQuantizedKVCache, QuantizedKVCache)
    assert KvBits.from_json(Q4.as_json()) == Q4 and Q4.as_json() == {"keys": 8, "values": 4, "group_size": 32}
    for bad in ({"keys": 8, "values": 4}, {"keys": 8, "values": 7, "group_size": 32}, [8, 4, 32],
                {"keys": "8", "values": 4, "group_size": 32}):
        with pytest.raises(ValueError):
            KvBits.from_json(bad)
    with pytest.raises(ValueError):
        KvBits(8, 4, 16)  # mx.quantize takes groups of 32, 64 and 128


def test_only_plain_kv_models_are_quantizable(loaded):
    model, _ = loaded
    assert quantizable(model)


@pytest.mark.parametrize("solo", [0, 1], ids=["batched-prefill", "solo-prefill"])
async def test_the_engine_serves_a_quantized_model(tiny_model_path, loaded, solo):
    """`Engine.load(kv_bits=Q4)`: concurrent requests (prefilled in the batch's waves, or each alone and
    joining the batch with its quantized KV) get the tokens the quantized generator gives them alone."""
    model, _ = loaded
    texts = TEXTS[1::2]
    async with Engine(solo_min_tokens=solo) as engine:
        info = await engine.load("m", tiny_model_path, eos_token_ids=frozenset(), kv_bits=Q4)
        assert info.kv_bits == Q4
        streams = [engine.submit("m", ChatRequest(f"r{i}", messages(t), SamplingParams(max_tokens=8, temperature=0)))
                   for i, t in enumerate(texts)]
        done = [await s.collect() for s in streams]
        assert all(isinstance(fin, Finished) for _, fin in done)
        tokenizer = mlx_lm.load(str(tiny_model_path))[1]
        for (_, fin), t in zip(done, texts):
            prompt = tokenizer.apply_chat_template(messages(t), add_generation_prompt=True)
            steps = []
            (alone,), _ = run(model, Q4, [prompt], [], [8], logits=steps)
            assert_decisive(steps[0].scores(), alone, "q4 alone")
            assert list(fin.completion_ids) == alone


async def test_a_vision_model_or_a_cache_that_is_not_plain_kv_refuses_quantization(tiny_model_path, monkeypatch):
    monkeypatch.setattr(loading, "quantizable", lambda model: False)
    async with Engine() as engine:
        with pytest.raises(EngineError) as refused:
            await engine.load("m", tiny_model_path, kv_bits=Q4)
        assert refused.value.code is EngineFailure.LOAD_FAILED
        with pytest.raises(EngineError) as vision:
            await engine.load("v", tiny_model_path, vision=True, kv_bits=Q8)
        assert vision.value.code is EngineFailure.LOAD_FAILED
        info = await engine.load("m", tiny_model_path)  # the refusal left nothing behind
        assert info.kv_bits is None


async def test_the_prefix_cache_keeps_and_reuses_quantized_sequences(tiny_model_path, loaded):
    """A quantized model's finished sequences go to the prefix cache quantized (the ledger holds their
    quantized bytes), a repeated prompt reuses them with the tokens a run without the cache gives, and
    an entry of another setting is never handed to the batch."""
    from kvcache import state
    from kvcache.manager import KvCacheManager
    from memory.ledger import Ledger, ReservationKind
    from memory.policy import GiB, figures
    from memory.snapshot import MemorySnapshot
    from provider.engine.reuse import PrefixReuse

    idle = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB)
    chat = [{"role": "system", "content": " ".join(["the river model token batch stream is blue"] * 12)},
            {"role": "user", "content": "hello there"}]
    params = SamplingParams(max_tokens=8, temperature=0)
    async with Engine() as plain:
        await plain.load("m", tiny_model_path, eos_token_ids=frozenset(), kv_bits=Q8)
        _, expected = await plain.submit("m", ChatRequest("x", chat, params)).collect()
    ledger = Ledger(figures(16 * GiB, env={}), sample=lambda: idle)
    manager = KvCacheManager(ledger)
    async with Engine(prefix_cache=manager.get) as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=frozenset(), kv_bits=Q8)
        kv = manager.attach("m", "weights")
        _, first = await engine.submit("m", ChatRequest("a", chat, params)).collect()
        [key] = list(kv.ram._index.keys_lru())
        entry = kv.ram.entry(key)
        assert state.quantization(entry) == Q8 and state.cache_tokens(entry) == len(key)
        held = ledger.snapshot().bytes_by_kind[ReservationKind.PREFIX_CACHE]
        float32_bytes = len(key) * 2 * 2 * 2 * 64 * 4  # 2 layers x (K, V) x 2 KV heads x 64 x float32
        assert held == state.cache_nbytes(entry) == float32_bytes * quantized_bytes_per_element(Q8, 4) / 4
        _, again = await engine.submit("m", ChatRequest("b", chat, params)).collect()
        assert again.cached_tokens == first.usage.prompt_tokens - 1
        assert PrefixReuse(manager.get).reuse("m", list(key) + [1], kv_bits=Q4).cache is None
        assert PrefixReuse(manager.get).reuse("m", list(key) + [1], kv_bits=KvBits(8, 8, 64)).cache is None
        assert PrefixReuse(manager.get).reuse("m", list(key) + [1], kv_bits=None).cache is None
        await engine.unload("m")
        manager.purge("m")
    assert list(first.completion_ids) == list(again.completion_ids) == list(expected.completion_ids)
    assert len(ledger) == 0


def test_a_quantized_sequence_round_trips_through_the_ssd_tier(loaded, tmp_path):
    """Host bytes and back (what the SSD tier's writer and a read do), sealed on disk and opened again:
    the same quantized KV, the same type, the same bits (the keys' and the values' their own)."""
    from kvcache import state
    from kvcache.disk import DiskBudget
    from kvcache.ssd import SsdStore
    from memory.policy import GiB

    model, prompts = loaded
    cache = make_quantized_cache(model, Q4)
    model(mx.array([prompts[3]]), cache=cache)
    entry = state.prefix_copy(cache, len(prompts[3]))
    state.settle(entry)
    store = SsdStore(tmp_path, budget=DiskBudget(tmp_path, GiB))
    store.open("m", "w")
    store.write("m", "w", prompts[3], state.host_copy(entry))
    back = state.from_host(store.read("m", "w", prompts[3]))
    assert state.quantization(back) == Q4 and all(type(c) is PromptQuantizedKVCache for c in back)
    for a, b in zip(back, entry):
        assert a.offset == b.offset
        for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
            assert x.dtype == y.dtype and mx.array_equal(x, y).item()


async def test_on_a_gpu_without_quantized_attention_the_engine_attends_over_dequantized_kv(tiny_model_path, loaded,
                                                                                            monkeypatch):
    """MLX's CUDA backend has no quantized attention: there the engine thread dequantizes the KV and runs
    MLX's own attention (here: the CPU's, with this machine's CPU tuning off), and the tokens are the ones
    MLX's quantized kernels give (keys and values at their own bits: q4)."""
    from provider.engine import attention

    model, _ = loaded
    monkeypatch.setattr(attention, "quantized_kernels", lambda: False)
    dequantized: list[int] = []
    inner = attention.quantized_attention
    monkeypatch.setattr(attention, "quantized_attention",
                        lambda *a, **k: dequantized.append(k["attend"] is attention.mlx_attention) or inner(*a, **k))
    text = TEXTS[1]
    async with Engine(cpu_attention=False) as engine:
        await engine.load("m", tiny_model_path, eos_token_ids=frozenset(), kv_bits=Q4)
        _, fin = await engine.submit("m", ChatRequest("r", messages(text), SamplingParams(max_tokens=8,
                                                                                          temperature=0))).collect()
    assert isinstance(fin, Finished) and dequantized and all(dequantized)
    prompt = mlx_lm.load(str(tiny_model_path))[1].apply_chat_template(messages(text), add_generation_prompt=True)
    steps = []
    (alone,), _ = run(model, Q4, [prompt], [], [8], logits=steps)
    assert_decisive(steps[0].scores(), alone, "q4 alone")
    assert list(fin.completion_ids) == alone
