"""provider.request.bounds: a prompt's tokens from its size, before tokenizing.

The bound must never claim more tokens than the real tokenizer produces (a false 400 would refuse a
prompt that fits), and it must be tight enough to refuse a 15 MiB prompt to a 2k-context model.
Checked with hypothesis against the suite's real tokenizers (byte-level BPE, a chat template).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provider.request.bounds import NO_BOUND, TokenBounds, countable_chars, normalizer_shrink
from provider.request.tokens import measure_bounds


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="module")
def bounds(tokenizer) -> TokenBounds:
    return measure_bounds(tokenizer)


def test_the_tiny_tokenizer_is_bounded(bounds):
    assert bounds.shrink == 1.0  # byte-level BPE, no normalizer
    assert 2 <= bounds.longest_token_chars <= 64
    assert bounds.per_message_tokens >= 2  # ChatML: <|im_start|>role ... <|im_end|>


# Text the tokenizers see in practice and at their worst: words, whitespace runs, the ChatML markers
# (one token for many characters), multi-byte characters.
_PIECES = st.sampled_from(["hello", " world", "  ", "\n", "<|im_start|>", "<|im_end|>", "é", "日本語", "😀",
                           "aaaaaaaaaaaaaaaa", "0123456789", " the", "ﬁ", "Ａ"])
_TEXT = st.one_of(st.text(max_size=300), st.lists(_PIECES, max_size=80).map("".join))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(contents=st.lists(_TEXT, min_size=1, max_size=6))
def test_the_lower_bound_never_exceeds_the_real_count(tokenizer, bounds, contents):
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert bounds.lower_bound(countable_chars(messages), len(messages)) <= len(ids)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert bounds.lower_bound(len(rendered)) <= len(ids)


def test_a_15_mib_prompt_is_far_over_a_2k_context(bounds):
    assert bounds.lower_bound(15 * 1024 * 1024, 1) > 100 * 2048


@given(tokens=st.integers(0, 10**7), longest=st.integers(1, 200), shrink=st.sampled_from([1.0, 1.5, 3.0]))
def test_max_chars_within_is_the_inverse_of_the_bound(tokens, longest, shrink):
    bounds = TokenBounds(longest_token_chars=longest, shrink=shrink)
    chars = bounds.max_chars_within(tokens)
    assert bounds.lower_bound(chars) <= tokens
    assert bounds.lower_bound(chars + 1) >= tokens  # one more character may need one more token


def test_no_bound_claims_nothing():
    assert NO_BOUND.lower_bound(10**9, 10**6) == 0
    assert NO_BOUND.max_chars_within(5) is None


@pytest.mark.parametrize(("tokenizer_json", "shrink"), [
    ({}, 1.0),
    ({"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}}, 1.0),
    ({"normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Isolated"}, {"type": "ByteLevel"}]}}, 3.0),  # Qwen2-style
    ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                          {"type": "Replace", "pattern": {"String": " "},
                                                           "content": "▁"}]}}, 1.0),  # Llama-2 style
    ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}}, 4.5),
    ({"normalizer": {"type": "StripAccents"}}, None),  # deletes characters
    ({"normalizer": {"type": "Replace", "pattern": {"String": "x"}, "content": ""}}, None),
    ({"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}}, None),
    ({"normalizer": {"type": "BertNormalizer"}}, None),
    ({"pre_tokenizer": {"type": "Whitespace"}}, None),  # drops whitespace
    ({"pre_tokenizer": {"type": "Split", "behavior": "Removed"}}, None),
    ({"normalizer": {"type": "SomethingNew"}}, None),  # unknown: no claim
])
def test_normalizer_shrink(tokenizer_json, shrink):
    assert normalizer_shrink(tokenizer_json) == shrink


def test_countable_chars_leave_out_what_templates_may_drop():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a b"}]},
                {"role": "assistant", "content": "<think>" + "x" * 10_000 + "</think>hi"},  # may be dropped
                {"role": "tool", "content": "  \n\t 42  "}, {"role": "user", "content": None}, "junk"]
    assert countable_chars(messages) == len("bebrief") + len("ab") + len("42")
