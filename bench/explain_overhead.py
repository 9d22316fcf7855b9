"""What explaining the tail costs the engine: step membership and wait causes on vs off.

    python bench/explain_overhead.py [--model bundled] [--dtype auto|bfloat16|float32]
                                     [--requests 48] [--rounds 3] [--quick]

One process, one set of weights, the same workload run alternately with the engine setting
``step_detail`` on and off (after one warm-up run; best of ``--rounds`` each, to damp drift on
a shared machine): ``--requests`` requests with prompts of 32-256 tokens and 32 output tokens
each, all queued at once, ``max_num_seqs`` 16 and ``max_batched_tokens`` 256, so most ticks
carry a batch of members and a queue of waiting requests that get wait notes. Prints output
tokens/s of each and the loss in percent (the issue's target: under 2%). ``--quick`` runs the
tiny random model (the worst case: the cheapest steps). Because the difference is small
against this machine's run-to-run noise, the time spent noting waits is also measured directly
(the scheduler's ``_note_waits`` timed inside the "on" runs) as a share of the run. No
pass/fail.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


NOTE_S = [0.0]  # time inside Scheduler._note_waits


def _timed_notes() -> None:
    from engine.scheduler import Scheduler

    inner = Scheduler._note_waits

    def timed(self, head, out):
        t = time.perf_counter()
        inner(self, head, out)
        NOTE_S[0] += time.perf_counter() - t

    Scheduler._note_waits = timed


def run(model, config, prompts: list[list[int]], out: int) -> float:
    from engine import Engine, SamplingParams

    engine = Engine(model, config)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=out, ignore_eos=True))
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return len(prompts) * out / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto: bfloat16 where the "
                    "CPU has native bf16 matmuls, else float32)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 rounds")
    args = ap.parse_args()

    from engine import EngineConfig, load_model
    from engine.loader.paths import resolve_model_path

    name = "tiny:49152" if args.quick else args.model
    model = load_model(name if name.startswith("tiny") else resolve_model_path(name),
                       dtype=args.dtype)
    rounds = 2 if args.quick else args.rounds
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(32, 256))]
               for _ in range(args.requests)]

    def config(on: bool) -> EngineConfig:
        return EngineConfig(dtype=args.dtype, max_num_seqs=16, max_batched_tokens=256,
                            prefix_caching=False, step_detail=on)

    run(model, config(True), prompts[:8], 4)  # warm-up
    _timed_notes()
    got: dict[bool, list[float]] = {True: [], False: []}
    on_s = 0.0
    for _ in range(rounds):
        for on in (True, False):
            t = time.perf_counter()
            got[on].append(run(model, config(on), prompts, args.output_tokens))
            on_s += (time.perf_counter() - t) if on else 0.0
    on, off = max(got[True]), max(got[False])
    print(f"{name} ({args.dtype}), {args.requests} requests x {args.output_tokens} tokens, "
          f"best of {rounds} alternating runs")
    print(f"  step detail on : {on:8.1f} output tok/s")
    print(f"  step detail off: {off:8.1f} output tok/s")
    print(f"  loss with membership and wait causes: {100 * (1 - on / off):+.2f}% "
          "(target: under 2%)")
    print(f"  time noting waits: {100 * NOTE_S[0] / on_s:.3f}% of the 'on' runs "
          f"({NOTE_S[0] * 1e3:.1f} ms of {on_s:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
