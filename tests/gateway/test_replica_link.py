"""The replica link against a peer on the network (second security audit): a frame past the
size limit is refused before it is held in memory, a captured frame is refused when sent again
(on its own link or another), and a replica's key cannot speak for another replica.

A gateway with one remote replica, ``far``, whose traffic both ways passes a recording relay
(two ZeroMQ sockets in a thread: what anyone on the path could capture)."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import zmq

from engine.link import NO_SESSION, ReplicaLink, link_key, seal, unseal
from engine.protocol import Health, Shutdown, encode
from tests.gateway.conftest import free_port, start_server, stop_server
from tests.gateway.test_faults import replicas, wait_for
from tests.gateway.test_remote_replica import complete, metric, remote

KEY = "fleet-key-for-the-link-tests-0123"


class Relay:
    """PULL on ``listen``, record, PUSH to ``target``: a recording man in the middle."""

    def __init__(self, ctx: zmq.Context, listen: int, target: int) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(f"tcp://127.0.0.1:{listen}")
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(f"tcp://127.0.0.1:{target}")
        self.frames: list[bytes] = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            if self.pull.poll(100):
                frame = self.pull.recv()
                self.frames.append(frame)
                self.push.send(frame)

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.pull.close(linger=0)
        self.push.close(linger=0)


@pytest.fixture(scope="module")
def linked(bundled_path):
    ctx = zmq.Context()
    outbox, relay_out, inbox, relay_in = (free_port() for _ in range(4))
    to_gateway = Relay(ctx, relay_out, outbox)  # replica -> gateway
    to_replica = Relay(ctx, relay_in, inbox)  # gateway -> replica
    replica = remote("far", inbox, relay_out, KEY)
    server = start_server(
        "--model", "tiny:49152", "--tokenizer", str(bundled_path), "--replicas", "0",
        "--remote-replica", f"far=tcp://127.0.0.1:{relay_in}",
        env={"TAILSCOPE_REPLICA_KEY": KEY, "TAILSCOPE_REPLICA_OUTBOX": f"tcp://127.0.0.1:{outbox}",
             "TAILSCOPE_HEARTBEAT_TIMEOUT_S": "5"}, ready_field="ready")
    out = {"server": server, "replica": replica, "ctx": ctx, "to_gateway": to_gateway,
           "to_replica": to_replica, "ports": {"outbox": outbox, "inbox": inbox}}
    yield out
    stop_server(server)
    replica.kill()
    replica.wait()
    to_gateway.close()
    to_replica.close()
    ctx.destroy(linger=0)


def push(ctx: zmq.Context, port: int, frames: list[bytes]) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for f in frames:
        sock.send(f)
    sock.close()


def rejected(url: str) -> float:
    return metric(url, "tailscope:replica_messages_rejected")


def test_captured_frames_sent_again_are_refused_by_both_ends(linked):
    url = linked["server"].url
    for _ in range(2):
        r = complete(url)
        assert r.status_code == 200 and r.headers["x-tailscope-replica"] == "far", r.text
    restarts = replicas(url)["far"]["restarts"]
    # everything the replica sent so far (Health, reports, heartbeats), sent again
    captured = list(linked["to_gateway"].frames)
    before = rejected(url)
    push(linked["ctx"], linked["ports"]["outbox"], captured)
    assert wait_for(lambda: rejected(url) >= before + len(captured), 10), (
        rejected(url), before, len(captured))
    info = replicas(url)["far"]
    assert info["ready"] and info["restarts"] == restarts
    # everything the gateway sent (Hellos, the requests), sent again to the replica itself
    sent = list(linked["to_replica"].frames)
    assert any(unseal(f, lambda rid: link_key(KEY.encode(), rid)) for f in sent)
    before_r = replicas(url)["far"]["rejected_by_replica"]
    push(linked["ctx"], linked["ports"]["inbox"], sent)
    # its next Health reports them (one every 5 s)
    assert wait_for(lambda: replicas(url)["far"]["rejected_by_replica"] >= before_r + len(sent),
                    15), (replicas(url)["far"], before_r, len(sent))
    r = complete(url)  # and it still serves, once per request
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_replica_key_cannot_speak_for_another_replica(linked):
    url = linked["server"].url
    # a peer holding replica "near"'s own key, claiming to be "far": it names "far" in the
    # frame (wrong key for far) or names itself ("near" is no replica of this gateway)
    near = link_key(KEY.encode(), "near")
    health = encode(Health("far", True, "m", "rev", 10, incarnation="forged"))
    forged = [seal(near, "far", os.urandom(16), NO_SESSION, 1, health),
              seal(near, "near", os.urandom(16), NO_SESSION, 1, health)]
    before = rejected(url)
    push(linked["ctx"], linked["ports"]["outbox"], forged)
    assert wait_for(lambda: rejected(url) >= before + 2, 10)
    assert replicas(url)["far"]["ready"]


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident size (VmHWM): a frame held for a moment shows there."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def test_a_frame_past_the_size_limit_is_refused_before_it_is_held(linked):
    url, server = linked["server"].url, linked["server"]
    big = b"\0" * (300 << 20)
    gateway_before = peak_rss_mb(server.proc.pid)
    replica_before = peak_rss_mb(linked["replica"].pid)
    push(linked["ctx"], linked["ports"]["outbox"], [big])
    push(linked["ctx"], linked["ports"]["inbox"], [big])
    del big
    time.sleep(1)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    r = complete(url)
    assert r.status_code == 200, r.text
    # a frame held whole would add 300 MB (twice, counting the signature check's copy)
    assert peak_rss_mb(server.proc.pid) - gateway_before < 100
    assert peak_rss_mb(linked["replica"].pid) - replica_before < 100


def test_a_shutdown_is_taken_once_and_only_on_its_own_link():
    key = link_key(KEY.encode(), "r0")
    gateway = os.urandom(16)
    a, b = ReplicaLink("r0", key), ReplicaLink("r0", key)  # two runs of replica r0
    for link in (a, b):  # each said Hello to this gateway
        hello = unseal(seal(key, "r0", gateway, NO_SESSION, 1, b""), lambda rid: key)
        assert link.accept(hello, is_hello=True)
    frame = seal(key, "r0", gateway, a.session, 2, encode(Shutdown()))
    opened = unseal(frame, lambda rid: key)
    assert a.accept(opened, is_hello=False)
    assert not a.accept(opened, is_hello=False)  # the same frame again
    assert not b.accept(opened, is_hello=False)  # another run of the same replica
    other = ReplicaLink("r1", link_key(KEY.encode(), "r1"))
    assert unseal(frame, lambda rid: other.key) is None  # another replica: another key


def test_a_replica_delivers_only_to_the_requests_it_holds():
    """A replica that speaks for itself (its own key) still cannot put tokens into a request
    another replica serves: the pool takes a delta only from the request's own replica."""
    import asyncio

    from engine.config import EngineConfig
    from engine.protocol import StepReport, TokenDelta
    from gateway.replicas import ReplicaPool

    pool = ReplicaPool("tiny:49152", EngineConfig(), num_replicas=2)
    try:
        r0, r1 = pool.replicas
        queue: asyncio.Queue = asyncio.Queue()
        pool.queues["req"], pool.owner["req"] = queue, r0
        pool.flow.track("req", queue)
        pool._handle(StepReport(r1.id, [TokenDelta("req", [666], "DECODING")]))
        assert queue.empty()
        pool._handle(StepReport(r0.id, [TokenDelta("req", [7], "DECODING")]))
        assert queue.get_nowait().token_ids == [7]
    finally:
        pool.transport.close()
