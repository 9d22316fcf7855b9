"""Decode on the bundled model with ``weights: native``, ``int4`` and ``int8`` (and, with
``+compile``, the same through ``torch.compile``d decode steps), side by side in one process:
the engines take turns, round after round, so this machine's drift (15-25% between runs)
falls on all of them alike.

    python bench/packed_weights.py [--dtype bfloat16] [--rounds 5] [--tokens 48] [--threads 2]
        [--engines native,int4,int8,int4+out=int4+compile] [--streams 1] [--prompt-tokens 64]

More: docs/benchmarks/methods.md#benchpacked_weights."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# a process that keeps a fraction of one core busy in bursts of 0.2 ms
BURN = """import sys, time
burst = 2e-4
rest = burst * (1 - float(sys.argv[1])) / float(sys.argv[1])
print(flush=True)
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < burst:
        pass
    time.sleep(rest)
"""


def neighbour(busy: float):
    """The ``BURN`` process, started and running (killed by the caller)."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", BURN, str(busy)], stdout=subprocess.PIPE)
    proc.stdout.readline()  # started
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="native,int4,int8")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--neighbour", type=float, default=0.0, metavar="F",
                    help="also measure each engine beside a process using F of one core")
    args = ap.parse_args()
    if not 0 <= args.neighbour < 1:
        ap.error("--neighbour: a fraction of one core, 0 <= F < 1")
    import torch

    from engine import Engine, EngineConfig, SamplingParams, load_model
    from engine.config import OUTPUT_FORMATS, WEIGHT_FORMATS
    from kernels import native

    torch.set_num_threads(args.threads)
    prompts = [list(range(100 + i, 100 + i + args.prompt_tokens)) for i in range(args.streams)]
    engines = {}
    for spec in args.engines.split(","):
        weights, *extras = spec.split("+")
        output = next((e.removeprefix("out=") for e in extras if e.startswith("out=")),
                      "native")
        compiled = "compile" in extras or "aot" in extras
        if weights not in WEIGHT_FORMATS or output not in OUTPUT_FORMATS \
                or any(e not in ("compile", "aot", "gather", "aten", "sdpa")
                       and not e.startswith("out=")
                       for e in extras) or ("gather" in extras and not compiled):
            ap.error(f"--engines: {spec!r} is not "
                     "WEIGHTS[+out=OUTPUT][+aten][+sdpa][+compile|+aot[+gather]]")
        t = time.perf_counter()
        switch = os.environ.get("TAILSCOPE_NATIVE_KERNELS")
        if "aten" in extras:  # read again with the switch off while this model is built
            os.environ["TAILSCOPE_NATIVE_KERNELS"] = "0"
            native.available.cache_clear()
        model = load_model(None, args.dtype, weights=weights, output_weights=output)
        if "aten" in extras:  # models built with ours keep using it
            os.environ.pop("TAILSCOPE_NATIVE_KERNELS")
            if switch is not None:
                os.environ["TAILSCOPE_NATIVE_KERNELS"] = switch
            native.available.cache_clear()
        model.direct_decode_attention = "gather" not in extras
        if "sdpa" in extras:
            model.native_decode_attention = False
        engines[spec] = Engine(model, EngineConfig(
            dtype=args.dtype, weights=weights, output_weights=output, kv_cache_mb=128,
            compile=compiled, compile_mode="aot" if "aot" in extras else "jit"))
        if compiled:
            print(f"{spec}: engine start {time.perf_counter() - t:.1f} s (compile "
                  f"{engines[spec].runner.compile_s:.1f} s)", flush=True)
        engines[spec].generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm
    runs = [(w, e, 0.0) for w, e in engines.items()]
    if args.neighbour:
        runs += [(f"{w} beside {args.neighbour:g}", e, args.neighbour) for w, e in engines.items()]
    ms: dict[str, list[float]] = {w: [] for w, _, _ in runs}
    tok_s: dict[str, list[float]] = {w: [] for w, _, _ in runs}
    for _ in range(args.rounds):
        for w, e, busy in runs:
            burner = neighbour(busy) if busy else None
            try:
                t = time.perf_counter()
                reqs = e.generate(prompts, SamplingParams(max_tokens=args.tokens,
                                                          ignore_eos=True))
                tok_s[w].append(len(reqs) * args.tokens / (time.perf_counter() - t))
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
            ms[w].append(statistics.median(
                (r.token_times_ns[-1] - r.token_times_ns[0]) / 1e6 / (args.tokens - 1)
                for r in reqs))
    print(f"# packed_weights  dtype={args.dtype}  threads={args.threads}  streams="
          f"{args.streams}  decode ms/token, {args.rounds} interleaved rounds of {args.tokens} "
          "tokens")
    first = next(iter(ms))
    base = statistics.median(ms[first])
    for w, v in ms.items():
        med = statistics.median(v)
        print(f"{w:<30} median {med:6.1f}  ({base / med:.2f}x {first})  "
              f"{statistics.median(tok_s[w]):6.1f} tok/s   rounds: "
              + " ".join(f"{x:.1f}" for x in v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
