"""Serving one OpenAI request: the endpoints, each a short pipeline over its request session.

Path: prepare (``gateway.prepare``: parse the body, tokenize, build the sampling parameters; a
bad request never reaches a replica) -> submit each prompt's ``n`` samples (``gateway.session``)
-> relay token deltas through the incremental detokenizer and stop strings -> one JSON body or
SSE chunks, shaped by the endpoint's format (``gateway.formatting``) -> the record
(``gateway.records``). A client that disconnects has its engine requests aborted; a sample
whose replica dies before its first token is retried once on another replica. A model an
external backend serves goes there instead (``gateway.upstream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.policy import POLICIES
from engine.sampling_params import ParamError
from gateway import upstream_rules
from gateway.backend import Backend, NoReplicas
from gateway.errors import APIError, bad_request
from gateway.formatting import (
    ChatFormat,
    CompletionFormat,
    Format,
    echoed,
    tool_calls,
    usage,
)
from gateway.prepare import Preparer, param_error, stops, validated
from gateway.records import RequestTrace, encode_json
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
from gateway.session import RequestSession, Samples, per_token
from gateway.tenants import Tenant, TenantRegistry
from gateway.tools import ToolSpec, ToolStream, conversation
from gateway.upstream import NoBackendLeft, UpstreamPool
from tracing import sse

log = logging.getLogger("tailscope.gateway")

# a choice that ended this way is an error to the client
FAILED = ("error", "rejected", "timeout", "cancelled")

# what an endpoint answers with: a backend's response as it sent it, a JSON body, or a
# stream's chunks
Answer = Response | dict | AsyncIterator[dict]


async def _decoded(body: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """A backend's server-sent events as the chunks they carry; closing this closes it."""
    decoder = sse.Decoder()
    async with contextlib.aclosing(body) as source:
        async for piece in source:
            for raw in decoder.feed(piece):
                yield json.loads(raw)


class Service:
    """Everything an API request needs, built once per gateway."""

    def __init__(self, config, tokenizer, pool: Backend, registry: TenantRegistry,
                 versions: dict[str, str], upstreams: UpstreamPool | None = None) -> None:
        self.config, self.tokenizer, self.pool = config, tokenizer, pool
        self.upstreams = upstreams  # external backends (their model names are proxied)
        self.registry, self.versions = registry, versions
        # what the engine's scheduling policy reads from a request (asked of it, not its name)
        self.policy = POLICIES[config.engine.scheduling_policy]
        # False for a gateway of external backends only: it serves no bundled model name
        self.bundled = not isinstance(pool, NoReplicas)
        self.samples = Samples(pool, tokenizer, config.queue_timeout_s,
                               config.request_timeout_s)
        self.prepare = Preparer(config, tokenizer, pool, registry, self.policy,
                                self.model_not_found, self.bundled)
        self.warm, self.warmed = self.prepare.warm, self.prepare.warmed
        self.chat_format = ChatFormat(tokenizer, config.served_model_name)
        self.completion_format = CompletionFormat(tokenizer, config.served_model_name)
        # /v1/responses kept for previous_response_id and retrieval (none when the bound is 0)
        mb = config.responses_store_mb
        self.stored_responses = ResponseStore(int(mb * 2**20)) if mb > 0 else None

    def trace_of(self, engine_id: str) -> str:
        """The trace id of an in-flight or recently ended engine request (else the id)."""
        return self.samples.inflight.trace_of(engine_id)

    def note_step(self, stats) -> None:
        """A replica's step: who brought prefill into each member's steps."""
        self.samples.inflight.note_step(stats)

    # ---- which side serves it ----------------------------------------------------------------
    def served_models(self) -> list[str]:
        """Every model name this gateway serves, once: the bundled replicas' and each
        backend's (a mixed pool's shared name once)."""
        bundled = [self.config.served_model_name] if self.bundled else []
        return list(dict.fromkeys([*bundled, *(self.upstreams.models if self.upstreams else [])]))

    def model_not_found(self, model: str) -> APIError:
        return APIError(404, f"model {model!r} does not exist; this gateway serves "
                        f"{', '.join(map(repr, self.served_models()))}", param="model",
                        code="model_not_found")

    async def proxied(self, session: RequestSession, path: str) -> Response | None:
        """A request for a model an external backend serves goes there as the client sent it
        (``gateway.upstream``); None for the bundled replicas' model."""
        if self.upstreams is None:
            return None
        request, tenant, trace = session.request, session.tenant, session.trace
        data, _ = await self.prepare.body_json(request)
        model = data.get("model")
        if not isinstance(model, str) or not self.upstreams.serves(model):
            return None
        mixed = model == self.config.served_model_name and self.bundled
        if mixed:  # replicas and backends
            if not self._mixed_route(model, trace):
                return None  # the bundled replicas take it
            # the served model's sampling defaults apply whoever serves it
            data = {**self.config.sampling_defaults, **data, **self.config.sampling_overrides}
        trace.versioned(self.versions)
        data, charge = await upstream_rules.admit(
            data, tenant, self.registry, self.limits,
            lambda text: self.prepare.encode(text, add_special_tokens=False))
        trace.tagged(data.get("safety_identifier") or data.get("user"), data.get("metadata"))
        trace.mark("ADMITTED")

        def settle(used: int | None = None) -> None:  # the tenant's slot and tokens, once
            if session.holds_slot:
                upstream_rules.settle(charge, used, tenant, self.registry)
                session.release()

        try:
            timeout = self.config.request_timeout_s
            return await self.upstreams.proxy(
                request, data, path, trace, settle,
                keep_ids=self.config.record_token_ids and tenant.capture == "full",
                fallback=mixed, deadline=time.monotonic() + timeout if timeout else None)
        except NoBackendLeft as exc:  # a mixed pool: the bundled replicas take it
            if session.holds_slot:  # the bundled path charges on its own
                upstream_rules.settle(charge, 0, tenant, self.registry)
            trace.fell_back(f"mixed pool: backend {exc.backend} failed before any content "
                            f"({exc.message}); the bundled replicas took it")
            log.warning("%s", trace.route_note)
            return None

    @property
    def limits(self):
        return self.prepare.limits

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

    # ---- utility endpoints (vLLM's shapes) ----------------------------------------------------
    async def _utility_body(self, request: Request, model):
        data, _ = await self.prepare.body_json(request)
        parsed = validated(model, data, strict=False)
        name = parsed.model
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"model {name!r}: tokenize and detokenize use the bundled "
                           f"model's tokenizer ({self.config.served_model_name!r})",
                           param="model", code="model_not_found")
        return parsed

    async def tokenize(self, session: RequestSession) -> Response:
        try:  # nothing is generated: the slot is given back here
            req = await self._utility_body(session.request, TokenizeRequest)
            text, special = self._tokenize_text(req)
            ids = await self.prepare.encode(text, add_special_tokens=special)
            # the answer's size in tokens (its strings too): under the tenant's tokens per minute
            self.registry.charge_tokens(session.tenant,
                                        len(ids) * (2 if req.return_token_strs else 1))
            t = self.chat_format.token_text
            return JSONResponse({
                "count": len(ids), "max_model_len": self.pool.max_model_len, "tokens": ids,
                "token_strs": [t(i) for i in ids] if req.return_token_strs else None})
        finally:
            session.release()

    def _tokenize_text(self, req: TokenizeRequest) -> tuple[str, bool]:
        """The text /tokenize encodes (a prompt, or the chat prompt of messages and tools) and
        whether special tokens are added."""
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send either prompt or messages", "prompt")
        if req.messages is None:
            return req.prompt or "", req.add_special_tokens is not False
        if len(req.messages) > self.limits.max_messages:
            raise bad_request(f"{len(req.messages)} messages; at most "
                              f"{self.limits.max_messages} are accepted", "messages")
        try:
            req.check_template_fields()
            check_content(req.messages)
            messages, _ = conversation(req)  # the prompt a chat completion of these would have
        except ParamError as exc:
            raise param_error(exc) from None
        return self.prepare.template(messages, req), bool(req.add_special_tokens)

    async def detokenize(self, session: RequestSession) -> Response:
        try:
            req = await self._utility_body(session.request, DetokenizeRequest)
            self.registry.charge_tokens(session.tenant, len(req.tokens))
            if any(t >= self.tokenizer.vocab_size for t in req.tokens):
                raise bad_request("tokens has ids outside the vocabulary", "tokens")
            return JSONResponse({"prompt": self.tokenizer.decode(req.tokens,
                                                                 skip_special_tokens=False)})
        finally:
            session.release()

    # ---- the generating endpoints -------------------------------------------------------------
    async def chat(self, session: RequestSession) -> Response:
        return self._respond(*await self._chat(session))

    async def _chat(self, session: RequestSession) -> tuple[Answer, SamplingFields | None]:
        """The chat answer (a backend's response as it sent it, else a body or chunks) and
        the parsed request (None for a backend's)."""
        if (proxied := await self.proxied(session, "/chat/completions")) is not None:
            return proxied, None
        req = await self.prepare.parse(session, ChatCompletionRequest)
        assert isinstance(req, ChatCompletionRequest)
        session.trace.mark("ADMITTED")
        session.parts, tools = await self.prepare.chat(session, req)
        return await self.run(session, req, self.chat_format, tools=tools), req

    async def completions(self, session: RequestSession) -> Response:
        if (proxied := await self.proxied(session, "/completions")) is not None:
            return proxied
        req = await self.prepare.parse(session, CompletionRequest)
        assert isinstance(req, CompletionRequest)
        session.trace.mark("ADMITTED")
        session.parts = await self.prepare.completions(session, req)
        answer = await self.run(session, req, self.completion_format,
                                scoring=req.max_tokens == 0)
        return self._respond(answer, req)

    @staticmethod
    def _respond(answer: Answer, req: SamplingFields | None) -> Response:
        """An answer as the client gets it: a JSON body, or its chunks as server-sent events
        (each content chunk obfuscated when the request asked, as OpenAI's are)."""
        if isinstance(answer, Response):
            return answer
        if isinstance(answer, dict):
            return JSONResponse(answer)
        obfuscate = bool(req.stream_options and req.stream_options.include_obfuscation)

        async def events() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(answer) as chunks:  # closing this ends the request
                async for payload in chunks:
                    data = encode_json(payload)
                    yield sse.event(obfuscated(data) if obfuscate and payload.get("choices")
                                    else data)
            yield sse.DONE

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def responses(self, session: RequestSession) -> Response:
        """OpenAI's Responses API, served as the chat request it means (``gateway.responses``):
        a 400 names the Responses field; the answer is the response object, or its events.
        Unless ``store`` is false, the response is kept (``ResponseStore``) once it ends."""
        request, tenant = session.request, session.tenant
        data, _ = await self.prepare.body_json(request)
        req = validated(ResponsesRequest, data)
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
            raise param_error(exc) from None
        request.state.body_json = body, encode_json(body)  # what chat() (or a backend) reads
        try:
            answer, _ = await self._chat(session)
        except APIError as exc:  # named as the client named it
            was, exc.param = exc.param, param_name(exc.param)
            if was and exc.param != was:
                exc.message = exc.message.replace(was.split(".")[0], exc.param.split(".")[0])
            raise
        if isinstance(answer, Response) and answer.status_code != 200:
            return answer  # a backend's error, as it sent it
        shell = Shell(req, stored=self.stored_responses is not None and req.store is not False)
        session.trace.answered_as(shell.id)

        def keep(response: dict) -> None:
            """Store a response that ended (not one that failed); one larger than the whole
            bound is not kept, and then says so (``store: false``)."""
            if shell.stored and response["status"] in ("completed", "incomplete"):
                items = input_items(req)
                turn = to_messages(items) + to_messages(response["output"], "output")
                if not self.stored_responses.put(tenant.name, response, history + turn,
                                                 with_ids(items)):
                    response["store"] = False

        if isinstance(answer, StreamingResponse):  # a backend's stream: its SSE decoded
            answer = _decoded(answer.body_iterator)
        elif isinstance(answer, Response):
            answer = json.loads(answer.body)
        if isinstance(answer, dict):
            obj = response_object(shell, answer)
            keep(obj)
            return JSONResponse(obj)
        return StreamingResponse(self._response_events(shell, answer, keep),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def stored_response(self, tenant: Tenant, response_id: str):
        """A response this tenant created and the gateway still keeps (else None)."""
        if self.stored_responses is None:
            return None
        return self.stored_responses.get(tenant.name, response_id)

    @staticmethod
    async def _response_events(shell: Shell, chunks: AsyncIterator[dict],
                               keep: Callable[[dict], None]) -> AsyncIterator[bytes]:
        """The chat answer's ``chunks`` as Responses events; closing this closes them (their
        own ending aborts what runs and writes the record). The final response goes to
        ``keep``."""
        events = ResponseEvents(shell)
        obfuscate = bool((shell.req.stream_options or {}).get("include_obfuscation"))
        for kind, payload in events.start():
            yield response_event(kind, payload)
        failed = False
        async with contextlib.aclosing(chunks) as source:
            async for data in source:
                failed = failed or "error" in data
                for kind, payload in events.chunk(data):
                    yield response_event(kind, payload, obfuscate)
        if not failed:
            final = events.end()
            keep(final[-1][1]["response"])  # kept before the client hears it ended
            for kind, payload in final:
                yield response_event(kind, payload)

    # ---- one request's samples ---------------------------------------------------------------
    async def run(self, session: RequestSession, req: SamplingFields, fmt: Format,
                  scoring: bool = False, tools: ToolSpec | None = None) -> Answer:
        """Serve the session's parts (one prompt, or a completions batch's) with ``req.n``
        samples each: choice ``k * n + j`` is prompt k's sample j (OpenAI's and vLLM's order).
        From here on the session's slot is released when the answer ends."""
        parts, tenant = session.parts, session.tenant
        req = self.prepare.degrade(req, parts, tenant)
        rid = fmt.id_prefix + uuid.uuid4().hex
        for part in parts:
            part.trace.configured(self.config.served_model_name, self.versions, part.params,
                                  req.n, req.stream, rid, len(part.prompt))
        stop = stops(req)
        if self.config.record_token_ids and tenant.capture == "full":  # what replay rebuilds
            for part in parts:
                part.trace.captured({
                    "engine": part.params, "n": req.n, "stop": stop,
                    "include_stop_str_in_output": req.include_stop_str_in_output,
                    "skip_special_tokens": req.skip_special_tokens, "scoring": scoring})
        # what the answer can hold, not only what is generated: each output token's logprobs,
        # and the prompt again (echo) or with its logprobs are charged as tokens too, so a
        # small request cannot ask for an answer many times its charged size
        budget = sum(part.params.max_tokens * per_token(part.params) + part.prompt_extra()
                     for part in parts) * req.n
        self.registry.admit_tokens(tenant, sum(len(part.prompt) for part in parts), budget)
        for part in parts:
            part.trace.mark("TOKENIZED")
        try:
            for k, part in enumerate(parts):
                await self.samples.start(session, part, rid, req.n, stop,
                                         req.include_stop_str_in_output,
                                         req.skip_special_tokens, first=k * req.n)
        except APIError:
            await self.samples.abort_all(session.choices)  # a batch: the earlier prompts'
            self.registry.give_back_tokens(tenant, budget)
            self.samples.forget(session)
            raise
        for part in parts:
            for c in part.choices:
                c.echo, c.scoring, c.tools = part.echo, scoring, tools
                c.return_ids = req.return_token_ids
                if tools is not None and tools.forced:
                    c.tool_stream = ToolStream()
                elif tools is not None:
                    c.held = ""
        created = int(time.time())
        if not req.stream:
            return await self._complete(session, req, fmt, rid, created)
        return self._chunks(session, req, fmt, rid, created)

    def _settle(self, session: RequestSession, client_gone: bool) -> None:
        """The answer ended: the tenant's slot and unused token budget back, the records."""
        self.samples.end(session)
        capture = self.config.record_token_ids and session.tenant.capture == "full"
        for part in session.parts:
            c0 = part.choices[0] if part.choices else None
            stats = self.samples.inflight.named(c0.stats) if c0 is not None else None
            if part.trace.ended(part.choices, part.prompt, capture, client_gone, stats):
                self.prepare.learn_length(session.tenant, part.trace.record.endpoint,
                                          c0.stream.generated_tokens)

    @staticmethod
    async def _client_gone(request: Request) -> None:
        """Returns when the client disconnects (the body is read: only that can arrive)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _complete(self, session: RequestSession, req, fmt: Format, rid: str,
                        created: int) -> dict:
        choices = session.choices
        texts = ["" for _ in choices]

        async def collect_one(c) -> None:
            done = False
            while not done:
                text, done = await self.samples.next_text(c)
                texts[c.index] += text
            tool_calls(c, texts[c.index])  # before the record is written

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
        gone = asyncio.ensure_future(self._client_gone(session.request))
        done_all = False
        try:  # a client that leaves has its engine requests aborted, as a stream's would
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()
                done_all = True
        finally:
            for task in (work, gone):
                task.cancel()
            await self.samples.abort_all(choices)
            self._settle(session, client_gone=not done_all)
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
        prompt_tokens = sum(len(part.prompt) for part in session.parts)
        return fmt.body(req, rid, created, session.parts, texts, prompt_tokens)

    async def _chunks(self, session: RequestSession, req, fmt: Format, rid: str, created: int
                      ) -> AsyncIterator[dict]:
        """A stream's chunks, typed (``_respond`` writes them as events, the Responses API
        reads them as they are); an error chunk for a choice that failed mid-stream."""
        choices = session.choices
        prompt_tokens = sum(len(part.prompt) for part in session.parts)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats

        def chunk(c, text: str | None, finish: str | None = None, **kw) -> dict:
            payload = fmt.chunk(rid, created, c, text, finish, **kw)
            if include_usage:  # continuous: the request's usage so far (every choice)
                payload["usage"] = usage(prompt_tokens, choices) if continuous else None
            return payload

        complete = False
        try:
            for c, extra in fmt.opening(choices):
                yield chunk(c, "", extra=extra)
            # closed on the way out (an error, the client gone): no choice's read left pending
            async with contextlib.aclosing(self.samples.deltas(choices)) as deltas:
                async for c, text, finished in deltas:
                    for piece in self._pieces(c, text, finished, chunk):
                        yield piece
                        c.trace.flush()
                    if finished:
                        yield fmt.error(c) if c.finish_reason in FAILED else \
                            chunk(c, fmt.finish_text, c.finish_reason)
            if include_usage:
                yield {"id": rid, "object": fmt.chunk_obj, "created": created,
                       "model": fmt.model, "choices": [], "usage": usage(prompt_tokens, choices)}
            complete = True
        finally:  # normal end, error, or the client went away: nothing left running
            await self.samples.abort_all(choices)
            self._settle(session, client_gone=not complete)

    @staticmethod
    def _pieces(c, text: str, finished: bool, chunk) -> list[dict]:
        """The content chunks one delta of ``c`` makes: its echoed prompt first, a forced tool
        call's deltas as they come, text held until it is known not to be a call (tool_choice
        auto), or the text itself."""
        out = []
        if c.echo is not None and not c.echo_sent:  # with the prompt's logprobs
            c.echo_sent = True
            head, head_lps = echoed(c)
            out.append(chunk(c, head, entries=head_lps))
        if c.tool_stream is not None:  # a forced call: its deltas as they come
            calls = c.tool_stream.feed(text) if text else []
            if calls:
                out.append(chunk(c, None, calls=calls))
            text = ""
        elif c.held is not None:  # auto: a call or text? hold until known
            c.held += text
            text = ""
            if c.held.strip() and not c.held.lstrip().startswith("{"):
                text, c.held = c.held, None  # text: from here on as it comes
        if text:
            out.append(chunk(c, text))
        if finished and c.held is not None:
            held, c.held = c.held, None
            calls = tool_calls(c, held)
            if calls:
                out.append(chunk(c, None, calls=[{"index": i, **x.body()}
                                                 for i, x in enumerate(calls)]))
            elif held:
                out.append(chunk(c, held))
        elif finished and c.tool_stream is not None:
            tool_calls(c, c.tool_stream.text)
        return out
