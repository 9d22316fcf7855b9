"""Request bodies of the OpenAI API (the subset Tailscope serves, plus engine extras).

Every number has a range the whole path can carry (the replica's msgpack, torch, the store's
Int64 and UInt32 columns), so an out-of-range value is a 400 naming its field, never an
overflow further in: integers fit int64 (ids and counts int32), floats are finite. Limits that
are settings (number of stop strings, messages, logit_bias entries, ...) are checked by
``gateway.limits``.

Unknown fields: the rule is OpenAI's. A field the bundled engine does not know is a 400 naming
it (``unknown_parameter``), never silently dropped: a client that sends ``reasoning_effort`` or
``audio`` learns at once that it has no effect here. Known OpenAI fields that the engine cannot
honour (``suffix``, ``best_of`` other than ``n``) are 400s naming them too
(``unsupported_parameter``). Fields that change nothing in the
answer are accepted: ``user``, ``metadata``, ``store`` (every request is recorded anyway),
``safety_identifier``, ``prompt_cache_key`` and ``service_tier`` ``auto`` / ``default`` (the
one tier there is).
Requests for an external backend's model are not parsed here: their bodies go to the upstream as
sent (``gateway.upstream``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from engine.sampling_params import ParamError
from engine.text.chat_template import conflict

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]


def _check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's bounds on ``metadata``: at most 16 pairs, keys of at most 64 characters,
    values of at most 512 (it is stored on the record, ``RequestRecord.metadata``)."""
    if value is not None:
        if len(value) > 16:
            raise ValueError(f"at most 16 key-value pairs, got {len(value)}")
        for k, v in value.items():
            if len(k) > 64:
                raise ValueError(f"key {k[:64]!r}... is longer than 64 characters")
            if len(v) > 512:
                raise ValueError(f"the value of {k!r} is longer than 512 characters")
    return value


# OpenAI's metadata, bounded as OpenAI bounds it; who the request is for (user,
# safety_identifier), at most 256 characters: both go on the record
Metadata = Annotated[dict[str, str] | None, AfterValidator(_check_metadata)]
EndUser = Annotated[str | None, Field(None, max_length=256)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    # vLLM's extra: every chunk carries the usage so far (with include_usage only)
    continuous_usage_stats: bool = False
    # OpenAI's: random padding in an ``obfuscation`` field of each streamed chunk
    # (``gateway.responses.obfuscated``). OpenAI pads unless told false; this gateway only when
    # told true (a client that says false, to save bandwidth, gets what it asked for)
    include_obfuscation: bool = False


def unsupported(param: str, message: str) -> ParamError:
    """A known OpenAI field the bundled engine cannot honour (yet): a 400 naming it."""
    return ParamError(param, message, "unsupported_parameter")


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    max_tokens: Count | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # accepted, changing nothing in the answer: every request is recorded anyway, and its
    # record holds user (or OpenAI's safety_identifier, which replaces it) as end_user and
    # metadata; prompt_cache_key (the router already keys the prefix cache's locality on the
    # prompt's own leading blocks, ``gateway.router``); one service tier
    user: EndUser = None
    metadata: Metadata = None
    store: bool | None = None
    safety_identifier: EndUser = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    # engine extras (vLLM names)
    # and at most the vocabulary (serving.py); 0 is off as -1 is (vLLM's rule today, so a
    # client tuned for vLLM that sends top_k: 0 gets what it meant)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    # vLLM's extra: at least this many output tokens before EOS, stop_token_ids or a stop
    # string can end the request (at most max_tokens)
    min_tokens: Count = 0
    # vLLM's extra: sample only among these tokens
    allowed_token_ids: list[TokenId] | None = None
    # vLLM's extra: one of json, json_object, regex, choice, grammar (Lark), enforced by the
    # grammar engine (engine.sampling_params.StructuredOutput.from_structured_outputs)
    structured_outputs: dict[str, Any] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's extra: false renders special tokens (e.g. <|im_start|>) in the text
    skip_special_tokens: bool = True
    # vLLM's extra: each prompt token's logprob and this many alternatives, in the response's
    # top-level "prompt_logprobs" (non-streamed responses)
    prompt_logprobs: Count | None = None
    # vLLM's extra: the prompt's token ids (chat: top level; completions: per choice) and each
    # choice's generated ids (per chunk when streamed)
    return_token_ids: bool = False
    # vLLM's extra: keep only the prompt's last k tokens (after the chat template); -1: the
    # context length's worth
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    # vLLM's extra: the order under the priority scheduling policy (lower first; default the
    # tenant's); refused when the engine runs another policy
    priority: int | None = Field(None, ge=-1_000_000, le=1_000_000)

    def unsupported(self) -> None:
        """Raise ``unsupported`` for a field the engine would otherwise ignore."""
        if self.stream_options is not None and not self.stream:  # OpenAI's and vLLM's rule
            raise unsupported("stream_options", "stream_options is only allowed with "
                              "stream: true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats \
                and not self.stream_options.include_usage:  # vLLM would ignore it
            raise unsupported("stream_options.continuous_usage_stats",
                              "continuous_usage_stats needs include_usage: true")
        if self.prompt_logprobs is not None and self.stream:
            raise unsupported("prompt_logprobs", "prompt_logprobs is returned in non-streamed "
                              "responses only (or use echo with logprobs on /v1/completions)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # "function": OpenAI's deprecated form of a tool result (its name, no call id)
    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # passed to the chat template (the bundled one does not show it)
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (gateway.tools)
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: dict[str, Any] | None = None  # the deprecated form of one call

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        # OpenAI's rule: an assistant turn (its calls) and a deprecated function result may
        # have none
        if self.content is None and self.role not in ("assistant", "function"):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)  # text parts only: check_content
        return self.content or ""


def check_content(messages: list[ChatMessage]) -> None:
    """Raise ``unsupported`` for a content part the bundled engine would drop: it reads text
    only, so an image, audio or file part is refused (naming it) rather than answered as if
    the user had not sent it. (A backend's requests are passed through untouched instead.)"""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            kind = part.get("type")
            if kind != "text":
                raise unsupported(f"messages.{i}.content.{j}.type",
                                  f"content part type {kind!r}: the bundled engine reads text "
                                  "parts only (image, audio and file input are refused rather "
                                  "than dropped)")
            if not isinstance(part.get("text"), str):
                raise unsupported(f"messages.{i}.content.{j}.text",
                                  'a text part is {"type": "text", "text": "..."}')


class ChatTemplateFields(BaseModel):
    """vLLM's chat-template extras (chat completions and ``/tokenize``)."""

    add_generation_prompt: bool = True
    # the last message (e.g. a partial assistant turn) is left open for the model to
    # continue; needs add_generation_prompt: false (vLLM's rule)
    continue_final_message: bool = False
    # more variables for the template (e.g. Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template_fields(self) -> None:
        bad = conflict(self.add_generation_prompt, self.continue_final_message,
                       self.chat_template_kwargs or {})
        if bad is not None:
            raise unsupported(*bad)


class ToolFields(BaseModel):
    """What a conversation's tools are (chat completions, and ``/tokenize`` to count the same
    prompt): ``gateway.tools.conversation`` renders them with the messages."""

    tools: list[dict[str, Any]] | None = None  # gateway.tools
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated forms of tools and tool_choice (one call, answered as function_call)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields, ChatTemplateFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI's output kinds: ["text"] (its default) is what the engine writes
    modalities: list[str] | None = None

    def unsupported(self) -> None:
        super().unsupported()
        self.check_template_fields()
        check_content(self.messages)
        if self.modalities is not None and self.modalities != ["text"]:
            raise unsupported("modalities", f"modalities {self.modalities!r}: the bundled "
                              'engine answers in text only (["text"])')
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule: it would return nothing
            raise unsupported("top_logprobs", "top_logprobs needs logprobs: true")


class TokenizeRequest(ChatTemplateFields, ToolFields):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered by the chat template (with
    their tools, as a chat completion renders them)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId]


class CompletionRequest(SamplingFields):
    # OpenAI's four shapes: a text, token ids, or a batch (a list of texts or of token lists);
    # a batch of one is that prompt (lm-evaluation-harness sends its requests so); a larger
    # batch runs every prompt (``n`` samples each) and is a record per prompt
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: Count | None = None
    echo: bool = False
    response_format: dict[str, Any] | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, p: Any) -> Any:
        """One clear 400 for a prompt of none of the four shapes (pydantic's own names a
        union member: ``prompt.str``)."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(type(t) is int and 0 <= t <= INT32_MAX
                                               for t in x)

        if isinstance(p, str) or ids(p) or isinstance(p, list) and (
                all(isinstance(x, str) for x in p) or all(ids(x) for x in p)):
            return p
        raise ValueError("prompt must be a text, a list of token ids (0 to 2**31-1), or a "
                         "batch: a list of texts or a list of token-id lists")

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            self.prompt = p[0]
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, in order (one unless it is a batch)."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return list(p)
        return [p]

    def unsupported(self) -> None:
        super().unsupported()
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion) is not supported by the bundled "
                              "engine")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "best_of other than n is not supported: send n "
                              "samples and choose among them")


class ResponsesRequest(BaseModel):
    """OpenAI's Responses API (``POST /v1/responses``): each request is served through the
    chat pipeline (``gateway.responses`` translates both ways); ``previous_response_id``
    continues a response the gateway keeps. What needs state it does not keep or hosted tools
    (``conversation``, ``background``, built-in tools, ``reasoning``) is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system message ahead of the input
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation only
    tools: list[dict[str, Any]] | None = None  # function tools: {type, name, parameters, ...}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": text | json_object | json_schema}
    include: list[str] | None = None  # "message.output_text.logprobs" only
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # accepted, changing nothing in the answer (every request is recorded anyway)
    store: bool | None = None
    metadata: Metadata = None
    user: EndUser = None
    safety_identifier: EndUser = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    # refused unless unset (``gateway.responses.to_chat``)
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None


# ---- documented shapes (the OpenAPI document; gateway.openapi) --------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx body (OpenAI's shape)."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str  # chatcmpl-...
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]  # index, message (content or tool_calls), logprobs, finish
    usage: Usage


class ResponseObject(BaseModel):
    """OpenAI's response object (``gateway.responses``); streamed, its typed events."""

    id: str  # resp_...
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    # message items (output_text parts) and function_call items
    output: list[dict[str, Any]]
    incomplete_details: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None  # input_tokens, output_tokens, total_tokens, details


class CompletionResponse(BaseModel):
    id: str  # cmpl-...
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]  # index, text, logprobs, finish_reason
    usage: Usage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """vLLM's ``GET /tokenizer_info`` (lm-evaluation-harness's ``remote`` tokenizer reads it)."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int
    revision: str


class DebugQuery(BaseModel):
    """``POST /debug/query``: one read-only SELECT, ``{name:Type}`` placeholders bound from
    ``params`` by ClickHouse."""

    model_config = ConfigDict(extra="forbid")

    sql: str
    params: dict[str, Any] | None = None
    format: Literal["json", "arrow"] = "json"


class BenchRunBody(BaseModel):
    """``POST /debug/bench-runs`` (``tailscope bench`` posts it)."""

    run_id: str
    mode: str
    target: str = ""
    config_id: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    results: dict[str, Any] = Field(default_factory=dict)


class BenchRunOpenBody(BaseModel):
    """``POST /debug/bench-runs/open``: a run id (minted when absent) and its token."""

    run_id: str | None = None


class WhatIfRunBody(BaseModel):
    """``POST /debug/whatif-runs`` (``tailscope whatif`` and ``tailscope size`` post it)."""

    run_id: str
    kind: Literal["whatif", "size"]
    window_start_us: int
    window_end_us: int
    replicas: str = ""
    config_id: str = ""
    params: dict[str, Any] = Field(default_factory=dict)
    step_cost: dict[str, Any] = Field(default_factory=dict)
    results: dict[str, Any] = Field(default_factory=dict)


class EvalRunBody(BaseModel):
    """``POST /debug/eval-runs`` (``tailscope eval run`` posts it)."""

    run: dict[str, Any]  # run_id, suite, config_id, config, url
    results: list[dict[str, Any]]  # case_id, trace_id, score, passed, detail, tags, ...
