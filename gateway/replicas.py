"""Replica supervision: start engine replica processes, route requests, relay their tokens.

Each replica is ``python -m engine.replica`` with its own ZeroMQ inbox; all replicas push to one
gateway outbox, read by one asyncio task that hands each token delta to the queue of the request
it belongs to. A watchdog notices a dead replica, fails its in-flight requests with a clear
error, and starts it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from engine.protocol import (
    AbortRequest,
    AddRequest,
    Health,
    Shutdown,
    StepReport,
    StopRequest,
    TokenDelta,
    decode_from_replica,
    encode,
)
from engine.sampling_params import SamplingParams

log = logging.getLogger("tailscope.replicas")


@dataclass
class ReplicaConfig:
    model: str = "bundled"
    dtype: str = "float32"
    kv_cache_mb: int = 512
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    num_kv_blocks: int | None = None
    tokenizer: str | None = None  # for JSON-constrained output (llguidance needs the vocab)


@dataclass
class Replica:
    id: str
    inbox_addr: str
    proc: subprocess.Popen | None = None
    socket: zmq.asyncio.Socket | None = None
    health: Health | None = None
    inflight: set[str] = field(default_factory=set)
    restarts: int = 0
    last_report: StepReport | None = None  # the latest engine view: running, waiting, KV
    ended: Counter[str] = field(default_factory=Counter)  # terminal states seen, by name

    @property
    def ready(self) -> bool:
        return self.health is not None and self.proc is not None and self.proc.poll() is None


class ReplicaFailed(RuntimeError):
    pass


class Overloaded(RuntimeError):
    """Every ready replica already holds its limit of in-flight requests: shed, don't queue."""


class ReplicaPool:
    def __init__(self, config: ReplicaConfig, num_replicas: int = 1,
                 max_inflight: int | None = None) -> None:
        self.config = config
        # past this many in-flight requests on every replica, new ones are shed (503)
        self.max_inflight = max_inflight or 4 * config.max_num_seqs
        self.ctx = zmq.asyncio.Context()
        self.dir = tempfile.mkdtemp(prefix="tailscope-")
        self.outbox_addr = f"ipc://{self.dir}/gateway.out"
        self.outbox = self.ctx.socket(zmq.PULL)
        self.outbox.bind(self.outbox_addr)
        self.replicas = [Replica(f"r{i}", f"ipc://{self.dir}/r{i}.in")
                         for i in range(num_replicas)]
        self.queues: dict[str, asyncio.Queue[TokenDelta | ReplicaFailed]] = {}
        self.owner: dict[str, Replica] = {}
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle -------------------------------------------------------------------------
    def _spawn(self, r: Replica) -> None:
        c = self.config
        cmd = [sys.executable, "-m", "engine.replica", "--id", r.id, "--model", c.model,
               "--dtype", c.dtype, "--kv-cache-mb", str(c.kv_cache_mb),
               "--block-size", str(c.block_size), "--max-num-seqs", str(c.max_num_seqs),
               "--max-batched-tokens", str(c.max_batched_tokens),
               "--inbox", r.inbox_addr, "--outbox", self.outbox_addr]
        if c.num_kv_blocks:
            cmd += ["--num-kv-blocks", str(c.num_kv_blocks)]
        if c.tokenizer:
            cmd += ["--tokenizer", c.tokenizer]
        r.health = None
        r.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if r.socket is None:
            r.socket = self.ctx.socket(zmq.PUSH)
            r.socket.setsockopt(zmq.LINGER, 0)
            r.socket.connect(r.inbox_addr)

    async def start(self) -> None:
        for r in self.replicas:
            self._spawn(r)
        self._tasks = [asyncio.create_task(self._read_outputs()),
                       asyncio.create_task(self._watchdog())]

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not all(r.ready for r in self.replicas):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("replicas did not become ready in time")
            await asyncio.sleep(0.05)

    @property
    def ready(self) -> bool:
        return all(r.ready for r in self.replicas)

    def describe(self) -> dict[str, dict]:
        out = {}
        for r in self.replicas:
            rep = r.last_report
            out[r.id] = {
                "ready": r.ready, "pid": r.proc.pid if r.proc else None, "restarts": r.restarts,
                "inflight": len(r.inflight),
                "running": rep.running if rep else 0, "waiting": rep.waiting if rep else 0,
                "kv_blocks_used": rep.kv_blocks_used if rep else 0,
                "kv_blocks_total": r.health.kv_blocks_total if r.health else 0,
                "ended": dict(r.ended),
            }
        return out

    async def close(self) -> None:
        for r in self.replicas:
            if r.socket is not None and r.ready:
                with contextlib.suppress(zmq.ZMQError):
                    await r.socket.send(encode(Shutdown()))
        for t in self._tasks:
            t.cancel()
        for r in self.replicas:
            if r.proc is not None:
                try:
                    r.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
            if r.socket is not None:
                r.socket.close(linger=0)
        self.outbox.close(linger=0)
        self.ctx.term()

    # ---- requests ------------------------------------------------------------------------------
    def choose(self) -> Replica:
        """Least in-flight requests among ready replicas (ties: lowest id)."""
        ready = [r for r in self.replicas if r.ready]
        if not ready:
            raise ReplicaFailed("no replica is ready")
        best = min(ready, key=lambda r: len(r.inflight))
        if len(best.inflight) >= self.max_inflight:
            raise Overloaded(f"all {len(ready)} replicas hold {self.max_inflight} requests")
        return best

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     deadline_s: float | None = None
                     ) -> tuple[Replica, asyncio.Queue[TokenDelta | ReplicaFailed]]:
        replica = self.choose()
        queue: asyncio.Queue[TokenDelta | ReplicaFailed] = asyncio.Queue()
        self.queues[request_id] = queue
        self.owner[request_id] = replica
        replica.inflight.add(request_id)
        await replica.socket.send(encode(AddRequest(request_id, prompt, params, deadline_s)))
        return replica, queue

    async def abort(self, request_id: str) -> None:
        replica = self.owner.get(request_id)
        if replica is not None and replica.ready:
            await replica.socket.send(encode(AbortRequest(request_id)))

    async def stop(self, request_id: str, stop_reason: str | int | None) -> None:
        replica = self.owner.get(request_id)
        if replica is not None and replica.ready:
            await replica.socket.send(encode(StopRequest(request_id, stop_reason)))

    def release(self, request_id: str) -> None:
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            replica.inflight.discard(request_id)
        self.queues.pop(request_id, None)

    # ---- background tasks ----------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        while True:
            msg = decode_from_replica(await self.outbox.recv())
            if isinstance(msg, Health):
                replica = next(r for r in self.replicas if r.id == msg.replica)
                replica.health = msg
                log.info("replica %s ready (%s)", msg.replica, msg.model)
            elif isinstance(msg, StepReport):
                replica = next((r for r in self.replicas if r.id == msg.replica), None)
                if replica is not None:
                    replica.last_report = msg
                for delta in msg.deltas:
                    if replica is not None and delta.finish_reason is not None:
                        replica.ended[delta.state] += 1
                    queue = self.queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for r in self.replicas:
                if r.proc is not None and r.proc.poll() is not None:
                    code = r.proc.returncode
                    log.error("replica %s exited with %s; restarting", r.id, code)
                    for rid in list(r.inflight):
                        queue = self.queues.get(rid)
                        if queue is not None:
                            queue.put_nowait(ReplicaFailed(
                                f"replica {r.id} exited (code {code}) while serving the request"))
                    r.inflight.clear()
                    r.restarts += 1
                    self._spawn(r)
