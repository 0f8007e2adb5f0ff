"""Loading a model on the engine thread: weights, the generator, and what is measured and warmed at load."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from kvcache.quantized import quantizable
from memory.activation import ActivationProfile
from memory.settle import clear_buffer_cache
from provider.engine import activation, attention
from provider.engine.active import Slot
from provider.engine.budget import MeasureBudget
from provider.engine.calibration import Calibration, Calibrator
from provider.engine.commands import Load
from provider.engine.layout import MAX_WEIGHT_BYTES, on_cpu, transpose_weights
from provider.engine.types import Calibrated, EngineError, EngineFailure, LoadedModelInfo, LoadPhase
from provider.engine.warmup import warm
from provider.models.kv import ALLOC_STEP
from provider.models.metadata import context_length, model_shape
from provider.telemetry import get_logger

log = get_logger("provider.engine")

# Caches that grow with the sequence (recurrent state has a constant size and is not per token).
_GROWING_CACHES = (KVCache, RotatingKVCache, QuantizedKVCache)
WEIGHT_PART_BYTES = 256 << 20  # the weights are read (evaluated) this much at a time, a progress step each


def on_cpu_unless(setting: bool | None) -> bool:
    """A CPU-device tuning's setting: None = on the CPU device only (layout.py, attention.py)."""
    return on_cpu() if setting is None else setting


def load_text(cmd: Load, generator: Callable[[object, frozenset[int]], BatchGenerator], *,
              weight_layout: bool | None, solo_min_tokens: int | None, measure_budget_s: float | None) -> Slot:
    """A text model loaded through mlx-lm, its generator made, then on the load's budget (budget.py):
    its solo prefill calibrated, the shapes serving uses warmed (warmup.py), its rates timed
    (calibration.py), and from the peaks of those passes its activation reserve's figures
    (activation.py). Each step ends with a `LoadPhase` to `cmd.progress`. Raises
    `EngineError(LOAD_FAILED)` for any broken model folder."""
    progress = cmd.progress or _no_progress
    before = mx.get_active_memory()
    started = time.monotonic()
    try:
        model, tokenizer, config = mlx_lm.load(str(cmd.path), lazy=True, return_config=True)
        read_weights(model, lambda: progress(LoadPhase.WEIGHTS))
        # One weight's copy at a time, within the load's estimate (on-disk bytes x 1.2).
        bound = min(MAX_WEIGHT_BYTES, (mx.get_active_memory() - before) // 10)
        transposed = transpose_weights(model, max_bytes=bound) if on_cpu_unless(weight_layout) else 0
        ctx = context_length(config)
    except Exception:  # an edge: any broken model folder must not kill the worker
        log.exception("model_load_failed", model=cmd.model_id)
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
            log.warning("kv_quantization_refused", model=cmd.model_id, reason="cache_not_plain_kv")
            slot.generator.close()
            raise EngineError(EngineFailure.LOAD_FAILED)
        slot.kv_bits = cmd.kv_bits
    progress(LoadPhase.WEIGHTS_READ)
    budget = MeasureBudget.after_weights(weights_s, measure_budget_s)
    calibrator = Calibrator(model, budget)
    solo_from = _calibrate(slot, calibrator, solo_min_tokens)
    progress(LoadPhase.SOLO_CALIBRATED)
    calibrated = time.monotonic()
    warmed = warm(slot, budget, calibrator.passes, on_shape=lambda shape: progress(LoadPhase.WARM_SHAPE))
    measured = time.monotonic()
    rates = _timed_rates(slot, calibrator)
    profile = _activation(slot, calibrator, config)
    progress(LoadPhase.RATES_TIMED)
    done = time.monotonic()
    slot.info = dataclasses.replace(
        info, solo_min_tokens=slot.solo_min_tokens if slot.split is not None else None,
        prefill_tps=rates.prefill_tps, decode_tps=rates.decode_tps, load_seconds=done - started, kv_bits=slot.kv_bits,
        weights_seconds=weights_s, measure_seconds=(calibrated - started - weights_s) + (done - measured),
        warm_seconds=measured - calibrated, measure_budget_seconds=budget.seconds, solo_from=solo_from,
        rates_from=rates.source, warm_shapes=len(warmed.served), warm_skipped=len(warmed.skipped),
        activation=profile)
    return slot


def read_weights(model: nn.Module, on_part: Callable[[], None]) -> None:
    """Evaluate a lazily loaded model's weights (read them from disk) a part at a time, `on_part()`
    after each part of about `WEIGHT_PART_BYTES`: a long read reports its progress."""
    part_bytes = WEIGHT_PART_BYTES
    part: list[mx.array] = []
    size = 0
    for _, array in tree_flatten(model.parameters()):
        part.append(array)
        size += array.nbytes
        if size >= part_bytes:
            mx.eval(part)
            on_part()
            part, size = [], 0
    if part:
        mx.eval(part)
        on_part()


def _no_progress(phase: LoadPhase) -> None:
    pass


def _calibrate(slot: Slot, calibrator: Calibrator, solo_min_tokens: int | None) -> Calibrated:
    """Whether and from how many tokens a prompt is prefilled alone (prefill.py, calibration.py)."""
    try:
        with mx.stream(slot.generator.stream):
            solo = calibrator.solo(solo_min_tokens)
    except Exception:  # an edge: without the measurement the model is served as mlx-lm serves it
        log.exception("prefill_calibration_failed", model=slot.info.model_id)
        return Calibrated.OFF
    finally:
        clear_buffer_cache()
    slot.split = solo.split
    if solo.split is not None:
        slot.solo_min_tokens = solo.min_tokens
    return solo.source


def _timed_rates(slot: Slot, calibrator: Calibrator) -> Calibration:
    """register's prefill_tps / decode_tps (calibration.py)."""
    try:
        with mx.stream(slot.generator.stream):
            return calibrator.rates()
    except Exception:  # an edge: without the passes the rates stay unreported (0)
        log.exception("rate_calibration_failed", model=slot.info.model_id)
        return Calibration(0.0, 0.0, Calibrated.FALLBACK)
    finally:
        calibrator.close()
        clear_buffer_cache()


def _activation(slot: Slot, calibrator: Calibrator, config: dict) -> ActivationProfile | None:
    """The activation reserve's figures from the peaks of the load's passes (activation.py)."""
    try:
        with mx.stream(slot.generator.stream):
            shape = model_shape(config, activation.activation_dtype(slot.model).size)
            return activation.profile(calibrator.meter, shape, slot.model,
                                      window=activation.window_tokens(slot.generator, slot.split is not None),
                                      batch_rows=slot.generator.completion_batch_size,
                                      quantized_kv=slot.kv_bits is not None)
    except Exception:  # an edge: without the measurement the config's estimate stands
        log.exception("activation_measurement_failed", model=slot.info.model_id)
        return None
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
        log.exception("vision_model_load_failed", model=cmd.model_id)
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
    if cmd.progress is not None:
        cmd.progress(LoadPhase.WEIGHTS_READ)
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
