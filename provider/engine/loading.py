"""Loading a model on the engine thread: weights, the generator, and what is measured at load."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from kvcache.quantized import quantizable
from memory.settle import clear_buffer_cache
from provider.engine import attention
from provider.engine.active import Slot
from provider.engine.calibration import Calibration, calibrate
from provider.engine.commands import Load
from provider.engine.layout import MAX_WEIGHT_BYTES, on_cpu, transpose_weights
from provider.engine.prefill import pass_costs, solo_threshold, split_head
from provider.engine.types import EngineError, EngineFailure, LoadedModelInfo
from provider.models.kv import ALLOC_STEP
from provider.models.metadata import context_length

log = logging.getLogger("provider.engine")

# Caches that grow with the sequence (recurrent state has a constant size and is not per token).
_GROWING_CACHES = (KVCache, RotatingKVCache, QuantizedKVCache)


def on_cpu_unless(setting: bool | None) -> bool:
    """A CPU-device tuning's setting: None = on the CPU device only (layout.py, attention.py)."""
    return on_cpu() if setting is None else setting


def load_text(cmd: Load, generator: Callable[[object, frozenset[int]], BatchGenerator], *,
              weight_layout: bool | None, solo_min_tokens: int | None) -> Slot:
    """A text model loaded through mlx-lm, its generator made, its solo prefill and rates measured.
    Raises `EngineError(LOAD_FAILED)` for any broken model folder."""
    before = mx.get_active_memory()
    started = time.monotonic()
    try:
        model, tokenizer, config = mlx_lm.load(str(cmd.path), lazy=True, return_config=True)
        mx.eval(model.parameters())
        # One weight's copy at a time, within the load's estimate (on-disk bytes x 1.2).
        bound = min(MAX_WEIGHT_BYTES, (mx.get_active_memory() - before) // 10)
        transposed = transpose_weights(model, max_bytes=bound) if on_cpu_unless(weight_layout) else 0
        ctx = context_length(config)
    except Exception:  # an edge: any broken model folder must not kill the worker
        log.exception("model load failed", extra={"model_id": cmd.model_id})
        gc.collect()
        mx.clear_cache()
        raise EngineError(EngineFailure.LOAD_FAILED) from None
    if cmd.eos_token_ids is not None:
        tokenizer.eos_token_ids = set(cmd.eos_token_ids)
    eos = frozenset(tokenizer.eos_token_ids)
    info = LoadedModelInfo(
        model_id=cmd.model_id,
        path=cmd.path,
        weights_bytes=mx.get_active_memory() - before,
        context_length=ctx,
        eos_token_ids=eos,
        vocab_size=int(config.get("vocab_size") or len(tokenizer)),
        load_seconds=time.monotonic() - started,
        transposed_weights=transposed,
        cpu_attention=attention.enabled(),
    )
    weights_s = time.monotonic() - started
    slot = Slot(info, model, tokenizer, generator(model, eos))
    if cmd.kv_bits is not None:
        if not quantizable(model):  # a cache that is not plain KV (sliding windows, recurrent state)
            log.warning("kv quantization refused: the model's cache is not plain KV", extra={"model_id": cmd.model_id})
            slot.generator.close()
            raise EngineError(EngineFailure.LOAD_FAILED)
        slot.kv_bits = cmd.kv_bits
    _calibrate(slot, solo_min_tokens)
    rates = _timed_rates(slot)
    measured = time.monotonic()
    warm(slot)
    done = time.monotonic()
    slot.info = dataclasses.replace(
        info, solo_min_tokens=slot.solo_min_tokens if slot.split is not None else None,
        prefill_tps=rates.prefill_tps, decode_tps=rates.decode_tps, load_seconds=done - started, kv_bits=slot.kv_bits,
        weights_seconds=weights_s, measure_seconds=measured - started - weights_s, warm_seconds=done - measured)
    return slot


# Two prompts of different lengths: a padded prefill pass, as a burst makes one (token ids any vocabulary has).
_WARM_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3])
_WARM_TOKENS = 3
_WARM_CALLS = 12  # far more generator calls than the two prompts need


def warm(slot: Slot) -> None:
    """Serve once before the first request does: two prompts through the slot's own generator, a
    padded prefill wave and decode steps of the two-row batch, so the kernels serving uses exist (MLX's
    CUDA backend builds each on first use: an 8B model's first prefill took 20 s on an H200). An edge:
    a failure only means the first request pays it."""
    generator = slot.generator
    try:
        with mx.stream(generator.stream):
            uids = generator.insert([list(p) for p in _WARM_PROMPTS], max_tokens=[_WARM_TOKENS] * len(_WARM_PROMPTS))
            for _ in range(_WARM_CALLS):
                generator.next()
                if not (generator._unprocessed_sequences or len(generator._prompt_batch)
                        or len(generator._generation_batch)):
                    break
            else:
                generator.remove(uids)
    except Exception:  # an edge: see the docstring
        log.exception("warm-up failed", extra={"model_id": slot.info.model_id})
    finally:
        clear_buffer_cache()


def _calibrate(slot: Slot, solo_min_tokens: int | None) -> None:
    """Whether and from how many tokens a prompt is prefilled alone (prefill.py)."""
    if solo_min_tokens == 0:
        return  # solo prefill off
    try:
        with mx.stream(slot.generator.stream):
            slot.split = split_head(slot.model)
            if slot.split is None:
                return
            if solo_min_tokens is not None:
                slot.solo_min_tokens = solo_min_tokens
                return
            slot.solo_min_tokens = solo_threshold(pass_costs(slot.model))
    except Exception:  # an edge: without the measurement the model is served as mlx-lm serves it
        log.exception("prefill calibration failed", extra={"model_id": slot.info.model_id})
        slot.split = None
    finally:
        clear_buffer_cache()


def _timed_rates(slot: Slot) -> Calibration:
    """register's prefill_tps / decode_tps: a short timed pass (calibration.py)."""
    try:
        with mx.stream(slot.generator.stream):
            return calibrate(slot.model, slot.split)
    except Exception:  # an edge: without the pass the rates stay unreported (0)
        log.exception("rate calibration failed", extra={"model_id": slot.info.model_id})
        return Calibration(0.0, 0.0)
    finally:
        clear_buffer_cache()


def load_vision(cmd: Load) -> tuple[LoadedModelInfo, object]:
    """A vision-language model loaded through mlx-vlm: its info and the loaded model.
    Raises `EngineError(LOAD_FAILED)` for a broken folder or without mlx-vlm."""
    from provider.engine.vlm import image_text_tokens, load_vlm  # mlx-vlm: only when a model is a VLM

    before = mx.get_active_memory()
    started = time.monotonic()
    try:
        vlm = load_vlm(cmd.path, cmd.eos_token_ids)
        ctx = context_length(vlm.config)
        wrapper = image_text_tokens(vlm)
    except Exception:  # an edge: a broken folder (or no mlx-vlm) must not kill the worker
        log.exception("vision model load failed", extra={"model_id": cmd.model_id})
        gc.collect()
        mx.clear_cache()
        raise EngineError(EngineFailure.LOAD_FAILED) from None
    text = vlm.config.get("text_config") if isinstance(vlm.config.get("text_config"), dict) else {}
    info = LoadedModelInfo(
        model_id=cmd.model_id, path=cmd.path, weights_bytes=mx.get_active_memory() - before,
        context_length=ctx, eos_token_ids=frozenset(vlm.tokenizer.eos_token_ids),
        vocab_size=int(text.get("vocab_size") or vlm.config.get("vocab_size") or len(vlm.tokenizer)),
        load_seconds=time.monotonic() - started, vision=True, image_text_tokens=wrapper,
        cpu_attention=attention.enabled())
    return info, vlm


def kv_bytes_per_token(slot: Slot) -> int:
    """Bytes per token the model's own caches allocate: one token into a fresh prompt cache makes
    every growing layer allocate its first ALLOC_STEP-token block; that block's bytes / ALLOC_STEP."""
    cache = slot.new_cache()
    logits = slot.model(mx.array([[0]]), cache=cache)
    mx.eval(logits, [c.state for c in cache if not c.empty()])
    nbytes = sum(c.nbytes for c in cache if isinstance(c, _GROWING_CACHES))
    del cache, logits
    return nbytes // ALLOC_STEP


__all__ = ["kv_bytes_per_token", "load_text", "load_vision", "on_cpu_unless"]
