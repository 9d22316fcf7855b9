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
import weakref
from collections.abc import Callable

import msgspec
import zmq

from engine.link import NO_SESSION, GatewayLink, link_key, new_session, seal, unseal
from engine.protocol import MAX_MESSAGE_BYTES, Health, Hello, decode_from_replica, encode

log = logging.getLogger("tailscope.replicas")

SEND_HWM = 100_000  # messages queued for one replica before a send is refused
HELLO_EVERY_S = 0.5  # to a replica whose session is not known yet
HELLO_KNOWN_EVERY_S = 5.0  # to one whose session is known (a restarted one answers the next)


class SendRefused(RuntimeError):
    """The replica's inbox holds ``SEND_HWM`` unread messages: it is not taking any."""


class ZmqTransport:
    def __init__(self, key: bytes | None = None, outbox_bind: str | None = None) -> None:
        if outbox_bind and not key:
            raise ValueError("a tcp:// replica outbox needs TAILSCOPE_REPLICA_KEY: every "
                             "message from another host must be signed")
        self.key = key
        self.rejected = 0  # messages from the outbox that did not verify or were replays
        self.session = new_session()  # this gateway's, on every signed link
        self._links: dict[str, GatewayLink] = {}
        self._hello_at: dict[str, float] = {}
        self.ctx = zmq.Context()
        self.dir = tempfile.mkdtemp(prefix="tailscope-")
        self.outbox_addr = f"ipc://{self.dir}/gateway.out"
        self.outbox = self.ctx.socket(zmq.PULL)
        self._sockets = [self.outbox]  # every socket opened, closed by ``_shut``
        # closed when this transport is collected without ``close`` (a gateway app built but
        # never started): left to the garbage collector, the context's own finalizer found
        # its sockets' weak references already cleared and waited in term() forever
        self._shut = weakref.finalize(self, _shut, self.ctx, self._sockets, self.dir)
        self.outbox.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
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
        if self.key:
            if len(replica_id.encode()) > 255:
                raise ValueError(f"replica id {replica_id[:40]!r}... is over 255 bytes")
            self._links[replica_id] = GatewayLink(link_key(self.key, replica_id))
        sock = self.ctx.socket(zmq.PUSH)
        self._sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.connect(self.inbox_addr(replica_id))
        self._inboxes[replica_id] = sock

    def link_key(self, replica_id: str) -> bytes | None:
        """The key a replica's link is signed with (a local replica is given it)."""
        link = self._links.get(replica_id)
        return link.key if link is not None else None

    def _frame(self, replica_id: str, data: bytes, hello: bool = False) -> bytes:
        link = self._links.get(replica_id)
        if link is None:  # no key: ipc:// in a private directory
            return data
        to = NO_SESSION if hello else (link.peer or NO_SESSION)
        return seal(link.key, replica_id, self.session, to, link.next_seq(), data)

    def send(self, replica_id: str, data: bytes) -> None:
        """Queue an encoded message for a replica; ``SendRefused`` if it is not reading."""
        try:
            self._inboxes[replica_id].send(self._frame(replica_id, data), zmq.NOBLOCK)
        except zmq.Again:
            raise SendRefused(f"replica {replica_id} is not accepting requests") from None

    def send_nowait(self, replica_id: str, msg: msgspec.Struct) -> None:
        """A control message (pause, resume, abort, stop, shutdown): dropped if the replica's
        inbox is full (a replica that stopped reading is the supervisor's business)."""
        sock = self._inboxes.get(replica_id)
        if sock is not None:
            with contextlib.suppress(zmq.Again, zmq.ZMQError):
                sock.send(self._frame(replica_id, encode(msg), isinstance(msg, Hello)),
                          zmq.NOBLOCK)

    def hello(self, now: float) -> None:
        """Offer a session on every signed link that is due one."""
        for rid, link in self._links.items():
            every = HELLO_KNOWN_EVERY_S if link.peer is not None else HELLO_EVERY_S
            if now - self._hello_at.get(rid, -every) >= every:
                self._hello_at[rid] = now
                self.send_nowait(rid, Hello())

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
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = self._open(frame)
                if msg is None:
                    self._reject()
                elif self._on_message is not None:
                    self._on_message(msg)
            except Exception:  # one bad message must not stop the reader
                log.exception("bad message from a replica")

    def _open(self, frame: bytes) -> msgspec.Struct | None:
        """The message in a frame from the outbox, or None: not signed by its replica's key,
        not for this gateway's session, a replay, or speaking for another replica."""
        if not self.key:
            return decode_from_replica(frame)
        sealed = unseal(frame, self.link_key)
        if sealed is None or sealed.receiver != self.session:
            return None
        msg = decode_from_replica(sealed.data)  # authenticated: safe to decode
        if msg.replica != sealed.replica_id:
            return None
        link = self._links[sealed.replica_id]
        return msg if link.accept(sealed, isinstance(msg, Health)) else None

    def _reject(self) -> None:
        self.rejected += 1
        if self.rejected & (self.rejected - 1) == 0:  # 1st, 2nd, 4th, ...
            log.warning("dropped a replica message that failed its signature or replay check "
                        "(%d so far): a sender without the replica's key, or a replay",
                        self.rejected)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.outbox.getsockopt(zmq.FD))
        self._shut()


def _shut(ctx: zmq.Context, sockets: list[zmq.Socket], directory: str) -> None:
    """Close every socket without waiting for unsent messages, end the context, and remove the
    directory of the ipc endpoints."""
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(directory, ignore_errors=True)
