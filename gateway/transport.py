"""The gateway's side of the replica wire: ZeroMQ sockets over ``ipc://`` in a private directory,
and ``tcp://`` for replicas on other hosts.

Each replica has its own inbox (the gateway PUSHes to it); every replica PUSHes to one gateway
outbox (``ipc://`` for its own replicas, also bound on ``outbox_bind``, a ``tcp://`` address,
when remote replicas connect to it). With a ``key`` every message both ways is signed
(``engine.protocol.sign``); one from the outbox that does not verify is dropped and counted in
``rejected``. The outbox is read by an event-loop reader callback that decodes each message
(``engine.protocol.decode_from_replica``) and hands it to ``on_message``. Plain (sync) sockets:
sends are non-blocking and the outbox is drained from the reader callback, which costs far less
per message than zmq.asyncio futures. Knows nothing of requests, routing or processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable

import msgspec
import zmq

from engine.protocol import decode_from_replica, encode, sign, verify

log = logging.getLogger("tailscope.replicas")

SEND_HWM = 100_000  # messages queued for one replica before a send is refused


class SendRefused(RuntimeError):
    """The replica's inbox holds ``SEND_HWM`` unread messages: it is not taking any."""


class ZmqTransport:
    def __init__(self, key: bytes | None = None, outbox_bind: str | None = None) -> None:
        if outbox_bind and not key:
            raise ValueError("a tcp:// replica outbox needs TAILSCOPE_REPLICA_KEY: every "
                             "message from another host must be signed")
        self.key = key
        self.rejected = 0  # messages from the outbox whose signature did not verify
        self.ctx = zmq.Context()
        self.dir = tempfile.mkdtemp(prefix="tailscope-")
        self.outbox_addr = f"ipc://{self.dir}/gateway.out"
        self.outbox = self.ctx.socket(zmq.PULL)
        self.outbox.bind(self.outbox_addr)
        if outbox_bind:
            self.outbox.bind(outbox_bind)
        self._inboxes: dict[str, zmq.Socket] = {}
        self._addrs: dict[str, str] = {}  # remote replicas' inboxes
        self._on_message: Callable[[msgspec.Struct], None] | None = None

    def add_remote(self, replica_id: str, inbox: str) -> None:
        """A replica on another host, whose inbox is ``inbox`` (``tcp://host:port``)."""
        if not self.key:
            raise ValueError(f"remote replica {replica_id} ({inbox}) needs "
                             "TAILSCOPE_REPLICA_KEY: every message to it must be signed")
        self._addrs[replica_id] = inbox

    def inbox_addr(self, replica_id: str) -> str:
        if replica_id in self._addrs:
            return self._addrs[replica_id]
        # a short file name whatever the id holds ("host:8000/r0"): a socket path has ~100 bytes
        name = hashlib.sha256(replica_id.encode()).hexdigest()[:16]
        return f"ipc://{self.dir}/{name}.in"

    def connect(self, replica_id: str) -> None:
        """Open the PUSH socket to a replica's inbox (once: it survives the replica's
        restarts, ZeroMQ reconnects by itself)."""
        if replica_id in self._inboxes:
            return
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.connect(self.inbox_addr(replica_id))
        self._inboxes[replica_id] = sock

    def send(self, replica_id: str, data: bytes) -> None:
        """Queue an encoded message for a replica; ``SendRefused`` if it is not reading."""
        try:
            self._inboxes[replica_id].send(sign(self.key, data), zmq.NOBLOCK)
        except zmq.Again:
            raise SendRefused(f"replica {replica_id} is not accepting requests") from None

    def send_nowait(self, replica_id: str, msg: msgspec.Struct) -> None:
        """A control message (pause, resume, abort, stop, shutdown): dropped if the replica's
        inbox is full (a replica that stopped reading is the supervisor's business)."""
        sock = self._inboxes.get(replica_id)
        if sock is not None:
            with contextlib.suppress(zmq.Again, zmq.ZMQError):
                sock.send(sign(self.key, encode(msg)), zmq.NOBLOCK)

    def listen(self, on_message: Callable[[msgspec.Struct], None]) -> None:
        """Hand every decoded message from the outbox to ``on_message`` on the event loop."""
        self._on_message = on_message
        loop = asyncio.get_running_loop()
        loop.add_reader(self.outbox.getsockopt(zmq.FD), self.drain)
        loop.call_soon(self.drain)  # the FD is edge-triggered: drain what came early

    def drain(self) -> None:
        """Handle every message waiting in the outbox. ZeroMQ's FD only signals edges, so read
        until ``EVENTS`` says nothing is left."""
        sock = self.outbox
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                data = verify(self.key, sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if data is None:
                self.rejected += 1
                if self.rejected & (self.rejected - 1) == 0:  # 1st, 2nd, 4th, ...
                    log.warning("dropped a replica message that failed its signature check "
                                "(%d so far): a sender without the replica key", self.rejected)
                continue
            try:
                msg = decode_from_replica(data)
                if self._on_message is not None:
                    self._on_message(msg)
            except Exception:  # one bad message must not stop the reader
                log.exception("bad message from a replica")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.outbox.getsockopt(zmq.FD))
        for sock in self._inboxes.values():
            sock.close(linger=0)
        self.outbox.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
