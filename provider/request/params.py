"""The OpenAI request parameters this provider does not implement, and what it does with each: one
table for both endpoints (chat and legacy completions) and both front doors.

A client that sends a parameter expects it to change the answer. So a parameter we cannot honour is
a 400 naming it (`InvalidBody`), never a 200 with an answer that silently differs from what was
asked. Three kinds:

* ``IGNORED``: accepted whatever its value, because the output does not depend on it (each entry says
  why ignoring it is honest);
* ``NEUTRAL``: accepted at the value that asks for nothing beyond what we do anyway (``n: 1``,
  ``presence_penalty: 0``), refused at any other;
* ``REFUSED``: refused at any value, other servers' sampling extensions included (``top_k``,
  ``min_p``...: sampling without them would give another distribution than the client asked for).

``null`` counts as not sent, as OpenAI reads it. A key in none of these tables and not one the body
validator reads is unknown (`unknown_names`): accepted, since other vendors' clients add fields of
their own and the coordinator adds its metadata (``endpoint``, ``tool_schema_metadata_protocol``, and
newer ones it may add), and the front doors name it in a warning of the request log. One that looks
like a misspelling of a parameter the endpoint reads (`misspelt`: ``max_token``, ``response_fromat``)
is a 400 naming it and the parameter meant, as OpenAI answers an unrecognized argument: a client
that asked for ``max_token: 3`` would otherwise get a 200 of hundreds of tokens.

Not here: ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``response_format``, ``logprobs`` and
``top_logprobs`` on chat are parsed by the body validator. On the legacy
completions endpoint, chat's output controls (tools, a forced call, a response format) are refused:
a completion there is free text.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


BOTH = frozenset(Endpoint)
CHAT = frozenset({Endpoint.CHAT})
COMPLETIONS = frozenset({Endpoint.COMPLETIONS})

# Accepted and ignored: the output is the same with or without them.
IGNORED: Mapping[str, str] = {
    "user": "an end-user id for the caller's own abuse monitoring",
    "safety_identifier": "the same as user, under its newer name",
    "metadata": "tags for OpenAI's stored-completions dashboard",
    "store": "asks OpenAI to keep the completion for its dashboard; this provider keeps none (retrieving one is a 404)",
    "service_tier": "OpenAI's price and latency tier; there is one tier here",
    "prompt_cache_key": "a hint for OpenAI's prompt cache; this provider reuses cached prefixes by their tokens anyway",
    "prediction": "a predicted output only makes OpenAI faster; the answer is the same without it",
}


@dataclass(frozen=True, slots=True)
class Rule:
    accepts: Callable[[Any], bool]  # the values we honour by doing what we do anyway
    rule: str  # what the client is told (fixed words)
    endpoints: frozenset[Endpoint] = BOTH


def _never(value: Any) -> bool:
    return False


def _zero(value: Any) -> bool:
    return type(value) in (int, float) and value == 0  # a bool is not a number


def _one(value: Any) -> bool:
    return type(value) is int and value == 1


def _false(value: Any) -> bool:
    return value is False


def _empty_object(value: Any) -> bool:
    return isinstance(value, dict) and not value


def _text_only(value: Any) -> bool:
    return value == ["text"]


def _empty_string(value: Any) -> bool:
    return value == ""


_UNSUPPORTED = "is not supported by this provider"
_CHAT_ONLY = "is not supported on /v1/completions: send it to /v1/chat/completions"
_SAMPLING = "is not supported: the sampling parameters are temperature, top_p and seed"

NEUTRAL: Mapping[str, Rule] = {
    "n": Rule(_one, "must be 1 (one choice per request)"),
    "best_of": Rule(_one, "must be 1 (one completion per request)", COMPLETIONS),
    # mlx-lm's penalties look back 20 tokens, not over the whole completion as OpenAI's: not the same thing.
    "presence_penalty": Rule(_zero, "is not supported: only 0 (no penalty)"),
    "frequency_penalty": Rule(_zero, "is not supported: only 0 (no penalty)"),
    "logit_bias": Rule(_empty_object, "is not supported: only an empty object (no bias)"),
    "modalities": Rule(_text_only, 'must be ["text"]: this provider answers in text only', CHAT),
    "echo": Rule(_false, "must be false: echoing the prompt is not supported", COMPLETIONS),
    "suffix": Rule(_empty_string, "is not supported (no text is inserted after the completion)", COMPLETIONS),
    "logprobs": Rule(_never, "is not supported on /v1/completions", COMPLETIONS),  # chat's: the body validator
}

REFUSED: Mapping[str, Rule] = {
    "audio": Rule(_never, _UNSUPPORTED, CHAT),
    "web_search_options": Rule(_never, _UNSUPPORTED, CHAT),
    "reasoning_effort": Rule(_never, _UNSUPPORTED, CHAT),
    "verbosity": Rule(_never, _UNSUPPORTED, CHAT),
    "functions": Rule(_never, "is not supported: send tools instead", CHAT),
    "function_call": Rule(_never, "is not supported: send tool_choice instead", CHAT),
    # Other servers' extensions: a client that sends them expects their effect.
    "top_k": Rule(_never, _SAMPLING),
    "min_p": Rule(_never, _SAMPLING),
    "typical_p": Rule(_never, _SAMPLING),
    "repetition_penalty": Rule(_never, _SAMPLING),
    "repetition_context_size": Rule(_never, _SAMPLING),
    "min_tokens": Rule(_never, _UNSUPPORTED),
    "ignore_eos": Rule(_never, _UNSUPPORTED),
    "chat_template_kwargs": Rule(_never, _UNSUPPORTED, CHAT),
    "guided_json": Rule(_never, "is not supported: send response_format instead", CHAT),
    "guided_regex": Rule(_never, _UNSUPPORTED),
    "guided_choice": Rule(_never, _UNSUPPORTED),
    "guided_grammar": Rule(_never, _UNSUPPORTED),
    # Chat's output controls: a legacy completion is free text (they are served on /v1/chat/completions).
    "tools": Rule(_never, _CHAT_ONLY, COMPLETIONS),
    "tool_choice": Rule(_never, _CHAT_ONLY, COMPLETIONS),
    "response_format": Rule(_never, _CHAT_ONLY, COMPLETIONS),
}

_CHECKS: Mapping[Endpoint, tuple[tuple[str, Rule], ...]] = {
    endpoint: tuple((name, rule) for name, rule in (*NEUTRAL.items(), *REFUSED.items()) if endpoint in rule.endpoints)
    for endpoint in Endpoint
}


# The coordinator's own keys in a body it forwards (its metadata, not the consumer's).
COORDINATOR_KEYS = frozenset({"endpoint", "tool_schema_metadata_protocol"})
TYPO_RATIO = 0.85  # difflib's similarity from which an unknown name is taken for a known one misspelt
MAX_TYPO_CHARS = 48  # the longest parameter name is 21 characters: a longer unknown one is no misspelling


def _known(endpoint: Endpoint, read: frozenset[str]) -> frozenset[str]:
    return read | IGNORED.keys() | {name for name, _ in _CHECKS[endpoint]} | COORDINATOR_KEYS


def unknown_names(data: Mapping[str, Any], endpoint: Endpoint, read: frozenset[str]) -> tuple[str, ...]:
    """The top-level keys of `data` that no table knows on `endpoint` (`read`: the keys its body
    validator reads), in the body's order."""
    known = _known(endpoint, read)
    return tuple(name for name in data if name not in known)


def misspelt(name: str, endpoint: Endpoint, read: frozenset[str]) -> str | None:
    """The parameter an unknown `name` looks like a misspelling of (one the endpoint reads, or accepts),
    or None."""
    if len(name) > MAX_TYPO_CHARS:
        return None  # too long to be within a letter or two of any parameter name
    candidates = sorted(read | IGNORED.keys() | {n for n, r in NEUTRAL.items() if endpoint in r.endpoints})
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=TYPO_RATIO)
    return close[0] if close else None


def unsupported(data: Mapping[str, Any], endpoint: Endpoint) -> tuple[str, str] | None:
    """The first parameter of `data` this provider cannot honour on `endpoint`, with its rule; None if
    there is none. Reads only the keys of the table (and never shows a value)."""
    for name, rule in _CHECKS[endpoint]:
        value = data.get(name)
        if value is not None and not rule.accepts(value):
            return name, rule.rule
    return None


__all__ = ["COORDINATOR_KEYS", "IGNORED", "NEUTRAL", "REFUSED", "TYPO_RATIO", "Endpoint", "Rule", "misspelt",
           "unknown_names", "unsupported"]
