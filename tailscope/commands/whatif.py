"""``tailscope whatif`` and ``tailscope size``: recorded traffic through the engine's own
scheduler under another config, and the replicas a peak rate needs."""

from __future__ import annotations

import argparse
import json
import sys
import time

from tailscope.commands.common import (
    _iso,
    _parse_slo,
    _store_target,
)
from tailscope.settings import Settings


def _window(spec: str | None) -> tuple[int, int]:
    """``FROM..TO`` (ISO 8601 times, UTC unless they say otherwise, or unix seconds) as µs;
    none: the last hour."""
    import datetime as dt

    def at(x: str) -> int:
        x = x.strip()
        try:
            return int(float(x) * 1e6)
        except ValueError:
            t = dt.datetime.fromisoformat(x)
            return int((t if t.tzinfo else t.replace(tzinfo=dt.UTC)).timestamp() * 1e6)

    if not spec:
        now = int(time.time() * 1e6)
        return now - 3_600_000_000, now
    start, sep, end = spec.partition("..")
    if not sep:
        raise ValueError(f"--window {spec!r}: expected FROM..TO")
    a, b = at(start), at(end)
    if b <= a:
        raise ValueError(f"--window {spec!r}: TO must be after FROM")
    return a, b




def _whatif_window(args: argparse.Namespace, s: Settings):
    """(store target, the ``tailscope.whatif.Window`` of ``--window`` / ``--bench-run``, the
    candidate: the recorded config with ``--engine-config``, ``--set`` and ``--policy``)."""
    from tailscope import engine_config as ECF
    from tailscope import whatif as W
    from tracing import queries as Q

    if not args.step_speed > 0:  # before the store is read
        raise ValueError("--step-speed must be > 0")
    kind, target = _store_target(args, s)
    source = Q.GatewaySource(target, s.admin_key or None) if kind == "gateway" else target
    if args.bench_run:
        if args.window:
            raise ValueError("give --window or --bench-run, not both")
        start, end = W.window_of_bench_run(source, args.bench_run)
    else:
        start, end = _window(args.window)
    w = W.load(source, start, end, args.replica)
    if args.contention is not None:
        if not args.contention >= 0:
            raise ValueError("--contention must be >= 0")
        w.contention, w.contention_source = args.contention, "flag"
    cand = W.candidate(w.base, ECF.load(args.engine_config).engine if args.engine_config
                       else None, args.set, args.policy)
    return target, w, cand


def _offsets(offsets) -> str:
    """``{1: -0.3, 2: 2.2}`` as ``1 (-0.3 ms), 2 (+2.2 ms)``."""
    return ", ".join(f"{k} ({v:+.1f} ms)" for k, v in sorted(offsets.items()))


def _print_window(w) -> None:
    e = w.cost.error
    print(f"window {_iso(w.start_us)}..{_iso(w.end_us)}: replica(s) {', '.join(w.replicas)}, "
          f"{len(w.requests)} requests ({len(w.arrivals)} sequences) at {w.rate_rps:.2f} req/s, "
          f"{w.steps} steps; config {w.config_id}"
          + ("" if w.config_known else " (not in the configs table: engine defaults)"))
    print("step cost (ms) = " + " + ".join(f"{c:.4g}*{f}" for c, f in
                                          zip(w.cost.coef, w.cost.as_dict()["features"],
                                              strict=True))
          + (f", + an offset for steps of {_offsets(w.cost.offsets)} tokens"
             if w.cost.offsets else "")
          + f"; held-out error median {e.median_rel:.1%}, p95 {e.p95_rel:.1%} "
          f"({e.n_test} steps; a constant cost per step: median {e.baseline_median_rel:.1%})")
    print(f"gateway share of TTFT (recorded median): {w.overhead_ms:.1f} ms, added to the "
          "predicted TTFT and E2E")
    if w.contention_source != "none":
        print(f"replicas on one host: a step beside b others mid-step costs "
              f"1 + {w.contention:.3f}*b times its model cost ({w.contention_source})")
    elif len(w.replicas) == 1:
        print("replicas on one host: not measured (a window of one replica cannot show how "
              "replicas slow each other; --contention BETA, e.g. from a window of several)")
    if w.stand_ins:
        print(f"note: {w.stand_ins} requests kept counts, not token ids: stand-in prompts, no "
              "prefix-cache hits for them")
    if w.estimated:
        print(f"note: {w.estimated} requests timed out before their first token: their output "
              "lengths are estimated (their tenant's median, capped at their max_tokens)")


def _print_columns(title: str, cols: dict[str, dict | None]) -> None:
    """One row per metric (each cell p50/p90/p99 ms), then preemptions, shed, timed out and
    the SLO."""
    from tailscope.whatif import LABELS, METRICS

    names = list(cols)
    print(f"{title:<14}" + "".join(f"{n:>28}" for n in names))
    for m in METRICS:
        cells = ("/".join(f"{c['table'][m][q]:.0f}" for q in ("p50", "p90", "p99"))
                 if c else "" for c in cols.values())
        print(f"{LABELS[m]:<14}" + "".join(f"{x:>28}" for x in cells))
    for key in ("preemptions", "shed", "timed_out"):
        print(f"{key:<14}" + "".join(f"{c.get(key, '') if c else '':>28}"
                                     for c in cols.values()))
    print(f"{'extrapolated':<14}" + "".join(  # tailscope.whatif.extrapolated
        f"{c['extrapolated']:.0%}".rjust(28) if c and "extrapolated" in c else f"{'':>28}"
        for c in cols.values()))
    if any(c and "slo" in c for c in cols.values()):
        print(f"{'SLO met':<14}" + "".join(
            f"{c['slo']['attainment']:.1%} ({c['slo']['goodput_rps']:.2f}/s)".rjust(28)
            if c else f"{'':>28}" for c in cols.values()))


def _warn_extrapolated(points: list[dict]) -> None:
    """A warning for each prediction that spends much of its time in step shapes the window
    barely recorded (``tailscope.whatif.extrapolated``)."""
    from tailscope.whatif import EXTRAPOLATED_WARN, SEEN_MIN

    for p in points:
        for key in ("recorded_config", "candidate"):
            share = p[key].get("extrapolated", 0.0)
            if share > EXTRAPOLATED_WARN:
                print(f"warning: {share:.0%} of the {key.replace('_', ' ')}'s predicted busy "
                      f"time (x{p['rate_scale']:g}) is in steps of batch sizes outside the "
                      f"range the window pins down (fewer than {SEEN_MIN} recorded steps at or "
                      "below, or at or above, the size): their cost is extrapolated; a window "
                      "with stretches at those batch sizes pins it down",
                      file=sys.stderr)


def _keep_run(args: argparse.Namespace, s: Settings, target, kind: str, w, params: dict,
              results: dict) -> str | None:
    """The run's id in ``whatif_runs`` (None with ``--no-store``, or when storing failed:
    then a warning says why and the figures are printed all the same)."""
    from tailscope import whatif as W

    if args.no_store:
        return None
    try:
        return W.store_run(target, kind, w, params, results, s.admin_key or None)
    except (W.WhatIfError, OSError) as exc:
        print(f"warning: {exc}", file=sys.stderr)
        return None


def cmd_whatif(args: argparse.Namespace) -> int:
    """Recorded traffic through the engine's own scheduler on a virtual clock
    (tailscope.whatif), under its recorded config and a candidate, side by side."""
    from tailscope import whatif as W
    from tracing.timing import Slo

    s = Settings.from_env()
    try:
        scales = [float(x) for x in args.rate_scale.split(",") if x.strip()]
        if not scales or not all(x > 0 for x in scales):
            raise ValueError("--rate-scale: positive numbers, comma-separated")
        slo = Slo(**_parse_slo(args.slo)) if args.slo else None
        if args.replicas is not None and args.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        target, w, cand = _whatif_window(args, s)
    except W.WhatIfError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # the recorded gateway's queue timeout unless --queue-timeout says otherwise (0: none)
    queue_timeout = (args.queue_timeout if args.queue_timeout is not None
                     else w.queue_timeout_s) or None
    params, results = W.compare(w, cand, args.replicas, scales, slo, args.max_inflight,
                                queue_timeout, args.step_speed)
    changed, points = params["candidate_changes"], results["points"]
    n_rec, n_cand = params["replicas_recorded"], params["replicas_candidate"]
    stored = _keep_run(args, s, target, "whatif", w, params, results)
    if args.plot:
        W.plot_frontier(points, args.plot, f"what-if: {changed or 'recorded config'}, "
                        f"{n_cand} replica(s)")
    _warn_extrapolated(points)
    if args.json:
        print(json.dumps({"run_id": stored, "replicas": w.replicas, "window_us":
                          [w.start_us, w.end_us], "config_id": w.config_id,
                          "step_cost": w.cost.as_dict(), **params, **results},
                         indent=2, default=float))
        return 0
    _print_window(w)
    print(f"candidate: {changed or 'the recorded config'}"
          + (f"; replicas {n_rec} -> {n_cand}" if n_cand != n_rec else "")
          + (f"; steps {args.step_speed:g}x as fast" if args.step_speed != 1.0 else "")
          + f"; engine queue timeout {f'{queue_timeout:g} s' if queue_timeout else 'none'}"
          + (" (the recorded gateway's)" if args.queue_timeout is None and queue_timeout
             else ""))
    for p in points:
        title = "ms" if p["rate_scale"] == 1.0 else \
            f"x{p['rate_scale']:g} ({p['offered_rps']:.2f}/s)"
        print()
        _print_columns(title, {"recorded": p.get("recorded"),
                               "predicted (recorded cfg)": p["recorded_config"],
                               "predicted (candidate)": p["candidate"]})
    print("\n(each cell p50/p90/p99 ms; TTFT and E2E as the client sees them, the rest the "
          "engine's; 'queue' runs from arrival to the first step that ran the request; "
          "'extrapolated': the share of busy time in step batch sizes beyond the window's)")
    if args.plot:
        print(f"frontier plot: {args.plot}")
    if stored:
        print(f"stored in whatif_runs as {stored}")
    return 0


def cmd_size(args: argparse.Namespace) -> int:
    """Replicas for a peak rate: N = ceil(peak / (c * rho)) from one replica's predicted goodput
    c on the window's traffic, confirmed by what-if runs at N - 1, N and N + 1."""
    from tailscope import whatif as W
    from tracing.timing import Slo

    s = Settings.from_env()
    try:
        slo = _parse_slo(args.slo)
        if not slo:
            raise ValueError("--slo is required: ttft_ms=N,tpot_ms=N")
        target, w, cand = _whatif_window(args, s)
        out = W.size(W.faster(w, args.step_speed), cand, Slo(**slo), args.peak_rate,
                     args.utilisation, args.attainment, args.max_inflight)
    except W.WhatIfError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    changed = W.changes(w.base, cand)
    params = {"slo": slo, "peak_rate_rps": args.peak_rate, "utilisation": args.utilisation,
              "target_attainment": args.attainment, "candidate_changes": changed,
              "max_inflight": args.max_inflight, "step_speed": args.step_speed}
    stored = _keep_run(args, s, target, "size", w, params, out)
    if args.json:
        print(json.dumps({"run_id": stored, "step_speed": args.step_speed, **out}, indent=2,
                         default=float))
        return 0
    _print_window(w)
    c = out["per_replica_goodput_rps"]
    print(f"per-replica goodput c = {c:.2f} req/s (the highest rate of this traffic at which "
          f"one replica{' of the candidate' if changed else ''}"
          + (f" with steps {args.step_speed:g}x as fast" if args.step_speed != 1.0 else "")
          + " meets the SLO for "
          f"{args.attainment:.0%} of requests, by what-if)")
    print(f"N = ceil({args.peak_rate:g} / ({c:.2f} x {args.utilisation:g})) = "
          f"{out['formula_replicas']} replicas"
          + ("" if out["replicas"] == out["formula_replicas"] else
             f"; raised to {out['replicas']}, the fewest whose what-if meets the SLO "
             "(replicas on one host slow each other)"))
    print(f"confirmed with the window scaled to {args.peak_rate:g} req/s "
          f"(x{out['rate_scale']:.2f}):")
    for chk in out["checks"]:
        mark = "  <- N" if chk["replicas"] == out["replicas"] else ""
        print(f"  {chk['replicas']} replica(s): SLO met {chk['attainment']:.1%}, goodput "
              f"{chk['goodput_rps']:.2f}/s, TTFT p99 {chk['ttft_ms']['p99']:.0f} ms, "
              f"shed {chk['shed']}{mark}")
    if stored:
        print(f"stored in whatif_runs as {stored}")
    return 0


def add_parser(sub) -> None:
    def window_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--window", metavar="FROM..TO", help="ISO 8601 times (UTC) or unix "
                       "seconds (default: the last hour)")
        p.add_argument("--bench-run", metavar="ID", help="the window of a 'tailscope bench' run")
        p.add_argument("--replica", help="only this replica's traffic (default: every "
                       "replica's in the window)")
        p.add_argument("--engine-config", metavar="FILE", help="the candidate's engine settings")
        p.add_argument("--set", action="append", metavar="NAME=VALUE",
                       help="a candidate engine setting (repeatable), e.g. max_num_seqs=32")
        p.add_argument("--policy", help="the candidate's scheduling_policy")
        p.add_argument("--max-inflight", type=int, help="the gateway's per-replica load "
                       "shedding limit (default 4 x max_num_seqs, the gateway's)")
        p.add_argument("--url", help="a gateway to read through (default: the running one, if "
                       "any)")
        p.add_argument("--dsn", help="store DSN (default TAILSCOPE_STORE_DSN)")
        p.add_argument("--no-store", action="store_true", help="do not keep the run in "
                       "whatif_runs")
        p.add_argument("--contention", type=float, metavar="BETA", help="replicas on one "
                       "host: a step that starts while b others are mid-step costs 1 + BETA*b "
                       "times its model cost (default: fitted from the window when it has "
                       "several replicas, else 0; 0 for replicas on separate hosts)")
        p.add_argument("--step-speed", type=float, default=1.0, metavar="X",
                       help="the candidate's engine steps X times as fast as the window's: "
                       "other hardware, a faster dtype or kernel (measure X on both, e.g. with "
                       "bench/engine_throughput.py); default 1")
        p.add_argument("--json", action="store_true", help="the figures as JSON")

    wi = sub.add_parser("whatif", help="recorded traffic through the engine's own scheduler and "
                        "the gateway's router on a virtual clock: the recorded config and a "
                        "candidate")
    window_args(wi)
    wi.add_argument("--replicas", type=int, help="the candidate's replica count (default: as "
                    "recorded)")
    wi.add_argument("--queue-timeout", type=float, metavar="S",
                    help="end a request still queued after S seconds (TIMED_OUT), as the "
                         "gateway's TAILSCOPE_QUEUE_TIMEOUT_S does (default: the recorded "
                         "gateway's, from the configs table; 0: no limit)")
    wi.add_argument("--rate-scale", default="1", metavar="X[,X...]",
                    help="arrivals this many times as fast; several: a sweep (see --plot)")
    wi.add_argument("--slo", metavar="ttft_ms=N,tpot_ms=N", help="also report SLO attainment "
                    "and goodput")
    wi.add_argument("--plot", metavar="PNG", help="write the TTFT frontier over the rate scales")
    wi.set_defaults(func=cmd_whatif)
    sz = sub.add_parser("size", help="replicas for a peak rate under an SLO, from one replica's "
                        "goodput on recorded traffic, confirmed by what-if runs")
    window_args(sz)
    sz.add_argument("--slo", required=True, metavar="ttft_ms=N,tpot_ms=N",
                    help="the latency targets a request must meet")
    sz.add_argument("--peak-rate", type=float, required=True, metavar="REQ/S",
                    help="the arrival rate to size for")
    sz.add_argument("--utilisation", type=float, default=0.8, metavar="RHO",
                    help="the share of a replica's goodput to plan for (default 0.8)")
    sz.add_argument("--attainment", type=float, default=0.99,
                    help="the share of requests that must meet the SLO (default 0.99)")
    sz.set_defaults(func=cmd_size)
