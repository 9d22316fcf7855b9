"""Structured output: JSON-schema, regex, choice and Lark grammars compiled to per-step token
masks (llguidance).

llguidance was picked over xgrammar and outlines-core because it needs nothing but the
``tokenizers`` JSON (no transformers), builds its tokenizer index in under a second for this
vocabulary, computes a mask in about a millisecond on the CPU, and reports invalid schemas as
messages we can return as 400s. The constraint lives with the request in the engine: the mask is
fed into the sampler's hard-mask step and every sampled token is consumed by the matcher.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy as llnp
import numpy as np

from engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import torch


class TokenConstraint:
    """One request's grammar state: which tokens may come next; consumes what was sampled."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = llnp.allocate_token_bitmask(1, vocab_size)

    def allowed_tokens(self, vocab: int) -> torch.Tensor:
        import torch  # here, not at import: the gateway uses this module without torch

        llnp.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, self.vocab_size)
        allowed[:n] = torch.from_numpy(bits[:n].astype(bool))
        return allowed

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"grammar rejected token {token_id}: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()


def _grammar(structured: StructuredOutput) -> str:
    """llguidance's grammar for each kind; a choice is a Lark rule of its strings as JSON
    literals (the escapes Lark's strings take), so no character in them is special."""
    m = llguidance.LLMatcher
    if structured.kind == "regex":
        return m.grammar_from_regex(structured.schema)
    if structured.kind == "choice":
        return m.grammar_from_lark("start: " + " | ".join(
            json.dumps(c, ensure_ascii=False) for c in json.loads(structured.schema)))
    if structured.kind == "grammar":
        return m.grammar_from_lark(structured.schema)
    return m.grammar_from_json_schema(structured.schema)


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int) -> None:
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                   eos_token=eos_token_id)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> GrammarCompiler:
        """``tokenizer`` is an ``engine.text.TextTokenizer`` (its ``tokenizers`` JSON is used)."""
        return cls(tokenizer.tokenizer.to_str(), vocab_size, tokenizer.eos_token_id)

    def compile(self, structured: StructuredOutput) -> TokenConstraint:
        """Raises ValueError naming the problem when the schema is not usable."""
        try:
            grammar = _grammar(structured)
        except Exception as exc:  # llguidance raises plain exceptions for malformed JSON
            raise ValueError(str(exc)) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(error)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return TokenConstraint(matcher, self.vocab_size)
