"""Incremental detokenization for streaming.

Decodes a small window (from ``prefix_offset``) instead of the whole sequence each token, and
holds back text while the newest bytes end in an incomplete UTF-8 character (the decoder shows
that as U+FFFD), so a multi-byte character split across tokens is never emitted broken. The
concatenated deltas equal ``tokenizer.decode(all_ids)`` (``finish`` emits any remainder).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # everything returned so far
        self.token_text_end: list[int] = []  # len(self.text) after each token was pushed

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: list[int]) -> str:
        delta = ""
        for tok in new_ids:
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            window = self._decode(self.ids[self.prefix_offset:])
            if len(window) > len(prefix) and not window.endswith(REPLACEMENT):
                delta += window[len(prefix):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
            self.token_text_end.append(len(self.text) + len(delta))
        self.text += delta
        return delta

    def skip(self) -> None:
        """A token that is part of the output but rendered as no text (the stop token that
        ended a request): it ends where the text so far ends."""
        self.token_text_end.append(len(self.text))

    def finish(self) -> str:
        """End of stream: return what is still held back (e.g. a trailing broken character,
        which ``decode`` itself renders as U+FFFD), so the total equals ``decode(all)``."""
        full = self._decode(self.ids)
        rest = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += rest
        if self.token_text_end:
            self.token_text_end[-1] = len(self.text)
        return rest
