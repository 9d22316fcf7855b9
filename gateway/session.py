"""One API request's engine side: its prompts (``Part``), their samples (``Choice``), the
``RequestSession`` that owns them and the tenant's slot, and ``Samples``, which submits samples
to the backend and reads their deltas.

Every per-request fact lives on the session or its choices; ``InFlight`` is the one map keyed
by engine request id, because the replicas' step reports and the backend's abandon callback name
requests that way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from fastapi import Request

from engine.observer import RequestStats
from engine.protocol import TokenDelta
from engine.sampling_params import SamplingParams
from engine.text import TextStream
from gateway.backend import Backend, DeadlineExceeded, Overloaded, ReplicaFailed, Unencodable
from gateway.errors import APIError, bad_request
from gateway.tenants import Tenant, TenantRegistry
from gateway.tools import ToolSpec, ToolStream

if TYPE_CHECKING:
    from gateway.records import RequestTrace

ENDED_KEPT = 8192  # ended requests whose trace ids late step reports may still name


def _wrap_int64(x: int) -> int:
    """Sample i of n is seeded ``seed + i``, wrapped so it stays an int64 like ``seed``."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def per_token(params: SamplingParams) -> int:
    """Tokens charged per output token: itself and its top logprobs."""
    return 1 + (params.top_logprobs if params.logprobs else 0)


@dataclass
class Choice:
    index: int
    engine_id: str
    stream: TextStream
    params: SamplingParams
    prompt: list[int]
    session: RequestSession
    trace: RequestTrace  # its prompt's (a batch has a trace per prompt)
    queue: asyncio.Queue | None = None  # its deltas, once submitted
    replica: str = ""
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

    def prompt_extra(self) -> int:
        """Tokens charged per sample for what the answer repeats of the prompt: the prompt
        (echo) and its logprobs."""
        n = len(self.prompt)
        lp = self.params.prompt_logprobs
        return (n if self.echo else 0) + (n * (1 + lp) if lp is not None else 0)


class RequestSession:
    """One API request from the ingress gate on: its tenant, its trace, its prompts and their
    samples. It holds the tenant's concurrency slot, given back exactly once by ``release``
    whoever ends the request (the gate on an early error, the answer's end, a backend that
    cancelled it for a slow client)."""

    def __init__(self, request: Request, tenant: Tenant, registry: TenantRegistry,
                 trace: RequestTrace | None) -> None:
        self.request, self.tenant, self.registry, self.trace = request, tenant, registry, trace
        self.parts: list[Part] = []
        self._holds_slot = True

    @property
    def choices(self) -> list[Choice]:
        """Every prompt's samples, in choice order."""
        return [c for part in self.parts for c in part.choices]

    @property
    def holds_slot(self) -> bool:
        return self._holds_slot

    def release(self, unused_tokens: int = 0) -> bool:
        """Give the tenant's slot back (and ``unused_tokens`` of its token budget); False when
        it already was."""
        if not self._holds_slot:
            return False
        self._holds_slot = False
        self.registry.finish(self.tenant, unused_tokens)
        return True

    def release_unused(self) -> bool:
        """``release`` with the token budget the samples did not use."""
        return self.release(sum((c.params.max_tokens - c.stream.generated_tokens)
                                * per_token(c.params) for c in self.choices))


class InFlight:
    """Engine request id -> its choice while in flight: step membership is stored by trace id,
    and a step report names its members by engine id. Ended ones keep their trace id a while
    (a step report or a wait note may name them afterwards)."""

    def __init__(self) -> None:
        self._live: dict[str, Choice] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()

    def add(self, c: Choice) -> None:
        self._live[c.engine_id] = c

    def forget(self, engine_id: str) -> None:
        self._live.pop(engine_id, None)

    def retire(self, engine_id: str) -> None:
        """Forget an ended request, keeping its trace id a while for late step reports."""
        c = self._live.pop(engine_id, None)
        if c is not None:
            self._ended[engine_id] = c.trace.record.trace_id
            if len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)

    def abandoned(self, engine_id: str) -> None:
        """The backend cancelled a request whose client stopped reading: its slot is freed at
        once (the client's socket may stay open for long)."""
        c = self._live.get(engine_id)
        if c is not None:
            c.session.release_unused()

    def trace_of(self, engine_id: str) -> str:
        """The trace id of an in-flight or recently ended engine request (else the id)."""
        c = self._live.get(engine_id)
        return c.trace.record.trace_id if c is not None else \
            self._ended.get(engine_id, engine_id)

    def note_step(self, stats) -> None:
        """A replica's step (``StepStats``): each member's neighbours' prefill, by tenant."""
        prefills = [(m.request_id, m.prefill_tokens) for m in stats.members
                    if m.prefill_tokens]
        if not prefills or len(stats.members) < 2:
            return
        live = self._live
        for m in stats.members:
            c = live.get(m.request_id)
            if c is None:
                continue
            acc = c.neighbours
            for rid, tokens in prefills:
                if rid != m.request_id:
                    other = live.get(rid)
                    tenant = other.trace.record.tenant if other is not None else "?"
                    acc[tenant] = acc.get(tenant, 0) + tokens

    def named(self, stats: RequestStats | None) -> RequestStats | None:
        """The replica's timeline with the requests its wait notes name as trace ids."""
        if stats is None or not any(e.holders for e in stats.events):
            return stats

        def named(e):
            holders = ", ".join(self.trace_of(h) for h in e.holders)
            return msgspec.structs.replace(e, detail=f"{e.detail} [{holders}]", holders=())

        return msgspec.structs.replace(stats, events=tuple(
            named(e) if e.holders else e for e in stats.events))


class Samples:
    """The engine side of requests: submit a prompt's samples to the backend, read each one's
    deltas into text, retry a sample whose replica died before its first token, abort them."""

    def __init__(self, pool: Backend, tokenizer, queue_timeout_s: float | None,
                 request_timeout_s: float | None) -> None:
        self.pool, self.tokenizer = pool, tokenizer
        self.queue_timeout_s, self.request_timeout_s = queue_timeout_s, request_timeout_s
        self.inflight = InFlight()
        pool.on_abandoned = self.inflight.abandoned

    async def start(self, session: RequestSession, part: Part, request_id: str, n: int,
                    stop: list[str], include_stop: bool, skip_special_tokens: bool = True,
                    first: int = 0) -> None:
        """Submit ``part``'s ``n`` samples: the first is routed, the others follow it to its
        replica as its branches (they share its prompt's KV blocks there). Their choice
        indexes (and engine ids) start at ``first`` (a batch's later prompts)."""
        if not self.pool.ready:
            raise APIError(503, "no replica is ready yet", "server_error",
                           code="not_ready", headers={"Retry-After": "1"})
        timeout = self.request_timeout_s
        deadline = time.monotonic() + timeout if timeout else None
        trace, params, first_sent = part.trace, part.params, 0
        for i in range(n):
            p = params if n == 1 or params.seed is None else \
                dataclasses.replace(params, seed=_wrap_int64(params.seed + i))
            text = TextStream(self.tokenizer, stop, include_stop, skip_special_tokens,
                              min_tokens=p.min_tokens)
            c = Choice(first + i, f"{request_id}-{first + i}", text, p, part.prompt, session,
                       trace, logprobs=[] if params.logprobs else None,
                       cache_salt=session.tenant.cache_salt, deadline=deadline)
            self.inflight.add(c)  # before a step can name it
            try:
                route, c.queue = await self.pool.submit(
                    c.engine_id, part.prompt, p, self.queue_timeout_s, cache_salt=c.cache_salt,
                    branch_of=part.choices[0].engine_id if part.choices else None,
                    deadline=deadline)
            except (Unencodable, ReplicaFailed, Overloaded) as exc:
                self.inflight.forget(c.engine_id)
                await self.abort_all(part.choices)  # n > 1: no earlier sample left running
                if isinstance(exc, Unencodable):
                    raise bad_request(str(exc)) from None
                code = "overloaded" if isinstance(exc, Overloaded) else "replica_unavailable"
                raise APIError(503, str(exc), "server_error", code=code,
                               headers={"Retry-After": "1"}) from None
            c.replica = route.replica
            if i == 0:
                first_sent = route.sent_ns
                trace.routed(route)
            part.choices.append(c)
        # the moment the first sample was sent: the replica's event offsets are placed from it,
        # and the engine cannot have seen the request earlier (a mark taken after the sends
        # could be late by a descheduled moment, placing engine events after END)
        trace.mark("ROUTED", first_sent)

    def end(self, session: RequestSession) -> None:
        """The request's slot and unused token budget back, its engine ids retired."""
        if session.release_unused():
            for c in session.choices:
                self.inflight.retire(c.engine_id)

    def forget(self, session: RequestSession) -> None:
        """A request refused while its samples were being submitted: none of them stays known."""
        for c in session.choices:
            self.inflight.forget(c.engine_id)

    async def _retry(self, c: Choice, failure: ReplicaFailed) -> bool:
        """Re-submit a sample whose replica died before it produced a token (once, elsewhere)."""
        if c.retries or c.token_ids:
            return False
        self.pool.release(c.engine_id)
        try:
            route, queue = await self.pool.submit(c.engine_id, c.prompt, c.params,
                                                  self.queue_timeout_s,
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
        else:
            c.finish_reason, default = _ENDED.get(delta.state, ("error", delta.finish_reason))
            c.error = delta.error or default
        self.pool.release(c.engine_id)
        return text, True

    async def abort_all(self, choices: list[Choice]) -> None:
        for c in choices:
            if c.final_state is None:
                await self.pool.abort(c.engine_id)
                self.pool.release(c.engine_id)

    async def deltas(self, choices: list[Choice]):
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


# an engine state that ended a request without finishing it -> the choice's finish reason and
# the error it reports when the engine gave none
_ENDED = {"REJECTED": ("rejected", "rejected"), "TIMED_OUT": ("timeout", "timed out"),
          "CANCELLED": ("cancelled", "cancelled")}
