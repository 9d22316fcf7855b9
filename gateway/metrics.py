"""Prometheus metrics (``GET /metrics``), fed from the request records and the replica pool.

Names follow vLLM's where the meaning is the same, with a ``tailscope:`` prefix instead of
``vllm:``; latencies are histograms in seconds. Request-level series are observed once per
finished record (one place, so they agree with the trace store); per-replica gauges are read
from the pool at scrape time, so nothing is updated on the token path.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pyarrow as pa
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tracing.record import RequestRecord

# seconds; dense below 1 s where TTFT/ITL live, sparse up to long generations
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class _GcCollector:
    """``tailscope:gc_threshold{generation}``: the collector's thresholds as they are now (a
    serving gateway raises generation 0's: ``TAILSCOPE_GC_THRESHOLD``)."""

    def collect(self):
        g = GaugeMetricFamily("tailscope:gc_threshold", "The garbage collector's threshold "
                              "per generation (gc.get_threshold())", labels=["generation"])
        for gen, value in enumerate(gc.get_threshold()):
            g.add_metric([str(gen)], value)
        yield g


class _ArrowCollector:
    """``tailscope:arrow_allocated_bytes{pool}``: what pyarrow's default memory pool holds now
    (the record writer's batches between conversion and insert), by the pool's backend
    (``tracing.arrow.use_arrow_pool``)."""

    def collect(self):
        pool = pa.default_memory_pool()
        g = GaugeMetricFamily("tailscope:arrow_allocated_bytes", "Bytes allocated from "
                              "pyarrow's default memory pool", labels=["pool"])
        g.add_metric([pool.backend_name], pool.bytes_allocated())
        yield g


class _PoolCollector:
    def __init__(self, pool) -> None:
        self.pool = pool

    def collect(self):
        running = GaugeMetricFamily("tailscope:num_requests_running",
                                    "Requests in the engine's running batch", labels=["replica"])
        waiting = GaugeMetricFamily("tailscope:num_requests_waiting",
                                    "Requests waiting in the engine queue", labels=["replica"])
        inflight = GaugeMetricFamily("tailscope:num_requests_inflight",
                                     "Requests the gateway has sent to the replica and not "
                                     "seen end", labels=["replica"])
        kv = GaugeMetricFamily("tailscope:kv_cache_usage_perc",
                               "Fraction of KV blocks in use (0-1)", labels=["replica"])
        ready = GaugeMetricFamily("tailscope:replica_ready", "1 when the replica is loaded",
                                  labels=["replica"])
        restarts = CounterMetricFamily("tailscope:replica_restarts",
                                       "Replica process restarts", labels=["replica"])
        kv_counts = {
            "prefix_queries": CounterMetricFamily(
                "tailscope:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                labels=["replica"]),
            "prefix_hits": CounterMetricFamily(
                "tailscope:prefix_cache_hits", "Prompt tokens served by the prefix cache",
                labels=["replica"]),
            "evictions": CounterMetricFamily(
                "tailscope:kv_cache_evictions", "Cached KV blocks evicted for reuse",
                labels=["replica"]),
            "preemptions": CounterMetricFamily(
                "tailscope:num_preemptions", "Requests preempted (recompute or swap)",
                labels=["replica"])}
        for rid, d in self.pool.describe().items():
            running.add_metric([rid], d["running"])
            waiting.add_metric([rid], d["waiting"])
            inflight.add_metric([rid], d["inflight"])
            total = d["kv_blocks_total"]
            kv.add_metric([rid], d["kv_blocks_used"] / total if total else 0.0)
            ready.add_metric([rid], 1.0 if d["ready"] else 0.0)
            restarts.add_metric([rid], d["restarts"])
            for key, family in kv_counts.items():
                family.add_metric([rid], d[key])
        yield from (running, waiting, inflight, kv, ready, restarts, *kv_counts.values())
        rejected = getattr(self.pool, "rejected_messages", None)
        if rejected is not None:
            c = CounterMetricFamily("tailscope:replica_messages_rejected",
                                    "Replica messages dropped: their signature did not verify "
                                    "under TAILSCOPE_REPLICA_KEY")
            c.add_metric([], rejected)
            yield c


class _WriterCollector:
    """The record writer's counters: nothing dropped silently."""

    def __init__(self, writer) -> None:
        self.writer = writer

    def collect(self):
        st = self.writer.stats
        for key, doc in (("queued", "Records handed to the store writer"),
                         ("written", "Records inserted into the store (replays included)"),
                         ("spooled", "Records spooled to disk after a failed insert"),
                         ("replayed", "Spooled records inserted later"),
                         ("dropped", "Records dropped (queue full); each one is logged"),
                         ("dead_lettered", "Records that could not be converted, set aside "
                          "in the dead-letter file"),
                         ("spool_errors", "Spool writes that failed (the batch stays in "
                          "memory and is retried)"),
                         ("quarantined", "Spool files moved aside because they fail while "
                          "the store is up"),
                         ("writer_errors", "Unexpected errors the writer thread survived")):
            c = CounterMetricFamily(f"tailscope:records_{key}", doc)
            c.add_metric([], st[key])
            yield c
        depth = GaugeMetricFamily("tailscope:records_queue_depth", "Items waiting in the "
                                  "writer's queue")
        depth.add_metric([], self.writer.queue_depth)
        yield depth
        size = GaugeMetricFamily("tailscope:records_queue_bytes", "Estimated bytes of the "
                                 "items waiting in the writer's queue")
        size.add_metric([], self.writer.queued_bytes)
        yield size
        files = GaugeMetricFamily("tailscope:records_spool_files", "Batches waiting on disk")
        files.add_metric([], len(self.writer.spool_files()))
        yield files
        alive = GaugeMetricFamily("tailscope:record_writer_alive",
                                  "1 while the record writer's thread runs")
        alive.add_metric([], 1.0 if self.writer.alive else 0.0)
        yield alive
        last = GaugeMetricFamily("tailscope:record_writer_last_success_timestamp_seconds",
                                 "Wall clock of the writer's latest successful insert (0: none)")
        last.add_metric([], self.writer.last_success_ts or 0.0)
        yield last


class _BackendCollector:
    """External backends (``gateway.upstream``): circuit-breaker state, load and errors."""

    STATES = ("ready", "half_open", "ejected")

    def __init__(self, upstreams) -> None:
        self.upstreams = upstreams

    def collect(self):
        state = GaugeMetricFamily("tailscope:backend_state", "1 for the backend's current "
                                  "circuit-breaker state", labels=["backend", "state"])
        inflight = GaugeMetricFamily("tailscope:backend_inflight", "Requests in flight to the "
                                     "backend", labels=["backend"])
        requests = CounterMetricFamily("tailscope:backend_requests", "Attempts sent to the "
                                       "backend", labels=["backend"])
        errors = CounterMetricFamily("tailscope:backend_errors", "Attempts that failed "
                                     "(timeouts, 5xx, broken streams)", labels=["backend"])
        for name, d in self.upstreams.describe().items():
            for st in self.STATES:
                state.add_metric([name, st], 1.0 if d["state"] == st else 0.0)
            inflight.add_metric([name], d["inflight"])
            requests.add_metric([name], d["requests"])
            errors.add_metric([name], d["errors"])
        yield from (state, inflight, requests, errors)


class GatewayMetrics:
    def __init__(self, pool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tailscope:request_success", "Finished requests by finish "
                                "reason", ["finish_reason"], registry=r)
        self.http = Counter("tailscope:http_requests", "API responses by endpoint and status",
                            ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("tailscope:prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("tailscope:generation_tokens",
                                         "Tokens emitted to clients", registry=r)

        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.ttft = hist("tailscope:time_to_first_token_seconds", "Arrival to first content")
        self.itl = hist("tailscope:inter_token_latency_seconds", "Between content flushes",
                        _ITL_BUCKETS)
        self.e2e = hist("tailscope:e2e_request_latency_seconds", "Arrival to end of response")
        self.queue = hist("tailscope:request_queue_time_seconds", "Time in the engine queue")
        self.prefill = hist("tailscope:request_prefill_time_seconds", "Engine prefill time")
        self.decode = hist("tailscope:request_decode_time_seconds", "Engine decode time")
        r.register(_PoolCollector(pool))
        r.register(_GcCollector())
        r.register(_ArrowCollector())
        self.stalls = LoopStalls(r)

    def watch_backends(self, upstreams) -> None:
        self.registry.register(_BackendCollector(upstreams))

    def watch_writer(self, writer) -> None:
        self.registry.register(_WriterCollector(writer))

    def observe(self, rec: RequestRecord) -> None:
        self.http.labels(rec.endpoint, str(rec.http_status)).inc()
        if rec.final_state == "FINISHED":
            self.requests.labels(rec.finish_reason).inc()
        else:
            self.requests.labels(rec.finish_reason or rec.final_state.lower()).inc()
        if rec.replica:  # it reached the engine
            self.prompt_tokens.inc(rec.prompt_tokens)
            self.generation_tokens.inc(rec.emitted_tokens)
            self.queue.observe(rec.engine_queue_ms / 1e3)
            self.prefill.observe(rec.prefill_ms / 1e3)
            self.decode.observe(rec.decode_ms / 1e3)
        if rec.ttft_ms is not None:
            self.ttft.observe(rec.ttft_ms / 1e3)
        for gap in rec.itl_ms:
            self.itl.observe(gap / 1e3)
        self.e2e.observe(rec.e2e_ms / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# seconds: a stall of the gateway's event loop holds every stream it serves at once
_STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
# a generation-0 collection takes a fraction of a millisecond at Python's threshold (700), a few
# at a serving gateway's (TAILSCOPE_GC_THRESHOLD), a full one up to tens of them
_GC_BUCKETS = (0.0001, 0.00025, 0.0005, *_STALL_BUCKETS)


class LoopStalls:
    """The gateway's own stalls, which delay every request it serves at that moment and show
    up in no engine stage: ``tailscope:event_loop_lag_seconds`` (how late a 50 ms timer on the
    event loop fires: a blocking call, a long callback, the GIL held by another thread) and
    ``tailscope:gc_pause_seconds{generation}`` (each collection of Python's cyclic garbage
    collector, in any thread of the process: it stops them all). The generation-0 ones are
    frequent and short but not cheap at Python's threshold: ~0.5 ms each in a tiny-model
    gateway under load, ~15 a second, more of its CPU than the rarer older ones,
    which is why a serving gateway raises it (``TAILSCOPE_GC_THRESHOLD``: 1-9 in 15 s);
    timing one costs ~2 us.
    Started and stopped with the app."""

    PERIOD_S = 0.05

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lag = Histogram("tailscope:event_loop_lag_seconds", "How late a timer on the "
                             "gateway's event loop fired (sampled every 50 ms)",
                             buckets=_STALL_BUCKETS, registry=registry)
        self.gc = Histogram("tailscope:gc_pause_seconds", "Cyclic garbage collections in "
                            "the gateway process, by generation", ["generation"],
                            buckets=_GC_BUCKETS, registry=registry)
        self._gc_start = 0.0
        self._task: asyncio.Task | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start:
            self.gc.labels(str(info["generation"])).observe(time.perf_counter() - self._gc_start)
            self._gc_start = 0.0

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.PERIOD_S
            await asyncio.sleep(self.PERIOD_S)
            self.lag.observe(max(0.0, loop.time() - due))

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.get_running_loop().create_task(self._sample())

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()
