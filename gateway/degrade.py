"""Degraded admission (docs/concepts/scheduling.md): under load, a tenant that allows it is admitted
DEGRADED, with stated reductions, instead of being queued behind everyone or refused.

Configured in the gateway's TOML file (``--config``) next to the tenants::

    [degraded_admission]
    queue_depth = 16      # requests waiting in the engines (all replicas together) ...
    kv_fraction = 0.9     # ... or this share of all replicas' KV blocks in use: under load

    [[tenants]]
    name = "batch"
    degrade = { max_tokens = 64, n = 1, priority = 2 }

Under load (either threshold reached, read from the replicas' latest step reports), a request
of a tenant with a ``degrade`` rule gets: ``max_tokens`` capped, ``n`` capped, and its priority
raised by ``priority`` levels (a lower-priority lane; only under the engine's ``priority``
scheduling policy, the others have no lanes). A request the rule does not reduce (it already
asks for less) is admitted as it is. The response carries ``X-Tailscope-Degraded`` (what
changed, and the load that decided it), the engine's timeline has the DEGRADED state (after
QUEUED) with the same text, and the record has ``lane = 'degraded'`` and ``degraded``. Tenants
without a rule are queued or refused as they would be without this section. Backends that
report no queue or KV (external OpenAI-compatible servers) are never under load here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from engine.sampling_params import PRIORITY_MAX, SamplingParams


@dataclass(frozen=True, slots=True)
class DegradeRule:
    """What a tenant's requests give up under load (None / 0: that part is kept)."""

    max_tokens: int | None = None
    n: int | None = None
    priority: int = 0  # levels added under the priority policy

    @classmethod
    def parse(cls, raw: Mapping, where: str) -> DegradeRule:
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{where}: degrade has unknown fields {sorted(unknown)}; it takes "
                             "max_tokens, n, priority")
        rule = cls(**raw)
        for name in ("max_tokens", "n"):
            v = getattr(rule, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{where}: degrade.{name} must be an integer >= 1, got {v!r}")
        if not isinstance(rule.priority, int) or not 0 <= rule.priority <= PRIORITY_MAX:
            raise ValueError(f"{where}: degrade.priority must be an integer in "
                             f"[0, {PRIORITY_MAX}], got {rule.priority!r}")
        return rule

    def apply(self, params: SamplingParams, n: int, lanes: bool, why: str = ""
              ) -> tuple[SamplingParams, int, str]:
        """The reduced parameters and ``n``, and what changed and why ("" when nothing did);
        ``lanes``: the engine runs the priority policy; ``why``: the load that decided it."""
        changes, update = [], {}
        if self.max_tokens is not None and params.max_tokens > self.max_tokens:
            changes.append(f"max_tokens {params.max_tokens}->{self.max_tokens}")
            update["max_tokens"] = self.max_tokens
            if params.min_tokens > self.max_tokens:  # min_tokens <= max_tokens holds
                changes.append(f"min_tokens {params.min_tokens}->{self.max_tokens}")
                update["min_tokens"] = self.max_tokens
        if self.n is not None and n > self.n:
            changes.append(f"n {n}->{self.n}")
            n = self.n
        if lanes and self.priority:
            new = min(PRIORITY_MAX, params.priority + self.priority)
            if new != params.priority:
                changes.append(f"priority {params.priority}->{new}")
                update["priority"] = new
        if not changes:
            return params, n, ""
        what = "; ".join(changes) + (f" ({why})" if why else "")
        return dataclasses.replace(params, degraded=what, **update), n, what


@dataclass(frozen=True, slots=True)
class LoadThresholds:
    """When the engines count as under load (None: that measure is not used)."""

    queue_depth: int | None = None
    kv_fraction: float | None = None

    @classmethod
    def parse(cls, raw: Mapping, where: str) -> LoadThresholds:
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{where}: [degraded_admission] has unknown fields "
                             f"{sorted(unknown)}; it takes queue_depth, kv_fraction")
        t = cls(**raw)
        if t.queue_depth is not None and (not isinstance(t.queue_depth, int)
                                          or t.queue_depth < 1):
            raise ValueError(f"{where}: queue_depth must be an integer >= 1")
        if t.kv_fraction is not None and not 0 < t.kv_fraction <= 1:
            raise ValueError(f"{where}: kv_fraction must be in (0, 1]")
        return t

    def pressure(self, replicas: Mapping[str, Mapping]) -> str:
        """Why the engines are under load ("" when they are not), from each replica's
        ``Backend.describe()`` entry (its latest step report)."""
        waiting = sum(int(d.get("waiting", 0)) for d in replicas.values())
        used = sum(int(d.get("kv_blocks_used", 0)) for d in replicas.values())
        total = sum(int(d.get("kv_blocks_total", 0)) for d in replicas.values())
        if self.queue_depth is not None and waiting >= self.queue_depth:
            return f"{waiting} requests waiting, queue_depth {self.queue_depth}"
        if self.kv_fraction is not None and total and used / total >= self.kv_fraction:
            return f"{used} of {total} KV blocks in use, kv_fraction {self.kv_fraction:g}"
        return ""
