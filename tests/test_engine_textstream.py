"""Incremental detokenisation and stop strings: properties over arbitrary text and token splits."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from provider.engine.textstream import CompletionText, Filtered, StopStringFilter

ALPHABET = st.sampled_from(list("ab c\n") + ["é", "日", "🚀", "𝄞", "ß", "语"])
TEXT = st.text(ALPHABET, max_size=40)
STOPS = st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3)


def truncated_at_first_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@st.composite
def text_in_chunks(draw):
    text = draw(TEXT)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=500, deadline=None)
@given(text_in_chunks(), STOPS)
def test_stop_filter_emits_exactly_the_text_before_the_first_stop(chunked, stops):
    text, chunks = chunked
    f = StopStringFilter(stops)
    out, stopped = "", False
    for chunk in chunks:
        r = f.feed(chunk)
        out += r.text
        if r.stopped:
            stopped = True
            break
        # Nothing emitted so far may be the start of a stop string that could still complete.
        assert truncated_at_first_stop(out, stops) == (out, False)
    if not stopped:
        tail = f.flush()
        out += tail.text
        stopped = tail.stopped
    assert (out, stopped) == truncated_at_first_stop(text, stops)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXT, STOPS)
def test_token_by_token_text_is_whole_characters_and_matches_decode(tokenizer, text, stops):
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = CompletionText(tokenizer.detokenizer, stops)
    out, stopped = "", False
    for token in ids:
        r = stream.add(token)
        assert "\ufffd" not in r.text  # a multi-byte character is never split across deltas
        out += r.text
        if r.stopped:
            stopped = True
            break
    if not stopped:
        r = stream.finish()
        out += r.text
        stopped = r.stopped
    decoded = tokenizer.decode(ids)
    # mlx-lm's BPE detokenizer drops the completion's leading space, as `mlx_lm.generate` does.
    expected = decoded[1:] if decoded.startswith(" ") else decoded
    assert (out, stopped) == truncated_at_first_stop(expected, stops)


def test_a_rare_character_arrives_as_byte_tokens_and_is_emitted_once_whole(tokenizer):
    ids = tokenizer.encode("𝄞", add_special_tokens=False)
    assert len(ids) > 1  # not in the tiny vocab: one token per UTF-8 byte
    stream = CompletionText(tokenizer.detokenizer, ())
    deltas = [stream.add(t).text for t in ids] + [stream.finish().text]
    assert [d for d in deltas if d] == ["𝄞"]


def test_a_longer_stop_starting_earlier_wins_over_a_shorter_one_matched_first():
    f = StopStringFilter(["a", "\naa"])
    assert f.feed("\na") == Filtered("", False)  # "a" matched, but "\naa" may start earlier
    assert f.feed("a") == Filtered("", True)
    g = StopStringFilter(["a", "\naa"])
    assert g.feed("\na") == Filtered("", False)
    assert g.flush() == Filtered("\n", True)  # the stream ended: the later "a" stands
