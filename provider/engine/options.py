"""The engine's options, one value the runtime builds from the settings (tests build their own)."""

from __future__ import annotations

from dataclasses import dataclass

from memory.mlx_limits import MlxLimits
from provider.engine.vlm import DEFAULT_PREFILL_STEP

DEFAULT_BATCH_SIZE = 32  # mlx-lm's own BatchGenerator default (completion_batch_size)


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How the engine runs its models.

    `batch_size`: sequences one model decodes at once (mlx-lm's `completion_batch_size`).
    `limits`: MLX's memory and buffer-cache limits (`memory.mlx_limits(figures)`), applied on the
    engine thread while it runs; the wired limit is the engine's either way (device.py).
    `next_turn_scratch_bytes`: the most a next-turn preparation may hold while the engine is idle
    (next_turn.py); 0: requests marked `prepare_next_turn` are served without it.
    `solo_min_tokens`: prompts with at least this many tokens left to prefill are prefilled alone, their
    first token out at once (prefill.py); None: measured per model at load; 0: never.
    `prefill_tokens`: the most prompt tokens one batched prefill pass takes (decode.py, "Prefill
    waves"); None: by device (`decode.prefill_tokens_for_device`).
    `weight_layout`: dense linear weights stored transposed for the BLAS (layout.py); None: on the CPU
    device only. `cpu_attention`: the engine thread's attention with a vectorised softmax
    (attention.py); None: on the CPU device only.
    `stream_interval_s`: in a large batch, text after a request's first token is delivered at most this
    often, several tokens at a time (delivery.py); 0: every token as it comes.
    `vision_prefill_step`: prompt tokens per prefill step of a vision request (each step is interleaved
    with the text batch).
    `measure_budget_s`: seconds a text model's load may spend on its measurements and warm-up after
    reading its weights (budget.py); None: the larger of a few seconds and a multiple of the read."""

    batch_size: int = DEFAULT_BATCH_SIZE
    limits: MlxLimits | None = None
    next_turn_scratch_bytes: int = 0
    solo_min_tokens: int | None = None
    prefill_tokens: int | None = None
    weight_layout: bool | None = None
    cpu_attention: bool | None = None
    stream_interval_s: float = 0.0
    vision_prefill_step: int = DEFAULT_PREFILL_STEP
    measure_budget_s: float | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            raise ValueError("prefill_tokens must be >= 1")
        if self.measure_budget_s is not None and self.measure_budget_s < 0:
            raise ValueError("measure_budget_s must be >= 0")


__all__ = ["DEFAULT_BATCH_SIZE", "EngineOptions"]
