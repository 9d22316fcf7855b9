"""Routing: which replica takes a new request, decided on plain load views.

``choose`` sees only ``ReplicaView``s (an id, readiness, in-flight requests, expected pending
work, recently served prompt prefixes), never processes or sockets, so it is unit-tested on
plain values and any backend (local replica processes today; remote replicas and external
servers next) can be routed to the same way.

The rule: the ready replica with the least expected completion time for the new request,
estimated in tokens: the work already sent to it and not yet done (unprefilled prompt tokens +
output tokens still allowed, over its in-flight requests) plus this prompt's tokens, minus a
prefix-locality bonus of the leading prompt tokens it served recently (its prefix cache can
skip them). The estimate is deliberately simple and stated: a token of prefill and a token of
decode are counted alike. Ties go to fewer in-flight requests, then the lowest id. Past
``max_inflight`` requests on every ready replica, new requests are shed (``Overloaded``), not
queued; ``prefer`` (the replica of an n > 1 request's first sample) wins while it is open.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

PREFIX_LRU_BLOCKS = 8192  # prefix hashes remembered per replica


class NoReplica(RuntimeError):
    """No replica can take the request (none is ready)."""


class Overloaded(RuntimeError):
    """Every ready replica already holds its limit of in-flight requests: shed, don't queue."""


class ReplicaView(Protocol):
    id: str
    inflight: set[str]
    pending_tokens: int  # expected work in tokens: unprefilled prompt + remaining output
    prefixes: OrderedDict[int, None]  # chained hashes of leading prompt blocks sent (LRU)

    @property
    def ready(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Decision:
    replica: ReplicaView
    prefix_hit_tokens: int
    reason: str


def prefix_hashes(prompt: list[int], block_size: int, salt: str = "") -> list[int]:
    """Chained hashes of the prompt's full blocks (hash i covers tokens [0, (i+1)*block)),
    rooted in the request's cache namespace like the engine's prefix cache, so the router's
    locality bonus never reflects another namespace's prompts. Only this process compares
    them, so Python's per-process string hash is fine."""
    out, h = [], hash(salt)
    for i in range(len(prompt) // block_size):
        h = hash((h, *prompt[i * block_size:(i + 1) * block_size]))
        out.append(h)
    return out


def choose(replicas: Sequence[ReplicaView], prompt: list[int], *, block_size: int,
           max_inflight: int, exclude: frozenset[str] = frozenset(), salt: str = "",
           prefer: str | None = None) -> Decision:
    """The replica for a new request (see the module doc); remembers the prompt's prefix
    blocks on the chosen one."""
    ready = [r for r in replicas if r.ready and r.id not in exclude]
    if not ready:
        raise NoReplica("no replica is ready" + (" (the one that failed is excluded)"
                                                 if exclude else ""))
    open_ = [r for r in ready if len(r.inflight) < max_inflight]
    if not open_:
        raise Overloaded(f"all {len(ready)} replicas hold {max_inflight} requests")
    pinned = [r for r in open_ if r.id == prefer]
    if pinned:
        return Decision(pinned[0], 0, f"branch of a sample on {prefer}")
    hashes = prefix_hashes(prompt, block_size, salt)

    def hit(r: ReplicaView) -> int:
        n = 0
        for h in hashes:
            if h not in r.prefixes:
                break
            n += 1
        return n * block_size

    scored = sorted(((r.pending_tokens + len(prompt) - hit(r), len(r.inflight), r.id), i)
                    for i, r in enumerate(open_))
    (cost, _, _), best_i = scored[0]
    best = open_[best_i]
    hit_tokens = hit(best)
    for h in hashes:
        best.prefixes[h] = None
        best.prefixes.move_to_end(h)
    while len(best.prefixes) > PREFIX_LRU_BLOCKS:
        best.prefixes.popitem(last=False)
    reason = f"least expected work ({cost} tokens, prefix hit {hit_tokens}) of {len(open_)}"
    return Decision(best, hit_tokens, reason)
