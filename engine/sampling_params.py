"""Per-request sampling parameters, validated at construction with clear messages.

Penalty conventions follow vLLM: ``repetition_penalty`` counts every token seen so far (prompt
and output); ``frequency_penalty`` and ``presence_penalty`` count generated tokens only.
``temperature`` below ``GREEDY_EPS`` selects the greedy branch (argmax, lowest id on ties); the
sampling branch never divides by a temperature that small.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

GREEDY_EPS = 1e-5
MAX_TOP_LOGPROBS = 20


class ParamError(ValueError):
    """A request field that is refused: a 400 naming ``param`` (OpenAI's error ``param``), with
    OpenAI's error ``code`` where one applies (``unsupported_parameter`` for a known field that
    cannot be honoured). The project's one parameter error: the engine raises it for sampling
    parameters, the gateway for tools, content parts and unsupported fields."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


SamplingParamsError = ParamError  # its name where the engine checks sampling parameters


PRIORITY_MAX = 1_000_000
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


# vLLM's structured_outputs keys this engine takes, each one kind of StructuredOutput
VLLM_STRUCTURED = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """``response_format`` (or vLLM's ``structured_outputs``) reduced to what the grammar
    needs: ``kind`` ``json_object`` / ``json_schema`` with a JSON schema as a string
    (``{"type": "object"}`` for ``json_object``); ``regex`` with the expression (Rust regex
    syntax, llguidance's); ``choice`` with a JSON list of the strings the output must be one
    of; ``grammar`` with a Lark grammar (llguidance's dialect).

    The JSON is written with fixed separators (llguidance's ``x-guidance`` option
    ``whitespace_flexible: false``) unless the schema sets ``x-guidance`` itself: with free
    whitespace between tokens a model can emit whitespace until ``max_tokens`` (the random
    test models always did; vLLM users report it with real ones), and compact JSON is what
    OpenAI's structured outputs return."""

    kind: str  # "json_object" | "json_schema" | "regex" | "choice" | "grammar"
    schema: str

    @classmethod
    def from_response_format(cls, rf: dict[str, Any] | None) -> StructuredOutput | None:
        if rf is None or rf.get("type", "text") == "text":
            return None
        kind = rf.get("type")
        if kind == "json_object":
            return cls("json_object", json.dumps({"type": "object", **_COMPACT}))
        if kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise SamplingParamsError("response_format",
                                          "response_format.json_schema.schema must be an object")
            return cls("json_schema", json.dumps({**_COMPACT, **schema}))
        raise SamplingParamsError("response_format",
                                  f"response_format type {kind!r} is not one of text, "
                                  "json_object, json_schema")

    @classmethod
    def from_structured_outputs(cls, so: dict[str, Any]) -> StructuredOutput:
        """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or
        a JSON string), ``json_object: true``, ``regex``, ``choice`` (a non-empty list of
        strings), ``grammar`` (Lark). Another key is refused, naming it."""
        unknown = sorted(set(so) - set(VLLM_STRUCTURED))
        if unknown:
            raise SamplingParamsError(f"structured_outputs.{unknown[0]}",
                                      f"structured_outputs.{unknown[0]} is not supported "
                                      f"(supported: {', '.join(VLLM_STRUCTURED)})")
        given = [k for k in VLLM_STRUCTURED if so.get(k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs", "structured_outputs needs exactly "
                                      f"one of {', '.join(VLLM_STRUCTURED)}; got "
                                      f"{given or 'none'}")
        key, value = given[0], so[given[0]]
        if key == "json_object":
            return cls.from_response_format({"type": "json_object"})
        if key == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    value = None
            if not isinstance(value, dict):
                raise SamplingParamsError("structured_outputs.json", "structured_outputs.json "
                                          "must be a JSON schema (an object or its JSON text)")
            return cls.from_response_format({"type": "json_schema",
                                             "json_schema": {"schema": value}})
        if key == "choice":
            if not isinstance(value, list) or not value or \
                    not all(isinstance(c, str) and c for c in value):
                raise SamplingParamsError("structured_outputs.choice", "structured_outputs."
                                          "choice must be a non-empty list of non-empty strings")
            return cls("choice", json.dumps(value))
        if not isinstance(value, str) or not value:
            raise SamplingParamsError(f"structured_outputs.{key}",
                                      f"structured_outputs.{key} must be a non-empty string")
        return cls(key, value)


def _check(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise SamplingParamsError(param, message)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's extra: no EOS (unless ignore_eos, which never stops on it anyway) and no
    # stop_token_ids before this many output tokens (the sampler masks them), and no stop
    # string matched in their text (the gateway's TextStream)
    min_tokens: int = 0
    # vLLM's extra: only these tokens may be sampled (the others get no mass); None: any
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # the prompt tokens' log-probabilities (raw model distribution; the first token has none),
    # with this many alternatives each; None: not computed. Such a request skips the prefix
    # cache (a cached token has no logits).
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    # the priority scheduling policy's order: lower runs first (vLLM's convention); the other
    # policies ignore it (the gateway refuses a non-zero one under them)
    priority: int = 0
    # the sjf scheduling policy's estimate of this request's output length (the gateway's
    # running mean for its tenant and endpoint); None: max_tokens. Only the order changes.
    predicted_tokens: int | None = None
    # the fair scheduling policy's accounting: whose share the request's tokens count against
    # (the gateway's tenant) and that tenant's weight (its share relative to the others')
    tenant: str = ""
    weight: float = 1.0
    # degraded admission (gateway.degrade): what the gateway reduced under load; the engine
    # admits the request DEGRADED (after QUEUED) with this detail. "": admitted as asked.
    degraded: str = ""

    def __post_init__(self) -> None:
        _check(isinstance(self.weight, (int, float)) and 0 < self.weight <= 1e6, "weight",
               f"weight must be in (0, 1e6], got {self.weight!r}")
        _check(self.predicted_tokens is None or (isinstance(self.predicted_tokens, int)
                                                 and self.predicted_tokens >= 1),
               "predicted_tokens", f"predicted_tokens must be None or an integer >= 1, got "
               f"{self.predicted_tokens!r}")
        _check(isinstance(self.priority, int) and abs(self.priority) <= PRIORITY_MAX,
               "priority", f"priority must be an integer in [-{PRIORITY_MAX}, {PRIORITY_MAX}], "
               f"got {self.priority}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
               f", got {self.min_tokens!r}")
        _check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
               "allowed_token_ids", "allowed_token_ids must not be empty")
        _check(self.temperature >= 0, "temperature",
               f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k",
               f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(0 < self.typical_p <= 1, "typical_p",
               f"typical_p must be in (0, 1], got {self.typical_p}")
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty",
               f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty",
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        for tok, bias in self.logit_bias.items():
            _check(isinstance(tok, int) and tok >= 0, "logit_bias",
                   f"logit_bias keys must be token ids >= 0, got {tok!r}")
            _check(-100 <= bias <= 100, "logit_bias",
                   f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
        _check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
               f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
               "prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
               f"{self.prompt_logprobs}")
        _check(self.seed is None or isinstance(self.seed, int), "seed",
               f"seed must be an integer, got {self.seed!r}")

    @property
    def expected_tokens(self) -> int:
        """The output length the sjf policy orders by: the prediction, at most max_tokens."""
        return min(self.max_tokens, self.predicted_tokens or self.max_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def needs_sort(self) -> bool:
        """top-k, top-p and typical-p work on a sorted distribution; min-p does not."""
        return self.top_k != -1 or self.top_p < 1.0 or self.typical_p < 1.0

    def check_vocab(self, vocab_size: int) -> None:
        _check(self.top_k <= vocab_size, "top_k",
               f"top_k must be -1 (disabled) or at most the vocabulary size {vocab_size}, "
               f"got {self.top_k}")
        bad = [t for t in self.logit_bias if t >= vocab_size]
        _check(not bad, "logit_bias",
               f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        bad = [t for t in self.allowed_token_ids or () if not 0 <= t < vocab_size]
        _check(not bad, "allowed_token_ids",
               f"allowed_token_ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        _check(not bad, "stop_token_ids",
               f"stop_token_ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
