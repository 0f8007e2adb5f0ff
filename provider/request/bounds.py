"""A lower bound on a prompt's tokens from its size alone, before any tokenization.

Tokenizing is the one step of admission whose cost grows with what the consumer sends: 15 MiB of
text takes a fast tokenizer 20 s and several GiB. But a prompt that cannot fit the context window
can be told from its length, because no token covers more than the tokenizer's longest token:

    tokens(prompt) ≥ ⌈chars / (longest · shrink)⌉ + messages · per_message

* `longest`: the most characters any one token decodes to (vocabulary and added tokens, measured
  once per model with the tokenizer's own decoder);
* `shrink`: how much the tokenizer's normalizer can shorten text before it is split (1 with no
  normalizer; 3 for Unicode composition, e.g. three Hangul jamo become one syllable and a
  full-width letter its ASCII form); None when a step may delete characters outright (accent
  stripping, a replace with nothing, a pre-tokenizer that drops whitespace): then no bound is
  claimed and only the exact count decides;
* `per_message`: template tokens every message adds at least (role markers), measured by rendering
  the model's own chat template.

Which characters count (`countable_chars`): only what a chat template copies into the prompt as it
is. Templates may drop parts of earlier *assistant* turns (e.g. a reasoning model's thinking) and
may trim whitespace, so assistant messages and ASCII whitespace are left out: the bound stays a
lower bound for any template. Counting characters (not UTF-8 bytes) keeps it valid for any text.
Everything here is pure: the tokenizer-facing measurements live in `tokens.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Unicode composition / compatibility folding shortens text by at most about 3x (L+V+T Hangul jamo
# -> one syllable; full-width forms and ligature expansions go the other way or 1:1).
_UNICODE_FORM_SHRINK = 3.0
_LOWERCASE_SHRINK = 1.5  # a few capitals lowercase to shorter sequences (e.g. U+1E9E -> ß)

_SAFE_NORMALIZERS = {"NFC": _UNICODE_FORM_SHRINK, "NFKC": _UNICODE_FORM_SHRINK, "NFD": _UNICODE_FORM_SHRINK,
                     "NFKD": _UNICODE_FORM_SHRINK, "Lowercase": _LOWERCASE_SHRINK, "Prepend": 1.0,
                     "ByteLevel": 1.0}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


@dataclass(frozen=True, slots=True)
class TokenBounds:
    """What a model's tokenizer says about prompt length before tokenizing."""

    longest_token_chars: int  # ≥ 1
    shrink: float | None  # None: no size bound is valid for this tokenizer
    per_message_tokens: int = 0  # template tokens each message adds at least

    def lower_bound(self, chars: int, messages: int = 0) -> int:
        """Tokens the templated prompt has at least (0 when no bound is claimed)."""
        if self.shrink is None:
            return 0
        content = math.ceil(max(0, chars) / (max(1, self.longest_token_chars) * self.shrink))
        return content + max(0, messages) * max(0, self.per_message_tokens)

    def max_chars_within(self, tokens: int) -> int | None:
        """The most characters a prompt of at most `tokens` tokens can have (None: no bound)."""
        if self.shrink is None:
            return None
        return math.floor(max(0, tokens) * max(1, self.longest_token_chars) * self.shrink)


NO_BOUND = TokenBounds(longest_token_chars=1, shrink=None)

_VERBATIM_ROLES = frozenset({"system", "developer", "user", "tool"})  # copied as they are by templates


def countable_chars(messages: Sequence[Any]) -> int:
    """Characters of message text every template keeps (see the module docstring): non-whitespace
    characters of the string content and text parts of non-assistant messages. Takes validated
    messages or a raw JSON list alike; anything unexpected counts 0."""
    total = 0
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in _VERBATIM_ROLES:
            continue
        content = message.get("content")
        if isinstance(content, str):
            total += _non_space(content)
        elif isinstance(content, list):
            total += sum(_non_space(p["text"]) for p in content
                         if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return total


def _non_space(text: str) -> int:
    return len(text) - text.count(" ") - text.count("\n") - text.count("\t") - text.count("\r")


def normalizer_shrink(tokenizer_json: Mapping[str, Any]) -> float | None:
    """How much the normalizer and pre-tokenizer of a `tokenizer.json` can shorten text (≥ 1), or
    None when a step may delete characters (or is not one we know)."""
    normalizer = _step_shrink(tokenizer_json.get("normalizer"), _normalizer_shrink)
    pre = _step_shrink(tokenizer_json.get("pre_tokenizer"), _pre_tokenizer_shrink)
    if normalizer is None or pre is None:
        return None
    return normalizer * pre


def _step_shrink(step: Any, leaf) -> float | None:
    if step is None:
        return 1.0
    if not isinstance(step, Mapping):
        return None
    if step.get("type") == "Sequence":
        parts = step.get("normalizers") if "normalizers" in step else step.get("pretokenizers")
        if not isinstance(parts, Sequence):
            return None
        total = 1.0
        for part in parts:
            factor = _step_shrink(part, leaf)
            if factor is None:
                return None
            total *= factor
        return total
    return leaf(step)


def _normalizer_shrink(step: Mapping[str, Any]) -> float | None:
    kind = step.get("type")
    if kind in _SAFE_NORMALIZERS:
        return _SAFE_NORMALIZERS[kind]
    if kind == "Replace":
        pattern = step.get("pattern") or {}
        text = pattern.get("String") if isinstance(pattern, Mapping) else None
        content = step.get("content")
        if not isinstance(text, str) or not text or not isinstance(content, str) or not content:
            return None  # a regex, or a replace with nothing: may delete characters
        return max(1.0, len(text) / len(content))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, …: may delete characters


def _pre_tokenizer_shrink(step: Mapping[str, Any]) -> float | None:
    kind = step.get("type")
    if kind not in _SAFE_PRE_TOKENIZERS:
        return None  # Whitespace, WhitespaceSplit, BertPreTokenizer drop characters
    if kind == "Split" and str(step.get("behavior", "")).lower() == "removed":
        return None
    return 1.0


__all__ = ["NO_BOUND", "TokenBounds", "countable_chars", "normalizer_shrink"]
