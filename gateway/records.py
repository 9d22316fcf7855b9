"""The record builder: the one place in the gateway that sets ``RequestRecord`` fields.

A ``RequestTrace`` holds one request's timing marks on the gateway's monotonic clock and its
record; ingress (``gateway.trace``'s middleware, the ingress gate), request preparation, the
request session's samples and the external backends tell it what they learned, each through a
method named for the moment (``admitted``, ``routed``, ``ended`` ...), and ``finish`` turns the
marks into the record's timeline and stage columns (``tracing.timing`` derives those, and the
record itself drops its detail when retention says so).
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

import msgspec

from engine.observer import RequestStats
from engine.sampling_params import SamplingParams
from tracing import timing
from tracing.record import RecordEvent, RequestRecord

if TYPE_CHECKING:
    from gateway.backend import Route
    from gateway.session import Choice

# the gateway's JSON for small dicts (a record's metadata and sampling parameters, a streamed
# chunk): msgspec's encoder, ~5x json.dumps on them (UTF-8 kept as is, as ensure_ascii=False
# did; compact separators)
encode_json = msgspec.json.Encoder().encode

# an ended choice's engine state -> the record's (final_state, finish_reason)
_FAILED = {"TIMED_OUT": ("TIMED_OUT", "timeout"), "CANCELLED": ("CANCELLED", "cancelled"),
           "REJECTED": ("REJECTED", "rejected")}


class RequestTrace:
    """Timing marks of one request on the gateway's monotonic clock, turned into a record."""

    def __init__(self, request_id: str, trace_id: str, span_id: str, parent_span_id: str,
                 endpoint: str, instance: str = "") -> None:
        self.arrival_ns = time.monotonic_ns()
        self.arrival_wall_us = time.time_ns() // 1000
        self.record = RequestRecord(trace_id=trace_id, span_id=span_id, request_id=request_id,
                                    parent_span_id=parent_span_id, endpoint=endpoint,
                                    arrival_ts_us=self.arrival_wall_us, instance=instance)
        self.marks: dict[str, int] = {}
        self.flushes: list[int] = []
        self.end_ns: int | None = None
        self.engine_stats: RequestStats | None = None  # the replica's (its timeline), at the end
        # where the replica's offsets start on this clock (None: at ROUTED); see TokenDelta
        self.engine_anchor_ns: int | None = None
        self.route_note = ""  # why this side of a mixed pool (ahead of the router's reason)
        self.keep_first: set[str] = set()  # marks a second attempt does not move
        self.earlier_tries = 0  # failed elsewhere first (a mixed pool's backend)
        # the other prompts of a /v1/completions batch: a record each (``sibling``)
        self.siblings: list[RequestTrace] = []
        self.client_trace = False  # the trace id is the client's (its traceparent)

    def sibling(self, prompt_index: int) -> RequestTrace:
        """The trace of prompt ``prompt_index`` of this request's batch: the same arrival,
        marks so far, request id, caller's span, bench run, tenant (its key, its rows' TTL),
        end user and metadata, its own trace and span ids; the middleware ends it with this one
        and emits its record."""
        r = self.record
        t = RequestTrace(r.request_id, secrets.token_hex(16), secrets.token_hex(8),
                         r.parent_span_id, r.endpoint, r.instance)
        t.arrival_ns, t.arrival_wall_us = self.arrival_ns, self.arrival_wall_us
        for name in ("arrival_ts_us", "bench_run", "tenant", "api_key_id", "ttl_days",
                     "end_user", "metadata"):
            setattr(t.record, name, getattr(r, name))
        t.record.prompt_index = prompt_index
        t.marks = dict(self.marks)
        self.siblings.append(t)
        return t

    def mark(self, stage: str, at_ns: int | None = None) -> None:
        if stage in self.keep_first and stage in self.marks:
            return
        self.marks[stage] = time.monotonic_ns() if at_ns is None else at_ns

    def flush(self) -> None:
        """A chunk carrying content was handed to the server (the client can read it)."""
        self.flushes.append(time.monotonic_ns())

    # ---- what the gateway learns of the request, in the order it learns it -----------------
    def from_client(self, bench_run: str, client_trace: bool) -> None:
        """The request's headers: its bench run label, and whether the trace id is the
        client's (its traceparent)."""
        self.record.bench_run = bench_run[:64]
        self.client_trace = client_trace

    def admitted(self, tenant: str, api_key_id: str, ttl_days: int) -> None:
        r = self.record
        r.tenant, r.api_key_id, r.ttl_days = tenant, api_key_id, ttl_days

    def renamed(self, trace_id: str) -> None:
        """A trace id of its own (the client's named another tenant's trace)."""
        self.record.trace_id = trace_id

    def tagged(self, end_user: str | None, metadata: dict[str, str] | None) -> None:
        """The record's ``end_user`` (the request's safety_identifier, else its user) and
        ``metadata`` (a JSON object; "" without); a backend's request may send anything there,
        so each is cut to the bundled path's bounds (256 characters, 16 pairs)."""
        r = self.record
        r.end_user = (end_user or "")[:256]
        if metadata:
            r.metadata = encode_json(dict(list(metadata.items())[:16])).decode()

    def versioned(self, versions: dict[str, str]) -> None:
        r = self.record
        r.gateway_version, r.config_id = versions["gateway"], versions["config_id"]

    def prompt_counted(self, tokens: int) -> None:
        """The prompt's length, kept by a request refused from here on."""
        self.record.prompt_tokens = tokens

    def configured(self, model: str, versions: dict[str, str], params: SamplingParams,
                   n: int, stream: bool, response_id: str, prompt_tokens: int) -> None:
        """What a bundled request runs with."""
        r = self.record
        self.versioned(versions)
        r.model, r.engine_version = model, versions["engine"]
        r.tokenizer_revision = versions["tokenizer"]
        r.temperature, r.top_p, r.top_k = params.temperature, params.top_p, params.top_k
        r.min_p, r.seed, r.max_tokens = params.min_p, params.seed, params.max_tokens
        r.priority = params.priority
        if params.degraded:
            r.lane, r.degraded = "degraded", params.degraded
        r.prompt_tokens, r.stream, r.n, r.response_id = prompt_tokens, stream, n, response_id

    def captured(self, sampling: dict) -> None:
        """What replay rebuilds (when the tenant's capture keeps it)."""
        # msgspec encodes the dataclass as asdict + json.dumps did (int keys as strings), at a
        # tenth of the cost (asdict deep-copies every field)
        self.record.sampling_params = encode_json(sampling).decode()

    def routed(self, route: Route) -> None:
        """Its first sample went to a replica."""
        r = self.record
        r.replica = route.replica
        r.route_reason = "; ".join(filter(None, (self.route_note, route.reason)))
        r.prefix_hit_tokens = route.prefix_hit_tokens
        r.model_revision = route.model_revision or r.model_revision

    def answered_as(self, response_id: str) -> None:
        """The Responses API's id for it."""
        self.record.response_id = response_id

    def ended(self, choices: list[Choice], prompt: list[int], capture: bool,
              client_gone: bool, stats: RequestStats | None) -> bool:
        """Its samples ended (``stats``: the first one's timeline, wait notes named); True
        when that made it FINISHED."""
        r = self.record
        r.generated_tokens = sum(c.stream.generated_tokens for c in choices)
        r.emitted_tokens = sum(c.stream.emitted_tokens for c in choices)
        r.retries = self.earlier_tries + sum(c.retries for c in choices)
        r.tool_calls = [name for c in choices for name in c.called]
        c0 = choices[0] if choices else None
        if capture:
            r.input_token_ids = list(prompt)
            r.output_token_ids = list(c0.token_ids) if c0 else []
            r.token_steps = list(c0.token_steps) if c0 else []
        if c0 is None:
            return False
        if c0.neighbours:  # who shared its steps with prefill chunks
            n = c0.neighbours
            r.neighbour_tenant = max(n, key=lambda t: (n[t], t))
            r.neighbour_prefill_tokens = sum(n.values())
        r.replica = c0.replica
        self.engine_stats, self.engine_anchor_ns = stats, c0.engine_anchor_ns
        if r.final_state:
            return False
        if client_gone and any(c.final_state is None for c in choices):
            self.fail("CANCELLED", "cancelled", "client_disconnected",
                      "the client went away before the response was complete")
            return False
        bad = next((c for c in choices if c.final_state not in ("FINISHED", None)), None)
        if bad is not None:
            state, reason = _FAILED.get(bad.final_state or "", ("FAILED", "error"))
            self.fail(state, reason, (bad.final_state or "error").lower(), bad.error or "")
            return False
        r.final_state = "FINISHED"
        r.finish_reason = "stop_string" if c0.stream.stopped else (c0.finish_reason or "stop")
        return True

    # ---- external backends (gateway.upstream) ----------------------------------------------
    def proxied(self, model: str, stream: bool) -> None:
        self.record.model, self.record.stream = model, stream

    def sent_upstream(self, backend: str, reason: str, model_revision: str) -> None:
        r = self.record
        r.replica = backend
        r.route_reason = "; ".join(filter(None, (self.route_note, reason)))
        r.model_revision = model_revision

    def retried(self) -> None:
        """A backend failed before any content; another one takes it."""
        self.record.retries += 1

    def upstream_engine(self, version: str) -> None:
        self.record.engine_version = version

    def answered_upstream(self, response_id: str, finish_reason: str, prompt_tokens: int,
                          generated_tokens: int, ids: tuple[list[int], list[int]] | None,
                          stats: RequestStats | None) -> None:
        """A backend's answer ended; ``ids`` (prompt, output) when they are kept, ``stats``
        its own timings as a timeline."""
        r = self.record
        r.response_id = response_id[:200]
        r.final_state, r.finish_reason = "FINISHED", finish_reason
        r.prompt_tokens = prompt_tokens
        r.generated_tokens = r.emitted_tokens = generated_tokens
        if ids is not None:
            r.input_token_ids, r.output_token_ids = ids
        if stats is not None:
            self.engine_stats = stats
            r.timing_source = "upstream"

    def fell_back(self, note: str) -> None:
        """A mixed pool's backend failed before any content: the bundled replicas take it,
        and the failed try counts as routing."""
        r = self.record
        self.earlier_tries += 1
        r.replica = r.model_revision = r.engine_version = ""
        self.marks.pop("UPSTREAM_HEADERS", None)
        self.keep_first |= {"ADMITTED", "TOKENIZED"}
        self.route_note = note

    # ---- the end ----------------------------------------------------------------------------
    def fail(self, final_state: str, finish_reason: str, error_type: str, message: str) -> None:
        r = self.record
        r.final_state, r.finish_reason = final_state, finish_reason
        r.error_type, r.error_message = error_type, message

    def _wall(self, ns: int) -> int:
        return self.arrival_wall_us + (ns - self.arrival_ns) // 1000

    def finish(self, status: int, batch: RequestTrace | None = None) -> RequestRecord:
        """The record, ended with ``status``; a batch's sibling also takes the batch's end
        and, when it did not end on its own account, the batch's failure."""
        r = self.record
        if batch is not None:
            self.end_ns = batch.end_ns
            if not r.final_state and batch.record.final_state not in ("", "FINISHED"):
                b = batch.record
                self.fail(b.final_state, b.finish_reason, b.error_type, b.error_message)
        end = self.end_ns or time.monotonic_ns()
        r.http_status = status
        if not r.final_state:  # never reached the serving code's bookkeeping
            if status < 400:
                r.final_state, r.finish_reason = "FINISHED", r.finish_reason or "stop"
            elif status >= 500 and status not in (503, 504):
                r.final_state, r.finish_reason = "FAILED", "error"
            elif status == 504:
                r.final_state, r.finish_reason = "TIMED_OUT", "timeout"
            else:
                r.final_state, r.finish_reason = "REJECTED", "rejected"

        m = self.marks
        c = timing.client_timings(self.arrival_ns, self.flushes, end)
        r.ttft_ms, r.itl_ms, r.tpot_ms, r.tail_ms, r.e2e_ms = (
            c.ttft_ms, c.itl_ms, c.tpot_ms, c.tail_ms, c.e2e_ms)
        s = self.engine_stats
        if s is not None:
            r.cached_tokens = s.cached_tokens
        r.timing_source = r.timing_source or ("engine" if s is not None else "gateway")
        events = [RecordEvent(self.arrival_wall_us, "RECEIVED")]
        events += [RecordEvent(self._wall(ns), stage) for stage, ns in
                   sorted(m.items(), key=lambda kv: kv[1])]
        routed = m.get("ROUTED")
        if routed is not None and s is not None:
            # the replica's offsets, from its arrival: not before ROUTED, and no later than
            # any delta's receipt allows (from ROUTED to there it waited for the replica to
            # read its inbox: the step in progress)
            at = routed if self.engine_anchor_ns is None else max(routed, self.engine_anchor_ns)
            events += [RecordEvent(self._wall(at + int(e.at_ms * 1e6)), e.state, e.detail)
                       for e in s.events]
        if self.flushes:
            events.append(RecordEvent(self._wall(self.flushes[0]), "FIRST_FLUSH"))
        events.append(RecordEvent(self._wall(end), "END", r.final_state))
        events.sort(key=lambda e: e.ts_us)
        r.events = events
        return timing.apply(r)  # every stage column, from the timeline

