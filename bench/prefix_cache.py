"""Prefix caching on vs off, side by side in one run, on the engine with the bundled model.

Workloads (the same seeded prompts for both settings):

- ``shared50``: every prompt is one shared system prompt (``--prefix-len`` tokens) followed by
  as many tokens of its own: half of each prompt is a shared prefix. Sent open loop at
  ``--rate`` requests/s (below saturation, so TTFT is mostly prefill): TTFT (from the scheduled
  arrival to the first sampled token) p50/p90 per setting, and the ratio. Target: median TTFT
  at least 2x lower with caching on.
- ``unique``: no two prompts share a block; all sent at once: throughput (prompt + generated
  tokens per second) per setting. Target: no loss with caching on (hashing and lookups are the
  only extra work).

Settings alternate run by run (``--rounds``) so machine noise hits both alike.

    python bench/prefix_cache.py [--requests 16] [--prefix-len 256] [--rate 0.5] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineConfig, SamplingParams, default_model_path, load_model  # noqa: E402


def prompts(kind: str, n: int, prefix_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(100, 40000) for _ in range(prefix_len)]
    out = []
    for _ in range(n):
        own = [rng.randrange(100, 40000) for _ in range(prefix_len)]
        if kind == "shared50":
            out.append(system + own)
        else:
            out.append([rng.randrange(100, 40000) for _ in range(prefix_len)] + own)
    return out


def run(model, caching: bool, batch: list[list[int]], rate: float | None,
        max_tokens: int) -> dict:
    engine = Engine(model, EngineConfig(prefix_caching=caching, max_num_seqs=32,
                                        max_batched_tokens=512, kv_cache_mb=256))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.monotonic_ns()
    due = [start + int(i / rate * 1e9) if rate else start for i in range(len(batch))]
    reqs, i = [], 0
    while i < len(batch) or engine.has_unfinished():
        now = time.monotonic_ns()
        while i < len(batch) and due[i] <= now:
            reqs.append(engine.add_request(f"q{i}", batch[i], params, arrival_ns=due[i]))
            i += 1
        if engine.has_unfinished():
            engine.step()
        elif i < len(batch):
            time.sleep(max(0.0, (due[i] - now) / 1e9))
    wall = (time.monotonic_ns() - start) / 1e9
    ttft = [(r.token_times_ns[0] - r.arrival_ns) / 1e6 for r in reqs]
    tokens = sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in reqs)
    cached = sum(r.num_cached_tokens for r in reqs)
    return {"ttft": ttft, "tokens_per_s": tokens / wall, "wall_s": wall,
            "cached_share": cached / sum(len(r.prompt_token_ids) for r in reqs)}


def q(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="8 requests, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rounds = 8, 1
    model = load_model(default_model_path(), "float32")
    run(model, True, prompts("unique", 2, 64, 99), None, 2)  # warm-up
    results: dict[tuple[str, bool], list[dict]] = {}
    for r in range(args.rounds):
        for kind, rate in (("shared50", args.rate), ("unique", None)):
            batch = prompts(kind, args.requests, args.prefix_len, seed=r)
            for caching in ((True, False) if r % 2 == 0 else (False, True)):
                results.setdefault((kind, caching), []).append(
                    run(model, caching, batch, rate, args.max_tokens))
    print(f"bundled model, {args.requests} requests x {args.rounds} rounds, prefix "
          f"{args.prefix_len} tokens, {args.max_tokens} output tokens\n")
    print("| workload | caching | TTFT p50 ms | TTFT p90 ms | tokens/s | prompt share cached |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for (kind, caching), runs in sorted(results.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        ttft = [t for x in runs for t in x["ttft"]]
        tps = statistics.mean(x["tokens_per_s"] for x in runs)
        share = statistics.mean(x["cached_share"] for x in runs)
        summary[(kind, caching)] = (q(ttft, 0.5), tps)
        print(f"| {kind} | {'on' if caching else 'off'} | {q(ttft, 0.5):.0f} | "
              f"{q(ttft, 0.9):.0f} | {tps:.0f} | {share:.0%} |")
    on, off = summary[("shared50", True)], summary[("shared50", False)]
    uon, uoff = summary[("unique", True)], summary[("unique", False)]
    print(f"\nshared50: median TTFT off/on = {off[0] / on[0]:.2f}x (target >= 2x: "
          f"{'met' if off[0] / on[0] >= 2 else 'NOT met'})")
    print(f"unique: throughput on/off = {uon[1] / uoff[1]:.3f} (target >= ~1: "
          f"{'met' if uon[1] / uoff[1] >= 0.97 else 'NOT met'}; within 3% counts as noise)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
