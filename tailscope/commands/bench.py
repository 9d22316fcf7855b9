"""``tailscope bench``: the load generator."""

from __future__ import annotations

import argparse
import sys

from tailscope.commands.common import _parse_slo
from tailscope.settings import Settings


def cmd_bench(args: argparse.Namespace) -> int:
    """Load-test any OpenAI-compatible endpoint (bench/loadgen.py)."""
    from pathlib import Path

    from bench import loadgen as L

    slo = _parse_slo(args.slo)
    target = L.Target(args.url, model=args.model, api_key=args.api_key)
    keys = [k for k in (args.tenant_keys or "").split(",") if k]
    if keys and not L.open_run(target, Settings.from_env().admin_key or None):
        print("no bench-run token from the target (not a Tailscope gateway, or no admin key): "
              "requests of the first tenant only are tagged into the run", file=sys.stderr)

    def items_for(n: int, seed: int) -> list:
        if args.trace:
            return L.load_trace(args.trace)[:n]
        return L.workload(n, L.Dist.parse(args.prompt_len), L.Dist.parse(args.output_len),
                          seed=seed, shared_prefix=args.shared_prefix, api_keys=keys or None)

    if args.mode == "sweep":
        result = L.sweep(target, items_for, args.steps, seed=args.seed, slo=slo or None,
                         point_s=args.duration or 10.0)
    else:
        n = args.requests or (int(args.rate * args.duration) if args.rate and args.duration
                              else 100)
        result = L.run(target, args.mode, items_for(n + args.warmup, args.seed),
                       rate=args.rate, burstiness=args.burstiness,
                       concurrency=args.concurrency, seed=args.seed, warmup=args.warmup,
                       slo=slo or None)
    result["run_id"] = target.run_id
    print(L.summary_md(result))
    if not args.no_record:
        params = {k: v for k, v in vars(args).items() if k not in ("func", "api_key",
                                                                    "tenant_keys")}
        print(L.record_run(target, result, params, Settings.from_env().admin_key or None),
              file=sys.stderr)
    if args.out:
        for path in L.write_outputs(result, Path(args.out)):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="base URL, with or without /v1")
    b.add_argument("--api-key", help="Bearer key for the gateway (a tenant's)")
    b.add_argument("--model", default="SmolLM2-135M-Instruct", help="the model to ask")
    b.add_argument("--mode", choices=["serial", "burst", "rate", "sweep", "closed"],
                   default="rate", help="one at a time, all at once, an open-loop rate, a "
                   "sweep of rates, or a fixed number of streams")
    b.add_argument("--rate", type=float, help="requests/s (mode rate)")
    b.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier")
    b.add_argument("--concurrency", type=int, default=8, help="streams (mode closed)")
    b.add_argument("--requests", type=int, help="requests to send (default rate x duration)")
    b.add_argument("--duration", type=float,
                   help="seconds of schedule (mode rate; per rate in a sweep, default 10)")
    b.add_argument("--steps", type=int, default=5, help="rates in a sweep")
    b.add_argument("--prompt-len", default="lognormal:128:0.6",
                   help="fixed:N | uniform:A:B | lognormal:MEDIAN:SIGMA (tokens)")
    b.add_argument("--output-len", default="uniform:16:64",
                   help="max_tokens distribution, as --prompt-len")
    b.add_argument("--shared-prefix", type=float, default=0.0,
                   help="fraction of prompts starting with the same 64 tokens")
    b.add_argument("--tenant-keys", help="comma-separated API keys, used round-robin")
    b.add_argument("--trace", help="JSONL trace to replay (timestamp, prompt, max_tokens)")
    b.add_argument("--warmup", type=int, default=2, help="serial requests reported apart")
    b.add_argument("--slo", help="ttft_ms=N,tpot_ms=N: report attainment and goodput")
    b.add_argument("--out", help="directory for results.json, summary.md and plots")
    b.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    b.add_argument("--no-record", action="store_true",
                   help="do not store the run in the gateway's bench_runs table")
    b.set_defaults(func=cmd_bench)
