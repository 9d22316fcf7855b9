"""Supervision of replica processes: start them, notice when one dies or stalls, restart it.

A ``Supervisor`` holds ``ReplicaProcess`` records (one per replica id) and a ``launch``
function that starts a replica's process. It knows nothing of requests or transport: the owner
tells it when a replica said something (``seen``) or announced itself ready (``became_ready``),
calls ``tick`` a few times a second, and is called back (``on_failed``) when a replica died (its
process exited) or stalled (no message, not even a heartbeat, for ``heartbeat_timeout_s``:
stopped, wedged or swapping), before the supervisor kills what is left of it. A failed replica is
started again after an exponential backoff (``RestartPolicy``); one that keeps failing soon after
its start is in ``crash_loop`` and is retried at the longest backoff.

A remote replica (``remote``: its inbox on another host) has no process here: its own host's
supervisor (systemd, Kubernetes) restarts it. This one only judges it: ready once it announced
itself, ``unreachable`` when it stalls (its requests fail as for a local replica), ready again
at its next announcement, and a new incarnation in an announcement from a ready replica means it
restarted behind our back, which fails what it held the same way.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
class ReplicaProcess:
    """A supervised replica: its process and where it stands."""

    id: str
    proc: subprocess.Popen | None = None
    state: str = "starting"  # starting | ready | restarting | crash_loop
    failures: int = 0  # failures in a row (see RestartPolicy)
    ready_at: float | None = None  # monotonic seconds when it last became ready
    restart_at: float | None = None  # monotonic seconds when the next start is due
    last_seen: float = 0.0  # monotonic seconds of its latest message (heartbeats included)
    last_failure: str = ""
    health: Any = None  # what it announced when it became ready (engine.protocol.Health)
    restarts: int = 0
    remote: str = ""  # a replica on another host: its inbox (tcp://host:port)

    @property
    def ready(self) -> bool:
        if self.remote:
            return self.state == "ready"
        return self.state == "ready" and self.proc is not None and self.proc.poll() is None

    def supervision(self, now: float) -> dict:
        """Its supervision state for ``/debug/replicas``."""
        return {
            "ready": self.ready, "state": self.state, "failures": self.failures,
            "last_failure": self.last_failure,
            "restart_in_s": round(max(0.0, self.restart_at - now), 3)
            if self.restart_at is not None else None,
            "last_seen_s_ago": round(now - self.last_seen, 3) if self.last_seen else None,
            "pid": self.proc.pid if self.proc else None, "restarts": self.restarts,
            "kind": "remote" if self.remote else "local",
            **({"inbox": self.remote} if self.remote else {}),
        }


class Supervisor:
    def __init__(self, replicas: Sequence[ReplicaProcess],
                 launch: Callable[[ReplicaProcess], subprocess.Popen],
                 on_failed: Callable[[ReplicaProcess, str], None],
                 restart: RestartPolicy | None = None,
                 heartbeat_timeout_s: float = 30.0) -> None:
        """``launch`` starts a replica's process; ``on_failed(replica, why)`` is called when one
        died or stalled, while its record still says what it was doing."""
        self.replicas = list(replicas)
        self.launch, self.on_failed = launch, on_failed
        self.restart = restart or RestartPolicy()
        self.heartbeat_timeout_s = heartbeat_timeout_s

    def spawn(self, r: ReplicaProcess) -> None:
        r.health, r.state, r.ready_at, r.restart_at = None, "starting", None, None
        r.proc = None if r.remote else self.launch(r)

    def start(self) -> None:
        for r in self.replicas:
            self.spawn(r)

    def seen(self, r: ReplicaProcess) -> None:
        r.last_seen = time.monotonic()

    def became_ready(self, r: ReplicaProcess, health: Any) -> bool:
        """A starting replica announced itself; False if it was not starting (a late or
        repeated announcement changes nothing) unless a ready remote replica announces a new
        incarnation: it restarted, so what it held is failed first."""
        if r.remote and r.state == "ready" and r.health is not None and getattr(
                health, "incarnation", "") != getattr(r.health, "incarnation", ""):
            self.fail(r, time.monotonic(), "restarted (a new incarnation announced itself)")
        if r.state not in ("starting", "unreachable", "refused"):
            if r.state == "ready" and r.health is not None and getattr(
                    health, "incarnation", "") == getattr(r.health, "incarnation", ""):
                r.health = health  # the same run's latest figures (its rejected count)
            return False
        r.health, r.state, r.ready_at = health, "ready", r.last_seen or time.monotonic()
        return True

    def tick(self, now: float | None = None) -> None:
        """Start replicas whose restart is due; fail those that exited or stalled."""
        now = time.monotonic() if now is None else now
        for r in self.replicas:
            if r.remote:
                if r.state == "ready" and now - r.last_seen > self.heartbeat_timeout_s:
                    self.fail(r, now, f"sent nothing for {now - r.last_seen:.1f} s (heartbeat "
                              f"timeout {self.heartbeat_timeout_s:g} s): unreachable")
            elif r.proc is None:
                if r.restart_at is not None and now >= r.restart_at:
                    log.info("replica %s: starting again (failure %d in a row)", r.id,
                             r.failures)
                    r.restarts += 1
                    self.spawn(r)
            elif r.proc.poll() is not None:
                self.fail(r, now, f"exited with code {r.proc.returncode}")
            elif r.state == "ready" and now - r.last_seen > self.heartbeat_timeout_s:
                self.fail(r, now, f"sent nothing for {now - r.last_seen:.1f} s (heartbeat "
                          f"timeout {self.heartbeat_timeout_s:g} s): stalled")

    def fail(self, r: ReplicaProcess, now: float, why: str) -> None:
        """The replica died or stalled: tell the owner, kill it, schedule its restart (a
        remote one: wait for its next announcement)."""
        log.error("replica %s %s; %s", r.id, why,
                  "waiting for it to announce itself" if r.remote else "restarting it")
        self.on_failed(r, why)
        if r.remote:
            r.failures, r.last_failure, r.health = r.failures + 1, why, None
            r.restarts += 1  # its next steps are another incarnation's
            r.state = "unreachable"
            return
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

    def close(self, grace_s: float = 1.0) -> None:
        """Wait up to ``grace_s`` for each process to exit (after the owner asked it to), then
        kill it."""
        for r in self.replicas:
            if r.proc is not None:
                try:
                    r.proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
