"""The FastAPI gateway: OpenAI-compatible endpoints over engine replica processes.

Path of a request: parse and validate (a bad request never reaches a replica) -> tokenize
(chat template for chat) -> route to a replica -> relay token deltas through the incremental
detokenizer and stop strings -> SSE chunks or one JSON body. A client that disconnects
mid-stream has its engine request aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.constrained import GrammarCompiler
from engine.protocol import TokenDelta
from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput
from engine.text import TextStream, load_tokenizer
from gateway.errors import APIError, api_error_handler, bad_request
from gateway.replicas import Overloaded, ReplicaConfig, ReplicaFailed, ReplicaPool
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.tenants import Tenant, TenantRegistry

log = logging.getLogger("tailscope.gateway")

DEFAULT_MAX_TOKENS = 512
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@dataclass
class GatewayConfig:
    model: str = "bundled"  # what replicas load
    tokenizer: str | None = None  # defaults to the model path
    served_model_name: str = "SmolLM2-135M-Instruct"
    replicas: int = 1
    replica: ReplicaConfig | None = None
    max_body_bytes: int = 1 << 20
    tenants_file: str | None = None  # TOML with [[tenants]]; none = open local mode
    max_inflight_per_replica: int | None = None  # load shedding threshold (4 x max_num_seqs)


def _trace_headers(request: Request) -> tuple[str, str]:
    """(trace_id, traceparent): continue the caller's W3C trace when one was sent."""
    m = TRACEPARENT.match(request.headers.get("traceparent", "").strip().lower())
    trace_id = m.group(1) if m and m.group(1) != "0" * 32 else secrets.token_hex(16)
    flags = m.group(3) if m else "01"
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"


def create_app(config: GatewayConfig) -> FastAPI:
    from engine.loader.paths import resolve_model_path

    tok_path = config.tokenizer or resolve_model_path(config.model)
    tokenizer = load_tokenizer(tok_path)
    replica_config = config.replica or ReplicaConfig(model=config.model)
    if replica_config.tokenizer is None:  # a copy: the caller's config stays as it was
        replica_config = dataclasses.replace(replica_config, tokenizer=str(tok_path))
    pool = ReplicaPool(replica_config, config.replicas, config.max_inflight_per_replica)
    registry = TenantRegistry.from_file(config.tenants_file)
    grammar: list[GrammarCompiler] = []  # built on first use (~1 s): validates schemas here
    if registry.open:
        log.warning("no API keys configured: open local mode, every request is tenant 'local'")

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await pool.start()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(title="Tailscope gateway", lifespan=lifespan)
    app.state.pool = pool
    app.state.tokenizer = tokenizer
    app.add_exception_handler(APIError, api_error_handler)

    @app.middleware("http")
    async def ids_and_limits(request: Request, call_next):
        request_id = request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
        trace_id, traceparent = _trace_headers(request)
        request.state.request_id = request_id
        request.state.trace_id = trace_id
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            response: Response = JSONResponse(
                APIError(413, f"request body of {length} bytes exceeds the limit of "
                         f"{config.max_body_bytes}", code="body_too_large").body(),
                status_code=413)
        else:
            response = await call_next(request)
        response.headers["x-request-id"] = request_id
        response.headers["x-tailscope-trace-id"] = trace_id
        response.headers["traceparent"] = traceparent
        return response

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        states = {r.id: r.ready for r in pool.replicas}
        return JSONResponse({"ready": pool.ready, "replicas": states},
                            status_code=200 if pool.ready else 503)

    @app.get("/debug/replicas")
    async def debug_replicas() -> dict:
        """Each replica's process, restarts, in-flight requests and latest KV usage."""
        return pool.describe()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model",
                                            "created": 0, "owned_by": "tailscope"}]}

    async def parse(request: Request, model: type[SamplingFields]) -> SamplingFields:
        body = await request.body()
        if len(body) > config.max_body_bytes:
            raise APIError(413, f"request body exceeds the limit of {config.max_body_bytes} bytes",
                           code="body_too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request("request body must be a JSON object")
        try:
            parsed = model.model_validate(data)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise bad_request(f"{param}: {err['msg']}", param) from None
        if parsed.model != config.served_model_name:
            raise APIError(404, f"model {parsed.model!r} does not exist; this gateway serves "
                           f"{config.served_model_name!r}", param="model", code="model_not_found")
        return parsed

    def sampling(req: SamplingFields, prompt_len: int, max_tokens: int | None,
                 logprobs: bool, top_logprobs: int, response_format) -> SamplingParams:
        limit = next((r.health.max_model_len for r in pool.replicas if r.health), 0)
        if max_tokens is None:
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, limit - prompt_len))
        if limit and prompt_len + max_tokens > limit:
            raise bad_request(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                              f"{prompt_len + max_tokens} exceeds the context length {limit}",
                              "max_tokens")
        bias = {}
        for k, v in (req.logit_bias or {}).items():
            if not k.lstrip("-").isdigit():
                raise bad_request(f"logit_bias key {k!r} is not a token id", "logit_bias")
            bias[int(k)] = v
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, min_p=req.min_p, typical_p=req.typical_p,
                repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                logit_bias=bias, seed=req.seed, ignore_eos=req.ignore_eos,
                stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=logprobs,
                top_logprobs=top_logprobs,
                structured=StructuredOutput.from_response_format(response_format))
            params.check_vocab(tokenizer.vocab_size)
        except SamplingParamsError as exc:
            raise bad_request(str(exc), exc.param) from None
        if params.structured is not None:  # an invalid schema is the caller's 400
            if not grammar:
                grammar.append(GrammarCompiler.from_tokenizer(tokenizer, tokenizer.vocab_size))
            try:
                grammar[0].compile(params.structured)
            except ValueError as exc:
                raise bad_request(f"invalid response_format: {exc}", "response_format") from None
        return params

    def stops(req: SamplingFields) -> list[str]:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop strings must be non-empty", "stop")
        return stop

    @dataclass
    class Choice:
        index: int
        engine_id: str
        stream: TextStream
        queue: asyncio.Queue
        finish_reason: str | None = None
        error: str | None = None
        logprobs: list | None = None

    async def start_choices(request_id: str, prompt: list[int], params: SamplingParams,
                            n: int, stop: list[str], include_stop: bool) -> list[Choice]:
        if not pool.ready:
            raise APIError(503, "no replica is ready yet", "server_error",
                           code="not_ready", headers={"Retry-After": "1"})
        choices = []
        for i in range(n):
            p = params if n == 1 or params.seed is None else \
                dataclasses.replace(params, seed=params.seed + i)
            engine_id = f"{request_id}-{i}"
            try:
                _, queue = await pool.submit(engine_id, prompt, p)
            except (ReplicaFailed, Overloaded) as exc:
                await abort_all(choices)  # n > 1: do not leave the earlier samples running
                code = "overloaded" if isinstance(exc, Overloaded) else "replica_unavailable"
                raise APIError(503, str(exc), "server_error", code=code,
                               headers={"Retry-After": "1"}) from None
            choices.append(Choice(i, engine_id, TextStream(tokenizer, stop, include_stop), queue,
                                  logprobs=[] if params.logprobs else None))
        return choices

    async def next_text(choice: Choice) -> tuple[str, bool]:
        """Wait for the choice's next delta; returns (text, finished)."""
        item = await choice.queue.get()
        if isinstance(item, ReplicaFailed):
            choice.finish_reason, choice.error = "error", str(item)
            return "", True
        delta: TokenDelta = item
        text = ""
        if choice.logprobs is not None and delta.logprobs:
            for tok, (lp, top) in zip(delta.token_ids, delta.logprobs, strict=False):
                choice.logprobs.append((tok, lp, top))
        if delta.token_ids and not choice.stream.stopped:
            d = choice.stream.push(delta.token_ids)
            text = d.text
            if d.stop_matched is not None:
                await pool.stop(choice.engine_id, d.stop_matched)
        if delta.finish_reason is not None:
            if delta.state in ("FINISHED",):
                choice.finish_reason = delta.finish_reason
                text += choice.stream.finish()
            elif delta.state == "REJECTED":
                choice.finish_reason, choice.error = "rejected", delta.error or "rejected"
            else:
                choice.finish_reason, choice.error = "error", delta.error or delta.finish_reason
            pool.release(choice.engine_id)
            return text, True
        return text, False

    async def abort_all(choices: list[Choice]) -> None:
        for c in choices:
            if c.finish_reason is None:
                await pool.abort(c.engine_id)
                pool.release(c.engine_id)

    def token_text(tok: int) -> str:
        return tokenizer.decode([tok], skip_special_tokens=False)

    def logprobs_body(c: Choice, chat: bool) -> dict | None:
        """OpenAI logprobs for the emitted tokens (a stop string's own tokens are left out)."""
        if c.logprobs is None:
            return None
        entries = c.logprobs[:c.stream.emitted_tokens]
        if chat:
            return {"content": [
                {"token": token_text(t), "logprob": lp,
                 "bytes": list(token_text(t).encode()),
                 "top_logprobs": [{"token": token_text(i), "logprob": v,
                                   "bytes": list(token_text(i).encode())} for i, v in top]}
                for t, lp, top in entries]}
        return {"tokens": [token_text(t) for t, _, _ in entries],
                "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{token_text(i): v for i, v in top} for _, _, top in entries]}

    def usage(prompt_len: int, choices: list[Choice]) -> dict:
        completion = sum(c.stream.emitted_tokens for c in choices)
        return {"prompt_tokens": prompt_len, "completion_tokens": completion,
                "total_tokens": prompt_len + completion}

    async def run(request: Request, req: SamplingFields, prompt: list[int],
                  params: SamplingParams, chat: bool, tenant: Tenant) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        registry.admit_tokens(tenant, len(prompt), params.max_tokens * req.n)
        try:
            choices = await start_choices(rid, prompt, params, req.n, stops(req),
                                          req.include_stop_str_in_output)
        except APIError:
            registry.give_back_tokens(tenant, params.max_tokens * req.n)
            raise

        def settle() -> None:  # the tenant's concurrency slot and unused token budget
            unused = sum(params.max_tokens - c.stream.generated_tokens for c in choices)
            registry.finish(tenant, unused)

        request.state.settled_by_run = True  # from here on, settle() releases the slot

        if not req.stream:
            texts = ["" for _ in choices]
            try:
                for c in choices:
                    done = False
                    while not done:
                        text, done = await next_text(c)
                        texts[c.index] += text
            finally:
                await abort_all(choices)
                settle()
            rejected = [c for c in choices if c.finish_reason == "rejected"]
            if rejected:  # the replica's admission refused it (e.g. beyond its KV pool)
                raise bad_request(rejected[0].error or "rejected")
            failed = [c for c in choices if c.finish_reason == "error"]
            if failed:
                raise APIError(500, failed[0].error or "generation failed", "server_error")
            body_choices = [
                ({"index": c.index, "message": {"role": "assistant", "content": texts[c.index]},
                  "logprobs": logprobs_body(c, chat), "finish_reason": c.finish_reason} if chat
                 else {"index": c.index, "text": texts[c.index],
                       "logprobs": logprobs_body(c, chat), "finish_reason": c.finish_reason})
                for c in choices]
            return JSONResponse({"id": rid, "object": obj, "created": created,
                                 "model": config.served_model_name, "choices": body_choices,
                                 "usage": usage(len(prompt), choices)})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(index: int, text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta: dict = {}
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                body = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                body = {"index": index, "text": text or "", "logprobs": None,
                        "finish_reason": finish}
            payload = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                       "model": config.served_model_name, "choices": [body]}
            if include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                if chat:
                    for c in choices:
                        yield chunk(c.index, "", None, first=True)
                pending = {asyncio.ensure_future(next_text(c)): c for c in choices}
                while pending:
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for fut in done:
                        c = pending.pop(fut)
                        text, finished = fut.result()
                        if text:
                            yield chunk(c.index, text, None)
                        if finished:
                            if c.finish_reason in ("error", "rejected"):
                                err = {"error": {"message": c.error, "type": "server_error",
                                                 "param": None, "code": None}}
                                yield f"data: {json.dumps(err)}\n\n"
                            else:
                                yield chunk(c.index, None if chat else "", c.finish_reason)
                        else:
                            pending[asyncio.ensure_future(next_text(c))] = c
                if include_usage:
                    payload = {"id": rid, "object": obj + (".chunk" if chat else ""),
                               "created": created, "model": config.served_model_name,
                               "choices": [], "usage": usage(len(prompt), choices)}
                    yield f"data: {json.dumps(payload)}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # normal end, error, or the client went away: nothing left running
                await abort_all(choices)
                settle()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def gated(request: Request, handler) -> Response:
        """Ingress gate (auth, request rate, concurrency) before any parsing or tokenizing;
        the tenant's slot is released here on early errors, otherwise by ``run``."""
        tenant, key_id = registry.authenticate(request.headers.get("authorization"))
        request.state.tenant, request.state.api_key_id = tenant.name, key_id
        registry.admit_request(tenant)
        try:
            return await handler(request, tenant)
        except BaseException:
            if not getattr(request.state, "settled_by_run", False):
                registry.finish(tenant)
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gated(request, _chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gated(request, _completions)

    async def _chat(request: Request, tenant: Tenant) -> Response:
        req = await parse(request, ChatCompletionRequest)
        assert isinstance(req, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(messages)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        prompt = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        params = sampling(req, len(prompt), max_tokens, req.logprobs, req.top_logprobs or 0,
                          req.response_format)
        return await run(request, req, prompt, params, chat=True, tenant=tenant)

    async def _completions(request: Request, tenant: Tenant) -> Response:
        req = await parse(request, CompletionRequest)
        assert isinstance(req, CompletionRequest)
        if isinstance(req.prompt, str):
            prompt = tokenizer.encode(req.prompt)
        else:
            prompt = list(req.prompt)
            if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
                raise bad_request("prompt has token ids outside the vocabulary", "prompt")
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        params = sampling(req, len(prompt), req.max_tokens, req.logprobs is not None,
                          req.logprobs or 0, req.response_format)
        return await run(request, req, prompt, params, chat=False, tenant=tenant)

    return app
