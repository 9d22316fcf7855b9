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

More: docs/design/gateway-notes.md#gatewayupstream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.observer import RequestStats, TimelineEvent
from gateway.errors import APIError
from gateway.trace import RequestTrace
from tailscope.keys import redact_url
from tracing import sse

log = logging.getLogger("tailscope.upstream")
# httpx logs every request at INFO: one line per proxied request would be the gateway's log
logging.getLogger("httpx").setLevel(logging.WARNING)


def _flag(v) -> bool | None:
    """A YAML bool, or true/false/1/0/yes/no as a --backend flag's text; None otherwise."""
    if isinstance(v, bool):
        return v
    return {"true": True, "1": True, "yes": True, "false": False, "0": False,
            "no": False}.get(str(v).strip().lower())


@dataclass(frozen=True)
class UpstreamConfig:
    name: str  # the replica name records and /debug/replicas use
    url: str  # base URL, with or without /v1
    model: str  # the model name clients send for it
    upstream_model: str = ""  # the name the upstream knows it by (default: ``model``)
    api_key_env: str = ""  # environment variable holding its API key (sent as a bearer token)
    max_concurrency: int = 64
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 120.0
    idle_timeout_s: float = 60.0
    eject_after: int = 3  # failures in a row that eject it
    eject_s: float = 10.0  # how long an ejected backend is left alone
    probe_interval_s: float = 5.0  # health probe period (0: no probes)
    # ask for token ids (vLLM's return_token_ids, vLLM >= 0.10.2, or another Tailscope) so the
    # records keep them; stripped from the answer unless the client asked for them itself
    return_token_ids: bool = False
    # ask for usage on streams (stream_options.include_usage) so the records have exact token
    # counts (and vLLM's per-request metrics, which come with the usage chunk); the usage chunk
    # is not passed on to a client that did not ask for it
    stream_usage: bool = True
    # what the gateway reads from it: a whole (non-streamed or error) body, one SSE line
    max_response_mb: float = 64.0
    max_line_kb: int = 1024

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"backend name {self.name!r} must be non-empty, without '/'")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend {self.name}: url must be http(s)://..., got {self.url!r}")
        if not self.model:
            raise ValueError(f"backend {self.name}: model (the name clients use) is required")
        for f in ("max_concurrency", "eject_after"):
            if getattr(self, f) < 1:
                raise ValueError(f"backend {self.name}: {f} must be >= 1")
        for f in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s", "eject_s",
                  "max_response_mb", "max_line_kb"):
            if getattr(self, f) <= 0:
                raise ValueError(f"backend {self.name}: {f} must be > 0")
        if self.probe_interval_s < 0:
            raise ValueError(f"backend {self.name}: probe_interval_s must be >= 0")

    @property
    def max_response_bytes(self) -> int:
        return int(self.max_response_mb * 2**20)

    @property
    def base(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"

    @property
    def root(self) -> str:
        """The server's root (where ``/health`` and version endpoints live)."""
        base = self.url.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base

    @classmethod
    def from_mapping(cls, values: dict, where: str = "backend") -> UpstreamConfig:
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(values) - set(known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: "
                             f"{', '.join(known)}")
        out = {}
        for k, v in values.items():
            kind = {"int": int, "float": float, "str": str, "bool": _flag}[known[k]]
            try:
                out[k] = kind(v) if not isinstance(v, bool) or kind is _flag else None
            except (TypeError, ValueError):
                out[k] = None
            if out[k] is None:
                raise ValueError(f"{where}: {k} must be {known[k]}, got {v!r}")
        return cls(**out)

    @classmethod
    def parse_flag(cls, text: str) -> UpstreamConfig:
        """``NAME=URL[,key=value...]`` (keys as in the YAML; ``model`` defaults to NAME)."""
        head, _, rest = text.partition(",")
        name, eq, url = head.partition("=")
        if not eq:
            raise ValueError(f"--backend {text!r}: expected NAME=URL[,key=value...]")
        values: dict = {"name": name.strip(), "url": url.strip(), "model": name.strip()}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            k, eq, v = item.partition("=")
            if not eq:
                raise ValueError(f"--backend {text!r}: {item!r} is not key=value")
            values[k.strip()] = v.strip()
        return cls.from_mapping(values, f"--backend {name}")


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


class UpstreamError(Exception):
    """A failed attempt: ``status``/``code``/``message`` for the client, ``retry`` when nothing
    reached the client yet and another backend may take it."""

    def __init__(self, status: int, code: str, message: str, retry: bool,
                 body: bytes | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry, self.body = (
            status, code, message, retry, body)


@dataclass
class _Stream:
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
            async with asyncio.timeout_at(_loop_time(deadline)):
                return await self._proxy(request, data, path, trace, settle, keep_ids,
                                         fallback, deadline)
        except NoBackendLeft:
            raise
        except TimeoutError:
            message = "the request passed the gateway's deadline before the backend answered"
            _fail(trace, 504, "request_timeout", message)
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
            seen = _Stream(keep_ids=keep_ids)
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
                _fail(trace, exc.status, exc.code, exc.message)
                settle(0)
                if exc.body is not None:  # the upstream's own error answer, as it sent it
                    return Response(exc.body, status_code=exc.status,
                                    media_type="application/json")
                raise APIError(exc.status, exc.message, "server_error" if exc.status >= 500
                               else "invalid_request_error", code=exc.code) from None

    async def _attempt(self, up: Upstream, request: Request, body: dict, path: str,
                       stream: bool, trace: RequestTrace, settle, seen: _Stream,
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
                message, code = _error_of(raw, resp.status_code)
                retry = resp.status_code >= 500 or resp.status_code == 429
                if resp.status_code >= 500:
                    up.failed(f"HTTP {resp.status_code}: {message}")
                raise UpstreamError(resp.status_code, code, f"backend {c.name}: {message}",
                                    retry, raw if _is_json(raw) else None)
            if not stream:
                raw = await self._read(resp, c)
                try:
                    answer = await _loads(raw)
                    if not isinstance(answer, dict):
                        raise ValueError("not an object")
                    _note(seen, answer)
                except ValueError as exc:
                    raise self._failure(up, 502, "upstream_protocol", f"backend {c.name} "
                                        f"answered 200 with a body that is not an OpenAI "
                                        f"answer: {exc}") from None
                up.succeeded()
                if seen.strip_ids and _strip_ids(answer):
                    raw = json.dumps(answer, ensure_ascii=False).encode()
                _finish(trace, seen)
                settle(_used(seen))
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
            return await asyncio.wait_for(_read_bounded(resp, c), c.idle_timeout_s)
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
                     settle, seen: _Stream, deadline: float | None) -> AsyncIterator[bytes]:
        """The upstream's SSE lines to the client as they come; a stall, a break, a line past
        ``max_line_kb``, a malformed event or the gateway's deadline becomes an SSE error
        event, and the record says which."""
        c = up.config
        lines = _lines(resp, c.max_line_kb << 10)
        code, message, done, ended = "", "", False, False
        try:
            while True:
                left = math.inf if deadline is None else deadline - time.monotonic()
                try:
                    async with asyncio.timeout(max(0.0, min(c.idle_timeout_s, left))):
                        line = await anext(lines)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if left <= c.idle_timeout_s:  # the deadline came first
                        code = "request_timeout"
                        message = "the request passed the gateway's deadline"
                    else:
                        code = "upstream_timeout"
                        message = f"backend {c.name} sent nothing for {c.idle_timeout_s:g} s"
                    break
                except httpx.HTTPError as exc:
                    code = "upstream_closed"
                    message = f"backend {c.name} closed the stream: {type(exc).__name__}"
                    break
                except LineTooLong:
                    code = "upstream_protocol"
                    message = (f"backend {c.name} sent a line longer than {c.max_line_kb} KiB "
                               "(max_line_kb)")
                    break
                if sse.is_done(line):
                    done = True
                elif (data := sse.data_of(line)) is not None:
                    try:
                        chunk = json.loads(data)
                        flushed = _note(seen, chunk)
                    except ValueError as exc:
                        code, message = "upstream_protocol", (f"backend {c.name} sent an event "
                                                              f"that is not an OpenAI chunk: "
                                                              f"{exc}")
                        break
                    if flushed:
                        trace.flush()
                    if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
                        code = "upstream_error"  # relayed as it came; the record keeps it
                        message = str(chunk["error"].get("message") or "upstream error")
                    edited = seen.strip_ids and _strip_ids(chunk)
                    if seen.strip_usage and isinstance(chunk, dict) and "usage" in chunk:
                        if not chunk.get("choices"):
                            continue  # the usage chunk the gateway asked for (noted above)
                        del chunk["usage"]
                        edited = True
                    if edited:
                        line = sse.line(json.dumps(chunk, ensure_ascii=False))
                yield (line + "\n").encode()
                if done:
                    break
            if not code and not done and not seen.finish_reason:
                code = "upstream_closed"
                message = f"backend {c.name} ended the stream before it finished"
            if code:
                if code != "request_timeout":  # the deadline is not the upstream's failure
                    up.failed(message)
                if code != "upstream_error":  # the upstream's own error event already went
                    yield _sse_error(message, code)
            ended = True
        finally:  # also when the client left: the upstream's stream is closed at once
            up.inflight -= 1
            used = None
            try:
                await resp.aclose()
                if code:
                    _fail(trace, 504 if code.endswith("timeout") else 502, code, message)
                    used = 0 if not seen.content_chunks else _used(seen)
                elif not ended:
                    trace.fail("CANCELLED", "cancelled", "client_disconnected",
                               "the client went away before the stream ended")
                    used = _used(seen)
                else:
                    _finish(trace, seen)
                    used = _used(seen)
            finally:  # the tenant's slot, whatever happened above
                settle(used)


def _note(seen: _Stream, chunk) -> bool:
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
    if _ids(chunk.get("prompt_token_ids")) is not None:  # vLLM: chat, top level
        seen.prompt_ids = chunk["prompt_token_ids"]
    choices = chunk.get("choices")
    if choices is not None and not isinstance(choices, list):
        raise ValueError(f"choices is a {type(choices).__name__}, not a list")
    content = False
    for choice in choices or []:
        if not isinstance(choice, dict):
            continue
        if choice.get("index", 0) == 0:  # return_token_ids (completions: per choice)
            if _ids(choice.get("prompt_token_ids")) is not None:
                seen.prompt_ids = choice["prompt_token_ids"]
            if (ids := _ids(choice.get("token_ids"))) is not None:
                seen.output_ids.extend(ids)
            seen.logprob_ids.extend(_logprob_ids(choice.get("logprobs")))
        if choice.get("finish_reason"):
            seen.finish_reason = _finish_reason(choice["finish_reason"])
        delta = choice.get("delta") or choice.get("message") or {}
        if choice.get("text") or (isinstance(delta, dict) and any(
                delta.get(k) for k in ("content", "tool_calls", "reasoning_content"))):
            content = True
    if content:
        seen.content_chunks += 1
    return content


def _ids(value) -> list[int] | None:
    """A list of token ids (ints that fit the record's column), else None."""
    if isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in value):
        return value
    return None


def _logprob_ids(lp) -> list[int]:
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


def _strip_ids(chunk) -> bool:
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


def _finish_reason(value) -> str:
    return value if isinstance(value, str) and value in FINISH_REASONS else "other"


def _count(value) -> int:
    """An upstream's token count if it is one (an int in [0, MAX_COUNT]), else 0."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
    return value if ok else 0


def _used(seen: _Stream) -> int | None:
    """Prompt + completion tokens by the upstream's usage; None when it said none."""
    used = _count(seen.usage.get("prompt_tokens")) + _count(seen.usage.get("completion_tokens"))
    return used or None


def _finish(trace: RequestTrace, seen: _Stream) -> None:
    u, t = seen.usage, _upstream_timings(seen)
    prompt_tokens = min(MAX_COUNT, _count(u.get("prompt_tokens")) or (
        t.prompt_n + t.cache_n if t else 0) or len(seen.prompt_ids or ()))
    generated = _count(u.get("completion_tokens")) or (t.predicted_n if t else 0) \
        or len(seen.output_ids or seen.logprob_ids) or seen.content_chunks
    ids = (list(seen.prompt_ids or ()), seen.output_ids or seen.logprob_ids) \
        if seen.keep_ids else None
    routed = trace.marks.get("ROUTED")
    stats = _timeline(t, seen.timings_ns - routed) if t is not None and routed is not None \
        else None
    trace.answered_upstream(seen.response_id, seen.finish_reason or "stop", prompt_tokens,
                            generated, ids, stats)


@dataclass(frozen=True)
class _Timings:
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int


def _upstream_timings(seen: _Stream) -> _Timings | None:
    """The upstream's own report, checked: llama.cpp's ``timings`` (prompt_n/ms,
    predicted_n/ms, cache_n), or vLLM's per-request ``metrics`` (``time_to_first_token_ms``:
    scheduled to first token, i.e. prefill; ``generation_time_ms``: first to last token, null
    for one token; the counts from ``usage``, cached tokens from its
    ``prompt_tokens_details``). None when absent or not numbers (it is then only what the
    gateway saw)."""
    raw, m = seen.timings, seen.metrics
    try:
        if raw:
            t = _Timings(int(raw["prompt_n"]), float(raw["prompt_ms"]),
                         int(raw["predicted_n"]), float(raw["predicted_ms"]),
                         int(raw.get("cache_n") or 0))
        elif m and m.get("time_to_first_token_ms") is not None:
            u = seen.usage
            details = u.get("prompt_tokens_details")
            cached = int((details or {}).get("cached_tokens") or 0) \
                if isinstance(details, dict) else 0
            t = _Timings(int(u.get("prompt_tokens") or 0) - cached,
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


def _timeline(t: _Timings, end_ms_after_routed_ns: int) -> RequestStats:
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


def _fail(trace: RequestTrace, status: int, code: str, message: str) -> None:
    state = "TIMED_OUT" if status == 504 else "REJECTED" if status in (400, 404, 413, 422,
                                                                       429) else "FAILED"
    trace.fail(state, "timeout" if state == "TIMED_OUT" else "rejected" if state == "REJECTED"
               else "error", code, message)


def _error_of(raw: bytes, status: int) -> tuple[str, str]:
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


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except ValueError:
        return False


class LineTooLong(Exception):
    """An SSE line from an upstream passed the backend's ``max_line_kb``."""


async def _lines(resp: httpx.Response, limit: int) -> AsyncIterator[str]:
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


async def _read_bounded(resp: httpx.Response, c: UpstreamConfig) -> bytes:
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


async def _loads(raw: bytes):
    """JSON off the event loop when it is large (parsing 100 MB holds the loop for seconds)."""
    return json.loads(raw) if len(raw) < 1 << 20 else await asyncio.to_thread(json.loads, raw)


def _loop_time(deadline: float | None) -> float | None:
    """A ``time.monotonic`` deadline on the event loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + deadline - time.monotonic()


def _sse_error(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return sse.event(json.dumps(body).encode())
