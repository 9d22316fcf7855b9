"""Streaming text: stop strings across chunk boundaries, UTF-8 safety, token counts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.text import IncrementalDetokenizer, StopChecker, TextStream

ALPHABET = "ab c\n"
STOPS = ["ab", "c\na", "bbb"]


def expected_output(text: str, stops: list[str], include: bool) -> str:
    hits = [(text.find(s), -len(s), s) for s in stops if s in text]
    if not hits:
        return text
    i, _, s = min(hits)
    return text[: i + len(s)] if include else text[:i]


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40), st.lists(st.integers(1, 6), max_size=40),
       st.lists(st.sampled_from(STOPS), min_size=1, max_size=3, unique=True), st.booleans())
def test_stop_strings_spanning_chunks(text, cuts, stops, include):
    chunks, pos = [], 0
    for c in cuts:
        chunks.append(text[pos:pos + c])
        pos += c
    chunks.append(text[pos:])
    expected = expected_output(text, stops, include)
    checker = StopChecker(stops, include)
    out = ""
    for chunk in chunks:
        result = checker.push(chunk)
        out += result.text
        # never ahead of what is safe: the output so far is always a prefix of the answer
        assert expected.startswith(out), (out, expected)
        if result.matched:
            break
    out += checker.finish()
    assert out == expected
    assert (checker.matched is not None) == any(s in text for s in stops)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40), st.integers(0, 40),
       st.lists(st.integers(1, 6), max_size=40),
       st.lists(st.sampled_from(STOPS), min_size=1, max_size=3, unique=True), st.booleans())
def test_no_stop_string_ends_in_unarmed_text(text, k, cuts, stops, include):
    """min_tokens: the first ``k`` characters arrive unarmed; a match must end after them."""
    k = min(k, len(text))
    hits = [(i, -len(s), s) for s in stops
            if (i := text.find(s, max(0, k - len(s) + 1))) >= 0]
    expected = text
    if hits:
        i, _, s = min(hits)
        expected = text[: i + len(s)] if include else text[:i]
    checker, out, pos, sizes = StopChecker(stops, include), "", 0, iter(cuts)
    while pos < len(text):
        end = min(len(text), pos + next(sizes, len(text)))
        if pos < k < end:
            end = k  # the boundary is a chunk boundary, as a token's text is
        result = checker.push(text[pos:end], armed=pos >= k)
        out += result.text
        assert expected.startswith(out), (out, expected)
        pos = end
        if result.matched:
            break
    out += checker.finish()
    assert out == expected


def test_stop_string_held_back_then_released():
    c = StopChecker(["STOP"])
    assert c.push("hello ST").text == "hello "
    assert c.push("AMP").text == "STAMP"  # "ST" was held, then proved not to be a stop
    r = c.push(" x STO")
    assert r.text == " x " and r.matched is None
    r = c.push("P and more")
    assert r.text == "" and r.matched == "STOP"
    assert c.push("ignored").text == "" and c.finish() == ""


def test_earliest_then_longest_stop_wins():
    assert StopChecker(["bc", "abcd"]).push("xabcd").matched == "abcd"
    assert StopChecker(["cd", "b"]).push("abcd").matched == "b"
    with pytest.raises(ValueError):
        StopChecker([""])


UNICODE_TEXTS = [
    "東京は日本の首都です。",
    "Emoji: 🤖🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "Ελληνικά, русский, العربية, हिन्दी",
    "mixed 数字123 and 🤖 end",
]


@pytest.mark.bundled
@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_multibyte_characters_never_stream_broken(text, bundled_tokenizer):
    ids = bundled_tokenizer.encode(text)
    assert len(ids) > len(text) / 4  # several tokens, some splitting characters' bytes
    detok = IncrementalDetokenizer(bundled_tokenizer)
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.finish())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == bundled_tokenizer.decode(ids) == text


@pytest.mark.bundled
def test_text_stream_counts_generated_and_emitted_tokens(bundled_tokenizer):
    ids = bundled_tokenizer.encode("The answer is 42. END of the story, really.")
    stream = TextStream(bundled_tokenizer, stop=["END"])
    out = ""
    for t in ids:
        delta = stream.push([t])
        out += delta.text
        if delta.stop_matched:
            break
    out += stream.finish()
    assert out == "The answer is 42. "
    assert stream.generated_tokens > stream.emitted_tokens
    emitted_text = bundled_tokenizer.decode(ids[:stream.emitted_tokens])
    assert out.startswith(emitted_text)
    assert "END" not in emitted_text


@pytest.mark.bundled
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_is_counted_but_its_text_is_not_emitted(bundled_tokenizer, include):
    """vLLM's rule: the token that ended a request (EOS or one of stop_token_ids) is an output
    token (usage, logprobs) whose text is left out unless include_stop_str_in_output."""
    ids = bundled_tokenizer.encode("Hello world. Goodbye")
    stream = TextStream(bundled_tokenizer, include_stop_str_in_output=include)
    out = stream.push(ids[:-2]).text + stream.push(ids[-2:], stop_token=True).text
    out += stream.finish()
    expected = bundled_tokenizer.decode(ids if include else ids[:-1])
    assert out == expected and (include or not out.endswith("Goodbye"))
    assert stream.generated_tokens == stream.emitted_tokens == len(ids)
