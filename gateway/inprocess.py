"""An in-process ``Backend``: one engine in the gateway's own process, for tests of the serving
code (OpenAI API, streaming, records) without replica subprocesses.

The engine is stepped on a worker thread (``asyncio.to_thread``) so the event loop stays free,
and every call into it holds one lock (the engine is not thread-safe). Its deltas and step
reports are the replica process's own (``engine.replica.step_report``), so what the serving code
receives is exactly what it receives over ZeroMQ. Flow control and the gateway's deadline are the
replica pool's own (``gateway.flow``), applied to the engine directly. No supervision and no
routing (one engine): this is for tests and embedding, not for serving traffic. Importing it
loads torch, so nothing on the gateway's default path imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from engine import Engine
from engine.protocol import AbortRequest, StepReport, StopRequest, TokenDelta
from engine.replica import control, step_report
from engine.sampling_params import SamplingParams
from gateway.backend import DeadlineExceeded, DeltaQueue, ReplicaFailed, Route
from gateway.flow import FlowControl
from gateway.replicas import KV_COUNTERS


class InProcessBackend:
    def __init__(self, engine: Engine, replica_id: str = "local",
                 max_buffered_deltas: int = 256, slow_client_timeout_s: float = 30.0) -> None:
        self.engine = engine
        self.id = replica_id
        self.on_step = None
        self.on_abandoned = None
        self.queues: dict[str, DeltaQueue] = {}
        self.flow = FlowControl(self._control, max_buffered_deltas, slow_client_timeout_s)
        self._lock = threading.Lock()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.last_report: StepReport | None = None

    @property
    def ready(self) -> bool:
        return bool(self._tasks) and not self._tasks[0].done()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._loop()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _tick(self) -> StepReport | None:
        with self._lock:
            before = self.engine.step_count
            return step_report(self.id, self.engine, self.engine.step(), before)

    def _busy(self) -> bool:
        with self._lock:
            return self.engine.has_unfinished()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:  # once more after the work is done: it reports what ended last
                report = await asyncio.to_thread(self._tick)
                if report is not None:
                    self._dispatch(report)
                if not self._busy():
                    break

    def _dispatch(self, report: StepReport) -> None:
        self.last_report = report
        if report.stats is not None and self.on_step is not None:
            self.on_step(self.id, 0, report)
        for delta in report.deltas:
            if self.flow.deliver(delta):  # its reader holds the queue
                self.release(delta.request_id)
                if self.on_abandoned is not None:
                    self.on_abandoned(delta.request_id)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            self.flow.tick()

    def _control(self, request_id: str, msg) -> None:
        with self._lock:
            control(self.engine, msg)
        self._wake.set()

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     queue_timeout_s: float | None = None,
                     exclude: frozenset[str] = frozenset(), cache_salt: str = "",
                     branch_of: str | None = None, deadline: float | None = None,
                     ) -> tuple[Route, DeltaQueue]:
        if not self.ready or self.id in exclude:
            raise ReplicaFailed("the in-process engine is not running")
        queue: DeltaQueue = asyncio.Queue()
        self.queues[request_id] = queue
        sent = time.monotonic_ns()
        with self._lock:
            try:
                self.engine.add_request(request_id, prompt, params, queue_timeout_s=
                                        queue_timeout_s, cache_salt=cache_salt,
                                        branch_of=branch_of, arrival_ns=sent)
            except ValueError as exc:
                self.queues.pop(request_id, None)
                raise ReplicaFailed(str(exc)) from None
        self.flow.track(request_id, queue, deadline)
        self._wake.set()
        mc = self.engine.model.config
        return Route(self.id, 0, "the in-process engine", mc.revision, sent), queue

    async def next_delta(self, request_id: str, queue: DeltaQueue
                         ) -> TokenDelta | ReplicaFailed | DeadlineExceeded:
        item = await queue.get()
        self.flow.taken(request_id)
        return item

    async def stop(self, request_id: str, stop_reason: str | int | None) -> None:
        self._control(request_id, StopRequest(request_id, stop_reason))

    async def abort(self, request_id: str) -> None:
        self._control(request_id, AbortRequest(request_id))

    def release(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.flow.forget(request_id)

    def states(self) -> dict[str, str]:
        return {self.id: "ready" if self.ready else "starting"}

    def describe(self) -> dict[str, dict]:
        rep = self.last_report
        usage = self.engine.kv.usage()
        return {self.id: {
            "ready": self.ready, "state": self.states()[self.id], "inflight": len(self.queues),
            "running": rep.running if rep else 0, "waiting": rep.waiting if rep else 0,
            "kv_blocks_used": usage.blocks_used, "kv_blocks_total": usage.blocks_total,
            "paused": sum(1 for rid in self.queues if self.flow.paused(rid)),
            "restarts": 0, **dict.fromkeys(KV_COUNTERS, 0),
            "kv_books": (rep.kv_books or {}) if rep else {}}}
