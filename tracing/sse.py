"""Server-sent events as the OpenAI API uses them: the project's one encoder and decoder.

The gateway writes every stream with ``event`` (and ends it with ``DONE``); the Responses API,
the proxy of external backends and the project's clients (eval runner, load generator, CLI)
read streams with ``data_of`` (one line) or ``Decoder`` (a byte stream). Written here because
the OpenAI dialect needs only ``data:`` lines, an optional ``event:`` line and the ``[DONE]``
sentinel, and the gateway's hot path writes pre-encoded bytes; an SSE library would add a
dependency and a dict per event. Lives in ``tracing`` so that the gateway and the clients
(which may not import the gateway) share it.
"""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"
_DONE_LINE = b"data: [DONE]"


def event(data: bytes, kind: str | None = None) -> bytes:
    """One event: ``data`` (a JSON document's bytes, one line) under an optional ``event:``
    type (the Responses API's typed events)."""
    if kind is None:
        return b"data: " + data + b"\n\n"
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def data_of(line: str | bytes) -> str | bytes | None:
    """The data of one line of a stream: None for a blank line, a comment, another field
    (``event:``, ``id:``, ``retry:``) and the ``[DONE]`` sentinel (see ``is_done``)."""
    prefix = b"data:" if isinstance(line, bytes) else "data:"
    if not line.startswith(prefix):
        return None
    data = line[5:]
    if data[:1] in (b" ", " "):
        data = data[1:]
    if data in (b"[DONE]", "[DONE]"):
        return None
    return data


def line(data: str) -> str:
    """One ``data:`` line (no event end): what a relay writes where it passes a stream on line
    by line and has rewritten one event's data."""
    return "data: " + data


def is_done(line: str | bytes) -> bool:
    """Whether a line is the stream's ``[DONE]`` sentinel."""
    return line.rstrip() in (_DONE_LINE, "data: [DONE]", b"data:[DONE]", "data:[DONE]")


class Decoder:
    """Events out of a byte stream cut anywhere: ``feed`` returns the data of each event it
    completed (an event ends at a blank line; its ``data:`` lines join with newlines, as the
    SSE specification says), the ``[DONE]`` sentinel left out; ``done`` says it was seen."""

    def __init__(self) -> None:
        self._buf = b""
        self.done = False

    def feed(self, piece: bytes | str) -> list[bytes]:
        piece = piece if isinstance(piece, bytes) else piece.encode()
        self._buf = (self._buf + piece).replace(b"\r\n", b"\n")
        out = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                return out
            frame, self._buf = self._buf[:end], self._buf[end + 2:]
            lines = frame.split(b"\n")
            self.done = self.done or any(is_done(line) for line in lines)
            parts = [d for d in map(data_of, lines) if d is not None]
            if parts:
                out.append(b"\n".join(parts))
