"""Batch-1 decode on the bundled model with ``weights: native``, ``int4`` and ``int8``, side by
side in one process: the three engines take turns, round after round, so this machine's drift
(15-25% between runs) falls on all of them alike.

    python bench/packed_weights.py [--dtype bfloat16] [--rounds 5] [--tokens 48] [--threads 2]

Prints each one's batch-1 decode ms/token per round, the medians and the ratios to native.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    from engine import Engine, EngineConfig, SamplingParams, load_model

    torch.set_num_threads(args.threads)
    prompt = list(range(100, 164))  # 64 tokens
    engines = {}
    for w in ("native", "int4", "int8"):
        engines[w] = Engine(load_model(None, args.dtype, weights=w),
                            EngineConfig(dtype=args.dtype, weights=w, kv_cache_mb=128))
        engines[w].generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))  # warm
    ms: dict[str, list[float]] = {w: [] for w in engines}
    for _ in range(args.rounds):
        for w, e in engines.items():
            (r,) = e.generate([prompt], SamplingParams(max_tokens=args.tokens, ignore_eos=True))
            ms[w].append((r.token_times_ns[-1] - r.token_times_ns[0]) / 1e6 / (args.tokens - 1))
    print(f"# packed_weights  dtype={args.dtype}  threads={args.threads}  batch-1 decode "
          f"ms/token, {args.rounds} interleaved rounds of {args.tokens} tokens")
    base = statistics.median(ms["native"])
    for w, v in ms.items():
        med = statistics.median(v)
        print(f"{w:<8} median {med:6.1f}  ({base / med:.2f}x native)   rounds: "
              + " ".join(f"{x:.1f}" for x in v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
