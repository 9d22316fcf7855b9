"""CPU sets for replica processes (``TAILSCOPE_REPLICA_CPUS``, ``engine.replica --cpus``).

On a CPU host every replica's torch threads, the gateway and the rest of the machine share the
cores; pinning each replica to cores of its own (as vLLM's CPU backend does with
``VLLM_CPU_OMP_THREADS_BIND=0-31|32-63``, one list per rank) keeps one replica's threads from
stalling on another's, or on the gateway's. No torch here: the gateway imports this.
"""

from __future__ import annotations

import os

from tailscope import env


def parse_cpus(spec: str) -> frozenset[int]:
    """A CPU list as ``taskset -c`` and ``/sys/.../cpulist`` write it (``3``, ``0-3``,
    ``0,2,4-5``) as a set; ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"CPU list {spec!r}: {part.strip()!r} is not a CPU number or a "
                             "range like 0-3") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {spec!r}: {part.strip()!r} is not a range of CPUs")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def replica_cpus(spec: str, replicas: int) -> list[frozenset[int]] | None:
    """``TAILSCOPE_REPLICA_CPUS``: the CPUs of each of ``replicas`` local replicas, ``|``
    between replicas (``0-3|4-7``), or one list for all, or ``auto`` (``split_cpus`` of the CPUs
    this process may use); empty: no pinning (None). Every CPU
    must exist on this machine (not necessarily be one the gateway itself runs on: a gateway
    pinned apart from its replicas is the point)."""
    if not spec.strip():
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("TAILSCOPE_REPLICA_CPUS needs sched_setaffinity (Linux); unset it here")
    if spec.strip() == "auto":
        return split_cpus(sorted(os.sched_getaffinity(0)), replicas)
    sets = [parse_cpus(part) for part in spec.split("|")]
    if len(sets) not in (1, replicas):
        raise ValueError(f"TAILSCOPE_REPLICA_CPUS={spec!r} gives {len(sets)} CPU lists for "
                         f"{replicas} replicas: give one list, or one per replica ('|' "
                         "between them)")
    machine = set(range(os.cpu_count() or 1))
    for cpus in sets:
        if not cpus <= machine:
            raise ValueError(f"TAILSCOPE_REPLICA_CPUS={spec!r}: CPU(s) "
                             f"{', '.join(map(str, sorted(cpus - machine)))} do not exist here "
                             f"(CPUs {format_cpus(machine)})")
    return sets * replicas if len(sets) == 1 else sets


def split_cpus(cpus: list[int], replicas: int) -> list[frozenset[int]]:
    """``cpus`` in ``replicas`` consecutive groups of ``len(cpus) // replicas`` each; the
    remainder, if any, is left to the gateway and everything else. (vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND=auto`` binds each rank to a NUMA node's cores instead; this
    does not read the NUMA layout: give explicit lists on a multi-socket host.)"""
    per = len(cpus) // max(replicas, 1)
    if replicas and per == 0:
        raise ValueError(f"TAILSCOPE_REPLICA_CPUS=auto: {len(cpus)} CPU(s) "
                         f"({format_cpus(cpus)}) for {replicas} replicas: each needs one")
    return [frozenset(cpus[i * per:(i + 1) * per]) for i in range(replicas)]


def torch_threads(cpus: frozenset[int] | None) -> int:
    """A replica's torch threads: ``TAILSCOPE_THREADS``, else one per CPU of its ``--cpus``,
    else 0 (torch's default). The replica sets them by this rule, and
    ``gateway.replicas.prepare`` groups replicas by it (the threads are part of a build's
    key)."""
    return env.threads() or len(cpus or ())


def replica_threads(cpus: frozenset[int] | None, local_replicas: int) -> int:
    """The torch threads a gateway gives one of its ``local_replicas``: ``torch_threads``
    (``TAILSCOPE_THREADS``, else one per CPU of its set), else, with two or more local replicas
    sharing the machine unpinned, the cores this process may use shared out among them (at
    least one each), else 0 (torch's default, one per core: right for a replica alone).

    Why: each replica's torch team defaults to every core, and its threads meet at a barrier
    at the end of every parallel kernel, spinning while they wait; two replicas of two threads
    on two cores kept preempting each other's teams. Served through the gateway here (2 cores,
    ``--replicas 2``, ``bench/replica_threads.py``): the tiny model 26.4 requests/s
    with every core for each replica against 217.9 shared out, the bundled model 1.5 against
    8.0 (one bundled replica alone: 8.2 with two threads, 6.1 with one, so a replica alone
    keeps torch's default). vLLM's CPU backend shares cores out the same way
    (``VLLM_CPU_OMP_THREADS_BIND``), as ``TAILSCOPE_REPLICA_CPUS=auto`` does with pinning."""
    explicit = torch_threads(cpus)
    if explicit or local_replicas < 2:
        return explicit
    return max(1, usable_cores() // local_replicas)


def usable_cores() -> int:
    """The physical cores among the CPUs this process may use: its affinity's CPUs (cgroups
    and ``taskset`` narrow them) scaled by the machine's cores per logical CPU (two hyperthreads
    of a core are one core to a matmul)."""
    import psutil

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    logical, physical = psutil.cpu_count() or 1, psutil.cpu_count(logical=False) or 0
    return max(1, cpus * physical // logical) if physical else cpus


def format_cpus(cpus) -> str:
    """The shortest CPU list for a set (``0-3,6``): what ``parse_cpus`` reads."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def move_threads(cpus) -> dict[int, set[int]]:
    """Every thread of this process onto ``cpus`` (``os.sched_setaffinity(0, ...)`` moves only
    the calling thread; threads started later inherit their creator's set). Returns each
    moved thread's set before, so a caller can put them back."""
    before = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # it ended meanwhile
            pass
    return before
