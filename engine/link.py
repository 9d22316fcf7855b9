"""Signed, replay-proof frames on the replica link (when it has a key).

An HMAC alone lets anyone who captured a frame send it again: one gateway ``Shutdown`` would
stop any replica on the key at any time, and an old ``Health`` would fail every request a
replica holds. So every frame names its replica, both ends' sessions and a sequence number,
all under the HMAC:

    tag(32) | len(id) | replica id | sender session(16) | receiver session(16) | seq(8) | msg

- **Keys per replica**: the tag is made with ``link_key(fleet key, replica id)``. The gateway
  holds the fleet key; a replica needs only its own link key (``tailscope replica-key ID``),
  so it cannot speak for another replica. (A replica given the fleet key derives its own,
  which is simpler to deploy and gives up that separation.)
- **Sessions**: each end draws a random session at start. The gateway sends ``Hello`` (to no
  session) until the replica answers with a ``Health`` addressed to the gateway's session;
  from then on each end takes only frames addressed to its own session, from the peer session
  it knows, with a higher sequence number than the last one. A frame captured on one link is
  refused on every other link (other key, other sessions) and on its own (sequence number); a
  session a replica restart replaced is never taken again.

Python's ``hmac``: no new dependency; frames are authenticated, not encrypted
(docs/guides/scaling-out.md says how to add transport encryption).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

TAG_BYTES = 32
NO_SESSION = bytes(16)
_HEADER = struct.Struct(">16s16sQ")
_LABEL = b"tailscope replica link\0"
_REMEMBERED = 64  # sessions whose last sequence number (or retirement) an end keeps


def link_key(fleet_key: bytes, replica_id: str) -> bytes:
    """The key of one replica's link, derived from the fleet key (hex text, so it can be
    handed to a replica in an environment variable)."""
    return hmac.new(fleet_key, _LABEL + replica_id.encode(), hashlib.sha256
                    ).hexdigest().encode()


def new_session() -> bytes:
    return os.urandom(16)


@dataclass(frozen=True)
class Frame:
    replica_id: str
    sender: bytes
    receiver: bytes
    seq: int
    data: bytes


def seal(key: bytes, replica_id: str, sender: bytes, receiver: bytes, seq: int,
         data: bytes) -> bytes:
    rid = replica_id.encode()
    body = bytes([len(rid)]) + rid + _HEADER.pack(sender, receiver, seq) + data
    return hmac.new(key, body, hashlib.sha256).digest() + body


def unseal(frame: bytes, key_for) -> Frame | None:
    """The frame's parts when its tag verifies under ``key_for(replica id)`` (None: no such
    replica), else None. The tag is checked in constant time before anything is decoded."""
    if len(frame) < TAG_BYTES + 1:
        return None
    start = TAG_BYTES + 1
    end = start + frame[TAG_BYTES]
    if len(frame) < end + _HEADER.size:
        return None
    try:
        replica_id = frame[start:end].decode()
    except UnicodeDecodeError:
        return None
    key = key_for(replica_id)
    body = memoryview(frame)[TAG_BYTES:]
    if key is None or not hmac.compare_digest(
            frame[:TAG_BYTES], hmac.new(key, body, hashlib.sha256).digest()):
        return None
    sender, receiver, seq = _HEADER.unpack_from(frame, end)
    return Frame(replica_id, sender, receiver, seq, frame[end + _HEADER.size:])


@dataclass
class SeqBook:
    """The highest sequence number taken from each recent sender session."""

    last: OrderedDict[bytes, int] = field(default_factory=OrderedDict)

    def take(self, session: bytes, seq: int) -> bool:
        """Whether ``seq`` is new for ``session``; it is then recorded."""
        if seq <= self.last.get(session, -1):
            return False
        self.last[session] = seq
        self.last.move_to_end(session)
        while len(self.last) > _REMEMBERED:
            self.last.popitem(last=False)
        return True


@dataclass
class GatewayLink:
    """The gateway's end of one replica's link."""

    key: bytes
    seq: int = 0
    peer: bytes | None = None  # the replica's current session
    retired: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    book: SeqBook = field(default_factory=SeqBook)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def accept(self, frame: Frame, is_health: bool) -> bool:
        """A frame addressed to this gateway's session: from the replica's current session
        with a new sequence number, or a ``Health`` opening a session never seen (the replica
        restarted), which retires the one before."""
        if frame.sender == self.peer:
            return self.book.take(frame.sender, frame.seq)
        if frame.sender in self.retired or not is_health:
            return False
        if self.peer is not None:
            self.retired[self.peer] = None
            while len(self.retired) > _REMEMBERED:
                self.retired.popitem(last=False)
        self.peer = frame.sender
        return self.book.take(frame.sender, frame.seq)


@dataclass
class ReplicaLink:
    """A replica's end of its link."""

    replica_id: str
    key: bytes
    session: bytes = field(default_factory=new_session)
    seq: int = 0
    gateway: bytes | None = None  # the gateway session that has spoken to this one
    offered: bytes | None = None  # the latest gateway session that said Hello
    book: SeqBook = field(default_factory=SeqBook)

    def accept(self, frame: Frame, is_hello: bool) -> bool:
        """A ``Hello`` (to no session), or a frame to this session from the gateway session
        that said Hello or already spoke to it, each with a new sequence number."""
        if frame.replica_id != self.replica_id:
            return False
        if frame.receiver == NO_SESSION:
            if not is_hello or not self.book.take(frame.sender, frame.seq):
                return False
            self.offered = frame.sender
            return True
        if frame.receiver != self.session or frame.sender not in (self.gateway, self.offered):
            return False
        if not self.book.take(frame.sender, frame.seq):
            return False
        self.gateway = frame.sender
        return True

    def seal(self, data: bytes, to: bytes | None = None) -> bytes | None:
        """``data`` for the gateway session ``to`` (default: the one it talks to); None when
        no gateway has said Hello yet."""
        to = to or self.gateway or self.offered
        if to is None:
            return None
        self.seq += 1
        return seal(self.key, self.replica_id, self.session, to, self.seq, data)
