"""Torch threads of a gateway's local replicas: the default (``engine.cpus.replica_threads``)
against other thread counts, served through the gateway side by side.

    python bench/replica_threads.py [--model tiny|bundled] [--replicas 2] [--threads all,1]
                                    [--rounds 4] [--seconds 8] [--concurrency 16] [--quick]

One gateway per setting, all started first (store off: this measures serving), each with
``--replicas`` local replicas, unpinned; ``--threads`` names the settings besides the default:
a number (``TAILSCOPE_THREADS``) or ``all`` (every usable core for each replica, what torch's
default gave every replica before the gateway shared the cores out). The gateways take the same
closed-loop load (bench/loadgen.py, ``--concurrency`` streams of 16 output tokens) one at a
time, ``--rounds`` rounds in alternating order, so the machine's drift falls on all of them.
Prints each round's requests/s, the medians, and each setting's ratio to the default round by
round. No pass/fail here; docs/benchmarks/serving.md quotes a run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def settings(spec: str) -> dict[str, dict[str, str]]:
    """The environments to compare: the default first, then each of ``spec``'s."""
    from engine.cpus import usable_cores

    out: dict[str, dict[str, str]] = {"default": {}}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        n = usable_cores() if item == "all" else int(item) if item.isdigit() else 0
        if n < 1:
            raise SystemExit(f"--threads: {item!r} is not a thread count or 'all'")
        out[f"{n} thread{'s' if n > 1 else ''} each" + (" (all cores)" if item == "all" else "")
            ] = {"TAILSCOPE_THREADS": str(n)}
    return out


def main() -> int:
    from bench.trace_overhead import MODELS, closed_loop, model_args
    from engine.cpus import replica_threads, usable_cores
    from tracing.client import GatewayProcess

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="tiny")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", default="all,1")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 3 s")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seconds = 2, 3.0
    envs = settings(args.threads)
    serve_args = model_args(args.model) + ["--replicas", str(args.replicas)]
    print(f"{args.model} model, {args.replicas} local replicas, {usable_cores()} usable cores; "
          f"the default gives each {replica_threads(None, args.replicas) or 'torch default'} "
          "thread(s)", flush=True)
    gateways: dict[str, GatewayProcess] = {}
    rps: dict[str, list[float]] = {name: [] for name in envs}
    try:
        for name, env in envs.items():
            gateways[name] = GatewayProcess(serve_args, cwd=ROOT, quiet=True,
                                            ready_timeout_s=600, env={
                                                "TAILSCOPE_KV_CACHE_MB": "64",
                                                "TAILSCOPE_STORE_DSN": "none", **env}).start()
        for gw in gateways.values():
            closed_loop(gw.url, 2.0, args.concurrency, args.model)  # warm-up
        for r in range(args.rounds):
            order = list(envs) if r % 2 == 0 else list(envs)[::-1]
            for name in order:
                got, _, _ = closed_loop(gateways[name].url, args.seconds, args.concurrency,
                                        args.model)
                rps[name].append(got)
                print(f"round {r + 1}: {name:28} {got:7.1f} req/s", flush=True)
    finally:
        for gw in gateways.values():
            gw.stop()
    print()
    for name, values in rps.items():
        line = f"{name:28} median {statistics.median(values):7.1f} req/s"
        if name != "default":
            ratios = [v / d for v, d in zip(values, rps["default"], strict=True)]
            line += (f"   against the default, round by round: "
                     f"{' '.join(f'{x:.2f}x' for x in ratios)}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
