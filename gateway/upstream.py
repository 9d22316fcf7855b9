"""External OpenAI-compatible servers (vLLM, SGLang, llama.cpp's ``llama-server``, another
Tailscope, a hosted API) as recorded replicas.

A backend is declared with a name, a base URL and the model name clients use for it
(``UpstreamConfig``; ``tailscope serve --backend NAME=URL[,key=value...]`` or the engine config
YAML's ``backends:`` list). A request whose ``model`` one or more backends serve is proxied: its
body goes to the upstream as the client sent it (fields the gateway does not know included:
``tools``, ``tool_choice``, vendor extras), only ``model`` rewritten to the upstream's name; the
upstream's response comes back as it sent it, streamed or not (the body bytes of a JSON answer,
each SSE event of a stream). The ingress gate (keys, tenants, rate limits, body size) has run
before; the trace middleware adds its ids and headers and writes the one record.

The backends' declarations are ``gateway.upstream_config``; reading what their answers say is
``gateway.upstream_answer``. More: docs/design/gateway-notes.md#gatewayupstream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gateway import upstream_answer as A
from gateway.errors import APIError
from gateway.records import RequestTrace
from gateway.upstream_answer import UpstreamError
from gateway.upstream_config import UpstreamConfig
from tailscope.keys import redact_url
from tracing import sse

log = logging.getLogger("tailscope.upstream")
# httpx logs every request at INFO: one line per proxied request would be the gateway's log
logging.getLogger("httpx").setLevel(logging.WARNING)


@dataclass
class Upstream:
    config: UpstreamConfig
    client: httpx.AsyncClient
    inflight: int = 0
    failures: int = 0  # in a row
    ejected_until: float = 0.0  # monotonic seconds
    requests: int = 0
    errors: int = 0
    last_error: str = ""
    server: str = ""  # the upstream's Server header, as last seen
    model_revision: str = ""  # from its /v1/models (vLLM/SGLang ``root``, else the id)
    version: str = ""  # its engine and version, from its version endpoint (once)
    probes: int = 0
    probe_failures: int = 0
    probe_streak: int = 0  # failed probes in the current run of failures
    resends: int = 0  # requests sent again after their connection broke before an answer
    last_probe: str = ""  # what the latest probe found

    @property
    def state(self) -> str:
        if self.ejected_until > time.monotonic():
            return "ejected"
        return "half_open" if self.failures >= self.config.eject_after else "ready"

    def succeeded(self) -> None:
        if self.failures >= self.config.eject_after:
            log.info("backend %s is back in", self.config.name)
        self.failures, self.ejected_until, self.probe_streak = 0, 0.0, 0

    def probe_succeeded(self) -> None:
        """A probe closes a half-open breaker and takes back the failures probes added; it
        does not clear request failures (a server whose /health is fine while every request
        fails must still be ejected)."""
        if self.state == "half_open":
            self.succeeded()
        else:
            self.failures = max(0, self.failures - self.probe_streak)
            self.probe_streak = 0

    def failed(self, why: str, probe: bool = False) -> None:
        if probe:
            self.probe_failures += 1
            self.probe_streak += 1
        else:
            self.errors += 1
        self.failures += 1
        self.last_error = why
        if self.failures >= self.config.eject_after:
            self.ejected_until = time.monotonic() + self.config.eject_s
            log.warning("backend %s ejected for %.0f s after %d failures in a row: %s",
                        self.config.name, self.config.eject_s, self.failures, why)


class NoBackendLeft(Exception):
    """A mixed pool's backend failed before sending anything and no other backend of the model
    can take the request: the bundled replicas may (nothing was settled or recorded)."""

    def __init__(self, backend: str, message: str) -> None:
        super().__init__(message)
        self.backend, self.message = backend, message


class UpstreamPool:
    def __init__(self, configs: list[UpstreamConfig] | tuple[UpstreamConfig, ...]) -> None:
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique: {names}")
        self.backends: dict[str, list[Upstream]] = {}
        for c in configs:
            key = os.environ.get(c.api_key_env, "") if c.api_key_env else ""
            client = httpx.AsyncClient(
                base_url=c.base, headers={"Authorization": f"Bearer {key}"} if key else {},
                timeout=httpx.Timeout(None, connect=c.connect_timeout_s),
                limits=httpx.Limits(max_connections=c.max_concurrency,
                                    max_keepalive_connections=c.max_concurrency))
            self.backends.setdefault(c.model, []).append(Upstream(c, client))

        self._probe_task: asyncio.Task | None = None

    @property
    def models(self) -> list[str]:
        return list(self.backends)

    # ---- health probes ------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe every backend now (their revision and version come with the first answer),
        then every ``probe_interval_s``."""
        self._probe_task = asyncio.create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        ups = [u for us in self.backends.values() for u in us if u.config.probe_interval_s > 0]
        due = dict.fromkeys(range(len(ups)), 0.0)
        while ups:
            now = time.monotonic()
            ready = [i for i, at in due.items() if at <= now]
            await asyncio.gather(*(self.probe(ups[i]) for i in ready))
            for i in ready:
                due[i] = time.monotonic() + ups[i].config.probe_interval_s
            await asyncio.sleep(max(0.01, min(due.values()) - time.monotonic()))

    async def probe(self, up: Upstream) -> bool:
        """``GET /health`` at the server's root (``/v1/models`` when it has none). While the
        backend is ejected nothing is sent to it; once its ejection has run out a probe is the
        half-open trial: a success brings it back in, a failure ejects it again. Failed probes
        of a backend in service count as failures in a row too, so a dead backend is ejected
        before a request finds it."""
        if up.state == "ejected":
            return False
        c = up.config
        up.probes += 1
        timeout = httpx.Timeout(min(5.0, c.first_byte_timeout_s), connect=c.connect_timeout_s)
        try:
            resp = await up.client.get(f"{c.root}/health", timeout=timeout)
            if resp.status_code in (401, 403, 404, 405):  # none (or not for us): the API's own
                resp = await up.client.get("/models", timeout=timeout)
            ok = resp.status_code == 200
            up.last_probe = f"HTTP {resp.status_code} from {resp.url.path}"
        except httpx.HTTPError as exc:
            ok, up.last_probe = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            up.failed(f"health probe: {up.last_probe}", probe=True)
            return False
        up.probe_succeeded()
        if not up.model_revision:
            await self._discover(up, timeout)
        return True

    async def _discover(self, up: Upstream, timeout: httpx.Timeout) -> None:
        """The served model's revision (``/v1/models``: vLLM and SGLang name the weights in
        ``root``; else the id) and the server's version (vLLM ``/version``, or another
        Tailscope's, which names its ``server``; llama.cpp ``/props``' ``build_info``, SGLang
        ``/get_server_info``), cached for the records."""
        c = up.config
        want = c.upstream_model or c.model
        try:
            models = (await up.client.get("/models", timeout=timeout)).json().get("data") or []
            entry = next((m for m in models if isinstance(m, dict) and m.get("id") == want),
                         models[0] if len(models) == 1 and isinstance(models[0], dict) else {})
            up.model_revision = str(entry.get("root") or entry.get("id") or "")[:200]
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        for path, key, engine in (("/version", "version", "vllm"),
                                  ("/props", "build_info", "llama.cpp"),
                                  ("/get_server_info", "version", "sglang")):
            try:
                resp = await up.client.get(f"{c.root}{path}", timeout=timeout)
                body = resp.json() if resp.status_code == 200 else {}
                found = body.get(key)
                server = body.get("server")  # another Tailscope names itself there
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            if isinstance(found, str | int | float) and str(found):
                named = server if isinstance(server, str) and server else engine
                up.version = f"{named} {found}"[:100]
                return

    def serves(self, model: str) -> bool:
        return model in self.backends

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        for ups in self.backends.values():
            for u in ups:
                await u.client.aclose()

    def describe(self) -> dict[str, dict]:
        return {u.config.name: {
            "kind": "external", "url": redact_url(u.config.base), "model": u.config.model,
            "state": u.state, "ready": u.state != "ejected", "inflight": u.inflight,
            "max_concurrency": u.config.max_concurrency, "requests": u.requests,
            "errors": u.errors, "failures_in_a_row": u.failures, "last_error": u.last_error,
            "server": u.server, "model_revision": u.model_revision, "version": u.version,
            "probes": u.probes, "probe_failures": u.probe_failures, "last_probe": u.last_probe,
            "resends": u.resends,
            } for ups in self.backends.values() for u in ups}

    def least_loaded(self, model: str, exclude: frozenset[str] = frozenset()
                     ) -> Upstream | None:
        """Fewest in flight among the backends of ``model`` that are not ejected or full."""
        candidates = [u for u in self.backends.get(model, [])
                      if u.config.name not in exclude and u.state != "ejected"
                      and u.inflight < u.config.max_concurrency]
        if not candidates:
            return None
        return min(candidates, key=lambda u: (u.inflight, u.failures, u.config.name))

    def choose(self, model: str, exclude: frozenset[str] = frozenset()) -> Upstream:
        up = self.least_loaded(model, exclude)
        if up is None:
            raise APIError(503, f"no backend for model {model!r} can take the request now",
                           "server_error", code="backend_unavailable",
                           headers={"Retry-After": "1"})
        return up

    # ---- one request ------------------------------------------------------------------------
    async def proxy(self, request: Request, data: dict, path: str, trace: RequestTrace,
                    settle, keep_ids: bool = True, fallback: bool = False,
                    deadline: float | None = None) -> Response:
        """Send ``data`` to a backend of its model (once more elsewhere when nothing was
        received); ``settle(used)`` (idempotent) is called when the exchange is over, with
        the tokens the upstream's usage says it used (0: nothing was produced; None: not
        said). ``keep_ids``: the record may keep token ids the backend returns (the tenant's
        capture setting). ``fallback``: when no backend is left to retry on, raise
        ``NoBackendLeft`` (unsettled) so the caller's bundled replicas can take it.
        ``deadline`` (monotonic seconds): the gateway's deadline, a 504 (or an SSE error
        event once streaming) when it passes."""
        try:
            async with asyncio.timeout_at(A.loop_time(deadline)):
                return await self._proxy(request, data, path, trace, settle, keep_ids,
                                         fallback, deadline)
        except NoBackendLeft:
            raise
        except TimeoutError:
            message = "the request passed the gateway's deadline before the backend answered"
            A.fail(trace, 504, "request_timeout", message)
            settle(0)
            raise APIError(504, message, "server_error", code="request_timeout") from None
        except BaseException:
            settle(0)  # once: a no-op when the exchange already settled
            raise

    async def _proxy(self, request: Request, data: dict, path: str, trace: RequestTrace,
                     settle, keep_ids: bool, fallback: bool, deadline: float | None
                     ) -> Response:
        model = data["model"]
        stream = bool(data.get("stream"))
        trace.proxied(model, stream)
        trace.mark("TOKENIZED")  # nothing to tokenize: the body goes as it is
        tried: set[str] = set()
        while True:
            up = self.choose(model, frozenset(tried))
            tried.add(up.config.name)
            trace.sent_upstream(up.config.name, f"fewest in flight ({up.inflight}) of "
                                f"{len(self.backends[model])} backends for {model}",
                                up.model_revision)
            body = {**data, "model": up.config.upstream_model or model}
            seen = A.Seen(keep_ids=keep_ids)
            if up.config.return_token_ids and "return_token_ids" not in data:
                body["return_token_ids"], seen.strip_ids = True, True
            options = data.get("stream_options")
            if stream and up.config.stream_usage and not (
                    isinstance(options, dict) and options.get("include_usage")):
                body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                          "include_usage": True}
                seen.strip_usage = True
            try:
                return await self._attempt(up, request, body, path, stream, trace, settle,
                                           seen, deadline)
            except UpstreamError as exc:
                can_retry = exc.retry and any(
                    u.config.name not in tried and u.state != "ejected"
                    for u in self.backends[model])
                if can_retry:
                    trace.retried()
                    log.warning("backend %s failed before any content (%s); retrying",
                                up.config.name, exc.message)
                    continue
                if fallback and exc.retry:
                    raise NoBackendLeft(up.config.name, exc.message) from None
                A.fail(trace, exc.status, exc.code, exc.message)
                settle(0)
                if exc.body is not None:  # the upstream's own error answer, as it sent it
                    return Response(exc.body, status_code=exc.status,
                                    media_type="application/json")
                raise APIError(exc.status, exc.message, "server_error" if exc.status >= 500
                               else "invalid_request_error", code=exc.code) from None

    async def _attempt(self, up: Upstream, request: Request, body: dict, path: str,
                       stream: bool, trace: RequestTrace, settle, seen: A.Seen,
                       deadline: float | None) -> Response:
        c = up.config
        up.inflight += 1
        up.requests += 1
        trace.mark("ROUTED")
        resp = None
        relayed = False  # a stream's relay owns the slot and the response from then on
        try:
            r = trace.record  # the upstream (another Tailscope, an OTel-aware server) joins
            req = up.client.build_request("POST", path, json=body, headers={  # our trace
                "traceparent": f"00-{r.trace_id}-{r.span_id}-01"})
            try:
                resp = await asyncio.wait_for(self._send(up, req), c.first_byte_timeout_s)
            except TimeoutError:
                raise self._failure(up, 504, "upstream_timeout", f"backend {c.name} sent no "
                                    f"response within {c.first_byte_timeout_s:g} s") from None
            except httpx.ConnectTimeout:
                raise self._failure(up, 504, "upstream_timeout", f"backend {c.name}: connect "
                                    f"timed out after {c.connect_timeout_s:g} s") from None
            except httpx.HTTPError as exc:
                raise self._failure(up, 502, "upstream_unreachable",
                                    f"backend {c.name}: {type(exc).__name__}: {exc}") from None
            trace.mark("UPSTREAM_HEADERS")
            up.server = resp.headers.get("server", up.server)
            trace.upstream_engine(up.version or up.server)
            if resp.status_code != 200:
                raw = await self._read(resp, c)
                message, code = A.error_of(raw, resp.status_code)
                retry = resp.status_code >= 500 or resp.status_code == 429
                if resp.status_code >= 500:
                    up.failed(f"HTTP {resp.status_code}: {message}")
                raise UpstreamError(resp.status_code, code, f"backend {c.name}: {message}",
                                    retry, raw if A.is_json(raw) else None)
            if not stream:
                raw = await self._read(resp, c)
                try:
                    answer = await A.loads(raw)
                    if not isinstance(answer, dict):
                        raise ValueError("not an object")
                    A.note(seen, answer)
                except ValueError as exc:
                    raise self._failure(up, 502, "upstream_protocol", f"backend {c.name} "
                                        f"answered 200 with a body that is not an OpenAI "
                                        f"answer: {exc}") from None
                up.succeeded()
                if seen.strip_ids and A.strip_ids(answer):
                    raw = json.dumps(answer, ensure_ascii=False).encode()
                A.finish(trace, seen)
                settle(A.used(seen))
                return Response(raw, media_type="application/json")
            up.succeeded()  # headers and a 200: the upstream is up
            relayed = True
            return StreamingResponse(self._relay(up, resp, trace, settle, seen, deadline),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        finally:
            if not relayed:
                up.inflight -= 1
                if resp is not None:
                    await resp.aclose()

    @staticmethod
    async def _send(up: Upstream, req: httpx.Request) -> httpx.Response:
        """Send on a pooled connection; when the connection breaks before a byte of response
        came back, send once more (the broken connection is dropped from the pool, so on a
        fresh one). The usual cause is a keep-alive race: the server closed an idle connection
        just as it was reused (llama-server does this now and then; uvicorn, under vLLM and
        SGLang, closes after 5 s idle, the health probes' period): it disconnects without a
        response, or resets the connection. A server that did take the request and then broke
        the connection generates it twice at most; the client still gets one answer (the
        OpenAI SDK retries these errors the same way). A refused connection is not sent again:
        the server is down."""
        try:
            return await up.client.send(req, stream=True)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            up.resends += 1
            log.info("backend %s broke the connection before answering (%s: %s); sending "
                     "again", up.config.name, type(exc).__name__, exc)
            return await up.client.send(req, stream=True)

    @staticmethod
    async def _read(resp: httpx.Response, c: UpstreamConfig) -> bytes:
        try:
            return await asyncio.wait_for(A.read_bounded(resp, c), c.idle_timeout_s)
        except TimeoutError:
            raise UpstreamError(504, "upstream_timeout", f"backend {c.name} stalled sending "
                                f"its response ({c.idle_timeout_s:g} s)", True) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(502, "upstream_closed", f"backend {c.name} broke off its "
                                f"response: {type(exc).__name__}", True) from None
        finally:
            await resp.aclose()

    @staticmethod
    def _failure(up: Upstream, status: int, code: str, message: str) -> UpstreamError:
        up.failed(message)
        return UpstreamError(status, code, message, True)

    async def _relay(self, up: Upstream, resp: httpx.Response, trace: RequestTrace,
                     settle, seen: A.Seen, deadline: float | None) -> AsyncIterator[bytes]:
        """The upstream's SSE lines to the client as they come; a stall, a break, a line past
        ``max_line_kb``, a malformed event or the gateway's deadline becomes an SSE error
        event, and the record says which."""
        c = up.config
        lines = A.lines(resp, c.max_line_kb << 10)
        code, message, done, ended = "", "", False, False
        try:
            while not done:
                line, why, said = await _next_line(lines, c, deadline)
                if why:
                    code, message = why, said
                if line is None:
                    break
                done = sse.is_done(line)
                if not done and (data := sse.data_of(line)) is not None:
                    line, why, said = _relayed(data, line, seen, trace, c)
                    if why:  # the upstream's own error event goes on; a malformed one ends it
                        code, message = why, said
                        if why == "upstream_protocol":
                            break
                if line is not None:
                    yield (line + "\n").encode()
            if not code and not done and not seen.finish_reason:
                code = "upstream_closed"
                message = f"backend {c.name} ended the stream before it finished"
            if code:
                if code != "request_timeout":  # the deadline is not the upstream's failure
                    up.failed(message)
                if code != "upstream_error":  # the upstream's own error event already went
                    yield A.sse_error(message, code)
            ended = True
        finally:  # also when the client left: the upstream's stream is closed at once
            up.inflight -= 1
            used = None
            try:
                await resp.aclose()
                if code:
                    A.fail(trace, 504 if code.endswith("timeout") else 502, code, message)
                    used = 0 if not seen.content_chunks else A.used(seen)
                elif not ended:
                    trace.fail("CANCELLED", "cancelled", "client_disconnected",
                               "the client went away before the stream ended")
                    used = A.used(seen)
                else:
                    A.finish(trace, seen)
                    used = A.used(seen)
            finally:  # the tenant's slot, whatever happened above
                settle(used)


async def _next_line(lines: AsyncIterator[str], c: UpstreamConfig, deadline: float | None
                     ) -> tuple[str | None, str, str]:
    """(the stream's next line, "", "") or (None, an error code or "" at its end, why): within
    ``idle_timeout_s`` and the gateway's deadline, no line past ``max_line_kb``."""
    left = math.inf if deadline is None else deadline - time.monotonic()
    try:
        async with asyncio.timeout(max(0.0, min(c.idle_timeout_s, left))):
            return await anext(lines), "", ""
    except StopAsyncIteration:
        return None, "", ""
    except TimeoutError:
        if left <= c.idle_timeout_s:  # the deadline came first
            return None, "request_timeout", "the request passed the gateway's deadline"
        return None, "upstream_timeout", (f"backend {c.name} sent nothing for "
                                          f"{c.idle_timeout_s:g} s")
    except httpx.HTTPError as exc:
        return None, "upstream_closed", (f"backend {c.name} closed the stream: "
                                         f"{type(exc).__name__}")
    except A.LineTooLong:
        return None, "upstream_protocol", (f"backend {c.name} sent a line longer than "
                                           f"{c.max_line_kb} KiB (max_line_kb)")


def _relayed(data: str, line: str, seen: A.Seen, trace: RequestTrace, c: UpstreamConfig
             ) -> tuple[str | None, str, str]:
    """An event's line as the client gets it (None: not passed on), noted for the record:
    (line, "", "") or with the upstream's own error event (relayed as it came) or a malformed
    one (not relayed) its code and message."""
    try:
        chunk = json.loads(data)
        flushed = A.note(seen, chunk)
    except ValueError as exc:
        return None, "upstream_protocol", (f"backend {c.name} sent an event that is not an "
                                           f"OpenAI chunk: {exc}")
    if flushed:
        trace.flush()
    code = message = ""
    if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
        code = "upstream_error"  # the record keeps it
        message = str(chunk["error"].get("message") or "upstream error")
    edited = seen.strip_ids and A.strip_ids(chunk)
    if seen.strip_usage and isinstance(chunk, dict) and "usage" in chunk:
        if not chunk.get("choices"):
            return None, code, message  # the usage chunk the gateway asked for (noted)
        del chunk["usage"]
        edited = True
    if edited:
        line = sse.line(json.dumps(chunk, ensure_ascii=False))
    return line, code, message
