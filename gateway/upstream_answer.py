"""What a backend's answer says, for the record and the client: the ids, usage, finish reason
and timings a response body or stream chunk carries (``note``), the record's fields from them
(``finish``), an error body's message, and bounded reads of bodies and SSE lines
(``gateway.upstream`` proxies; this reads)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from engine.observer import RequestStats, TimelineEvent
from gateway.records import RequestTrace
from gateway.upstream_config import UpstreamConfig
from tracing import sse


class UpstreamError(Exception):
    """A failed attempt: ``status``/``code``/``message`` for the client, ``retry`` when nothing
    reached the client yet and another backend may take it."""

    def __init__(self, status: int, code: str, message: str, retry: bool,
                 body: bytes | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry, self.body = (
            status, code, message, retry, body)


@dataclass
class Seen:
    """What a proxied response showed, for the record."""

    response_id: str = ""
    finish_reason: str = ""
    usage: dict = field(default_factory=dict)
    content_chunks: int = 0
    timings: dict | None = None  # llama.cpp's own per-request timings object
    timings_ns: int = 0  # monotonic time it arrived (the end of generation, upstream)
    keep_ids: bool = True  # the record may keep token ids (the tenant's capture setting)
    strip_usage: bool = False  # the gateway asked for the stream's usage: not the client's
    metrics: dict | None = None  # vLLM's per-request metrics (--enable-per-request-metrics)
    strip_ids: bool = False  # the gateway asked for token ids: they are not the client's
    prompt_ids: list[int] | None = None  # return_token_ids: the prompt's
    output_ids: list[int] = field(default_factory=list)  # and choice 0's generated ids
    # choice 0's ids from its logprobs' tokens, when the upstream writes them as "token_id:N"
    # (vLLM's --return-tokens-as-token-ids)
    logprob_ids: list[int] = field(default_factory=list)



def note(seen: Seen, chunk) -> bool:
    """Take what the record needs from a response body or stream chunk; True when it carried
    content for the client (a flush)."""
    if not isinstance(chunk, dict):
        return False
    seen.response_id = seen.response_id or str(chunk.get("id") or "")
    if isinstance(chunk.get("usage"), dict):
        seen.usage = chunk["usage"]
    if isinstance(chunk.get("timings"), dict):
        seen.timings, seen.timings_ns = chunk["timings"], time.monotonic_ns()
    if isinstance(chunk.get("metrics"), dict):
        seen.metrics, seen.timings_ns = chunk["metrics"], time.monotonic_ns()
    if ids_of(chunk.get("prompt_token_ids")) is not None:  # vLLM: chat, top level
        seen.prompt_ids = chunk["prompt_token_ids"]
    choices = chunk.get("choices")
    if choices is not None and not isinstance(choices, list):
        raise ValueError(f"choices is a {type(choices).__name__}, not a list")
    content = False
    for choice in choices or []:
        if not isinstance(choice, dict):
            continue
        if choice.get("index", 0) == 0:  # return_token_ids (completions: per choice)
            if ids_of(choice.get("prompt_token_ids")) is not None:
                seen.prompt_ids = choice["prompt_token_ids"]
            if (ids := ids_of(choice.get("token_ids"))) is not None:
                seen.output_ids.extend(ids)
            seen.logprob_ids.extend(logprob_ids(choice.get("logprobs")))
        if choice.get("finish_reason"):
            seen.finish_reason = finish_reason_of(choice["finish_reason"])
        delta = choice.get("delta") or choice.get("message") or {}
        if choice.get("text") or (isinstance(delta, dict) and any(
                delta.get(k) for k in ("content", "tool_calls", "reasoning_content"))):
            content = True
    if content:
        seen.content_chunks += 1
    return content


def ids_of(value) -> list[int] | None:
    """A list of token ids (ints that fit the record's column), else None."""
    if isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in value):
        return value
    return None


def logprob_ids(lp) -> list[int]:
    """Token ids from a choice's logprobs whose tokens are "token_id:N" (chat: ``content``,
    completions: ``tokens``); none when the tokens are text."""
    if not isinstance(lp, dict):
        return []
    tokens = lp.get("tokens")
    if not isinstance(tokens, list):
        content = lp.get("content")
        tokens = [c.get("token") for c in content if isinstance(c, dict)] \
            if isinstance(content, list) else []
    out = []
    for t in tokens:
        if not (isinstance(t, str) and t.startswith("token_id:") and t[9:].isdigit()):
            return []
        out.append(int(t[9:]))
    return out


def strip_ids(chunk) -> bool:
    """Remove return_token_ids' fields from a body or chunk; True when there were any."""
    if not isinstance(chunk, dict):
        return False
    found = chunk.pop("prompt_token_ids", None) is not None
    for choice in chunk.get("choices") or []:
        if isinstance(choice, dict):
            found |= choice.pop("prompt_token_ids", None) is not None
            found |= choice.pop("token_ids", None) is not None
    return found


# The finish reasons a record (and a metric label) may carry; an upstream's own word for
# anything else is recorded as "other" (labels must stay a closed set)
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter",
                            "abort", "error", "timeout", "cancelled"})
MAX_COUNT = 2**31 - 1  # a token count an upstream may report (the record's column is UInt32)


def finish_reason_of(value) -> str:
    return value if isinstance(value, str) and value in FINISH_REASONS else "other"


def count_of(value) -> int:
    """An upstream's token count if it is one (an int in [0, MAX_COUNT]), else 0."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
    return value if ok else 0


def used(seen: Seen) -> int | None:
    """Prompt + completion tokens by the upstream's usage; None when it said none."""
    used = count_of(seen.usage.get("prompt_tokens")) + count_of(seen.usage.get("completion_tokens"))
    return used or None


def finish(trace: RequestTrace, seen: Seen) -> None:
    u, t = seen.usage, timings_of(seen)
    prompt_tokens = min(MAX_COUNT, count_of(u.get("prompt_tokens")) or (
        t.prompt_n + t.cache_n if t else 0) or len(seen.prompt_ids or ()))
    generated = count_of(u.get("completion_tokens")) or (t.predicted_n if t else 0) \
        or len(seen.output_ids or seen.logprob_ids) or seen.content_chunks
    ids = (list(seen.prompt_ids or ()), seen.output_ids or seen.logprob_ids) \
        if seen.keep_ids else None
    routed = trace.marks.get("ROUTED")
    stats = timeline(t, seen.timings_ns - routed) if t is not None and routed is not None \
        else None
    trace.answered_upstream(seen.response_id, seen.finish_reason or "stop", prompt_tokens,
                            generated, ids, stats)


@dataclass(frozen=True)
class Timings:
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int


def timings_of(seen: Seen) -> Timings | None:
    """The upstream's own report, checked: llama.cpp's ``timings`` (prompt_n/ms,
    predicted_n/ms, cache_n), or vLLM's per-request ``metrics`` (``time_to_first_token_ms``:
    scheduled to first token, i.e. prefill; ``generation_time_ms``: first to last token, null
    for one token; the counts from ``usage``, cached tokens from its
    ``prompt_tokens_details``). None when absent or not numbers (it is then only what the
    gateway saw)."""
    raw, m = seen.timings, seen.metrics
    try:
        if raw:
            t = Timings(int(raw["prompt_n"]), float(raw["prompt_ms"]),
                         int(raw["predicted_n"]), float(raw["predicted_ms"]),
                         int(raw.get("cache_n") or 0))
        elif m and m.get("time_to_first_token_ms") is not None:
            u = seen.usage
            details = u.get("prompt_tokens_details")
            cached = int((details or {}).get("cached_tokens") or 0) \
                if isinstance(details, dict) else 0
            t = Timings(int(u.get("prompt_tokens") or 0) - cached,
                         float(m["time_to_first_token_ms"]),
                         int(u.get("completion_tokens") or 0),
                         float(m.get("generation_time_ms") or 0.0), cached)
        else:
            return None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    ok = (0 <= min(t.prompt_n, t.predicted_n, t.cache_n)
          and max(t.prompt_n, t.predicted_n, t.cache_n) <= MAX_COUNT
          and 0 <= min(t.prompt_ms, t.predicted_ms) and max(t.prompt_ms, t.predicted_ms) < 1e9)
    return t if ok else None


def timeline(t: Timings, end_ms_after_routed_ns: int) -> RequestStats:
    """The upstream's report as an engine timeline on the gateway's clock, so the one timing
    owner (``tracing.timing``) makes every stage column, span and chart from it: generation
    ended when the report arrived; decode took ``predicted_ms`` before that and prefill
    ``prompt_ms`` before decode; what is left after the request was sent is its queue wait
    (network included). Clamped to the time the upstream held the request."""
    end = max(0.0, end_ms_after_routed_ns / 1e6)
    decode = max(0.0, end - t.predicted_ms)
    prefill = max(0.0, decode - t.prompt_ms)
    why = "upstream-reported"
    return RequestStats(events=(TimelineEvent("QUEUED", 0.0, why),
                                TimelineEvent("PREFILLING", prefill, why),
                                TimelineEvent("DECODING", decode, why),
                                TimelineEvent("FINISHED", end, why)),
                        token_offsets_ms=(), cached_tokens=t.cache_n)


def fail(trace: RequestTrace, status: int, code: str, message: str) -> None:
    state = "TIMED_OUT" if status == 504 else "REJECTED" if status in (400, 404, 413, 422,
                                                                       429) else "FAILED"
    trace.fail(state, "timeout" if state == "TIMED_OUT" else "rejected" if state == "REJECTED"
               else "error", code, message)


def error_of(raw: bytes, status: int) -> tuple[str, str]:
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            return str(err.get("message") or f"HTTP {status}"), str(
                err.get("code") or err.get("type") or f"upstream_{status}")
        if isinstance(err, str):
            return err, f"upstream_{status}"
    except (ValueError, AttributeError):
        pass
    return f"HTTP {status}: {raw[:200].decode('utf-8', 'replace')}", f"upstream_{status}"


def is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except ValueError:
        return False


class LineTooLong(Exception):
    """An SSE line from an upstream passed the backend's ``max_line_kb``."""


async def lines(resp: httpx.Response, limit: int) -> AsyncIterator[str]:
    """The response's lines, none held past ``limit`` bytes (httpx's ``aiter_lines`` buffers
    a line however long it grows)."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        *whole, buf = buf.split(b"\n")
        for line in whole:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
        if len(buf) > limit:
            raise LineTooLong
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", "replace")


async def read_bounded(resp: httpx.Response, c: UpstreamConfig) -> bytes:
    """The whole body, refused past ``max_response_mb`` (by its length header, else as it
    arrives)."""
    limit = c.max_response_bytes
    length = resp.headers.get("content-length", "")
    too_big = UpstreamError(502, "upstream_too_large", f"backend {c.name} sent a body over "
                            f"{c.max_response_mb:g} MiB (max_response_mb)", True)
    if length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def loads(raw: bytes):
    """JSON off the event loop when it is large (parsing 100 MB holds the loop for seconds)."""
    return json.loads(raw) if len(raw) < 1 << 20 else await asyncio.to_thread(json.loads, raw)


def loop_time(deadline: float | None) -> float | None:
    """A ``time.monotonic`` deadline on the event loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + deadline - time.monotonic()


def sse_error(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return sse.event(json.dumps(body).encode())
