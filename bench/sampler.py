"""Sampler time per tick as a share of one decode step, measured side by side in one run.

    python bench/sampler.py [--dtype float32|bfloat16] [--threads 2]

A batch of 32 requests on the bundled model's vocabulary (49,152): the sampler alone on
logits of that shape, greedy and with the full pipeline (repetition/frequency/presence
penalties over 64 prompt + 100 output tokens, temperature, top-k, top-p, min-p), compared with
the median wall time of a batch-32 decode step of the engine measured in the same process.
Prints figures and shares; no thresholds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.request import Request
from engine.sampler import Sampler

BATCH = 32


def median_ms(fn, logits: torch.Tensor, repeat: int = 30) -> float:
    """Median time of ``fn(fresh_logits)``; the copies are made outside the timed region (the
    engine hands the sampler fresh logits every tick, which it may modify in place)."""
    copies = [logits.clone() for _ in range(repeat + 1)]
    fn(copies.pop())
    times = []
    for x in copies:
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def decode_step_ms(dtype: str) -> float:
    rng = random.Random(0)
    engine = Engine(load_model(None, dtype), EngineConfig(dtype=dtype, max_batched_tokens=4096))
    for i in range(BATCH):
        engine.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(64)],
                           SamplingParams(max_tokens=64, ignore_eos=True))
    engine.step()  # the whole batch prefills in one tick (64 x 32 < 4096 tokens)
    steps = []
    for _ in range(20):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    assert engine.observer.steps[-1].decode_tokens == BATCH
    return statistics.median(steps) * 1e3


def requests(params: SamplingParams) -> list[Request]:
    rng = random.Random(1)
    out = []
    for i in range(BATCH):
        r = Request(f"s{i}", [rng.randrange(49152) for _ in range(64)], params)
        r.output_token_ids = [rng.randrange(49152) for _ in range(100)]
        out.append(r)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    step = decode_step_ms(args.dtype)
    logits = torch.randn(BATCH, 49152) * 3
    full = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                          repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2,
                          seed=0)
    cases = {
        "greedy": SamplingParams(),
        "temperature only": SamplingParams(temperature=0.8, seed=0),
        "full pipeline": full,
    }
    print(f"# sampler  batch={BATCH}  vocab=49152  dtype={args.dtype}  threads={args.threads}")
    print(f"decode step (batch {BATCH}, engine, median): {step:.1f} ms")
    for name, params in cases.items():
        sampler, reqs = Sampler(), requests(params)
        ms = median_ms(lambda x, s=sampler, r=reqs: s.sample(x, r), logits)
        print(f"{name:<20} {ms:8.2f} ms/tick   {100 * ms / step:5.1f}% of a decode step")


if __name__ == "__main__":
    main()
