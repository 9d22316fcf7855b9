"""Serving one OpenAI request: validate, tokenize, route, relay, and fill its trace record.

Path: parse the body (a bad request never reaches a replica) -> tokenize (chat template for
chat) and build the sampling parameters -> submit each of the ``n`` samples to a replica ->
relay token deltas through the incremental detokenizer and stop strings -> SSE chunks or one
JSON body. A client that disconnects mid-stream has its engine requests aborted; a sample whose
replica dies before its first token is retried once on another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.constrained import GrammarCompiler
from engine.observer import RequestStats
from engine.policy import POLICIES
from engine.protocol import TokenDelta
from engine.sampling_params import ParamError, SamplingParams, StructuredOutput
from engine.text import TextStream
from gateway import upstream_rules
from gateway.backend import (
    Backend,
    DeadlineExceeded,
    NoReplicas,
    Overloaded,
    ReplicaFailed,
    Unencodable,
)
from gateway.errors import APIError, bad_request
from gateway.limits import RequestLimits, check_body, check_counts
from gateway.responses import (
    ResponseEvents,
    ResponseStore,
    Shell,
    input_items,
    obfuscated,
    param_name,
    response_event,
    response_object,
    to_chat,
    to_messages,
    with_ids,
)
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    SamplingFields,
    TokenizeRequest,
    check_content,
)
from gateway.tenants import Tenant, TenantRegistry
from gateway.tools import (
    ToolCall,
    ToolSpec,
    ToolStream,
    conversation,
    cut_short,
    legacy_delta,
    parse,
)
from gateway.trace import RequestTrace
from gateway.upstream import NoBackendLeft, UpstreamPool
from tracing import sse

DEFAULT_MAX_TOKENS = 512
LARGE_TEXT_CHARS = 16_384  # tokenized off the event loop from this length (~10 ms of work)
LENGTH_EWMA = 0.2  # sjf policy: weight of the latest output length in the running mean
_TOKEN_ID = re.compile(r"[0-9]{1,10}")

log = logging.getLogger("tailscope.gateway")


MIN_LOGPROB = -9999.0  # what a masked token (-inf) is reported as, like vLLM: JSON has no -inf


def _finite_logprob(x: float) -> float:
    return x if x >= MIN_LOGPROB else MIN_LOGPROB  # NaN compares False: reported as the floor


def _wrap_int64(x: int) -> int:
    """Sample i of n is seeded ``seed + i``, wrapped so it stays an int64 like ``seed``."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


@dataclass
class Choice:
    index: int
    engine_id: str
    stream: TextStream
    queue: asyncio.Queue
    replica: str
    params: SamplingParams
    prompt: list[int]
    finish_reason: str | None = None  # the OpenAI one, once it ended
    final_state: str | None = None  # the engine's terminal state name
    error: str | None = None
    logprobs: list | None = None  # (token, logprob, top) per generated token
    logprobs_sent: int = 0  # entries already streamed
    token_ids: list[int] = field(default_factory=list)
    stats: RequestStats | None = None  # the replica's timeline, at the end
    retries: int = 0
    cache_salt: str = ""
    deadline: float | None = None  # monotonic seconds (the gateway's request timeout)
    echo: str | None = None  # completions' echo: the prompt text, put before the completion
    echo_sent: bool = False  # (streams) the echo chunk went out
    scoring: bool = False  # max_tokens 0 with echo: the sampled token is not emitted
    # echo with logprobs: (token, logprob, top) per prompt token, the first (token, None, None)
    prompt_logprobs: list | None = None
    tools: ToolSpec | None = None  # chat with tools (gateway.tools)
    tool_stream: ToolStream | None = None  # (streams) a forced call's deltas
    held: str | None = None  # (streams, tool_choice auto) text held until it is known
    calls: list = field(default_factory=list)  # the gateway.tools.ToolCall it made
    called: list[str] = field(default_factory=list)  # the tools it called
    token_steps: list[int] = field(default_factory=list)  # the engine step of each token
    # the engine's arrival on this gateway's monotonic clock, bounded from above by each
    # delta's receipt less its ``sent_ms`` (the tightest bound wins; None: no delta said)
    engine_anchor_ns: int | None = None
    return_ids: bool = False  # vLLM's return_token_ids
    # tenant -> prompt tokens other requests' prefill chunks brought into its steps
    neighbours: dict[str, int] = field(default_factory=dict)
    ids_sent: int = -1  # (streams) generated ids sent so far; -1: not even the prompt's
    trace: RequestTrace | None = None  # its prompt's (a batch has a trace per prompt)
    text_offset: int = 0  # completions' logprobs: the token texts' length so far

    def new_ids(self) -> list[int]:
        """(streams, return_token_ids) the generated ids not sent yet (none when scoring)."""
        ids = [] if self.scoring else self.token_ids
        out = ids[max(self.ids_sent, 0):]
        self.ids_sent = len(ids)
        return out


@dataclass
class Part:
    """One prompt of a request with what it runs with: a /v1/completions batch has one per
    prompt, each with its own trace (and record); every other request has one."""

    trace: RequestTrace
    prompt: list[int]
    params: SamplingParams
    echo: str | None = None  # completions' echo: the prompt text the model saw
    choices: list[Choice] = field(default_factory=list)


# a streamed chunk's JSON: msgspec's encoder, ~5x json.dumps on these small dicts (UTF-8 kept
# as is, as ensure_ascii=False did; compact separators)
_encode_json = msgspec.json.Encoder().encode


def tag_record(record, end_user: str | None, metadata: dict[str, str] | None) -> None:
    """The record's ``end_user`` (the request's safety_identifier, else its user) and
    ``metadata`` (a JSON object; "" without); a backend's request may send anything there,
    so each is cut to the bundled path's bounds (256 characters, 16 pairs)."""
    record.end_user = (end_user or "")[:256]
    if metadata:
        pairs = dict(list(metadata.items())[:16])
        record.metadata = _encode_json(pairs).decode()


def _per_token(params: SamplingParams) -> int:
    """Tokens charged per output token: itself and its top logprobs."""
    return 1 + (params.top_logprobs if params.logprobs else 0)


def _prompt_extra(part) -> int:
    """Tokens charged per sample for what the answer repeats of the prompt: the prompt
    (echo) and its logprobs."""
    n = len(part.prompt)
    lp = part.params.prompt_logprobs
    return (n if part.echo else 0) + (n * (1 + lp) if lp is not None else 0)


def _param_error(exc: ParamError) -> APIError:
    return APIError(400, str(exc), "invalid_request_error", exc.param, code=exc.code)


class Service:
    """Everything an API request needs, built once per gateway."""

    def __init__(self, config, tokenizer, pool: Backend, registry: TenantRegistry,
                 versions: dict[str, str], upstreams: UpstreamPool | None = None) -> None:
        self.config = config
        self.upstreams = upstreams  # external backends (their model names are proxied)
        self.tokenizer = tokenizer
        self.pool = pool
        # what the engine's scheduling policy reads from a request (asked of it, not its name)
        self.policy = POLICIES[config.engine.scheduling_policy]
        # False for a gateway of external backends only: it serves no bundled model name
        self.bundled = not isinstance(pool, NoReplicas)
        self.registry = registry
        self.versions = versions
        self.limits: RequestLimits = config.limits
        # engine id -> frees its request's tenant slot; the pool calls it when the request was
        # cancelled because its client stopped reading (its socket may stay open for long)
        self._abandon: dict[str, Callable[[], None]] = {}
        pool.on_abandoned = lambda engine_id: self._abandon.pop(engine_id, lambda: None)()
        # engine request id -> trace id while in flight: step membership is stored by trace;
        # ended ones stay a while (a step report or a wait note may name them afterwards)
        self._traces: dict[str, str] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        # engine request id -> its tenant, and -> the prompt tokens other requests' prefill
        # chunks brought into its steps, by their tenant (``note_step``), while in flight
        self._tenant_of: dict[str, str] = {}
        self._neighbours: dict[str, dict[str, int]] = {}
        # built by ``build_grammar`` at startup: llguidance's tokenizer index takes ~0.5 s and
        # holds the GIL all along (it paused every stream on its first use, mid-serving)
        self._grammar: GrammarCompiler | None = None
        self.warmed = threading.Event()  # ``warm`` ran: /ready waits for it
        # sjf policy: running mean of choice 0's output tokens per (tenant, endpoint)
        self._lengths: dict[tuple[str, str], float] = {}
        self._grammar_lock = threading.Lock()
        # /v1/responses kept for previous_response_id and retrieval (none when the bound is 0)
        mb = config.responses_store_mb
        self.stored_responses = ResponseStore(int(mb * 2**20)) if mb > 0 else None

    def trace_of(self, engine_id: str) -> str:
        """The trace id of an in-flight or recently ended engine request (else the id)."""
        return self._traces.get(engine_id) or self._ended.get(engine_id, engine_id)

    def note_step(self, stats) -> None:
        """A replica's step (``StepStats``): each member's neighbours' prefill, by tenant."""
        prefills = [(m.request_id, m.prefill_tokens) for m in stats.members
                    if m.prefill_tokens]
        if not prefills or len(stats.members) < 2:
            return
        for m in stats.members:
            acc = self._neighbours.get(m.request_id)
            if acc is None:
                continue
            for rid, tokens in prefills:
                if rid != m.request_id:
                    tenant = self._tenant_of.get(rid, "?")
                    acc[tenant] = acc.get(tenant, 0) + tokens

    def _forget(self, engine_id: str) -> None:
        self._tenant_of.pop(engine_id, None)
        self._neighbours.pop(engine_id, None)
        self._traces.pop(engine_id, None)

    def _retire(self, engine_id: str) -> None:
        """Forget an ended request, keeping its trace id a while for late step reports."""
        trace_id = self._traces.get(engine_id)
        self._forget(engine_id)
        if trace_id is not None:
            self._ended[engine_id] = trace_id
            if len(self._ended) > 8192:
                self._ended.popitem(last=False)

    def _named(self, stats: RequestStats | None) -> RequestStats | None:
        """The replica's timeline with the requests its wait notes name as trace ids."""
        if stats is None or not any(e.holders for e in stats.events):
            return stats
        def named(e):
            holders = ", ".join(self.trace_of(h) for h in e.holders)
            return msgspec.structs.replace(e, detail=f"{e.detail} [{holders}]", holders=())

        return msgspec.structs.replace(stats, events=tuple(
            named(e) if e.holders else e for e in stats.events))

    # ---- parsing and validation (nothing here reaches a replica) ---------------------------
    async def read_body(self, request: Request) -> bytes:
        """The body, read no further than the size limit: a chunked body carries no
        content-length to check up front, so it is counted as it arrives."""
        limit = self.config.max_body_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes",
                               code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def body_json(self, request: Request) -> tuple[dict, bytes]:
        """The body as a checked JSON object (read, parsed and checked once per request)."""
        parsed = getattr(request.state, "body_json", None)
        if parsed is not None:
            return parsed
        body = await self.read_body(request)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise bad_request("request body nests too deep to parse") from None
        if not isinstance(data, dict):
            raise bad_request("request body must be a JSON object")
        check_body(data, body, self.limits)
        request.state.body_json = data, body
        return data, body

    async def proxied(self, request: Request, tenant: Tenant, path: str) -> Response | None:
        """A request for a model an external backend serves goes there as the client sent it
        (``gateway.upstream``); None for the bundled replicas' model."""
        if self.upstreams is None:
            return None
        data, _ = await self.body_json(request)
        model = data.get("model")
        if not isinstance(model, str) or not self.upstreams.serves(model):
            return None
        trace: RequestTrace = request.state.trace
        if model == self.config.served_model_name and self.bundled:  # replicas and backends
            if not self._mixed_route(model, trace):
                return None  # the bundled replicas take it
            # the served model's sampling defaults apply whoever serves it
            data = {**self.config.sampling_defaults, **data, **self.config.sampling_overrides}
        r = trace.record
        r.gateway_version, r.config_id = self.versions["gateway"], self.versions["config_id"]
        data, charge = await upstream_rules.admit(
            data, tenant, self.registry, self.limits,
            lambda text: self.encode(text, add_special_tokens=False))
        tag_record(r, data.get("safety_identifier") or data.get("user"), data.get("metadata"))
        trace.mark("ADMITTED")
        settled = False

        def settle(used: int | None = None) -> None:  # the tenant's slot and tokens, once
            nonlocal settled
            if not settled:
                settled = True
                upstream_rules.settle(charge, used, tenant, self.registry)
                self.registry.finish(tenant)

        request.state.settled_by_run = True
        mixed = model == self.config.served_model_name and self.bundled
        try:
            timeout = self.config.request_timeout_s
            return await self.upstreams.proxy(
                request, data, path, trace, settle,
                keep_ids=self.config.record_token_ids and tenant.capture == "full",
                fallback=mixed, deadline=time.monotonic() + timeout if timeout else None)
        except NoBackendLeft as exc:  # a mixed pool: the bundled replicas take it
            request.state.settled_by_run = False  # the bundled path settles from here on
            upstream_rules.settle(charge, 0, tenant, self.registry)  # it charges on its own
            trace.earlier_tries += 1
            r.replica = r.model_revision = r.engine_version = ""
            trace.marks.pop("UPSTREAM_HEADERS", None)
            trace.keep_first |= {"ADMITTED", "TOKENIZED"}  # the failed try counts as routing
            trace.route_note = (f"mixed pool: backend {exc.backend} failed before any "
                                f"content ({exc.message}); the bundled replicas took it")
            log.warning("%s", trace.route_note)
            return None

    def _mixed_route(self, model: str, trace: RequestTrace) -> bool:
        """Bundled replicas and external backends serve ``model``: the side with fewer requests
        in flight per server takes the request (ties: the bundled replicas, whose records have
        token ids and the engine's own timeline). True for a backend; either way the record's
        route reason starts with why (``trace.route_note``)."""
        ready = [d for d in self.pool.describe().values() if d.get("ready")]
        bundled = sum(d.get("inflight", 0) for d in ready) / len(ready) if ready else None
        external = self.upstreams.least_loaded(model)
        if external is None and bundled is None:
            return True  # nobody can take it: the backends' path answers 503
        if external is not None and (bundled is None or external.inflight < bundled):
            trace.route_note = "mixed pool: a backend, " + (
                "no bundled replica is ready" if bundled is None else
                f"{external.inflight} in flight vs {bundled:g} per bundled replica")
            return True
        trace.route_note = "mixed pool: the bundled replicas, " + (
            "no backend can take it" if external is None else
            f"{bundled:g} in flight per replica vs {external.inflight} on the least loaded "
            "backend")
        return False

    def served_models(self) -> list[str]:
        """Every model name this gateway serves, once: the bundled replicas' and each
        backend's (a mixed pool's shared name once)."""
        bundled = [self.config.served_model_name] if self.bundled else []
        return list(dict.fromkeys([*bundled, *(self.upstreams.models if self.upstreams else [])]))

    def model_not_found(self, model: str) -> APIError:
        return APIError(404, f"model {model!r} does not exist; this gateway serves "
                        f"{', '.join(map(repr, self.served_models()))}", param="model",
                        code="model_not_found")

    @staticmethod
    def validated(model: type[pydantic.BaseModel], data: dict) -> Any:
        """``data`` as ``model``, or the 400 naming the field (an unknown one by its code)."""
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            if err["type"] == "extra_forbidden":
                raise APIError(400, f"unknown parameter {param!r}: the bundled engine does not "
                               "know it (it is refused rather than ignored)",
                               "invalid_request_error", param, code="unknown_parameter") from None
            raise bad_request(f"{param}: {err['msg']}", param) from None

    async def parse(self, request: Request, model: type[SamplingFields]) -> SamplingFields:
        data, _ = await self.body_json(request)
        if self.config.sampling_defaults or self.config.sampling_overrides:
            data = {**self.config.sampling_defaults, **data, **self.config.sampling_overrides}
        parsed = self.validated(model, data)
        tag_record(request.state.trace.record, parsed.safety_identifier or parsed.user,
                   parsed.metadata)
        try:
            parsed.unsupported()
        except ParamError as exc:
            raise _param_error(exc) from None
        if parsed.model != self.config.served_model_name or not self.bundled:
            raise self.model_not_found(parsed.model)
        check_counts(parsed, self.limits)
        return parsed

    def priority(self, req: SamplingFields, tenant: Tenant) -> int:
        """The request's ``priority``, else its tenant's default, under a policy that orders by
        it (one more urgent than the tenant's ``min_priority`` is refused); a non-zero one under
        another policy is refused (it would change nothing)."""
        if self.policy.takes_priority:
            if req.priority is None:
                return tenant.priority
            tenant.check_priority(req.priority)
            return req.priority
        if req.priority:
            raise APIError(400, f"priority needs the engine's scheduling_policy 'priority' "
                           f"(this gateway runs {self.config.engine.scheduling_policy!r})",
                           param="priority", code="unsupported_parameter")
        return 0

    def predicted_tokens(self, tenant: Tenant, endpoint: str) -> int | None:
        """Under a policy that orders by expected length (sjf): the running mean (EWMA,
        ``LENGTH_EWMA``) of choice 0's output tokens of this tenant's finished requests on this
        endpoint; None before the first one (the engine then orders by ``max_tokens``) and
        under the other policies."""
        if not self.policy.predicts_length:
            return None
        est = self._lengths.get((tenant.name, endpoint))
        return None if est is None else max(1, math.ceil(est))

    async def sampling(self, req: SamplingFields, prompt_len: int, max_tokens: int | None,
                       logprobs: bool, top_logprobs: int, response_format,
                       prompt_logprobs: int | None = None,
                       grammar_param: str = "response_format", priority: int = 0,
                       predicted_tokens: int | None = None,
                       tenant: Tenant | None = None) -> SamplingParams:
        max_tokens = self.max_tokens(prompt_len, max_tokens)
        vocab = self.tokenizer.vocab_size
        if req.top_k > vocab:
            raise bad_request(f"top_k must be -1 or 0 (disabled) or at most the vocabulary "
                              f"size {vocab}, got {req.top_k}", "top_k")
        bias = {}
        for k, v in (req.logit_bias or {}).items():
            if not _TOKEN_ID.fullmatch(k):  # ASCII digits only: int() also takes '²', ' 1_0'
                raise bad_request(f"logit_bias key {k!r} is not a token id", "logit_bias")
            bias[int(k)] = v
        try:
            structured = StructuredOutput.from_response_format(response_format)
            if req.structured_outputs is not None:
                if structured is not None:
                    raise bad_request("structured_outputs cannot be combined with "
                                      "response_format or a required tool call",
                                      "structured_outputs")
                structured = StructuredOutput.from_structured_outputs(req.structured_outputs)
                grammar_param = "structured_outputs"
            params = SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k or -1, min_p=req.min_p, typical_p=req.typical_p,
                repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                logit_bias=bias, seed=req.seed, ignore_eos=req.ignore_eos,
                stop_token_ids=tuple(req.stop_token_ids or ()), min_tokens=req.min_tokens,
                allowed_token_ids=None if req.allowed_token_ids is None
                else tuple(req.allowed_token_ids),
                logprobs=logprobs,
                top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                structured=structured, priority=priority, predicted_tokens=predicted_tokens,
                tenant=tenant.name if tenant else "", weight=tenant.weight if tenant else 1.0)
            params.check_vocab(vocab)
        except ParamError as exc:
            param, message = exc.param, str(exc)
            if param == "top_logprobs" and isinstance(req, CompletionRequest):  # its name here
                param, message = "logprobs", message.replace("top_logprobs", "logprobs")
            raise bad_request(message, param) from None
        if params.structured is not None:  # an invalid schema is the caller's 400
            if len(params.structured.schema) > self.limits.max_schema_bytes:
                raise bad_request(f"{grammar_param}'s schema is {len(params.structured.schema)}"
                                  f" bytes; at most {self.limits.max_schema_bytes} are accepted",
                                  grammar_param)
            # compiled in a worker thread: a large schema takes a second, and the event loop
            # serves every other stream meanwhile
            try:
                await asyncio.to_thread(self._compile, params.structured)
            except ValueError as exc:
                raise bad_request(f"invalid {grammar_param}: {exc}", grammar_param) from None
        return params

    def max_tokens(self, prompt_len: int, max_tokens: int | None, what: str = "prompt") -> int:
        """The request's max_tokens (by default what the context leaves, at most
        ``DEFAULT_MAX_TOKENS``); a 400 when the prompt and it do not fit the context."""
        limit = self.pool.max_model_len
        if max_tokens is None:
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, limit - prompt_len))
        if limit and prompt_len + max_tokens > limit:
            raise bad_request(f"{what} ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                              f"{prompt_len + max_tokens} exceeds the context length {limit}",
                              "max_tokens")
        return max_tokens

    def build_grammar(self) -> GrammarCompiler:
        """The grammar compiler, built once (the gateway calls it in a thread at startup, so its
        GIL-holding build falls before serving; +35 MB of RSS for the bundled vocabulary)."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler.from_tokenizer(self.tokenizer,
                                                               self.tokenizer.vocab_size)
            return self._grammar

    def warm(self) -> None:
        """Startup work that would otherwise pause the event loop on first use (a worker
        thread runs it while the replicas load). A failure is logged, not fatal: a structured
        request then retries the build and gets its error."""
        try:
            self.build_grammar()
        except Exception:
            log.exception("the grammar compiler could not be built")
        finally:
            self.warmed.set()

    def _compile(self, structured: StructuredOutput) -> None:
        self.build_grammar().compile(structured)

    def truncate(self, prompt: list[int], req: SamplingFields) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: the context
        length's worth); the record keeps the ids the model saw."""
        k = req.truncate_prompt_tokens
        if k is None:
            return prompt
        limit = self.pool.max_model_len
        if k == 0 or (k == -1 and not limit):
            raise bad_request("truncate_prompt_tokens must be >= 1 (keep the last k prompt "
                              "tokens) or -1 (the context length)", "truncate_prompt_tokens")
        if k == -1:
            k = limit
        if limit and k > limit:
            raise bad_request(f"truncate_prompt_tokens {k} exceeds the context length {limit}",
                              "truncate_prompt_tokens")
        return prompt[-k:]

    @staticmethod
    def stops(req: SamplingFields) -> list[str]:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop strings must be non-empty", "stop")
        return stop

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; a long text is tokenized in a worker thread that releases the GIL, so
        the event loop keeps serving every other stream meanwhile."""
        if len(text) < LARGE_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode_releasing_gil, text,
                                       add_special_tokens)

    # ---- utility endpoints (vLLM's shapes) ----------------------------------------------------
    async def _utility_body(self, request: Request, model: type[pydantic.BaseModel]
                            ) -> pydantic.BaseModel:
        data, _ = await self.body_json(request)
        try:
            parsed = model.model_validate(data)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise bad_request(f"{param}: {err['msg']}", param) from None
        name = parsed.model
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"model {name!r}: tokenize and detokenize use the bundled "
                           f"model's tokenizer ({self.config.served_model_name!r})",
                           param="model", code="model_not_found")
        return parsed

    async def tokenize(self, request: Request, tenant: Tenant) -> Response:
        request.state.settled_by_run = True  # nothing is generated: the slot is given back here
        try:
            return await self._tokenize(request, tenant)
        finally:
            self.registry.finish(tenant)

    async def detokenize(self, request: Request, tenant: Tenant) -> Response:
        request.state.settled_by_run = True
        try:
            return await self._detokenize(request, tenant)
        finally:
            self.registry.finish(tenant)

    async def _tokenize(self, request: Request, tenant: Tenant) -> Response:
        req = await self._utility_body(request, TokenizeRequest)
        assert isinstance(req, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send either prompt or messages", "prompt")
        if req.messages is not None:
            if len(req.messages) > self.limits.max_messages:
                raise bad_request(f"{len(req.messages)} messages; at most "
                                  f"{self.limits.max_messages} are accepted", "messages")
            try:
                req.check_template_fields()
                check_content(req.messages)
            except ParamError as exc:
                raise _param_error(exc) from None
            try:  # the prompt a chat completion of these messages and tools would have
                messages, _ = conversation(req)
            except ParamError as exc:
                raise _param_error(exc) from None
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, req.add_generation_prompt, req.continue_final_message,
                    req.chat_template_kwargs)
            except ValueError as exc:
                raise bad_request(str(exc), "messages") from None
            special = bool(req.add_special_tokens)
        else:
            text = req.prompt or ""
            special = req.add_special_tokens is not False
        ids = await self.encode(text, add_special_tokens=special)
        # the answer's size in tokens (its strings too): under the tenant's tokens per minute
        self.registry.charge_tokens(tenant, len(ids) * (2 if req.return_token_strs else 1))
        return JSONResponse({
            "count": len(ids), "max_model_len": self.pool.max_model_len, "tokens": ids,
            "token_strs": [self._token_text(t) for t in ids] if req.return_token_strs else None})

    async def _detokenize(self, request: Request, tenant: Tenant) -> Response:
        req = await self._utility_body(request, DetokenizeRequest)
        assert isinstance(req, DetokenizeRequest)
        self.registry.charge_tokens(tenant, len(req.tokens))
        if any(t >= self.tokenizer.vocab_size for t in req.tokens):
            raise bad_request("tokens has ids outside the vocabulary", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens,
                                                             skip_special_tokens=False)})

    # ---- endpoints ------------------------------------------------------------------------
    async def chat(self, request: Request, tenant: Tenant) -> Response:
        if (proxied := await self.proxied(request, tenant, "/chat/completions")) is not None:
            return proxied
        req = await self.parse(request, ChatCompletionRequest)
        assert isinstance(req, ChatCompletionRequest)
        trace: RequestTrace = request.state.trace
        trace.mark("ADMITTED")
        response_format, grammar_param = req.response_format, "response_format"
        try:
            messages, spec = conversation(req)
        except ParamError as exc:
            raise _param_error(exc) from None
        if spec is not None and spec.forced:  # the call is enforced by the grammar engine
            if response_format and response_format.get("type", "text") != "text":
                raise bad_request("a required tool call cannot be combined with "
                                  "response_format", "tool_choice")
            response_format = {"type": "json_schema", "json_schema": {"schema": spec.schema()}}
            grammar_param = "tools"
        try:
            text = self.tokenizer.apply_chat_template(
                messages, req.add_generation_prompt, req.continue_final_message,
                req.chat_template_kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        prompt = self.truncate(await self.encode(text, add_special_tokens=False), req)
        trace.record.prompt_tokens = len(prompt)  # kept by a request refused from here on
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        params = await self.sampling(req, len(prompt), max_tokens, req.logprobs,
                                     req.top_logprobs or 0, response_format,
                                     prompt_logprobs=req.prompt_logprobs,
                                     grammar_param=grammar_param,
                                     priority=self.priority(req, tenant),
                                     predicted_tokens=self.predicted_tokens(
                                         tenant, trace.record.endpoint), tenant=tenant)
        return await self.run(request, req, [Part(trace, prompt, params)], chat=True,
                              tenant=tenant,
                              tools=spec if spec is not None and spec.mode != "none" else None)

    async def responses(self, request: Request, tenant: Tenant) -> Response:
        """OpenAI's Responses API, served as the chat request it means (``gateway.responses``):
        a 400 names the Responses field; the answer is the response object, or its events.
        Unless ``store`` is false, the response is kept (``ResponseStore``) once it ends."""
        data, _ = await self.body_json(request)
        req = self.validated(ResponsesRequest, data)
        history: list[dict] = []
        if req.previous_response_id is not None:
            prev = self.stored_response(tenant, req.previous_response_id)
            if prev is None:
                raise APIError(400, f"Previous response with id '{req.previous_response_id}' "
                               "not found.", param="previous_response_id",
                               code="previous_response_not_found")
            history = prev.conversation
        try:
            body = to_chat(req, history)
        except ParamError as exc:
            raise _param_error(exc) from None
        request.state.body_json = body, _encode_json(body)  # what chat() (or a backend) reads
        try:
            answer = await self.chat(request, tenant)
        except APIError as exc:  # named as the client named it
            was, exc.param = exc.param, param_name(exc.param)
            if was and exc.param != was:
                exc.message = exc.message.replace(was.split(".")[0], exc.param.split(".")[0])
            raise
        if answer.status_code != 200:  # a backend's error, as it sent it
            return answer
        shell = Shell(req, stored=self.stored_responses is not None and req.store is not False)
        request.state.trace.record.response_id = shell.id

        def keep(response: dict) -> None:
            """Store a response that ended (not one that failed); one larger than the whole
            bound is not kept, and then says so (``store: false``)."""
            if shell.stored and response["status"] in ("completed", "incomplete"):
                items = input_items(req)
                turn = to_messages(items) + to_messages(response["output"], "output")
                if not self.stored_responses.put(tenant.name, response, history + turn,
                                                 with_ids(items)):
                    response["store"] = False

        if not isinstance(answer, StreamingResponse):
            obj = response_object(shell, json.loads(answer.body))
            keep(obj)
            return JSONResponse(obj)
        return StreamingResponse(self._response_events(shell, answer.body_iterator, keep),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def stored_response(self, tenant: Tenant, response_id: str):
        """A response this tenant created and the gateway still keeps (else None)."""
        if self.stored_responses is None:
            return None
        return self.stored_responses.get(tenant.name, response_id)

    @staticmethod
    async def _response_events(shell: Shell, chunks, keep: Callable[[dict], None]
                               ) -> AsyncIterator[bytes]:
        """The chat stream ``chunks`` as Responses events; closing this closes it (its own
        ending aborts what runs and writes the record). The final response goes to ``keep``."""
        events = ResponseEvents(shell)
        obfuscate = bool((shell.req.stream_options or {}).get("include_obfuscation"))
        for kind, payload in events.start():
            yield response_event(kind, payload)
        failed, decoder = False, sse.Decoder()
        async with contextlib.aclosing(chunks) as source:
            async for piece in source:
                for raw in decoder.feed(piece):
                    data = json.loads(raw)
                    failed = failed or "error" in data
                    for kind, payload in events.chunk(data):
                        yield response_event(kind, payload, obfuscate)
        if not failed:
            final = events.end()
            keep(final[-1][1]["response"])  # kept before the client hears it ended
            for kind, payload in final:
                yield response_event(kind, payload)

    async def completions(self, request: Request, tenant: Tenant) -> Response:
        if (proxied := await self.proxied(request, tenant, "/completions")) is not None:
            return proxied
        req = await self.parse(request, CompletionRequest)
        assert isinstance(req, CompletionRequest)
        trace: RequestTrace = request.state.trace
        trace.mark("ADMITTED")
        scoring = req.max_tokens == 0  # echo only: the prompt and its logprobs, nothing more
        if scoring and not req.echo:
            raise bad_request("max_tokens must be >= 1 (0 only with echo, to score the prompt)",
                              "max_tokens")
        texts = req.prompts()
        parts: list[Part] = []
        for i, text in enumerate(texts):
            name = "prompt" if len(texts) == 1 else f"prompt.{i}"  # a batch names the element
            if isinstance(text, str):
                prompt = await self.encode(text)
            else:
                prompt = list(text)
                if any(not 0 <= t < self.tokenizer.vocab_size for t in prompt):
                    raise bad_request(f"{name} has token ids outside the vocabulary", "prompt")
            if not prompt:
                raise bad_request(f"{name} is empty", "prompt")
            whole = len(prompt)
            prompt = self.truncate(prompt, req)
            if i == 0:
                trace.record.prompt_tokens = len(prompt)  # kept by a request refused from here
            max_tokens = 1 if scoring else req.max_tokens
            if i == 0:  # the parameters are checked (and a grammar compiled) once
                params = await self.sampling(
                    req, len(prompt), max_tokens, req.logprobs is not None, req.logprobs or 0,
                    req.response_format,
                    prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None
                    else req.prompt_logprobs, priority=self.priority(req, tenant),
                    predicted_tokens=self.predicted_tokens(tenant, trace.record.endpoint),
                    tenant=tenant)
            else:  # the same ones, with this prompt's max_tokens
                params = dataclasses.replace(parts[0].params, max_tokens=self.max_tokens(
                    len(prompt), max_tokens, name))
            echo = None
            if req.echo:
                echo = text if isinstance(text, str) and len(prompt) == whole else \
                    self.tokenizer.decode(prompt, skip_special_tokens=False)  # what it saw
            parts.append(Part(trace, prompt, params, echo))
        # a trace per further prompt of a batch, once every prompt is valid (a refused batch
        # is one record)
        for i, part in enumerate(parts[1:], start=1):
            part.trace = trace.sibling(i)
        return await self.run(request, req, parts, chat=False, tenant=tenant, scoring=scoring)

    # ---- the engine side -----------------------------------------------------------------------
    async def start_choices(self, request_id: str, prompt: list[int], params: SamplingParams,
                            n: int, stop: list[str], include_stop: bool,
                            trace: RequestTrace, cache_salt: str = "",
                            skip_special_tokens: bool = True, first: int = 0) -> list[Choice]:
        """Submit the ``n`` samples: the first is routed, the others follow it to its replica
        as its branches (they share its prompt's KV blocks there). Their choice indexes (and
        engine ids) start at ``first`` (a batch's later prompts)."""
        if not self.pool.ready:
            raise APIError(503, "no replica is ready yet", "server_error",
                           code="not_ready", headers={"Retry-After": "1"})
        choices: list[Choice] = []
        timeout = self.config.request_timeout_s
        deadline = time.monotonic() + timeout if timeout else None
        for i in range(n):
            p = params if n == 1 or params.seed is None else \
                dataclasses.replace(params, seed=_wrap_int64(params.seed + i))
            engine_id = f"{request_id}-{first + i}"
            self._traces[engine_id] = trace.record.trace_id  # before a step can name it
            self._tenant_of[engine_id] = trace.record.tenant
            neighbours = self._neighbours[engine_id] = {}
            try:
                route, queue = await self.pool.submit(
                    engine_id, prompt, p, self.config.queue_timeout_s, cache_salt=cache_salt,
                    branch_of=choices[0].engine_id if choices else None, deadline=deadline)
            except Unencodable as exc:
                await self.abort_all(choices)
                raise bad_request(str(exc)) from None
            except (ReplicaFailed, Overloaded) as exc:
                await self.abort_all(choices)  # n > 1: do not leave earlier samples running
                code = "overloaded" if isinstance(exc, Overloaded) else "replica_unavailable"
                raise APIError(503, str(exc), "server_error", code=code,
                               headers={"Retry-After": "1"}) from None
            if i == 0:
                first_sent = route.sent_ns
                r = trace.record
                r.replica = route.replica
                r.route_reason = "; ".join(filter(None, (trace.route_note, route.reason)))
                r.prefix_hit_tokens = route.prefix_hit_tokens
                r.model_revision = route.model_revision or r.model_revision
            text = TextStream(self.tokenizer, stop, include_stop, skip_special_tokens,
                              min_tokens=p.min_tokens)
            choices.append(Choice(first + i, engine_id, text,
                                  queue, route.replica, p, prompt,
                                  logprobs=[] if params.logprobs else None,
                                  cache_salt=cache_salt, deadline=deadline,
                                  neighbours=neighbours, trace=trace))
        # the moment the first sample was sent: the replica's event offsets are placed from it,
        # and the engine cannot have seen the request earlier (a mark taken after the sends
        # could be late by a descheduled moment, placing engine events after END)
        trace.mark("ROUTED", first_sent)
        return choices

    async def _retry(self, c: Choice, failure: ReplicaFailed) -> bool:
        """Re-submit a sample whose replica died before it produced a token (once, elsewhere)."""
        if c.retries or c.token_ids:
            return False
        self.pool.release(c.engine_id)
        try:
            route, queue = await self.pool.submit(c.engine_id, c.prompt, c.params,
                                                  self.config.queue_timeout_s,
                                                  exclude=frozenset({c.replica}),
                                                  cache_salt=c.cache_salt, deadline=c.deadline)
        except (ReplicaFailed, Overloaded, Unencodable):
            return False
        c.retries, c.queue, c.replica = 1, queue, route.replica
        c.engine_anchor_ns = None  # another engine, another arrival
        return True

    async def next_text(self, c: Choice) -> tuple[str, bool]:
        """Wait for the choice's next delta; returns (text, finished)."""
        while True:
            item = await self.pool.next_delta(c.engine_id, c.queue)
            if isinstance(item, DeadlineExceeded):
                c.finish_reason, c.final_state, c.error = "timeout", "TIMED_OUT", str(item)
                self.pool.release(c.engine_id)
                return "", True
            if not isinstance(item, ReplicaFailed):
                break
            if not await self._retry(c, item):
                c.finish_reason, c.final_state, c.error = "error", "FAILED", str(item)
                self.pool.release(c.engine_id)
                return "", True
        delta: TokenDelta = item
        if delta.sent_ms > 0:
            bound = time.monotonic_ns() - int(delta.sent_ms * 1e6)
            c.engine_anchor_ns = bound if c.engine_anchor_ns is None else \
                min(c.engine_anchor_ns, bound)
        text = ""
        c.token_ids.extend(delta.token_ids)
        c.token_steps.extend([delta.step] * len(delta.token_ids))
        if delta.prompt_logprobs is not None and c.prompt_logprobs is None:
            c.prompt_logprobs = [(tok, *(lp if lp is not None else (None, None)))
                                 for tok, lp in zip(c.prompt, delta.prompt_logprobs,
                                                    strict=False)]
        if c.scoring:  # the one sampled token is not part of the answer
            if delta.finish_reason is None:
                return "", False
        elif c.logprobs is not None and delta.logprobs:
            for tok, (lp, top) in zip(delta.token_ids, delta.logprobs, strict=False):
                c.logprobs.append((tok, lp, top))
        if delta.token_ids and not c.stream.stopped and not c.scoring:
            # the engine stopped on EOS or a stop token (a stop string's reason is its text)
            by_token = delta.finish_reason == "stop" and not isinstance(delta.stop_reason, str)
            d = c.stream.push(delta.token_ids, stop_token=by_token)
            text = d.text
            if d.stop_matched is not None:
                await self.pool.stop(c.engine_id, d.stop_matched)
        if delta.finish_reason is None:
            return text, False
        c.final_state, c.stats = delta.state, delta.stats
        if delta.state == "FINISHED":
            c.finish_reason = delta.finish_reason
            text += c.stream.finish()
        elif delta.state == "REJECTED":
            c.finish_reason, c.error = "rejected", delta.error or "rejected"
        elif delta.state == "TIMED_OUT":
            c.finish_reason, c.error = "timeout", delta.error or "timed out"
        elif delta.state == "CANCELLED":
            c.finish_reason, c.error = "cancelled", delta.error or "cancelled"
        else:
            c.finish_reason, c.error = "error", delta.error or delta.finish_reason
        self.pool.release(c.engine_id)
        return text, True

    async def abort_all(self, choices: list[Choice]) -> None:
        for c in choices:
            if c.final_state is None:
                await self.pool.abort(c.engine_id)
                self.pool.release(c.engine_id)

    # ---- response bodies -----------------------------------------------------------------------
    def _token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok], skip_special_tokens=False)

    def logprobs_body(self, entries: list, chat: bool, c: Choice | None = None) -> dict:
        """OpenAI's logprobs object for ``entries`` (chat's ``content`` list, or completions'
        parallel lists with ``text_offset``: where each token's text starts in the choice's
        text, counted from the texts of the tokens before it, an echoed prompt's included, as
        vLLM counts them; ``c`` carries the count across a stream's chunks)."""
        t, v = self._token_text, _finite_logprob
        if chat:
            return {"content": [
                {"token": t(tok), "logprob": v(lp), "bytes": list(t(tok).encode()),
                 "top_logprobs": [{"token": t(i), "logprob": v(x), "bytes": list(t(i).encode())}
                                  for i, x in top]}
                for tok, lp, top in entries]}
        tokens = [t(tok) for tok, _, _ in entries]
        offset = c.text_offset if c is not None else 0
        offsets = list(itertools.accumulate((len(x) for x in tokens[:-1]), initial=offset)) \
            if tokens else []
        if c is not None:
            c.text_offset = offset + sum(map(len, tokens))
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else v(lp) for _, lp, _ in entries],
                "top_logprobs": [None if top is None else {t(i): v(x) for i, x in top}
                                 for _, _, top in entries],  # an echoed first token: None
                "text_offset": offsets}

    def echoed(self, c: Choice) -> tuple[str, list]:
        """An echoing choice's prompt text and (with logprobs) its prompt entries."""
        return c.echo or "", (c.prompt_logprobs or []) if c.logprobs is not None else []

    def new_logprobs(self, c: Choice) -> list:
        """Entries for tokens emitted since the last call (a stop string's tokens never are)."""
        if c.logprobs is None:
            return []
        upto = c.stream.emitted_tokens
        entries = c.logprobs[c.logprobs_sent:upto]
        c.logprobs_sent = max(c.logprobs_sent, upto)
        return entries

    @staticmethod
    def usage(prompt_len: int, choices: list[Choice]) -> dict:
        completion = sum(c.stream.emitted_tokens for c in choices)
        return {"prompt_tokens": prompt_len, "completion_tokens": completion,
                "total_tokens": prompt_len + completion}

    # ---- the record ----------------------------------------------------------------------------
    def fill_record(self, trace: RequestTrace, req: SamplingFields, prompt: list[int],
                    params: SamplingParams, choices: list[Choice], client_gone: bool,
                    tenant: Tenant) -> None:
        r = trace.record
        r.generated_tokens = sum(c.stream.generated_tokens for c in choices)
        r.emitted_tokens = sum(c.stream.emitted_tokens for c in choices)
        r.retries = trace.earlier_tries + sum(c.retries for c in choices)
        r.tool_calls = [name for c in choices for name in c.called]
        if self.config.record_token_ids and tenant.capture == "full":
            r.input_token_ids = list(prompt)
            r.output_token_ids = list(choices[0].token_ids) if choices else []
            r.token_steps = list(choices[0].token_steps) if choices else []
        if choices and choices[0].neighbours:  # who shared its steps with prefill chunks
            n = choices[0].neighbours
            r.neighbour_tenant = max(n, key=lambda t: (n[t], t))
            r.neighbour_prefill_tokens = sum(n.values())
        if choices:
            c0 = choices[0]
            r.replica = c0.replica
            trace.engine_stats = self._named(c0.stats)
            trace.engine_anchor_ns = c0.engine_anchor_ns
        if r.final_state:
            return
        states = [c.final_state for c in choices]
        if client_gone and any(s is None for s in states):
            trace.fail("CANCELLED", "cancelled", "client_disconnected",
                       "the client went away before the response was complete")
            return
        bad = next((c for c in choices if c.final_state not in ("FINISHED", None)), None)
        if bad is not None:
            kind = {"TIMED_OUT": ("TIMED_OUT", "timeout"), "CANCELLED": ("CANCELLED", "cancelled"),
                    "REJECTED": ("REJECTED", "rejected")}.get(bad.final_state or "",
                                                             ("FAILED", "error"))
            trace.fail(kind[0], kind[1], (bad.final_state or "error").lower(), bad.error or "")
            return
        c0 = choices[0]
        r.final_state = "FINISHED"
        r.finish_reason = "stop_string" if c0.stream.stopped else (c0.finish_reason or "stop")
        if self.policy.predicts_length:  # what the next prediction rests on
            key, n_out = (tenant.name, r.endpoint), c0.stream.generated_tokens
            old = self._lengths.get(key)
            self._lengths[key] = n_out if old is None else old + LENGTH_EWMA * (n_out - old)

    def _fill_static(self, trace: RequestTrace, params: SamplingParams) -> None:
        r = trace.record
        r.model = self.config.served_model_name
        r.engine_version = self.versions["engine"]
        r.gateway_version = self.versions["gateway"]
        r.tokenizer_revision = self.versions["tokenizer"]
        r.config_id = self.versions["config_id"]
        r.temperature, r.top_p, r.top_k = params.temperature, params.top_p, params.top_k
        r.min_p, r.seed, r.max_tokens = params.min_p, params.seed, params.max_tokens
        r.priority = params.priority
        if params.degraded:
            r.lane, r.degraded = "degraded", params.degraded

    def degrade(self, req: SamplingFields, parts: list[Part], tenant: Tenant) -> SamplingFields:
        """Degraded admission (``gateway.degrade``): under load, the reductions of a tenant
        that allows them (the request's ``n`` and each prompt's parameters, as they will
        run); one decision for the whole request."""
        rule = tenant.degrade
        why = self.registry.load.pressure(self.pool.describe()) if rule is not None else ""
        if not why:
            return req
        n = req.n
        for part in parts:
            part.params, n, what = rule.apply(part.params, req.n, self.policy.takes_priority,
                                              why)
        if n != req.n:
            req = req.model_copy(update={"n": n})
        return req

    # ---- one request ---------------------------------------------------------------------------
    async def run(self, request: Request, req: SamplingFields, parts: list[Part], chat: bool,
                  tenant: Tenant, scoring: bool = False, tools: ToolSpec | None = None
                  ) -> Response:
        """Serve ``parts`` (one prompt, or a completions batch's) with ``req.n`` samples each:
        choice ``k * n + j`` is prompt k's sample j (OpenAI's and vLLM's order)."""
        req = self.degrade(req, parts, tenant)
        capture = self.config.record_token_ids and tenant.capture == "full"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        for part in parts:
            self._fill_static(part.trace, part.params)
            r = part.trace.record
            r.prompt_tokens, r.stream, r.n, r.response_id = \
                len(part.prompt), req.stream, req.n, rid
            if capture:  # what replay rebuilds
                # msgspec encodes the dataclass as asdict + json.dumps did (int keys as
                # strings), at a tenth of the cost (asdict deep-copies every field)
                r.sampling_params = _encode_json({
                    "engine": part.params, "n": req.n, "stop": self.stops(req),
                    "include_stop_str_in_output": req.include_stop_str_in_output,
                    "skip_special_tokens": req.skip_special_tokens,
                    "scoring": scoring}).decode()
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        registry = self.registry
        # what the answer can hold, not only what is generated: each output token's logprobs,
        # and the prompt again (echo) or with its logprobs are charged as tokens too, so a
        # small request cannot ask for an answer many times its charged size
        budget = sum(part.params.max_tokens * _per_token(part.params) + _prompt_extra(part)
                     for part in parts) * req.n
        registry.admit_tokens(tenant, sum(len(part.prompt) for part in parts), budget)
        for part in parts:
            part.trace.mark("TOKENIZED")
        choices: list[Choice] = []
        try:
            for k, part in enumerate(parts):
                part.choices = await self.start_choices(
                    rid, part.prompt, part.params, req.n, self.stops(req),
                    req.include_stop_str_in_output, part.trace, tenant.cache_salt,
                    req.skip_special_tokens, first=k * req.n)
                choices += part.choices
        except APIError:
            await self.abort_all(choices)  # a batch: the earlier prompts' samples
            registry.give_back_tokens(tenant, budget)
            for i in range(len(parts) * req.n):
                self._forget(f"{rid}-{i}")
            raise
        for part in parts:
            for c in part.choices:
                c.echo, c.scoring, c.tools = part.echo, scoring, tools
                c.return_ids = req.return_token_ids
                if tools is not None and tools.forced:
                    c.tool_stream = ToolStream()
                elif tools is not None:
                    c.held = ""

        held = True

        def free_slot() -> None:  # the tenant's slot and unused token budget, once
            nonlocal held
            if held:
                held = False
                unused = sum((c.params.max_tokens - c.stream.generated_tokens)
                             * _per_token(c.params) for c in choices)
                registry.finish(tenant, unused)
                for c in choices:
                    self._abandon.pop(c.engine_id, None)
                    self._retire(c.engine_id)

        def settle(client_gone: bool) -> None:  # tenant slot, unused token budget, records
            free_slot()
            for part in parts:
                self.fill_record(part.trace, req, part.prompt, part.params, part.choices,
                                 client_gone, tenant)

        for c in choices:  # a client cancelled for not reading frees its slot at once
            self._abandon[c.engine_id] = free_slot
        request.state.settled_by_run = True  # from here on, settle() releases the slot
        prompt_tokens = sum(len(part.prompt) for part in parts)
        if not req.stream:
            return await self._complete(request, req, parts, prompt_tokens, choices, chat, rid,
                                        obj, created, settle)
        return StreamingResponse(
            self._events(req, prompt_tokens, choices, chat, rid, obj, created, settle),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @staticmethod
    def _calls(c: Choice, text: str) -> list[ToolCall]:
        """A finished choice's tool calls (none: it answered in text); notes them on it."""
        if c.tools is None or c.final_state != "FINISHED":
            return []
        calls = parse(text, c.tools) or []
        if not calls and c.tools.forced and c.finish_reason == "length":
            calls = cut_short(text)
        if calls and c.tools.legacy:  # the deprecated shape holds one call
            calls = calls[:1]
        if calls:
            c.calls, c.called = calls, [x.name for x in calls]
            if c.finish_reason == "stop":
                c.finish_reason = "function_call" if c.tools.legacy else "tool_calls"
        return calls

    @staticmethod
    async def _client_gone(request: Request) -> None:
        """Returns when the client disconnects (the body is read: only that can arrive)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _complete(self, request, req, parts, prompt_tokens, choices, chat, rid, obj,
                        created, settle) -> Response:
        texts = ["" for _ in choices]

        async def collect_one(c: Choice) -> None:
            done = False
            while not done:
                text, done = await self.next_text(c)
                texts[c.index] += text
            self._calls(c, texts[c.index])  # before the record is written

        async def collect() -> None:
            # every choice's deltas are taken as they come: read one after the other, the
            # later choices' buffers would fill, pause them (flow control) and, when the first
            # choice outlasts slow_client_timeout_s, cancel them as if the client had stalled
            try:
                async with asyncio.TaskGroup() as group:
                    for c in choices:
                        group.create_task(collect_one(c))
            except ExceptionGroup as failed:  # the first error, as one reader would raise it
                raise failed.exceptions[0] from None

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(self._client_gone(request))
        done_all = False
        try:  # a client that leaves has its engine requests aborted, as a stream's would
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()
                done_all = True
        finally:
            for task in (work, gone):
                task.cancel()
            await self.abort_all(choices)
            settle(client_gone=not done_all)
        if not done_all:
            raise APIError(499, "the client closed the request", code="client_closed")
        for c in choices:
            if c.finish_reason == "rejected":  # the replica's admission refused it
                raise bad_request(c.error or "rejected")
            if c.finish_reason == "timeout":
                raise APIError(504, c.error or "timed out", "server_error", code="timeout")
            if c.finish_reason in ("error", "cancelled"):
                raise APIError(500, c.error or "generation failed", "server_error",
                               code="generation_failed")
        body_choices = []
        lead = {c.index: part.choices[0] for part in parts for c in part.choices}
        for c in choices:
            head, head_lps = self.echoed(c)
            texts[c.index] = head + texts[c.index]
            lp = self.logprobs_body(head_lps + self.new_logprobs(c), chat, c) \
                if c.logprobs is not None else None
            if c.calls or (chat and c.tools is not None and c.tools.forced):
                message = {"role": "assistant", "content": None}
                if not c.tools.legacy:
                    message["tool_calls"] = [x.body() for x in c.calls]
                elif c.calls:  # the deprecated shape: the one call, no id
                    message["function_call"] = c.calls[0].body()["function"]
                body_choices.append({"index": c.index, "message": message, "logprobs": lp,
                                     "finish_reason": c.finish_reason})
            elif chat:
                body_choices.append({"index": c.index, "message": {
                    "role": "assistant", "content": texts[c.index]}, "logprobs": lp,
                    "finish_reason": c.finish_reason})
            else:
                body_choices.append({"index": c.index, "text": texts[c.index], "logprobs": lp,
                                     "finish_reason": c.finish_reason})
                if req.return_token_ids:
                    body_choices[-1]["prompt_token_ids"] = c.prompt
                if req.prompt_logprobs is not None:  # vLLM's completions: per choice
                    body_choices[-1]["prompt_logprobs"] = self.vllm_prompt_logprobs(
                        lead[c.index].prompt_logprobs)
            if req.return_token_ids:
                body_choices[-1]["token_ids"] = [] if c.scoring else c.token_ids
        body = {"id": rid, "object": obj, "created": created,
                "model": self.config.served_model_name, "choices": body_choices,
                "usage": self.usage(prompt_tokens, choices)}
        if chat and req.prompt_logprobs is not None and choices:  # vLLM's chat: top level
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(choices[0].prompt_logprobs)
        if req.return_token_ids and chat:
            body["prompt_token_ids"] = parts[0].prompt
        return JSONResponse(body)

    def vllm_prompt_logprobs(self, entries: list | None) -> list:
        """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank,
        decoded_token}} for the token itself and its alternatives (rank: its place among the
        alternatives, None when it is not among them)."""
        out: list = []
        for tok, lp, top in entries or []:
            if lp is None:
                out.append(None)
                continue
            ranked = {i: (r, x) for r, (i, x) in enumerate(top or (), start=1)}
            item = {str(tok): {"logprob": _finite_logprob(lp), "rank": ranked.get(tok, (None,))[0],
                               "decoded_token": self._token_text(tok)}}
            for i, (r, x) in ranked.items():
                item.setdefault(str(i), {"logprob": _finite_logprob(x), "rank": r,
                                         "decoded_token": self._token_text(i)})
            out.append(item)
        return out

    async def _deltas(self, choices: list[Choice]):
        """(choice, text, finished) as each choice's next delta comes. One choice (most
        streams) is awaited directly: a task and an ``asyncio.wait`` per token cost the event
        loop more than the rest of a chunk's work. A choice's next delta is awaited only once
        the consumer has handled its previous one (it reads the choice's state)."""
        if len(choices) == 1:
            c, finished = choices[0], False
            while not finished:
                text, finished = await self.next_text(c)
                yield c, text, finished
            return
        pending = {asyncio.ensure_future(self.next_text(c)): c for c in choices}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    c = pending.pop(fut)
                    text, finished = fut.result()
                    yield c, text, finished
                    if not finished:
                        pending[asyncio.ensure_future(self.next_text(c))] = c
        finally:
            for fut in pending:
                fut.cancel()

    async def _events(self, req, prompt_tokens, choices, chat, rid, obj, created, settle
                      ) -> AsyncIterator[str | bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        obfuscate = bool(req.stream_options and req.stream_options.include_obfuscation)
        model = self.config.served_model_name
        chunk_obj = obj + (".chunk" if chat else "")

        def chunk(c: Choice, text: str | None, finish: str | None, first: bool = False,
                  head: list | None = None, tool_calls: list | None = None) -> str:
            entries = head if head is not None else self.new_logprobs(c)
            lp = self.logprobs_body(entries, chat, c) if entries else None
            if chat:
                delta: dict = {}
                if first:
                    delta["role"] = "assistant"
                if tool_calls and c.tools is not None and c.tools.legacy:
                    if (call := legacy_delta(tool_calls)) is not None:
                        delta["function_call"] = call
                elif tool_calls:
                    delta["tool_calls"] = tool_calls
                elif text is not None:
                    delta["content"] = text
                body = {"index": c.index, "delta": delta, "logprobs": lp,
                        "finish_reason": finish}
            else:
                body = {"index": c.index, "text": text or "", "logprobs": lp,
                        "finish_reason": finish}
            payload = {"id": rid, "object": chunk_obj, "created": created, "model": model,
                       "choices": [body]}
            if c.return_ids:  # vLLM's shape: the prompt's ids with a choice's first chunk
                if c.ids_sent < 0:
                    (payload if chat else body)["prompt_token_ids"] = c.prompt
                body["token_ids"] = c.new_ids()
            if include_usage:  # continuous: the request's usage so far (every choice)
                payload["usage"] = self.usage(prompt_tokens, choices) if continuous else None
            data = _encode_json(payload)
            return sse.event(obfuscated(data) if obfuscate else data)

        complete = False
        try:
            if chat:
                for c in choices:
                    yield chunk(c, "", None, first=True)
            # closed on the way out (an error, the client gone): no choice's read left pending
            async with contextlib.aclosing(self._deltas(choices)) as deltas:
                async for c, text, finished in deltas:
                    if c.echo is not None and not c.echo_sent:  # with the prompt's logprobs
                        c.echo_sent = True
                        head, head_lps = self.echoed(c)
                        yield chunk(c, head, None, head=head_lps)
                        c.trace.flush()
                    if c.tool_stream is not None:  # a forced call: its deltas as they come
                        calls = c.tool_stream.feed(text) if text else []
                        if calls:
                            yield chunk(c, None, None, tool_calls=calls)
                            c.trace.flush()
                        text = ""
                    elif c.held is not None:  # auto: a call or text? hold until known
                        c.held += text
                        text = ""
                        if c.held.strip() and not c.held.lstrip().startswith("{"):
                            text, c.held = c.held, None  # text: from here on as it comes
                    if text:
                        yield chunk(c, text, None)
                        c.trace.flush()
                    if finished and c.held is not None:
                        held, c.held = c.held, None
                        calls = self._calls(c, held)
                        if calls:
                            yield chunk(c, None, None, tool_calls=[
                                {"index": i, **x.body()} for i, x in enumerate(calls)])
                        elif held:
                            yield chunk(c, held, None)
                        c.trace.flush()
                    elif finished and c.tool_stream is not None:
                        self._calls(c, c.tool_stream.text)
                    if finished:
                        if c.finish_reason in ("error", "rejected", "timeout", "cancelled"):
                            code = {"timeout": "timeout", "rejected": "rejected"}.get(
                                c.finish_reason, "generation_failed")
                            err = {"error": {"message": c.error, "type": "server_error",
                                             "param": None, "code": code}}
                            yield sse.event(_encode_json(err))
                        else:
                            yield chunk(c, None if chat else "", c.finish_reason)
            if include_usage:
                payload = {"id": rid, "object": chunk_obj, "created": created, "model": model,
                           "choices": [], "usage": self.usage(prompt_tokens, choices)}
                yield sse.event(_encode_json(payload))
            yield sse.DONE
            complete = True
        finally:  # normal end, error, or the client went away: nothing left running
            await self.abort_all(choices)
            settle(client_gone=not complete)
