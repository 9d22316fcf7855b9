"""Stop strings over a text stream whose chunks may split a stop string anywhere.

Text that could still be the start of a stop string is held back; text that cannot is
released. When a stop string completes, everything before its start is released (plus the stop
string itself with ``include_stop_str_in_output``) and nothing after it ever is. The earliest
match wins; at one position the longest stop string wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopResult:
    text: str  # safe to emit now
    matched: str | None  # the stop string that ended the stream, if any


class StopChecker:
    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False
                 ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self.include = include_stop_str_in_output
        self.buffer = ""
        self.matched: str | None = None
        # a match must end past this index of the buffer: the text pushed while not armed
        # (min_tokens) cannot hold a whole match
        self.unarmed = 0

    def push(self, delta: str, armed: bool = True) -> StopResult:
        """``armed=False``: ``delta`` is text in which no stop string may end (it is still
        held back while it could begin one that ends in later, armed text)."""
        if self.matched is not None:
            return StopResult("", self.matched)
        self.buffer += delta
        if not armed:
            self.unarmed = len(self.buffer)
        best: tuple[int, str] | None = None
        for s in self.stop if armed else ():
            i = self.buffer.find(s, max(0, self.unarmed - len(s) + 1))
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
                best = (i, s)
        if best is not None:
            i, s = best
            self.matched = s
            out = self.buffer[: i + len(s)] if self.include else self.buffer[:i]
            self.buffer = ""
            return StopResult(out, s)
        hold = self._held_suffix()
        out = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(out):]
        self.unarmed = max(0, self.unarmed - len(out))
        return StopResult(out, None)

    def _held_suffix(self) -> int:
        """Length of the longest buffer suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.buffer)), best, -1):
                if self.buffer.endswith(s[:k]):
                    best = k
                    break
        return best

    def finish(self) -> str:
        """The stream ended without a match: release whatever was held back."""
        out, self.buffer = ("" if self.matched is not None else self.buffer), ""
        return out
