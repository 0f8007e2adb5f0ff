"""mlx-lm's private internals, in one place: the only module of provider/ that names them.

The engine runs mlx-lm's `BatchGenerator` with a prompt batch, a decode batch and a schedule of its own
(provider/engine/decode.py, guided.py), and the model room reads two things mlx-lm keeps to itself (the
tokenizer its wrapper holds, the model classes of a config). All of that needs names mlx-lm marks private
(a leading underscore) and data it lays out in tuples and lists; here each gets a public name. Written
against mlx-lm 0.32.x: an mlx-lm upgrade is checked against this file, and tests/test_mlxlm_private.py
keeps every other module of provider/ off mlx-lm's private names.

What is here:

* `BatchGenerator` (`BatchGeneratorBase`, and functions for any generator): the three places a sequence
  is in (waiting: inserted, not yet in a batch; prefilling: in the prompt batch; decoding: in the
  generation batch), its counters, and its one-call hook `_next` as `BatchGeneratorBase.step`. A waiting
  sequence is mlx-lm's tuple (uid, segments, max tokens, cache, tokens, sampler, processors, stop
  sequences) and a prefilling one its list [segments left, tokens done, tokens in all]: the functions
  below read and advance them by name.
* `GenerationBatch` (`GenerationBatchBase`): its step hook `_step` as `step`, and the step's tokens
  and log-probabilities: those scheduled (`next_tokens`, read by the next step) and those being read
  (`current_tokens`).
* `PromptProcessingBatch` (`PromptBatchBase`): its copy hook `_copy` (which `split` calls) as
  `copy_for_split`; `right_pad_prompts`.
* `BatchKVCache`: the end of the part of its buffer written so far (`kv_end`), every row's.
* `TokenizerWrapper`: the tokenizer it wraps, a chat template of its own, its thinking switch.
* `mlx_lm.utils._get_classes`: the model classes mlx-lm has for a config.

Nothing here changes what mlx-lm computes: the classes only rename. Importing this module imports
mlx-lm (about a second): a module that must stay light imports it where it is used.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch, _right_pad_prompts
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.utils import _get_classes


def _renamed(private: str, doc: str) -> property:
    """A public name, read and written, for one of mlx-lm's private attributes."""

    def get(self: Any) -> Any:
        return getattr(self, private)

    def put(self: Any, value: Any) -> None:
        setattr(self, private, value)

    return property(get, put, doc=doc)


# -- BatchGenerator -----------------------------------------------------------------------------


def waiting(generator: BatchGenerator) -> Any:
    """The sequences inserted that no batch has taken yet, first come first (mlx-lm's deque)."""
    return generator._unprocessed_sequences


def prompt_batch(generator: BatchGenerator) -> PromptProcessingBatch:
    return generator._prompt_batch


def generation_batch(generator: BatchGenerator) -> GenerationBatch:
    return generator._generation_batch


def holds_sequences(generator: BatchGenerator) -> bool:
    """Whether any sequence is waiting, prefilling or decoding."""
    return bool(waiting(generator) or len(prompt_batch(generator)) or len(generation_batch(generator)))


def sequence_uids(generator: BatchGenerator) -> list[int]:
    """The uid of every sequence the generator holds: prefilling, decoding, then waiting."""
    return [*prompt_batch(generator).uids, *generation_batch(generator).uids,
            *(waiting_uid(entry) for entry in waiting(generator))]


def waiting_uid(entry: tuple) -> int:
    """A waiting sequence's uid."""
    return entry[0]


def waiting_segments(entry: tuple) -> list[list[int]]:
    """A waiting sequence's prompt segments (the last one its last token alone)."""
    return entry[1]


def prefill_segments(entry: list) -> list[list[int]]:
    """A prefilling sequence's segments still to go (the last one its last token alone)."""
    return entry[0]


def last_token_only(entry: list) -> bool:
    """Whether a prefilling sequence has only its last prompt token left: it moves to decoding."""
    segments = entry[0]
    return len(segments) == 1 and len(segments[0]) == 1


def prompt_tokens_total(entry: list) -> int:
    """All the prompt tokens of a prefilling sequence."""
    return entry[2]


def take_chunk(entry: list, most: int) -> tuple[list[int], tuple[int, int], bool]:
    """The next (at most) `most` tokens of a prefilling sequence's current segment, taken as mlx-lm's
    `BatchGenerator._next` takes them: (the tokens, its progress (done, all), whether the segment ended)."""
    segments = entry[0]
    chunk, segments[0] = segments[0][:most], segments[0][most:]
    ended = not segments[0]
    if ended:
        segments.pop(0)
    entry[1] += len(chunk)
    return chunk, (entry[1], entry[2]), ended


class BatchGeneratorBase(BatchGenerator):
    """mlx-lm's `BatchGenerator`, its private parts under public names; `step` is one `next()` call."""

    prompt_batch = _renamed("_prompt_batch", "The batch of prompts being prefilled.")
    generation_batch = _renamed("_generation_batch", "The batch of sequences being decoded.")
    prefilling = _renamed("_currently_processing",
                          "The prompt batch's sequences' progress, in its order (see `take_chunk`).")

    @property
    def waiting(self) -> Any:
        """See the function `waiting`."""
        return waiting(self)

    @property
    def counters(self) -> Any:
        """mlx-lm's `BatchCounters`, which `stats()` reads."""
        return self._counters

    def make_batch(self, n: int) -> PromptProcessingBatch:
        """The first `n` waiting sequences as a prompt batch; their progress joins `prefilling`."""
        return self._make_batch(n)

    def _next(self):  # mlx-lm's hook, run by next() on the generator's stream
        return self.step()

    def step(self) -> tuple[list, list]:
        """One call of `next()`: (prompt responses, generation responses). mlx-lm's own here."""
        return BatchGenerator._next(self)


# -- GenerationBatch ----------------------------------------------------------------------------


class GenerationBatchBase(GenerationBatch):
    """mlx-lm's `GenerationBatch`, its step hook as `step` and the step's state under public names."""

    next_tokens = _renamed("_next_tokens", "The tokens the step in flight samples: the next step's inputs.")
    next_logprobs = _renamed("_next_logprobs", "Their log-probabilities, one entry a row (None: not kept).")
    current_tokens = _renamed("_current_tokens", "The inputs of the step being read.")
    current_logprobs = _renamed("_current_logprobs", "Their log-probabilities, one entry a row.")

    def _step(self):  # mlx-lm's hook, run by next() and by __init__ on a non-empty batch
        return self.step()

    def step(self) -> tuple[list[int], list]:
        """One decode step: (this step's input tokens, their log-probabilities). mlx-lm's own here."""
        return GenerationBatch._step(self)


# -- PromptProcessingBatch ----------------------------------------------------------------------


class PromptBatchBase(PromptProcessingBatch):
    """mlx-lm's `PromptProcessingBatch`, the copy `split` makes as `copy_for_split`."""

    def _copy(self):  # mlx-lm's hook, run by split()
        return self.copy_for_split()

    def copy_for_split(self) -> PromptProcessingBatch:
        """A copy of the batch that `split` then filters. mlx-lm's own here (its caches deep-copied)."""
        return PromptProcessingBatch._copy(self)


def right_pad_prompts(prompts: list[list[int]], max_length: int) -> mx.array:
    """Prompts of different lengths as one [rows, max_length] array, padded on the right (mlx-lm's)."""
    return _right_pad_prompts(prompts, max_length=max_length)


# -- BatchKVCache -------------------------------------------------------------------------------


def kv_end(layer: BatchKVCache) -> int:
    """Where the next token's keys and values go in the layer's buffer: the end of its written part,
    every row's (a row's own tokens end there too; its left padding says where they start)."""
    return layer._idx


def set_kv_end(layer: BatchKVCache, end: int) -> None:
    """Move the end of the layer's written part (for a filter that drops leading columns of padding)."""
    layer._idx = end


# -- TokenizerWrapper and the model classes -----------------------------------------------------


def wrapped_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer an mlx-lm `TokenizerWrapper` wraps (transformers')."""
    return tokenizer._tokenizer


def unwrapped(tokenizer: Any) -> Any:
    """`wrapped_tokenizer` of an mlx-lm `TokenizerWrapper`, anything else as it is. By the attribute's
    name, so a transformers fast tokenizer gives its own `_tokenizer`, its Rust backend."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def own_chat_template(tokenizer: Any) -> Any:
    """A chat template an mlx-lm `TokenizerWrapper` renders with itself instead of its tokenizer's
    (None when it has none)."""
    return vars(tokenizer).get("_chat_template")


def thinking_switch(tokenizer: Any) -> str | None:
    """The template variable an mlx-lm `TokenizerWrapper` sets from `has_thinking` (None: none)."""
    return vars(tokenizer).get("_thinking_kwarg")


def model_classes(config: dict) -> tuple[type, type]:
    """(model class, model args class) mlx-lm's loader takes for a config; ValueError when it has none."""
    return _get_classes(config)


__all__ = [
    "BatchGeneratorBase",
    "GenerationBatchBase",
    "PromptBatchBase",
    "generation_batch",
    "holds_sequences",
    "kv_end",
    "last_token_only",
    "model_classes",
    "own_chat_template",
    "prefill_segments",
    "prompt_batch",
    "prompt_tokens_total",
    "right_pad_prompts",
    "sequence_uids",
    "set_kv_end",
    "take_chunk",
    "thinking_switch",
    "unwrapped",
    "waiting",
    "waiting_segments",
    "waiting_uid",
    "wrapped_tokenizer",
]
