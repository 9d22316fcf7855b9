"""Supervision (``gateway.supervisor``) of real processes (plain ``python`` sleepers standing in
for replicas: what is supervised is the process, not the engine): an exit or a stall is reported
with its cause, the process is killed, and it is started again after the backoff; failures soon
after start in a row end in crash_loop."""

from __future__ import annotations

import subprocess
import sys
import time

from gateway.supervisor import ReplicaProcess, RestartPolicy, Supervisor


def sleeper(_r: ReplicaProcess) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


POLICY = RestartPolicy(base_s=0.5, max_s=2.0, stable_s=60, crash_loop_after=3)


def make(policy=POLICY, heartbeat_timeout_s=30.0):
    failed: list[tuple[str, str, bool]] = []
    r = ReplicaProcess("r0")
    # the owner is told while the process is still there (it fails what the replica holds)
    sup = Supervisor([r], sleeper, lambda rep, why: failed.append(
        (rep.id, why, rep.proc is not None)), policy, heartbeat_timeout_s)
    return sup, r, failed


def test_an_exit_is_reported_and_restarted_after_the_backoff():
    sup, r, failed = make()
    sup.start()
    try:
        sup.seen(r)
        assert sup.became_ready(r, "health") and r.ready and r.health == "health"
        assert not sup.became_ready(r, "again")  # a repeated announcement changes nothing
        first = r.proc
        first.kill()
        first.wait()
        now = time.monotonic()
        sup.tick(now)
        assert failed == [("r0", "exited with code -9", True)]
        assert r.state == "restarting" and r.proc is None and r.health is None
        assert r.failures == 1 and r.restart_at == now + 0.5
        sup.tick(now + 0.4)
        assert r.proc is None  # not yet due
        sup.tick(now + 0.5)
        assert r.proc is not None and r.proc.pid != first.pid and r.proc.poll() is None
        assert r.state == "starting" and r.restarts == 1 and not r.ready
        info = r.supervision(time.monotonic())
        assert info["pid"] == r.proc.pid and info["last_failure"] == "exited with code -9"
    finally:
        sup.close(grace_s=0)


def test_a_stalled_replica_is_killed_and_repeated_early_failures_are_a_crash_loop():
    sup, r, failed = make(heartbeat_timeout_s=5.0)
    sup.start()
    try:
        now = time.monotonic()
        for n in range(1, 4):
            sup.seen(r)
            sup.became_ready(r, "health")
            proc = r.proc
            sup.tick(r.last_seen + 4.0)
            assert r.ready  # within the heartbeat timeout
            sup.tick(r.last_seen + 6.0)
            assert "stalled" in failed[-1][1] and proc.wait(timeout=5) == -9
            assert r.failures == n  # each soon after its start: counted in a row
            assert r.state == ("crash_loop" if n >= 3 else "restarting")
            now = r.restart_at
            sup.tick(now)  # started again
        assert r.restarts == 3 and len(failed) == 3
        # a failure long after becoming ready starts the count again
        sup.seen(r)
        sup.became_ready(r, "health")
        r.proc.kill()
        r.proc.wait()
        sup.tick(r.ready_at + 61)
        assert r.failures == 1 and r.state == "restarting"
    finally:
        sup.close(grace_s=0)
