"""The activation reserve of one model: what its passes hold beside its weights and its KV.

A pass of `tokens` prompt tokens (a prefill chunk, a batched wave of several prompts' chunks, a decode
step of the whole batch) holds what grows with its tokens (hidden states, the MLP's intermediates) and
the attention's scores, which grow with its tokens times the keys they attend over:

    pass(tokens, rows, keys) = fixed + per_token × tokens + attention
    attention = pair × tokens × keys, at most max(blocked, pair × rows × keys) when the attention works
                in blocks of query rows (one row of every sequence at least), 0 when it is fused (pair 0)

The engine runs one pass at a time and never one of more prompt tokens than its window (the most one
prefill pass takes; `window_tokens`), nor a decode step of more rows than its batch (`batch_rows`). So a
model's reserve is its worst pass at its whole context, with a margin for what the line does not say:

    reserve(context) = MARGIN × max(pass(min(window, context), 1, context), pass(rows, rows, context))

Where the figures come from (`ReserveSource`): measured at load (`measured_profile`: MLX's peak over
the timed passes a load already runs, their KV taken off, the attention's part as the engine models it
taken off, a line through the rest), kept from an earlier load, or, for a model never loaded here,
estimated from its config (`estimated_profile`), where the attention's part is counted as if it held
every score of a window over the whole context but no more than the documented fixed reserve leaves
after the rest (whether it holds them is what a load measures). Pure arithmetic; the engine measures,
provider/models stores and estimates from the config's fields.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from memory.policy import DEFAULT_ACTIVATION_RESERVE_BYTES, saturate

MARGIN = 1.05  # over the line the measured passes draw (the blocks and the line already over-state a little)

# The config estimate per token: 16 hidden-size and 4 intermediate-size vectors in the activations' dtype.
# Measured (ours, float32, a 2,048-token pass less its attention): the tiny, small and medium presets hold
# 14, 8.6 and 12 hidden-size vectors' worth a token; this counts 1.4-2.8 times that.
ESTIMATE_HIDDEN_VECTORS = 16
ESTIMATE_FFN_VECTORS = 4
ESTIMATE_LOGIT_ROWS = 3  # the last token's logits, their log-sum-exp and log-probabilities (float32)
ESTIMATE_LOGIT_BYTES = 4
ESTIMATE_SCORE_COPIES = 1.1  # an attention that holds the scores holds about one float32 buffer of them


class ReserveSource(StrEnum):
    """Where a model's activation reserve comes from."""

    SETTING = "setting"  # DARKBLOOM_ACTIVATION_RESERVE_GB: every model's, nothing measured counts
    MEASURED = "measured"  # measured at this process's load of the model
    STORED = "stored"  # measured at an earlier load of the same weights (the state dir)
    ESTIMATED = "estimated"  # from the model's config: never loaded here
    DEFAULT = "default"  # nothing to go on (a vision model, a config without its shape): the fixed reserve


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a model's config says about its passes' size (the text model's, for a multimodal one)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 4  # the activations' dtype (a quantized model's: its scales')


@dataclass(frozen=True, slots=True)
class PassSample:
    """One timed pass at load: `tokens` of one prompt into a fresh cache (so its keys are its tokens) and
    MLX's peak over it less what was held before and the KV it made (`nbytes`)."""

    tokens: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ActivationProfile:
    """A model's passes' activation memory (module docstring); bytes, floats where a rate."""

    fixed_bytes: int
    per_token_bytes: float
    pair_bytes: float  # per query token × key token, every head (0: a fused attention holds no scores)
    blocked_bytes: int | None  # the most a blocked attention holds (None: it holds all its scores)
    window_tokens: int  # the most prompt tokens one pass takes
    batch_rows: int  # the most sequences one decode step takes
    source: ReserveSource
    attention_ceiling_bytes: int | None = None  # an estimate's cap on the attention's part (None: none)
    peak_bytes: int = 0  # measured: the largest pass the load ran (what doctor shows beside the reserve)
    peak_tokens: int = 0  # ... and its tokens

    def attention_bytes(self, tokens: int, rows: int, keys: int) -> int:
        """What the attention holds at once in a pass of `tokens` queries in `rows` rows over `keys` keys."""
        held = self.pair_bytes * max(0, tokens) * max(0, keys)
        if self.blocked_bytes is not None:
            held = min(held, max(self.blocked_bytes, self.pair_bytes * max(1, rows) * max(0, keys)))
        if self.attention_ceiling_bytes is not None:
            held = min(held, self.attention_ceiling_bytes)
        return saturate(math.ceil(held))

    def linear_bytes(self, tokens: int) -> int:
        """What grows with the pass's tokens alone (and the fixed part)."""
        return saturate(self.fixed_bytes + math.ceil(self.per_token_bytes * max(0, tokens)))

    def pass_bytes(self, tokens: int, rows: int, keys: int) -> int:
        """A pass of `tokens` prompt tokens in `rows` rows attending over `keys` keys."""
        return saturate(self.linear_bytes(tokens) + self.attention_bytes(tokens, rows, keys))

    def reserve_bytes(self, context_tokens: int | None) -> int:
        """The reserve for a model of this context (None: the config names none, a window's worth):
        its worst pass there, with the margin (module docstring)."""
        context = self.window_tokens if context_tokens is None else max(1, context_tokens)
        prefill = self.pass_bytes(min(self.window_tokens, context), 1, context)
        decode = self.pass_bytes(self.batch_rows, self.batch_rows, context)
        return saturate(math.ceil(MARGIN * max(prefill, decode)))

    def as_json(self) -> dict[str, Any]:
        """Its figures (not its source: a reader says where it got them)."""
        return {"fixed_bytes": self.fixed_bytes, "per_token_bytes": self.per_token_bytes,
                "pair_bytes": self.pair_bytes, "blocked_bytes": self.blocked_bytes,
                "window_tokens": self.window_tokens, "batch_rows": self.batch_rows,
                "attention_ceiling_bytes": self.attention_ceiling_bytes,
                "peak_bytes": self.peak_bytes, "peak_tokens": self.peak_tokens}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: ReserveSource) -> ActivationProfile | None:
        """`as_json`'s figures back, or None when they are not all there and numbers of the right kind."""
        try:
            profile = cls(fixed_bytes=_count(data["fixed_bytes"]), per_token_bytes=_rate(data["per_token_bytes"]),
                          pair_bytes=_rate(data["pair_bytes"]), blocked_bytes=_optional(data["blocked_bytes"]),
                          window_tokens=_count(data["window_tokens"]), batch_rows=_count(data["batch_rows"]),
                          source=source, attention_ceiling_bytes=_optional(data.get("attention_ceiling_bytes")),
                          peak_bytes=_count(data.get("peak_bytes", 0)), peak_tokens=_count(data.get("peak_tokens", 0)))
        except (KeyError, TypeError, ValueError):
            return None
        return profile if profile.window_tokens >= 1 and profile.batch_rows >= 1 else None


def measured_profile(samples: Iterable[PassSample], *, pair_bytes: float, blocked_bytes: int | None,
                     window_tokens: int, batch_rows: int,
                     source: ReserveSource = ReserveSource.MEASURED) -> ActivationProfile | None:
    """The profile of a model's timed passes (one row each, into fresh caches), with the attention as the
    engine runs it (`pair_bytes`, `blocked_bytes`). Each sample less its attention's part is the linear
    part at its length (the largest sample of each length counts); with two lengths or more, the line
    through the two longest, raised to lie on or above every one; with one, its bytes per token (an upper
    bound: a pass of n tokens holds no more than n passes of one would); with none, None."""
    shape = ActivationProfile(0, 0.0, pair_bytes, blocked_bytes, window_tokens, batch_rows, source)
    largest: dict[int, int] = {}
    for s in samples:
        if s.tokens > 0:
            largest[s.tokens] = max(largest.get(s.tokens, 0), max(0, s.nbytes))
    if not largest:
        return None
    linear = {n: max(0, b - shape.attention_bytes(n, 1, n)) for n, b in largest.items()}
    lengths = sorted(linear)
    if len(lengths) == 1:
        [n] = lengths
        per_token = linear[n] / n
    else:
        short, long = lengths[-2], lengths[-1]
        per_token = max(0.0, (linear[long] - linear[short]) / (long - short))
    fixed = max(0, max(math.ceil(b - per_token * n) for n, b in linear.items()))
    peak_tokens = max(largest, key=lambda n: (largest[n], n))
    return ActivationProfile(fixed, per_token, pair_bytes, blocked_bytes, window_tokens, batch_rows, source,
                             peak_bytes=largest[peak_tokens], peak_tokens=peak_tokens)


def estimated_profile(shape: ModelShape, *, window_tokens: int, batch_rows: int) -> ActivationProfile:
    """A model's profile from its config alone (module docstring): what grows with the tokens, over-stated
    (checked against the measured presets), and the attention's scores as if held, within what the fixed
    reserve leaves beside the rest."""
    per_token = max(1, shape.dtype_bytes) * (ESTIMATE_HIDDEN_VECTORS * shape.hidden
                                             + ESTIMATE_FFN_VECTORS * shape.intermediate)
    fixed = ESTIMATE_LOGIT_ROWS * ESTIMATE_LOGIT_BYTES * shape.vocab
    pair = ESTIMATE_SCORE_COPIES * 4 * shape.heads  # float32 scores
    profile = ActivationProfile(fixed, float(per_token), pair, None, max(1, window_tokens), max(1, batch_rows),
                                ReserveSource.ESTIMATED)
    # With the margin, the whole reserve stays within the fixed one unless the rest alone asks more.
    ceiling = max(0, math.floor(DEFAULT_ACTIVATION_RESERVE_BYTES / MARGIN) - profile.linear_bytes(profile.window_tokens))
    return ActivationProfile(fixed, float(per_token), pair, None, profile.window_tokens, profile.batch_rows,
                             ReserveSource.ESTIMATED, attention_ceiling_bytes=ceiling)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("not a count")
    return value


def _rate(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError("not a rate")
    return float(value)


def _optional(value: Any) -> int | None:
    return None if value is None else _count(value)


__all__ = ["MARGIN", "ActivationProfile", "ModelShape", "PassSample", "ReserveSource", "estimated_profile",
           "measured_profile"]
