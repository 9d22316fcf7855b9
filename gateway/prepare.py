"""Request preparation: everything between the ingress gate and the first submit, none of which
reaches a replica. The body is read within its size limit and parsed once, checked against the
request limits and the schema (an unknown field is refused, not ignored), the chat template and
tools applied, the prompt tokenized and truncated, and the sampling parameters built and
checked (a grammar compiled off the event loop). The result is the request's ``Part`` list.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import threading
from collections.abc import Callable
from typing import Any

import pydantic
from fastapi import Request

from engine.constrained import GrammarCompiler
from engine.sampling_params import ParamError, SamplingParams, StructuredOutput
from gateway.backend import Backend
from gateway.errors import APIError, bad_request
from gateway.limits import RequestLimits, check_body, check_counts
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.session import Part, RequestSession
from gateway.tenants import Tenant, TenantRegistry
from gateway.tools import ToolSpec, conversation

DEFAULT_MAX_TOKENS = 512
LARGE_TEXT_CHARS = 16_384  # tokenized off the event loop from this length (~10 ms of work)
LENGTH_EWMA = 0.2  # sjf policy: weight of the latest output length in the running mean
_TOKEN_ID = re.compile(r"[0-9]{1,10}")

log = logging.getLogger("tailscope.gateway")


def param_error(exc: ParamError) -> APIError:
    return APIError(400, str(exc), "invalid_request_error", exc.param, code=exc.code)


def validated(model: type[pydantic.BaseModel], data: dict, strict: bool = True) -> Any:
    """``data`` as ``model``, or the 400 naming the field (an unknown one by its code where
    ``strict``)."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if strict and err["type"] == "extra_forbidden":
            raise APIError(400, f"unknown parameter {param!r}: the bundled engine does not "
                           "know it (it is refused rather than ignored)",
                           "invalid_request_error", param, code="unknown_parameter") from None
        raise bad_request(f"{param}: {err['msg']}", param) from None


def stops(req: SamplingFields) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise bad_request("stop strings must be non-empty", "stop")
    return stop


class OutputLengths:
    """sjf policy: the running mean (EWMA, ``LENGTH_EWMA``) of choice 0's output tokens of a
    tenant's finished requests per endpoint."""

    def __init__(self) -> None:
        self._mean: dict[tuple[str, str], float] = {}

    def predict(self, tenant: str, endpoint: str) -> int | None:
        est = self._mean.get((tenant, endpoint))
        return None if est is None else max(1, math.ceil(est))

    def learn(self, tenant: str, endpoint: str, tokens: int) -> None:
        key, old = (tenant, endpoint), self._mean.get((tenant, endpoint))
        self._mean[key] = tokens if old is None else old + LENGTH_EWMA * (tokens - old)


class Preparer:
    """Turns a request into its prompts and sampling parameters (built once per gateway)."""

    def __init__(self, config, tokenizer, pool: Backend, registry: TenantRegistry, policy,
                 not_found: Callable[[str], APIError], bundled: bool) -> None:
        self.config, self.tokenizer, self.pool, self.registry = config, tokenizer, pool, registry
        self.policy = policy  # what the engine's scheduling policy reads from a request
        self.not_found, self.bundled = not_found, bundled
        self.limits: RequestLimits = config.limits
        self.lengths = OutputLengths()
        # built by ``build_grammar`` at startup: llguidance's tokenizer index takes ~0.5 s and
        # holds the GIL all along (it paused every stream on its first use, mid-serving)
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.warmed = threading.Event()  # ``warm`` ran: /ready waits for it

    # ---- the body -------------------------------------------------------------------------
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

    async def parse(self, session: RequestSession, model: type[SamplingFields]
                    ) -> SamplingFields:
        data, _ = await self.body_json(session.request)
        if self.config.sampling_defaults or self.config.sampling_overrides:
            data = {**self.config.sampling_defaults, **data, **self.config.sampling_overrides}
        parsed = validated(model, data)
        session.trace.tagged(parsed.safety_identifier or parsed.user, parsed.metadata)
        try:
            parsed.unsupported()
        except ParamError as exc:
            raise param_error(exc) from None
        if parsed.model != self.config.served_model_name or not self.bundled:
            raise self.not_found(parsed.model)
        check_counts(parsed, self.limits)
        return parsed

    # ---- the prompts ------------------------------------------------------------------------
    async def chat(self, session: RequestSession, req: ChatCompletionRequest
                   ) -> tuple[list[Part], ToolSpec | None]:
        """A chat request's one prompt (the template over its messages and tools) and its
        tools (None when it has none or turned them off)."""
        trace, tenant = session.trace, session.tenant
        response_format, grammar_param = req.response_format, "response_format"
        try:
            messages, spec = conversation(req)
        except ParamError as exc:
            raise param_error(exc) from None
        if spec is not None and spec.forced:  # the call is enforced by the grammar engine
            if response_format and response_format.get("type", "text") != "text":
                raise bad_request("a required tool call cannot be combined with "
                                  "response_format", "tool_choice")
            response_format = {"type": "json_schema", "json_schema": {"schema": spec.schema()}}
            grammar_param = "tools"
        text = self.template(messages, req)
        prompt = self.truncate(await self.encode(text, add_special_tokens=False), req)
        trace.prompt_counted(len(prompt))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        params = await self.sampling(req, len(prompt), max_tokens, req.logprobs,
                                     req.top_logprobs or 0, response_format,
                                     prompt_logprobs=req.prompt_logprobs,
                                     grammar_param=grammar_param, tenant=tenant,
                                     endpoint=trace.record.endpoint)
        tools = spec if spec is not None and spec.mode != "none" else None
        return [Part(trace, prompt, params)], tools

    async def completions(self, session: RequestSession, req: CompletionRequest) -> list[Part]:
        """A completions request's prompts (a batch has several), each with its parameters."""
        trace, tenant = session.trace, session.tenant
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
            max_tokens = 1 if scoring else req.max_tokens
            if i == 0:  # the parameters are checked (and a grammar compiled) once
                trace.prompt_counted(len(prompt))
                params = await self.sampling(
                    req, len(prompt), max_tokens, req.logprobs is not None, req.logprobs or 0,
                    req.response_format,
                    prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None
                    else req.prompt_logprobs, tenant=tenant, endpoint=trace.record.endpoint)
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
        return parts

    def template(self, messages: list[dict], req) -> str:
        """The chat template over ``messages`` with the request's template fields."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, req.add_generation_prompt, req.continue_final_message,
                req.chat_template_kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None

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

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; a long text is tokenized in a worker thread that releases the GIL, so
        the event loop keeps serving every other stream meanwhile."""
        if len(text) < LARGE_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode_releasing_gil, text,
                                       add_special_tokens)

    # ---- the sampling parameters ------------------------------------------------------------
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
        """Under a policy that orders by expected length (sjf): ``OutputLengths``' estimate
        (None before the first finished request: the engine then orders by ``max_tokens``);
        None under the other policies."""
        if not self.policy.predicts_length:
            return None
        return self.lengths.predict(tenant.name, endpoint)

    def learn_length(self, tenant: Tenant, endpoint: str, tokens: int) -> None:
        """A request finished with ``tokens`` output tokens (choice 0's)."""
        if self.policy.predicts_length:  # what the next prediction rests on
            self.lengths.learn(tenant.name, endpoint, tokens)

    async def sampling(self, req: SamplingFields, prompt_len: int, max_tokens: int | None,
                       logprobs: bool, top_logprobs: int, response_format,
                       prompt_logprobs: int | None = None,
                       grammar_param: str = "response_format",
                       tenant: Tenant | None = None, endpoint: str = "") -> SamplingParams:
        priority = self.priority(req, tenant) if tenant is not None else 0
        predicted = self.predicted_tokens(tenant, endpoint) if tenant is not None else None
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
                structured=structured, priority=priority, predicted_tokens=predicted,
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
            part.params, n, _ = rule.apply(part.params, req.n, self.policy.takes_priority, why)
        if n != req.n:
            req = req.model_copy(update={"n": n})
        return req

    # ---- the grammar compiler ----------------------------------------------------------------
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
