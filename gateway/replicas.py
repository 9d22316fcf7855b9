"""The replica pool: engine replica processes as one ``Backend`` (``gateway.backend``).

Each replica is ``python -m engine.replica`` with its own ZeroMQ inbox. The pool composes the
parts, each in its own module:

- ``gateway.supervisor``: starts the processes, notices a dead or stalled replica, restarts it
  with backoff (``RestartPolicy``); the pool fails that replica's in-flight requests with a clear
  error (a sample with no token yet is retried elsewhere by the serving code);
- ``gateway.transport``: the ZeroMQ sockets (one inbox per replica, one outbox read on the event
  loop);
- ``gateway.router``: which replica takes a request, decided on plain load views (expected
  pending work, prefix locality, in-flight limits);
- ``gateway.flow``: per-request output buffers (pause/resume a request whose client stops
  reading, cancel a client that never does) and the gateway's deadline.

What stays here is the books the router reads (each replica's in-flight requests and expected
pending work in tokens) and the dispatch of replica messages: health, step reports and their
token deltas into each request's queue. ``describe()`` (``/debug/replicas``) shows each replica's
state and load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from engine.config import EngineConfig
from engine.cpus import format_cpus, replica_threads
from engine.protocol import (
    AbortRequest,
    AddRequest,
    Health,
    Shutdown,
    StepReport,
    StopRequest,
    TokenDelta,
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
from gateway.flow import FlowControl
from gateway.supervisor import ReplicaProcess, RestartPolicy, Supervisor
from gateway.transport import SendRefused, ZmqTransport

__all__ = ["KV_COUNTERS", "Replica", "ReplicaPool", "RestartPolicy"]

log = logging.getLogger("tailscope.replicas")

# per-step engine counters the pool sums per replica (prefix cache in tokens, evicted blocks,
# preempted requests)
KV_COUNTERS = ("prefix_queries", "prefix_hits", "evictions", "preemptions")


@dataclass
class Replica(ReplicaProcess):
    """A supervised replica process and the pool's books on it (its ``router.ReplicaView``)."""

    inflight: set[str] = field(default_factory=set)
    last_report: StepReport | None = None  # the latest engine view: running, waiting, KV
    ended: Counter[str] = field(default_factory=Counter)  # terminal states seen, by name
    kv_counters: Counter[str] = field(default_factory=Counter)  # KV_COUNTERS, summed
    # chained hashes of leading prompt blocks recently sent here (LRU), for prefix locality
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)
    pending_tokens: int = 0  # expected work in tokens: unprefilled prompt + remaining output


@dataclass(slots=True)
class _Work:
    """The expected work of one in-flight request on its replica."""

    replica: Replica
    prompt_pending: int  # prompt tokens not yet prefilled (0 after the first token)
    output_pending: int  # output tokens still allowed


def local_ids(instance: str, n: int) -> list[str]:
    """Local replicas' ids: ``r0``, ``r1``, ... or ``<instance>/r0``, ... under a gateway
    instance id (unique among gateways sharing a store)."""
    prefix = f"{instance}/" if instance else ""
    return [f"{prefix}r{i}" for i in range(n)]


def replica_command(model: str, engine: EngineConfig, rid: str, tokenizer: str | None = None,
                    cpus: frozenset[int] | None = None) -> list[str]:
    """A local replica's command line, less its sockets: what the pool starts, and what
    ``prepare`` runs ahead with ``--prepare-only``."""
    cmd = [sys.executable, "-m", "engine.replica", "--id", rid, "--model", model,
           "--engine-config", json.dumps(engine.as_dict())]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    if cpus is not None:
        cmd += ["--cpus", format_cpus(cpus)]
    return cmd


def prepare(model: str, engine: EngineConfig, ids: list[str], tokenizer: str | None = None,
            cpus: list[frozenset[int]] | None = None) -> int:
    """``tailscope serve --prepare-only``: each local replica's start run ahead, one after the
    other (``python -m engine.replica ... --prepare-only``: the model loaded, our kernels built,
    with ``compile: true`` the compiled decode step built and warmed up, into the caches the
    replicas will read), so that the gateway's replicas start by loading, not building (an init
    container's job). Replicas that would run with the same number of threads share one
    preparation: the model, engine config and threads are the builds' whole key here. Returns
    0, or the exit status of the first preparation that failed."""
    if not ids:
        log.info("no local replicas to prepare")
    done: dict[int, str] = {}
    for i, rid in enumerate(ids):
        mine = cpus[i] if cpus else None
        threads = replica_threads(mine, len(ids))
        if threads in done:
            log.info("replica %s: prepared by %s (same model, engine and threads)", rid,
                     done[threads])
            continue
        rc = subprocess.run([*replica_command(model, engine, rid, tokenizer, mine),
                             "--prepare-only"], env=replica_env(threads)).returncode
        if rc:
            log.error("replica %s: preparing failed (%s)", rid, f"exit status {rc}" if rc > 0
                      else f"killed by signal {-rc}")
            return rc if rc > 0 else 1
        done[threads] = rid
    return 0


def replica_env(threads: int) -> dict[str, str]:
    """A local replica's environment: this process's, its output unbuffered, and its torch
    threads (``engine.cpus.replica_threads``; 0: torch's default) where the gateway chose
    them."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env["TAILSCOPE_THREADS"] = str(threads)
    return env


class ReplicaPool:
    def __init__(self, model: str, engine: EngineConfig, num_replicas: int = 1,
                 max_inflight: int | None = None, max_buffered_deltas: int = 256,
                 slow_client_timeout_s: float = 30.0, heartbeat_timeout_s: float = 30.0,
                 restart: RestartPolicy | None = None, tokenizer: str | None = None,
                 instance: str = "", remote: dict[str, str] | None = None,
                 key: bytes | None = None, outbox_bind: str | None = None,
                 cpus: list[frozenset[int]] | None = None) -> None:
        """Replicas of ``model`` run ``engine``; ``tokenizer`` (its path) lets them compile
        response_format grammars. Replica ids are ``r0``, ``r1``, ... or, under a gateway
        ``instance`` id, ``<instance>/r0``, ...: unique among gateways sharing a store.
        ``remote`` adds replicas on other hosts (id: their ``tcp://`` inbox); they connect
        back to ``outbox_bind``, and every message is signed with ``key``. ``cpus``: the CPU
        set of each local replica (``engine.cpus.replica_cpus``; None: not pinned)."""
        self.model, self.config, self.tokenizer = model, engine, tokenizer
        self.work: dict[str, _Work] = {}
        # called with (replica id, incarnation, StepReport) for every engine tick (the store's
        # engine_steps)
        self.on_step = None
        # called with a request id when a request cancelled for a slow client has ended in its
        # replica: its slot here is freed at once, and the owner can free its own
        self.on_abandoned: Callable[[str], None] | None = None
        # past this many in-flight requests on every replica, new ones are shed (503)
        self.max_inflight = max_inflight or 4 * engine.max_num_seqs
        self.transport = ZmqTransport(key, outbox_bind)
        self.replicas = [Replica(rid) for rid in local_ids(instance, num_replicas)]
        self.local = num_replicas  # they share this machine's cores (replica_threads)
        if cpus is not None and len(cpus) != num_replicas:
            raise ValueError(f"{len(cpus)} CPU sets for {num_replicas} replicas")
        self.cpus = dict(zip((r.id for r in self.replicas), cpus or (), strict=False))
        if remote and not outbox_bind:
            raise ValueError("remote replicas need an outbox to connect to "
                             "(TAILSCOPE_REPLICA_OUTBOX=tcp://HOST:PORT)")
        for rid, inbox in (remote or {}).items():
            if any(r.id == rid for r in self.replicas):
                raise ValueError(f"remote replica id {rid!r} is taken by a local replica")
            self.transport.add_remote(rid, inbox)
            self.transport.connect(rid)
            self.replicas.append(Replica(rid, remote=inbox))
        if not self.replicas:
            raise ValueError("no replicas: give --replicas 1 or more, or remote replicas")
        self.supervisor = Supervisor(self.replicas, self._launch, self._failed, restart,
                                     heartbeat_timeout_s)
        self.flow = FlowControl(self._control, max_buffered_deltas, slow_client_timeout_s)
        self.queues: dict[str, DeltaQueue] = {}
        self.owner: dict[str, Replica] = {}
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle -------------------------------------------------------------------------
    def _launch(self, r: ReplicaProcess) -> subprocess.Popen:
        cmd = [*replica_command(self.model, self.config, r.id, self.tokenizer,
                                self.cpus.get(r.id)),
               "--inbox", self.transport.inbox_addr(r.id),
               "--outbox", self.transport.outbox_addr, "--parent-pid", str(os.getpid())]
        env = replica_env(replica_threads(self.cpus.get(r.id), self.local))
        env.pop("TAILSCOPE_REPLICA_KEY", None)  # the fleet key would let it speak for others
        if (key := self.transport.link_key(r.id)) is not None:  # its own link's key only
            env["TAILSCOPE_REPLICA_LINK_KEY"] = key.decode()
        # a session of its own: a terminal's Ctrl-C (SIGINT to the foreground process group)
        # reaches the gateway alone, which stops its replicas itself (in the gateway's group
        # each replica died of the SIGINT mid-shutdown, with a KeyboardInterrupt traceback, and
        # the supervisor started it again while the gateway was stopping). Not merely a process
        # group of its own: in the terminal's session, that is a background job, which
        # `stty tostop` stops at its first log line; outside it, the terminal is not its
        # controlling one and its writes pass. It stops by itself if the gateway dies
        # (--parent-pid).
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.transport.connect(r.id)
        return proc

    async def start(self) -> None:
        self.supervisor.start()
        self.transport.listen(self._handle)
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

    @property
    def slow_client_cancels(self) -> int:
        return self.flow.slow_client_cancels

    @property
    def rejected_messages(self) -> int:
        """Replica messages dropped here because their signature did not verify."""
        return self.transport.rejected

    def states(self) -> dict[str, str]:
        return {r.id: r.state for r in self.replicas}

    def describe(self) -> dict[str, dict]:
        out = {}
        now = time.monotonic()
        for r in self.replicas:
            rep = r.last_report
            out[r.id] = {
                **r.supervision(now),
                "inflight": len(r.inflight), "pending_tokens": r.pending_tokens,
                "paused": sum(1 for rid in r.inflight if self.flow.paused(rid)),
                "running": rep.running if rep else 0, "waiting": rep.waiting if rep else 0,
                "kv_blocks_used": rep.kv_blocks_used if rep else 0,
                "kv_blocks_total": r.health.kv_blocks_total if r.health else 0,
                "ended": dict(r.ended), **{k: r.kv_counters[k] for k in KV_COUNTERS},
                "kv_books": (rep.kv_books or {}) if rep else {},
                # messages it dropped for a bad signature (its latest announcement's count)
                "rejected_by_replica": getattr(r.health, "rejected", 0) if r.health else 0,
                # the CPUs it was started on (TAILSCOPE_REPLICA_CPUS); None: not pinned
                "cpus": format_cpus(self.cpus[r.id]) if r.id in self.cpus else None,
                # its torch intra-op threads, as it reports them (None: not ready yet)
                "threads": r.health.threads if r.health and r.health.threads else None,
                # its compiled decode step: off, compiling (serving eagerly), compiled, failed
                "compile": r.health.compile if r.health else None,
            }
        return out

    async def close(self) -> None:
        for r in self.replicas:
            if r.ready:
                self.transport.send_nowait(r.id, Shutdown())
        for t in self._tasks:
            t.cancel()
        self.supervisor.close()
        self.transport.close()

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
        work = _Work(replica, len(prompt), params.max_tokens)
        self.work[request_id] = work
        replica.pending_tokens += work.prompt_pending + work.output_pending
        self.flow.track(request_id, queue, deadline)
        route = Route(replica.id, decision.prefix_hit_tokens, decision.reason,
                      replica.health.model_revision if replica.health else "",
                      time.monotonic_ns())
        try:
            self.transport.send(replica.id, message)
        except SendRefused as exc:
            self.release(request_id)
            raise ReplicaFailed(str(exc)) from None
        return route, queue

    async def next_delta(self, request_id: str, queue: asyncio.Queue
                         ) -> TokenDelta | ReplicaFailed | DeadlineExceeded:
        """The request's next delta; resumes a paused request once its buffer has drained."""
        item = await queue.get()
        self.flow.taken(request_id)
        return item

    def _control(self, request_id: str, msg) -> None:
        """Send a control message to the replica that holds the request, if it is up."""
        replica = self.owner.get(request_id)
        if replica is not None and replica.ready:
            self.transport.send_nowait(replica.id, msg)

    async def abort(self, request_id: str) -> None:
        self._control(request_id, AbortRequest(request_id))

    async def stop(self, request_id: str, stop_reason: str | int | None) -> None:
        self._control(request_id, StopRequest(request_id, stop_reason))

    def release(self, request_id: str) -> None:
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            replica.inflight.discard(request_id)
        self.queues.pop(request_id, None)
        self.flow.forget(request_id)
        work = self.work.pop(request_id, None)
        if work is not None:
            work.replica.pending_tokens -= work.prompt_pending + work.output_pending

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

    # ---- replica messages and supervision ------------------------------------------------------
    def _replica(self, replica_id: str) -> Replica | None:
        return next((r for r in self.replicas if r.id == replica_id), None)

    def _handle(self, msg) -> None:
        replica = self._replica(msg.replica)
        if replica is not None:
            self.supervisor.seen(replica)
        if isinstance(msg, Health):
            if replica is not None and replica.remote and not self._same_engine(replica, msg):
                return
            if replica is not None and self.supervisor.became_ready(replica, msg):
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
                final = delta.finish_reason is not None
                if replica is not None and final:
                    replica.ended[delta.state] += 1
                if self.owner.get(delta.request_id) is not replica:
                    continue  # not a request this replica holds (a late or forged delta)
                self._account(delta)
                if self.flow.deliver(delta):  # its reader holds the queue
                    self.release(delta.request_id)
                    if self.on_abandoned is not None:
                        self.on_abandoned(delta.request_id)

    def _same_engine(self, r: Replica, health: Health) -> bool:
        """A remote replica runs its own ``--engine-config``: one that differs from this
        gateway's would make every record's config_id a lie, so it is not used."""
        mine = self.config.as_dict()
        try:
            theirs = json.loads(health.engine_config) if health.engine_config else None
        except ValueError:
            theirs = None
        if theirs == mine:
            return True
        why = "runs another engine config than this gateway: " + (", ".join(
            f"{k}={theirs.get(k)!r} (here {v!r})" for k, v in mine.items()
            if theirs.get(k) != v) if isinstance(theirs, dict) else "it did not say which")
        if r.state == "ready":  # it restarted with other settings: what it held is gone
            self.supervisor.fail(r, time.monotonic(), why)
        if r.last_failure != why or r.state != "refused":
            log.error("remote replica %s %s; not routing to it", r.id, why)
        r.state, r.last_failure = "refused", why
        return False

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            try:
                self.transport.drain()  # a late tick must judge heartbeats that already came
                now = time.monotonic()
                self.transport.hello(now)
                self.flow.tick(now)
                self.supervisor.tick(now)
            except Exception:  # the watchdog must outlive any one bad tick
                log.exception("replica watchdog tick failed")

    def _failed(self, r: ReplicaProcess, why: str) -> None:
        """The supervisor found ``r`` dead or stalled: fail what it holds."""
        assert isinstance(r, Replica)
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
