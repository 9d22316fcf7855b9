"""Request bodies of the OpenAI API (the subset Tailscope serves, plus engine extras).

Every number has a range the whole path can carry (the replica's msgpack, torch, the store's
Int64 and UInt32 columns), so an out-of-range value is a 400 naming its field, never an
overflow further in: integers fit int64 (ids and counts int32), floats are finite. Limits that
are settings (number of stop strings, messages, logit_bias entries, ...) are checked by
``gateway.limits``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

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
    user: str | None = None
    # engine extras (vLLM names)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)  # and at most the vocabulary (serving.py)
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId]
    logprobs: Count | None = None
    echo: bool = False
    response_format: dict[str, Any] | None = None
