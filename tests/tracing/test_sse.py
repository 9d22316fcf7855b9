"""The one SSE encoder and decoder (tracing.sse): what the gateway writes, its readers read
back, however the bytes are cut on the way."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tracing import sse


def test_events_are_openais_shape():
    assert sse.event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert sse.event(b"{}", "response.created") == b"event: response.created\ndata: {}\n\n"
    assert sse.DONE == b"data: [DONE]\n\n"
    assert sse.line('{"a":1}') == 'data: {"a":1}'


def test_data_of_a_line():
    assert sse.data_of('data: {"a":1}') == '{"a":1}'
    assert sse.data_of(b'data:{"a":1}') == b'{"a":1}'  # the space after the colon is optional
    for other in ("", ": a comment", "event: x", "id: 3", "data: [DONE]"):
        assert sse.data_of(other) is None, other
    assert sse.is_done("data: [DONE]") and sse.is_done(b"data: [DONE]\r")
    assert not sse.is_done('data: {"a":1}')


payloads = st.lists(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=8),
                                    max_size=3), max_size=6)


@given(payloads, st.lists(st.integers(min_value=1, max_value=7), min_size=1), st.booleans())
def test_the_decoder_reads_back_what_was_written_however_it_is_cut(objs, cuts, crlf):
    stream = b"".join(sse.event(json.dumps(o).encode(), "kind" if i % 2 else None)
                      for i, o in enumerate(objs)) + b": keep-alive\n\n" + sse.DONE
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    decoder, out, at, i = sse.Decoder(), [], 0, 0
    while at < len(stream):
        size = cuts[i % len(cuts)]
        out += decoder.feed(stream[at:at + size])
        at, i = at + size, i + 1
    assert [json.loads(raw) for raw in out] == objs
    assert decoder.done


def test_multi_line_data_joins_with_newlines():
    assert sse.Decoder().feed(b"data: a\ndata: b\n\n") == [b"a\nb"]
