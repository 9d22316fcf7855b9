"""A real replica process over ZeroMQ: same tokens as in-process, aborts, rejections, death."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from engine import Engine, EngineConfig, SamplingParams
from engine.protocol import (
    AbortRequest,
    AddRequest,
    Health,
    Shutdown,
    StepReport,
    decode_from_replica,
    encode,
)


@pytest.fixture
def replica(tmp_path):
    ctx = zmq.Context()
    outbox = ctx.socket(zmq.PULL)
    out_addr = f"ipc://{tmp_path}/out"
    outbox.bind(out_addr)
    in_addr = f"ipc://{tmp_path}/in"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.replica", "--id", "r0", "--model", "tiny",
         "--engine-config", json.dumps({"dtype": "float64", "num_kv_blocks": 64,
                                        "block_size": 4, "max_batched_tokens": 16}),
         "--inbox", in_addr, "--outbox", out_addr])
    inbox = ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    assert outbox.poll(60_000), "replica never reported health"
    health = decode_from_replica(outbox.recv())
    assert isinstance(health, Health) and health.ready and health.replica == "r0"
    assert health.kv_blocks_total == 64
    yield proc, inbox, outbox
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    inbox.close(linger=0)
    outbox.close(linger=0)
    ctx.term()


def collect(outbox, until: set[str], timeout_s: float = 60.0) -> dict[str, list]:
    deltas: dict[str, list] = {}
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while done != until:
        assert outbox.poll(int(1000 * max(0.0, deadline - time.monotonic()))), "timed out"
        report = decode_from_replica(outbox.recv())
        assert isinstance(report, StepReport) and report.replica == "r0"
        for d in report.deltas:
            deltas.setdefault(d.request_id, []).append(d)
            if d.finish_reason is not None:
                done.add(d.request_id)
    return deltas


def test_replica_process_streams_the_same_tokens_as_the_engine(replica, tiny_model):
    proc, inbox, outbox = replica
    prompts = {"a": [5, 6, 7, 8], "b": list(range(3, 30)), "c": [9]}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for rid, prompt in prompts.items():
        inbox.send(encode(AddRequest(rid, prompt, params)))
    deltas = collect(outbox, set(prompts))
    local = Engine(tiny_model, EngineConfig(block_size=4, num_kv_blocks=64, dtype="float64"))
    expected = {rid: r.output_token_ids for rid, r in
                zip(prompts, local.generate(list(prompts.values()), params), strict=True)}
    for rid in prompts:
        tokens = [t for d in deltas[rid] for t in d.token_ids]
        assert tokens == expected[rid]
        last = deltas[rid][-1]
        assert last.state == "FINISHED" and last.finish_reason == "length"
        timeline = [e.state for e in last.stats.events]
        assert timeline[0] == "QUEUED" and timeline[-1] == "FINISHED"
        assert [e.at_ms for e in last.stats.events] == sorted(e.at_ms for e in last.stats.events)
        offsets = last.stats.token_offsets_ms  # typed, whole: nothing dropped on the wire
        assert len(offsets) == len(tokens) == 6 and list(offsets) == sorted(offsets)


def test_replica_abort_rejection_and_shutdown(replica):
    proc, inbox, outbox = replica
    inbox.send(encode(AddRequest("long", [5, 6], SamplingParams(max_tokens=200,
                                                                  ignore_eos=True))))
    inbox.send(encode(AddRequest("huge", list(range(3, 300)), SamplingParams(max_tokens=8))))
    inbox.send(encode(AbortRequest("long")))
    deltas = collect(outbox, {"long", "huge"})
    assert deltas["long"][-1].state == "CANCELLED"
    assert deltas["huge"][-1].state == "REJECTED" and "KV blocks" in deltas["huge"][-1].error
    inbox.send(b"not msgpack at all")  # a bad message is logged, never fatal
    inbox.send(encode(Shutdown()))
    assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("when", ["serving", "loading"])
def test_replica_exits_when_its_parent_dies(tmp_path, when):
    """A gateway killed with SIGKILL must not leave replica processes behind, whether it dies
    while the replica serves or while it is still starting (imports, model load, warm-up: the
    start takes seconds, longer on a loaded machine; the CI run that caught this killed the
    parent before the replica had read its parent pid)."""
    script = (
        "import os, subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-m', 'engine.replica', '--id', 'r9', '--model',"
        " 'tiny', '--engine-config', '{\"num_kv_blocks\": 8}',"
        f" '--inbox', 'ipc://{tmp_path}/i', '--outbox',"
        f" 'ipc://{tmp_path}/o', '--parent-pid', str(os.getpid())])\n"
        "print(p.pid, flush=True)\n"
        "import time; time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    if when == "serving":  # the replica is serving once it has bound its inbox
        deadline = time.monotonic() + 60
        while not (tmp_path / "i").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("replica outlived its parent")
