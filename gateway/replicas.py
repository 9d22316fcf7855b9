"""Replica supervision: start engine replica processes, route requests, relay their tokens.

Each replica is ``python -m engine.replica`` with its own ZeroMQ inbox; all replicas push to one
gateway outbox, read by one asyncio task that hands each token delta to the queue of the request
it belongs to. Requests go to any ready replica; one that is starting, dead or stalled is
skipped. A watchdog notices a dead replica (its process exited) or a stalled one (no message,
not even a heartbeat, for ``heartbeat_timeout_s``: stopped, wedged or swapping), fails its
in-flight requests with a clear error (a sample with no token yet is retried elsewhere), kills
what is left of it and starts it again after an exponential backoff (``RestartPolicy``); a
replica that keeps failing soon after its start is in ``crash_loop`` and is retried at the
longest backoff. ``describe()`` (``/debug/replicas``) shows each replica's state.

Routing: ``gateway.router.choose`` on the replicas as plain load views (expected pending work,
prefix locality, in-flight limits). This pool implements the serving code's ``Backend``
interface (``gateway.backend``).

Output buffers: each request's deltas wait in a queue until its HTTP response takes them. When
a queue holds ``max_buffered_deltas`` the replica is told to pause the request (BACKPRESSURED:
it keeps its KV, gets no tokens); when it drains to half, to resume. A request paused longer
than ``slow_client_timeout_s``, or whose buffer reaches four times the limit, is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from engine.config import EngineConfig
from engine.protocol import (
    AbortRequest,
    AddRequest,
    Health,
    PauseRequest,
    ResumeRequest,
    Shutdown,
    StepReport,
    StopRequest,
    TokenDelta,
    decode_from_replica,
    encode,
)
from engine.sampling_params import SamplingParams
from gateway import router
from gateway.backend import (
    DeadlineExceeded,
    DeltaQueue,
    ReplicaFailed,
    Route,
    Unencodable,
)

log = logging.getLogger("tailscope.replicas")


@dataclass(frozen=True)
class RestartPolicy:
    """Restart delays: ``base_s * 2**(failures - 1)`` up to ``max_s``, where ``failures``
    counts exits (or stalls) in a row that came less than ``stable_s`` after the replica was
    ready (or before it ever was). From ``crash_loop_after`` such failures on, the replica is
    reported in ``crash_loop``."""

    base_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 60.0
    crash_loop_after: int = 5

    def delay(self, failures: int) -> float:
        return min(self.max_s, self.base_s * 2 ** max(0, failures - 1))


@dataclass
class Replica:
    id: str
    inbox_addr: str
    proc: subprocess.Popen | None = None
    state: str = "starting"  # starting | ready | restarting | crash_loop
    failures: int = 0  # failures in a row (see RestartPolicy)
    ready_at: float | None = None  # monotonic seconds when it last became ready
    restart_at: float | None = None  # monotonic seconds when the next start is due
    last_seen: float = 0.0  # monotonic seconds of its latest message (heartbeats included)
    last_failure: str = ""
    socket: zmq.Socket | None = None
    health: Health | None = None
    inflight: set[str] = field(default_factory=set)
    restarts: int = 0
    last_report: StepReport | None = None  # the latest engine view: running, waiting, KV
    ended: Counter[str] = field(default_factory=Counter)  # terminal states seen, by name
    kv_counters: Counter[str] = field(default_factory=Counter)  # KV_COUNTERS, summed
    # chained hashes of leading prompt blocks recently sent here (LRU), for prefix locality
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)
    pending_tokens: int = 0  # expected work in tokens: unprefilled prompt + remaining output

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.proc is not None and self.proc.poll() is None


@dataclass(slots=True)
class _Work:
    """What the gateway knows about one in-flight request on its replica."""

    replica: Replica
    prompt_pending: int  # prompt tokens not yet prefilled (0 after the first token)
    output_pending: int  # output tokens still allowed
    paused_since: float | None = None  # monotonic seconds, while BACKPRESSURED
    slow_cancelled: bool = False  # cancelled because its client stopped reading
    deadline: float | None = None  # monotonic seconds: the gateway gives up on it then


# per-step engine counters the pool sums per replica (prefix cache in tokens, evicted blocks,
# preempted requests)
KV_COUNTERS = ("prefix_queries", "prefix_hits", "evictions", "preemptions")


class ReplicaPool:
    def __init__(self, model: str, engine: EngineConfig, num_replicas: int = 1,
                 max_inflight: int | None = None, max_buffered_deltas: int = 256,
                 slow_client_timeout_s: float = 30.0, heartbeat_timeout_s: float = 30.0,
                 restart: RestartPolicy | None = None, tokenizer: str | None = None) -> None:
        """Replicas of ``model`` run ``engine``; ``tokenizer`` (its path) lets them compile
        response_format grammars."""
        self.model, self.config, self.tokenizer = model, engine, tokenizer
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.restart = restart or RestartPolicy()
        self.max_buffered_deltas = max_buffered_deltas
        self.slow_client_timeout_s = slow_client_timeout_s
        self.work: dict[str, _Work] = {}
        # called with (replica id, incarnation, StepReport) for every engine tick (the store's
        # engine_steps)
        self.on_step = None
        # called with a request id when a request cancelled for a slow client has ended in its
        # replica: its slot here is freed at once, and the owner can free its own
        self.on_abandoned: Callable[[str], None] | None = None
        self.slow_client_cancels = 0
        # past this many in-flight requests on every replica, new ones are shed (503)
        self.max_inflight = max_inflight or 4 * engine.max_num_seqs
        # Plain (sync) sockets: sends are non-blocking PUSHes and the outbox is drained from an
        # event-loop reader callback, which costs far less per message than zmq.asyncio futures.
        self.ctx = zmq.Context()
        self.dir = tempfile.mkdtemp(prefix="tailscope-")
        self.outbox_addr = f"ipc://{self.dir}/gateway.out"
        self.outbox = self.ctx.socket(zmq.PULL)
        self.outbox.bind(self.outbox_addr)
        self.replicas = [Replica(f"r{i}", f"ipc://{self.dir}/r{i}.in")
                         for i in range(num_replicas)]
        self.queues: dict[str, DeltaQueue] = {}
        self.owner: dict[str, Replica] = {}
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle -------------------------------------------------------------------------
    def _spawn(self, r: Replica) -> None:
        cmd = [sys.executable, "-m", "engine.replica", "--id", r.id, "--model", self.model,
               "--engine-config", json.dumps(self.config.as_dict()),
               "--inbox", r.inbox_addr, "--outbox", self.outbox_addr]
        if self.tokenizer:
            cmd += ["--tokenizer", self.tokenizer]
        r.health, r.state, r.ready_at, r.restart_at = None, "starting", None, None
        r.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if r.socket is None:
            r.socket = self.ctx.socket(zmq.PUSH)
            r.socket.setsockopt(zmq.LINGER, 0)
            r.socket.setsockopt(zmq.SNDHWM, 100_000)
            r.socket.connect(r.inbox_addr)

    async def start(self) -> None:
        for r in self.replicas:
            self._spawn(r)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.outbox.getsockopt(zmq.FD), self._drain_outbox)
        loop.call_soon(self._drain_outbox)  # the FD is edge-triggered: drain what came early
        self._tasks = [asyncio.create_task(self._watchdog())]

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not all(r.ready for r in self.replicas):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("replicas did not become ready in time")
            await asyncio.sleep(0.05)

    @property
    def ready(self) -> bool:
        """At least one replica can take requests."""
        return any(r.ready for r in self.replicas)

    @property
    def max_model_len(self) -> int:
        return next((r.health.max_model_len for r in self.replicas if r.health), 0)

    def states(self) -> dict[str, str]:
        return {r.id: r.state for r in self.replicas}

    def describe(self) -> dict[str, dict]:
        out = {}
        for r in self.replicas:
            rep = r.last_report
            now = time.monotonic()
            out[r.id] = {
                "ready": r.ready, "state": r.state, "failures": r.failures,
                "last_failure": r.last_failure,
                "restart_in_s": round(max(0.0, r.restart_at - now), 3)
                if r.restart_at is not None else None,
                "last_seen_s_ago": round(now - r.last_seen, 3) if r.last_seen else None,
                "pid": r.proc.pid if r.proc else None, "restarts": r.restarts,
                "inflight": len(r.inflight), "pending_tokens": r.pending_tokens,
                "paused": sum(1 for rid in r.inflight
                              if (w := self.work.get(rid)) and w.paused_since is not None),
                "running": rep.running if rep else 0, "waiting": rep.waiting if rep else 0,
                "kv_blocks_used": rep.kv_blocks_used if rep else 0,
                "kv_blocks_total": r.health.kv_blocks_total if r.health else 0,
                "ended": dict(r.ended), **{k: r.kv_counters[k] for k in KV_COUNTERS},
                "kv_books": (rep.kv_books or {}) if rep else {},
            }
        return out

    async def close(self) -> None:
        for r in self.replicas:
            if r.socket is not None and r.ready:
                with contextlib.suppress(zmq.ZMQError):
                    r.socket.send(encode(Shutdown()), zmq.NOBLOCK)
        for t in self._tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.outbox.getsockopt(zmq.FD))
        for r in self.replicas:
            if r.proc is not None:
                try:
                    r.proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
            if r.socket is not None:
                r.socket.close(linger=0)
        self.outbox.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- requests ------------------------------------------------------------------------------
    def choose(self, prompt: list[int], exclude: frozenset[str] = frozenset(),
               salt: str = "", prefer: str | None = None) -> router.Decision:
        try:
            return router.choose(self.replicas, prompt, block_size=self.config.block_size,
                                 max_inflight=self.max_inflight, exclude=exclude, salt=salt,
                                 prefer=prefer)
        except router.NoReplica as exc:
            raise ReplicaFailed(str(exc)) from None

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     queue_timeout_s: float | None = None,
                     exclude: frozenset[str] = frozenset(), cache_salt: str = "",
                     branch_of: str | None = None, deadline: float | None = None,
                     ) -> tuple[Route, DeltaQueue]:
        """Send a request to a replica. ``branch_of`` (another sample of the same request)
        routes it to that sample's replica, where the engine forks it from the sample. At
        ``deadline`` (monotonic seconds) the queue gets a ``DeadlineExceeded`` and the engine
        request is aborted, whatever state the replica is in."""
        parent = self.owner.get(branch_of) if branch_of else None
        decision = self.choose(prompt, exclude, cache_salt,
                               prefer=parent.id if parent is not None else None)
        replica = decision.replica
        if parent is None or replica is not parent:
            branch_of = None
        try:  # before anything is registered: a request that cannot be sent takes no slot
            message = encode(AddRequest(request_id, prompt, params,
                                        queue_timeout_s=queue_timeout_s, cache_salt=cache_salt,
                                        branch_of=branch_of))
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as exc:
            raise Unencodable(f"the request cannot be sent to a replica: {exc}") from None
        queue: DeltaQueue = asyncio.Queue()
        self.queues[request_id] = queue
        self.owner[request_id] = replica
        replica.inflight.add(request_id)
        work = _Work(replica, len(prompt), params.max_tokens, deadline=deadline)
        self.work[request_id] = work
        replica.pending_tokens += work.prompt_pending + work.output_pending
        route = Route(replica.id, decision.prefix_hit_tokens, decision.reason,
                      replica.health.model_revision if replica.health else "",
                      time.monotonic_ns())
        try:
            replica.socket.send(message, zmq.NOBLOCK)
        except zmq.Again:  # 100k messages queued for it: the replica is not taking any
            self.release(request_id)
            raise ReplicaFailed(f"replica {replica.id} is not accepting requests") from None
        return route, queue

    async def next_delta(self, request_id: str, queue: asyncio.Queue
                         ) -> TokenDelta | ReplicaFailed:
        """The request's next delta; resumes a paused request once its buffer has drained."""
        item = await queue.get()
        work = self.work.get(request_id)
        if (work is not None and work.paused_since is not None and not work.slow_cancelled
                and queue.qsize() <= self.max_buffered_deltas // 2):
            work.paused_since = None
            self._send_nowait(work.replica, ResumeRequest(request_id))
        return item

    def _account(self, delta: TokenDelta) -> None:
        work = self.work.get(delta.request_id)
        if work is None:
            return
        before = work.prompt_pending + work.output_pending
        if delta.token_ids:
            work.prompt_pending = 0
            work.output_pending = max(0, work.output_pending - len(delta.token_ids))
        if delta.finish_reason is not None:
            work.prompt_pending = work.output_pending = 0
        work.replica.pending_tokens -= before - work.prompt_pending - work.output_pending

    def _buffer_check(self, request_id: str, queue: asyncio.Queue) -> None:
        work = self.work.get(request_id)
        if work is None:
            return
        size = queue.qsize()
        if size >= 4 * self.max_buffered_deltas:
            self._cancel_slow(request_id, work, f"its output buffer reached {size} deltas")
        elif size >= self.max_buffered_deltas and work.paused_since is None:
            work.paused_since = time.monotonic()
            self._send_nowait(work.replica, PauseRequest(request_id))

    def _cancel_slow(self, request_id: str, work: _Work, why: str) -> None:
        if work.slow_cancelled:
            return
        work.slow_cancelled = True
        self.slow_client_cancels += 1
        log.warning("cancelling %s: the client is not reading its stream (%s)", request_id, why)
        self._send_nowait(work.replica, AbortRequest(
            request_id, error=f"cancelled: the client did not read its stream ({why})"))

    def _send_nowait(self, replica: Replica, msg) -> None:
        if replica.socket is not None and replica.ready:
            with contextlib.suppress(zmq.Again):  # control messages to a stuck replica
                replica.socket.send(encode(msg), zmq.NOBLOCK)

    async def abort(self, request_id: str) -> None:
        replica = self.owner.get(request_id)
        if replica is not None:
            self._send_nowait(replica, AbortRequest(request_id))

    async def stop(self, request_id: str, stop_reason: str | int | None) -> None:
        replica = self.owner.get(request_id)
        if replica is not None and replica.ready:
            self._send_nowait(replica, StopRequest(request_id, stop_reason))

    def release(self, request_id: str) -> None:
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            replica.inflight.discard(request_id)
        self.queues.pop(request_id, None)
        work = self.work.pop(request_id, None)
        if work is not None:
            work.replica.pending_tokens -= work.prompt_pending + work.output_pending

    # ---- background tasks ----------------------------------------------------------------------
    def _drain_outbox(self) -> None:
        """Event-loop reader callback: handle every message waiting in the outbox. ZeroMQ's FD
        only signals edges, so read until ``EVENTS`` says nothing is left."""
        sock = self.outbox
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                self._handle(decode_from_replica(data))
            except Exception:  # one bad message must not stop the reader
                log.exception("bad message from a replica")

    def _replica(self, replica_id: str) -> Replica | None:
        return next((r for r in self.replicas if r.id == replica_id), None)

    def _handle(self, msg) -> None:
        replica = self._replica(msg.replica)
        if replica is not None:
            replica.last_seen = time.monotonic()
        if isinstance(msg, Health):
            if replica is not None and replica.state == "starting":
                replica.health, replica.state = msg, "ready"
                replica.ready_at = replica.last_seen
                log.info("replica %s ready (%s)", msg.replica, msg.model)
        elif isinstance(msg, StepReport):
            if replica is not None:
                replica.last_report = msg
                if msg.stats is not None:
                    for key in KV_COUNTERS:
                        replica.kv_counters[key] += getattr(msg.stats, key)
                if msg.stats is not None and self.on_step is not None:
                    self.on_step(replica.id, replica.restarts, msg)
            for delta in msg.deltas:
                if replica is not None and delta.finish_reason is not None:
                    replica.ended[delta.state] += 1
                self._account(delta)
                queue = self.queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
                    if delta.finish_reason is None:
                        self._buffer_check(delta.request_id, queue)
                    elif (w := self.work.get(delta.request_id)) and w.slow_cancelled:
                        self.release(delta.request_id)  # its reader holds the queue
                        if self.on_abandoned is not None:
                            self.on_abandoned(delta.request_id)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            try:
                self._supervise()
            except Exception:  # the watchdog must outlive any one bad tick
                log.exception("replica watchdog tick failed")

    def _supervise(self) -> None:
        self._drain_outbox()  # a late tick must judge heartbeats that already arrived
        now = time.monotonic()
        for rid, work in list(self.work.items()):
            if (work.paused_since is not None and not work.slow_cancelled
                    and now - work.paused_since > self.slow_client_timeout_s):
                self._cancel_slow(rid, work, f"paused for over {self.slow_client_timeout_s:g} s")
            if work.deadline is not None and now >= work.deadline:
                work.deadline = None  # once
                queue = self.queues.get(rid)
                if queue is not None:
                    queue.put_nowait(DeadlineExceeded("the request passed the gateway's "
                                                      "deadline (TAILSCOPE_REQUEST_TIMEOUT_S)"))
                self._send_nowait(work.replica, AbortRequest(rid))
        for r in self.replicas:
            if r.proc is None:
                if r.restart_at is not None and now >= r.restart_at:
                    log.info("replica %s: starting again (failure %d in a row)", r.id,
                             r.failures)
                    r.restarts += 1
                    self._spawn(r)
            elif r.proc.poll() is not None:
                self._failed(r, now, f"exited with code {r.proc.returncode}")
            elif r.state == "ready" and now - r.last_seen > self.heartbeat_timeout_s:
                self._failed(r, now, f"sent nothing for {now - r.last_seen:.1f} s (heartbeat "
                             f"timeout {self.heartbeat_timeout_s:g} s): stalled")

    def _failed(self, r: Replica, now: float, why: str) -> None:
        """The replica died or stalled: fail what it holds, kill it, schedule its restart."""
        log.error("replica %s %s; restarting it", r.id, why)
        for rid in list(r.inflight):
            queue = self.queues.get(rid)
            if queue is not None:
                queue.put_nowait(ReplicaFailed(f"replica {r.id} {why} while serving the request"))
        r.inflight.clear()
        r.pending_tokens = 0
        r.prefixes.clear()
        for work in self.work.values():
            if work.replica is r:
                work.prompt_pending = work.output_pending = 0
        if r.proc is not None and r.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                r.proc.send_signal(signal.SIGKILL)  # works on a SIGSTOPped process too
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=1)
        stable = r.ready_at is not None and now - r.ready_at >= self.restart.stable_s
        r.failures = 1 if stable else r.failures + 1
        r.last_failure = why
        r.proc, r.health = None, None
        r.restart_at = now + self.restart.delay(r.failures)
        r.state = "crash_loop" if r.failures >= self.restart.crash_loop_after else "restarting"
