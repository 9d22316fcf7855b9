"""What-if and fleet sizing over recorded traffic (``tailscope whatif``, ``tailscope size``).

A ``Window`` is what a store holds of some minutes of a gateway's traffic: the requests (arrival
times, prompt token ids or counts, output counts, ``n``, tenants, priorities), the engine steps
of the replicas that served them, the step-cost model fitted on those steps
(``engine.whatif.StepCost``) and the config the replicas ran (the ``configs`` table).
``predict`` runs the window's arrivals through ``engine.whatif.simulate`` (the engine's own
scheduler and KV code on a virtual clock) with the gateway's own routing rule
(``gateway.router.choose``) choosing among simulated replicas, so a candidate config, policy,
replica count or arrival rate is scheduled as the deployed code would schedule it.

What the simulation times is the engine: from a sequence's arrival (at its recorded time, so
the wait for the step in progress is in it) to its tokens. What a client sees adds the
gateway's own share (parsing, tokenising, routing, the first flush); the window's median of it
(recorded client TTFT minus engine TTFT) is added to predicted TTFT and E2E so that an SLO is
checked on the client's figures; it is reported.

More: docs/design/gateway-notes.md#tailscopewhatif."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace

import pandas as pd

from bench.loadgen import percentile
from engine.config import EngineConfig
from engine.loader.tiny import TINY_CONFIG
from engine.whatif import (
    Arrival,
    SimReplica,
    SimRequest,
    StepCost,
    fit_contention,
    loop_times,
    overlaps,
    simulate,
)
from tracing import queries as Q
from tracing.timing import Slo

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms")
SEEN_MIN = 30  # recorded steps at or below and at or above a batch size that pin its cost
EXTRAPOLATED_WARN = 0.25  # the busy-time share past which the command warns
LABELS = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E",
          "queue_ms": "queue"}


# stands in for the model (the KV pool is pinned by the config): any token id and length the
# replicas took passes
STAND_IN = replace(TINY_CONFIG, vocab_size=2**31 - 1, max_position_embeddings=1 << 24,
                   name="whatif")


class WhatIfError(ValueError):
    """The window cannot be replayed (nothing recorded, too few steps): the message says why."""


def pct(values) -> dict[str, float]:
    """Nearest-rank p50/p90/p99 (``bench.loadgen.percentile``) of the values that exist."""
    xs = [float(v) for v in values if v is not None and v == v]  # not None, not NaN
    return {f"p{q}": percentile(xs, q) for q in (50, 90, 99)}


@dataclass
class Window:
    start_us: int
    end_us: int
    replicas: list[str]
    requests: pd.DataFrame | None  # None: a hand-built window (``of_arrivals``)
    cost: StepCost
    config_id: str
    config_known: bool  # the configs table had it (else: engine defaults)
    base: EngineConfig  # the recorded engine config, KV pinned to what the replicas had
    overhead_ms: float  # median client TTFT - engine TTFT: the gateway's share
    stand_ins: int = 0  # requests whose token ids were not kept (counts only)
    estimated: int = 0  # requests that timed out before a token: output length estimated
    # the recorded gateway's engine queue timeout (configs table; None: none, or not stored)
    queue_timeout_s: float | None = None
    arrivals: list[Arrival] = field(default_factory=list)
    step_rows: list[dict] = field(default_factory=list)  # what the cost was fitted on
    # how much replicas on one host slow each other's steps (engine.whatif.fit_contention):
    # fitted from a window of several replicas, else None (a window of one cannot show it);
    # ``tailscope whatif --contention`` sets it ("flag")
    contention: float | None = None
    contention_source: str = "none"

    @property
    def steps(self) -> int:
        return len(self.step_rows)

    @property
    def duration_s(self) -> float:
        return (self.end_us - self.start_us) / 1e6

    @property
    def rate_rps(self) -> float:
        """The recorded arrival rate: requests over the span from the first to the last."""
        t = [x / 1e6 for x in self.requests["arrival_us"]] if self.requests is not None else \
            sorted({a.at_ms / 1e3 for a in self.arrivals})
        span = max(t) - min(t) if len(t) > 1 else 0.0
        return (len(t) - 1) / span if span > 0 else float("nan")

    @classmethod
    def of_arrivals(cls, arrivals: list[Arrival], config: EngineConfig, cost: StepCost
                    ) -> Window:
        """A window with no records behind it (tests, benchmarks): these arrivals, this
        config, these step costs, no gateway share."""
        end = int(max(a.at_ms for a in arrivals) * 1000) + 1
        return cls(0, end, ["r0"], None, cost, "", False, config, 0.0, arrivals=arrivals)


def window_of_bench_run(source, run_id: str) -> tuple[int, int]:
    """The span of a ``tailscope bench`` run's requests (first arrival to last end)."""
    _, rows = source.select(Q.WHATIF_BENCH_RUN, {"b": run_id})
    if not rows or rows[0][0] is None or not rows[0][2]:
        raise WhatIfError(f"no requests of bench run {run_id!r} in the store")
    return int(rows[0][0]), int(rows[0][1]) + 1


def load(source, start_us: int, end_us: int, replica: str | None = None) -> Window:
    """The window's traffic: of ``replica``, else of every replica that served in it."""
    win = {"start": start_us, "end": end_us}
    if replica is None:
        found = Q.frame(source, Q.WHATIF_REPLICAS, win)
        if found.empty:
            raise WhatIfError("no requests with a replica in the window")
        replicas = [str(r) for r in found["replica"]]
    else:
        replicas = [replica]
    reqs = Q.frame(source, Q.WHATIF_REQUESTS, {**win, "rs": replicas})
    steps = Q.frame(source, Q.WHATIF_STEPS, {**win, "rs": replicas})
    if reqs.empty or steps.empty:
        raise WhatIfError(f"replica(s) {', '.join(replicas)} have no requests or no engine "
                          "steps in the window")
    busy = []  # loop times per replica: a step's start to the next one's when it followed
    for _, group in steps.groupby("replica", sort=True):
        busy += loop_times(group.to_dict("records"))
    contention = None
    try:
        if len(replicas) > 1:  # the cost of a step alone, then what company adds to it
            alone = [s for s, b in zip(busy, overlaps(busy), strict=True) if b == 0]
            cost = StepCost.fit(alone if len(alone) >= 20 else busy)
            contention = fit_contention(busy, cost)
        else:
            cost = StepCost.fit(busy)
    except ValueError as exc:  # too few steps: the window, not the command line, is at fault
        raise WhatIfError(str(exc)) from None
    config_id = str(reqs["config_id"].mode().iloc[0])
    _, rows = source.select(Q.CONFIG_OF, {"c": config_id})
    stored = json.loads(rows[0][1]) if rows else {}
    recorded = stored.get("engine", {})
    base = EngineConfig(**{**recorded, "num_kv_blocks": int(steps["kv_blocks_total"].max())})
    engine_ttft = reqs["engine_queue_ms"] + reqs["prefill_ms"]
    overhead = (reqs["ttft_ms"] - engine_ttft).dropna()
    w = Window(start_us, end_us, replicas, reqs, cost, config_id, bool(rows), base,
               float(overhead.median()) if len(overhead) else 0.0, step_rows=busy,
               queue_timeout_s=(stored.get("admission") or {}).get("queue_timeout_s"),
               contention=contention, contention_source="fitted" if contention is not None
               else "none")
    w.arrivals, w.stand_ins, w.estimated = _arrivals(reqs, start_us)
    return w


def _arrivals(reqs: pd.DataFrame, start_us: int) -> tuple[list[Arrival], int, int]:
    """One arrival per sequence (an ``n``-sample request is n sequences with its prompt), and
    how many requests had stand-in prompts and estimated lengths. A request that timed out
    before its first token (in the queue, or past its deadline) generated nothing, so how long
    it would have run is unknown: under another config it may be served, so it is an arrival
    with the median per-sequence output of the window's requests of its tenant that did
    generate (of all of them when its tenant has none), capped at its ``max_tokens``."""
    out, stand_ins, estimated = [], 0, 0
    ran = reqs[reqs["generated_tokens"] > 0]
    per_seq = ran["generated_tokens"] / ran["n"].clip(lower=1)
    typical = per_seq.groupby(ran["tenant"]).median().to_dict()
    overall = float(per_seq.median()) if len(per_seq) else 16.0
    for r in reqs.itertuples(index=False):
        ids = [int(x) for x in (r.input_token_ids if r.input_token_ids is not None else [])]
        if not ids:  # counts-only capture: distinct stand-in ids (no prefix-cache hits)
            stand_ins += 1
            ids = [1000 + (hash((r.trace_id, k)) % 40000) for k in range(int(r.prompt_tokens))]
        n = max(1, int(r.n))
        # its max_tokens (NULL in a record stored before the gateway kept it): the router
        # counts it as the request's work, and it caps an estimated length
        allowed = int(r.max_tokens) if r.max_tokens == r.max_tokens \
            and r.max_tokens is not None else None  # not NaN / NULL
        if int(r.generated_tokens) > 0:
            out_tokens = max(1, int(r.generated_tokens) // n)
        else:
            estimated += 1
            out_tokens = round(typical.get(r.tenant, overall))
            if allowed is not None:
                out_tokens = min(out_tokens, allowed)
            out_tokens = max(1, out_tokens)
        for c in range(n):
            out.append(Arrival(f"{r.trace_id}-{c}", (int(r.arrival_us) - start_us) / 1e3, ids,
                               out_tokens, tenant=str(r.tenant), priority=int(r.priority),
                               cache_salt=f"tenant:{r.tenant}", max_tokens=allowed))
    return out, stand_ins, estimated


def candidate(base: EngineConfig, engine_settings: dict | None = None,
              sets: list[str] | None = None, policy: str | None = None) -> EngineConfig:
    """``base`` with an engine config file's settings, then each ``NAME=VALUE``, then a
    policy; the KV pool stays the recorded one (it is the replicas' memory, not a setting a
    what-if changes by accident)."""
    from tailscope.settings import parse_env

    merged = {**base.as_dict(), **(engine_settings or {})}
    types = EngineConfig.setting_types()
    for item in sets or []:
        name, sep, raw = item.partition("=")
        if not sep or name not in types:
            raise ValueError(f"--set {item!r}: expected NAME=VALUE with an engine setting "
                             f"name ({', '.join(types)})")
        kind, optional, _ = types[name]
        merged[name] = parse_env(name, raw, kind, optional)
    if policy:
        merged["scheduling_policy"] = policy
    return replace(EngineConfig(**merged), num_kv_blocks=base.num_kv_blocks)


def changes(base: EngineConfig, cand: EngineConfig) -> dict:
    """The settings ``cand`` has that ``base`` has not."""
    b = base.as_dict()
    return {k: v for k, v in cand.as_dict().items() if b[k] != v}


def _route(config: EngineConfig, max_inflight: int | None):
    """The gateway's routing rule over simulated replicas (``None``: shed, as a 429)."""
    from gateway import router

    limit = max_inflight or 4 * config.max_num_seqs  # the gateway's default

    def route(reps: list[SimReplica], a: Arrival) -> SimReplica | None:
        try:
            return router.choose(reps, a.prompt_token_ids, block_size=config.block_size,
                                 max_inflight=limit, salt=a.cache_salt).replica
        except router.Overloaded:
            return None

    return route


def _attainment(good: int, n: int, duration_s: float) -> dict:
    """The share of requests within the SLO and such requests per second (as
    ``bench.loadgen.slo_stats`` has them for a load generator's samples)."""
    return {"attainment": good / n if n else float("nan"),
            "goodput_rps": good / duration_s if duration_s > 0 else float("nan")}


@dataclass
class Prediction:
    config: EngineConfig
    replicas: int
    rate_scale: float
    sims: list[SimRequest]
    preemptions: int
    steps: int
    overhead_ms: float
    duration_s: float
    # the share of the simulated busy time in steps of batch sizes the window had fewer than
    # SEEN_MIN steps of (their cost is the fit's extrapolation)
    extrapolated: float = 0.0

    def values(self, metric: str) -> list[float]:
        """Client-side TTFT and E2E (engine + the recorded gateway share); the rest as the
        engine has them."""
        add = self.overhead_ms if metric in ("ttft_ms", "e2e_ms") else 0.0
        if metric == "itl_ms":
            return [b - a for s in self.sims
                    for a, b in zip(s.token_ms, s.token_ms[1:], strict=False)]
        return [v + add for s in self.sims if (v := getattr(s, metric)) is not None]

    def table(self) -> dict[str, dict[str, float]]:
        return {m: pct(self.values(m)) for m in METRICS}

    def slo(self, slo: Slo) -> dict:
        good = sum(slo.met(s.state == "FINISHED",
                           None if s.ttft_ms is None else s.ttft_ms + self.overhead_ms,
                           s.tpot_ms) for s in self.sims)
        return _attainment(good, len(self.sims), self.duration_s)

    def summary(self, slo: Slo | None) -> dict:
        out = {"replicas": self.replicas, "rate_scale": self.rate_scale, "table": self.table(),
               "preemptions": self.preemptions, "steps": self.steps,
               "extrapolated": self.extrapolated,
               "shed": sum(s.state == "SHED" for s in self.sims),
               "timed_out": sum(s.state == "TIMED_OUT" for s in self.sims)}
        if slo is not None:
            out["slo"] = self.slo(slo)
        return out


def predict(w: Window, config: EngineConfig, replicas: int = 1, rate_scale: float = 1.0,
            max_inflight: int | None = None, queue_timeout_s: float | None = None
            ) -> Prediction:
    """The window's arrivals, ``rate_scale`` times as fast, through ``replicas`` simulated
    replicas of ``config`` behind the gateway's router; with ``queue_timeout_s`` (the
    gateway's ``TAILSCOPE_QUEUE_TIMEOUT_S``) a request still queued that long ends TIMED_OUT,
    on the virtual clock, as the engine ends it."""
    if not rate_scale > 0:
        raise ValueError("the rate scale must be > 0")
    arrivals = [replace(a, at_ms=a.at_ms / rate_scale, queue_timeout_s=queue_timeout_s)
                for a in w.arrivals]
    sims, reps = simulate(arrivals, config, w.cost, STAND_IN, replicas,
                          _route(config, max_inflight) if replicas > 1 else None,
                          w.contention or 0.0)
    return Prediction(config, replicas, rate_scale, sims,
                      sum(r.engine.preemptions for r in reps),
                      sum(len(r.runner.steps) for r in reps), w.overhead_ms,
                      w.duration_s / rate_scale, extrapolated(w, reps))


def extrapolated(w: Window, reps) -> float:
    """The share of the simulated replicas' busy time in steps of a batch size outside the
    range the window pins down: fewer than ``SEEN_MIN`` recorded steps at or below it, or at or
    above it (a linear cost is fitted between well-recorded sizes, not only at them: a size
    between two well-recorded ones is not extrapolated however few steps had exactly it).
    0 for a window without step rows."""
    sizes = sorted(int(s["num_seqs"]) for s in w.step_rows)
    if not sizes:
        return 0.0
    if len(sizes) < SEEN_MIN:
        lo, hi = math.inf, -math.inf  # nothing is pinned down
    else:
        lo, hi = sizes[SEEN_MIN - 1], sizes[-SEEN_MIN]
    total = outside = 0.0
    for r in reps:
        for members, ms in zip(r.runner.steps, r.runner.step_ms, strict=True):
            total += ms
            if not lo <= len(members) <= hi:
                outside += ms
    return outside / total if total > 0 else 0.0


def recorded(w: Window, slo: Slo | None) -> dict:
    """The window's own figures, as ``Prediction.summary`` has them: client TTFT and E2E
    (engine + gateway share, as recorded), the engine's TPOT, ITL and queue time."""
    r = w.requests
    itl = [float(x) for v in r["itl_ms"] if v is not None for x in v]
    table = {"ttft_ms": pct(r["ttft_ms"].tolist()), "tpot_ms": pct(r["tpot_ms"].tolist()),
             "itl_ms": pct(itl), "e2e_ms": pct(r["e2e_ms"].tolist()),
             "queue_ms": pct(r["engine_queue_ms"].tolist())}
    out = {"replicas": len(w.replicas), "rate_scale": 1.0, "table": table,
           "preemptions": int(r["preemptions"].sum()), "steps": w.steps, "shed": 0,
           "timed_out": int((r["final_state"] == "TIMED_OUT").sum())}
    if slo is not None:
        good = sum(slo.met(x.final_state == "FINISHED", x.ttft_ms,
                           None if x.tpot_ms != x.tpot_ms else x.tpot_ms)
                   for x in r.itertuples(index=False))
        out["slo"] = _attainment(good, len(r), w.duration_s)
    return out


def faster(w: Window, speed: float) -> Window:
    """``w`` with every step ``speed`` times as fast: replicas on other hardware, or with a
    faster dtype or kernel, which the window's own steps cannot show (measure the factor on
    both, e.g. with ``bench/engine_throughput.py``). Every term of the step cost scales alike:
    a change that speeds up the matmuls but not the per-step overhead is not modelled."""
    if not speed > 0:
        raise ValueError("--step-speed must be > 0")
    if speed == 1.0:
        return w
    return replace(w, cost=w.cost.scaled(speed))


def compare(w: Window, cand: EngineConfig, replicas: int | None = None,
            scales: list[float] | tuple[float, ...] = (1.0,), slo: Slo | None = None,
            max_inflight: int | None = None, queue_timeout_s: float | None = None,
            step_speed: float = 1.0) -> tuple[dict, dict]:
    """The recorded config (on the recorded replica count) and the candidate (on ``replicas``,
    default the same; its steps ``step_speed`` times as fast, ``faster``) at each rate scale,
    with the recorded figures at scale 1: (params, results) as ``whatif_runs`` keeps them."""
    n_rec = len(w.replicas)
    n_cand = replicas or n_rec
    changed = changes(w.base, cand)
    fast = faster(w, step_speed)
    points = []
    for scale in scales:
        point = {"rate_scale": scale, "offered_rps": w.rate_rps * scale,
                 "recorded_config": predict(w, w.base, n_rec, scale, max_inflight,
                                            queue_timeout_s).summary(slo),
                 "candidate": predict(fast, cand, n_cand, scale, max_inflight,
                                      queue_timeout_s).summary(slo)}
        if scale == 1.0 and w.requests is not None:
            point["recorded"] = recorded(w, slo)
        points.append(point)
    params = {"candidate_changes": changed, "replicas_recorded": n_rec,
              "replicas_candidate": n_cand, "rate_scales": list(scales),
              "slo": None if slo is None else {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
              "max_inflight": max_inflight, "queue_timeout_s": queue_timeout_s,
              "step_speed": step_speed}
    results = {"requests": len(w.requests) if w.requests is not None else len(w.arrivals),
               "sequences": len(w.arrivals),
               "recorded_rate_rps": w.rate_rps, "overhead_ms": w.overhead_ms,
               "config_known": w.config_known, "stand_in_prompts": w.stand_ins,
               "estimated_lengths": w.estimated,
               "contention": contention_of(w),
               "extrapolated_warn": EXTRAPOLATED_WARN,
               "steps": w.steps, "points": points}
    return params, results


def contention_of(w: Window) -> dict:
    """What the run assumed of replicas sharing a host, and where it came from."""
    return {"beta": w.contention or 0.0, "source": w.contention_source}


def capacity(w: Window, config: EngineConfig, slo: Slo, target: float = 0.99,
             max_inflight: int | None = None, iterations: int = 12) -> dict:
    """One replica's goodput c for this traffic: the highest arrival rate (the window's mix,
    scaled) whose predicted SLO attainment is at least ``target``, by bisection on the rate
    scale between a passing and a failing one."""
    def ok(scale: float) -> bool:
        return predict(w, config, 1, scale, max_inflight).slo(slo)["attainment"] >= target

    lo, hi = 0.0, 1.0
    while ok(hi):  # double until it fails (the window's own rate may be far below capacity)
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise WhatIfError("the SLO holds at 10000x the recorded rate: the step costs "
                              "cannot bound a capacity (is the SLO set?)")
    if lo == 0.0:
        lo = hi / 2
        while not ok(lo):
            hi, lo = lo, lo / 2
            if lo < 1e-4:
                raise WhatIfError(f"the SLO is missed (attainment < {target:.0%}) even with "
                                  "the arrivals spread 10000x: it is tighter than a lone "
                                  "request's latency")
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return {"rate_scale": lo, "goodput_rps": lo * w.rate_rps, "target_attainment": target}


def size(w: Window, config: EngineConfig, slo: Slo, peak_rate: float, utilisation: float = 0.8,
         target: float = 0.99, max_inflight: int | None = None) -> dict:
    """N = ceil(peak / (c * rho)), raised while the what-if of the window's traffic scaled to
    the peak on N replicas misses the target (replicas sharing a host slow each other: the
    window's ``contention``), and the what-if attainment at N - 1, N and N + 1."""
    if not peak_rate > 0:
        raise ValueError("--peak-rate must be > 0")
    if not 0 < utilisation <= 1:
        raise ValueError("--utilisation must be in (0, 1]")
    if not w.rate_rps > 0:
        raise WhatIfError("the window has too few requests to scale (need at least two)")
    cap = capacity(w, config, slo, target, max_inflight)
    formula = n = max(1, math.ceil(peak_rate / (cap["goodput_rps"] * utilisation)))
    scale = peak_rate / w.rate_rps
    while predict(w, config, n, scale, max_inflight).slo(slo)["attainment"] < target:
        n += 1
        if n > 4 * formula + 8:
            raise WhatIfError(f"{n} replicas still miss the SLO at {peak_rate:g} req/s in the "
                              "what-if: replicas on one host slow each other too much "
                              f"(contention {w.contention or 0.0:.2f}) for more of them to help")
    checks = []
    for k in sorted({max(1, n - 1), n, n + 1}):
        p = predict(w, config, k, scale, max_inflight)
        checks.append({"replicas": k, **p.slo(slo), "ttft_ms": pct(p.values("ttft_ms")),
                       "shed": sum(s.state == "SHED" for s in p.sims)})
    return {"replicas": n, "formula_replicas": formula, "contention": contention_of(w),
            "peak_rate_rps": peak_rate, "utilisation": utilisation,
            "per_replica_goodput_rps": cap["goodput_rps"], "target_attainment": target,
            "recorded_rate_rps": w.rate_rps, "rate_scale": scale, "checks": checks}


def store_run(target, kind: str, w: Window, params: dict, results: dict,
              admin_key: str | None = None) -> str:
    """Keep the run in ``whatif_runs`` (the step-cost model with it, so it can be redone):
    through the gateway that owns the store, or into the store itself. Returns its id."""
    run_id = uuid.uuid4().hex[:16]
    row = {"run_id": run_id, "kind": kind, "window_start_us": w.start_us,
           "window_end_us": w.end_us, "replicas": ",".join(w.replicas),
           "config_id": w.config_id, "params": params, "step_cost": w.cost.as_dict(),
           "results": results}
    if isinstance(target, str):  # a gateway's URL
        import httpx

        try:
            r = httpx.post(f"{target}/debug/whatif-runs", json=row, timeout=30, headers={
                "Authorization": f"Bearer {admin_key}"} if admin_key else {})
        except httpx.HTTPError as exc:
            raise WhatIfError(f"not stored in whatif_runs ({exc!r})") from None
        if r.status_code != 200:
            raise WhatIfError(f"not stored in whatif_runs (HTTP {r.status_code}: "
                              f"{r.text[:200]})")
    else:
        from tracing.schema import WhatIfRunRow

        target.insert_rows("whatif_runs", [WhatIfRunRow.from_body(row, int(time.time() * 1e6))])
    return run_id


def plot_frontier(points: list[dict], path, title: str) -> None:
    """Predicted TTFT p50/p99 against the offered rate, recorded config and candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, colour in (("recorded_config", "tab:blue"), ("candidate", "tab:orange")):
        x = [p["offered_rps"] for p in points]
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [p[key]["table"]["ttft_ms"][q] for p in points], style, color=colour,
                    label=f"{key.replace('_', ' ')} TTFT {q}")
    rec = [p for p in points if p["rate_scale"] == 1.0 and "recorded" in p]
    if rec:
        ax.plot([rec[0]["offered_rps"]] * 2, [rec[0]["recorded"]["table"]["ttft_ms"][q]
                                               for q in ("p50", "p99")], "k*", ms=10,
                label="recorded p50 / p99")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("predicted TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
