"""How fast the drill-down is on a busy day: every query-library function on a seeded chDB store.

    python bench/drilldown_queries.py [--records 1000000] [--quick]

Seeds ``--records`` synthetic request records (``tracing.seed``: lognormal stage times, 2-64
inter-token gaps each, 4 replicas, 2 tenants, a regression on r1 in the last hour) spread over
the last 24 hours, plus one engine step per replica every 50 ms over the last hour, each with
its members (4-16 requests' trace ids and their prefill/decode tokens), into a fresh embedded
store, and one request whose tokens came from 40 of those steps; then times each function of
``tracing.queries`` (best of 3 runs, after one warm-up) over the whole day, ``why`` on that
request and the window comparison by neighbour tenant included. Target from the issues: each
under one second. No pass/fail.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def seed(store, n: int) -> tuple[dt.datetime, dt.datetime, str]:
    from tracing.seed import synthetic_records, synthetic_steps

    end = dt.datetime.now(dt.UTC).replace(microsecond=0)
    start = end - dt.timedelta(hours=24)
    s_us, e_us = int(start.timestamp() * 1e6), int(end.timestamp() * 1e6)
    chunk = 100_000
    t0 = time.monotonic()
    first_trace = ""
    for i in range(0, n, chunk):
        k = min(chunk, n - i)
        a = s_us + (e_us - s_us) * i // n
        b = s_us + (e_us - s_us) * (i + k) // n
        recent = b > e_us - 3600 * 1_000_000
        recs = synthetic_records(k, a, b, seed=i, replicas=("r0", "r1", "r2", "r3"),
                                 slow_replica="r1" if recent else None, slow_fraction=0.05,
                                 slow_queue_ms=200.0)
        first_trace = first_trace or recs[0].trace_id
        store.insert_rows("requests", recs)
        print(f"  seeded {i + k:,} records ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    steps = synthetic_steps(e_us - 3600 * 1_000_000, e_us, replicas=("r0", "r1", "r2", "r3"),
                            every_ms=50)
    victim = synthetic_records(1, e_us - 1800 * 1_000_000, e_us, seed=7)[0]
    victim.replica, victim.token_steps = "r0", []
    rng = random.Random(1)
    pool = [f"{rng.getrandbits(128):032x}" for _ in range(5000)]  # neighbours' trace ids
    for s in steps:  # the step's members, their prefill chunks and decode tokens
        k = s.num_seqs
        s.member_traces = rng.sample(pool, k)
        s.member_prefill = [s.prefill_tokens if j == 0 else 0 for j in range(k)]
        s.member_decode = [0 if j == 0 and s.prefill_tokens else 1 for j in range(k)]
        if s.replica == "r0" and s.ts_us >= victim.arrival_ts_us and len(victim.token_steps) < 40:
            s.member_traces[-1], s.member_decode[-1] = victim.trace_id, 1
            victim.token_steps.append(s.step)
    victim.e2e_ms = max(victim.e2e_ms, 40 * 50 + 100)
    store.insert_rows("engine_steps", steps)
    store.insert_rows("requests", [victim])
    return start, end, first_trace, victim.trace_id


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--quick", action="store_true", help="100,000 records")
    args = ap.parse_args()
    n = 100_000 if args.quick else args.records

    from tracing import queries as Q
    from tracing.store import Store
    from tracing.why import why

    store = Store(f"chdb://{tempfile.mkdtemp(prefix='tailscope-drill-bench-')}/store")
    store.migrate()
    t0 = time.monotonic()
    start, end, trace_id, victim = seed(store, n)
    print(f"seeded {n:,} records in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    hour = end - dt.timedelta(hours=1)
    cases = {
        "percentiles e2e by replica, 5-min buckets":
            lambda: Q.percentiles(store, start, end, "e2e_ms", by="replica", bucket_s=300),
        "percentiles ttft by tenant":
            lambda: Q.percentiles(store, start, end, "ttft_ms", by="tenant"),
        "percentiles itl (array join)": lambda: Q.percentiles(store, start, end, "itl_ms"),
        "percentiles by prompt bucket":
            lambda: Q.percentiles(store, start, end, "ttft_ms", by="prompt_bucket"),
        "tail_breakdown e2e": lambda: Q.tail_breakdown(store, start, end, "e2e_ms"),
        "compare_windows ttft by replica (hour vs hour)":
            lambda: Q.compare_windows(store, (hour - dt.timedelta(hours=1), hour), (hour, end),
                                      "ttft_ms", by="replica"),
        "compare_windows e2e by tenant (day)":
            lambda: Q.compare_windows(store, (start, hour), (hour, end), "e2e_ms",
                                      by="tenant"),
        "slowest 50": lambda: Q.slowest(store, start, end, limit=50),
        "trace": lambda: Q.trace(store, trace_id),
        "why (40 tokens over 40 steps with members)": lambda: why(store, victim, top=5),
        "compare_windows e2e by neighbour_tenant (hour vs hour)":
            lambda: Q.compare_windows(store, (hour - dt.timedelta(hours=1), hour), (hour, end),
                                      "e2e_ms", by="neighbour_tenant"),
        "slo by replica": lambda: Q.slo(store, start, end, 500, 50, by="replica"),
        "rates, 5-min buckets": lambda: Q.rates(store, start, end, bucket_s=300),
        "by_finish_reason": lambda: Q.by_finish_reason(store, start, end, bucket_s=300),
    }
    print(f"\nquery library on {n:,} records over 24 h (best of 3, seconds)")
    worst = 0.0
    for name, fn in cases.items():
        fn()
        best = min(_timed(fn) for _ in range(3))
        worst = max(worst, best)
        print(f"  {best:7.3f}  {name}")
    print(f"\nslowest query: {worst:.3f} s (target: under 1 s each)")
    return 0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
