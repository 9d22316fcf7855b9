"""One request's text side: detokenize the engine's tokens, apply stop strings, count tokens.

Runs in the gateway process (replicas see token ids only). ``generated_tokens`` counts what the
engine sampled; ``emitted_tokens`` counts the tokens whose text reached the client, which is
fewer when a stop string truncates the output (the stop string's own tokens, and any token
sampled after the match, are generated but not emitted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.stop_checker import StopChecker


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    stop_matched: str | None = None


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        """``min_tokens``: no stop string ends the stream in the text of its first
        ``min_tokens`` tokens (vLLM's semantics: stop strings are checked once more tokens than
        that have been generated; a match must end in a later token's text)."""
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = StopChecker(stop, include_stop_str_in_output)
        self.min_tokens = min_tokens
        self.text = ""  # emitted so far
        self.generated_tokens = 0

    @property
    def stopped(self) -> bool:
        return self.stop.matched is not None

    def push(self, token_ids: list[int], stop_token: bool = False) -> TextDelta:
        """``stop_token``: the last of ``token_ids`` ended the request (EOS or one of its
        ``stop_token_ids``): it is counted, but its text is not emitted unless
        ``include_stop_str_in_output`` (vLLM's rule, as for a stop string)."""
        self.generated_tokens += len(token_ids)
        if self.stopped:
            return TextDelta("", self.stop.matched)
        hidden = stop_token and bool(token_ids) and not self.stop.include
        result = self.stop.push(self.detok.push(token_ids[:-1] if hidden else token_ids),
                                armed=self.generated_tokens > self.min_tokens)
        if hidden:  # still an output token (usage, logprobs), with no text
            self.detok.skip()
        self.text += result.text
        return TextDelta(result.text, result.matched)

    def finish(self) -> str:
        """End of the stream: release held-back text (nothing after a matched stop string)."""
        if self.stopped:
            return ""
        out = self.stop.push(self.detok.finish()).text + self.stop.finish()
        self.text += out
        return out

    @property
    def emitted_tokens(self) -> int:
        """Tokens whose whole text lies within what was emitted."""
        n = len(self.text)
        return sum(1 for end in self.detok.token_text_end if end <= n)


@dataclass(frozen=True, slots=True)
class TextResult:
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    generated_tokens: int
    emitted_tokens: int
    output_token_ids: list[int]
    error: str | None = None


def generate_text(engine, tokenizer, request_id: str, prompt_ids: list[int], params,
                  stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                  on_text=None) -> TextResult:
    """Drive an in-process engine for one request until it ends, streaming text to
    ``on_text``. A matched stop string finishes the engine request at once (``engine.stop``),
    so no further tokens are generated for it. Raises ValueError when the engine rejects it."""
    stream = TextStream(tokenizer, stop, include_stop_str_in_output,
                        min_tokens=params.min_tokens if params is not None else 0)
    req = engine.add_request(request_id, prompt_ids, params)
    if req.error and req.is_finished:
        raise ValueError(req.error)
    while not req.is_finished:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            delta = stream.push(out.new_token_ids, stop_token=out.finish_reason == "stop"
                                and not isinstance(req.stop_reason, str))
            if delta.text and on_text:
                on_text(delta.text)
            if delta.stop_matched is not None:
                engine.stop(request_id, delta.stop_matched)
    tail = stream.finish()
    if tail and on_text:
        on_text(tail)
    return TextResult(stream.text, req.finish_reason, req.stop_reason, len(req.output_token_ids),
                      stream.emitted_tokens, list(req.output_token_ids), req.error)
