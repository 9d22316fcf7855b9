"""Engine throughput vs ``transformers.generate``, side by side in one run.

    python bench/engine_throughput.py [--dtype float32|bfloat16] [--weights native|int4|int8]
        [--output-weights native|int4|int8] [--compile] [--threads 2] [--quick]
        [--reference-dtype float32|bfloat16]
    python bench/engine_throughput.py --batch-invariant [--dtype ...]

With ``--batch-invariant`` the engine runs twice, with ``engine.batch_invariant`` off and on
(each in its own subprocess, same workload), and the table shows the mode's cost instead of
transformers.

Each side runs in its own subprocess (so peak memory is the engine's alone) on the bundled
SmolLM2-135M-Instruct, with identical prompts (random token ids, fixed seed) and
``ignore_eos`` / ``min_new_tokens`` so every request emits exactly its output length:

* batch 1: a 64-token prompt, 128 output tokens: tokens/s and decode ms/token;
* 8 concurrent streams of 128 tokens: aggregate output tokens/s;
* 32 requests with prompts of 16..512 tokens and 128 output tokens each, all submitted at
  once: output tokens/s (the engine batches continuously; transformers runs one static,
  left-padded batch);
* the memory-bandwidth floor for batch-1 decode: weight bytes / measured copy bandwidth;
* the engine process's peak RSS.

It prints the figures and their ratios; there are no pass/fail thresholds here.
llama.cpp is measured side by side, through both servers, by ``bench/vs_llamacpp.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def workload(quick: bool, seed: int = 1234) -> dict:
    import random

    rng = random.Random(seed)
    n_mixed = 8 if quick else 32
    out_len = 32 if quick else 128

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    return {
        "batch1": {"prompt": prompt(64), "max_tokens": out_len},
        "streams": [prompt(rng.randrange(32, 96)) for _ in range(8)],
        "streams_tokens": out_len,
        "mixed": [prompt(rng.randrange(16, 513)) for _ in range(n_mixed)],
        "mixed_tokens": out_len,
    }


def copy_bandwidth_gbs() -> float:
    import torch

    src = torch.ones(64 * 1024 * 1024)  # 256 MiB, far beyond the caches that matter
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best / 1e9  # read + write


def run_engine(w: dict, dtype: str, batch_invariant: bool = False, weights: str = "native",
               compile: bool = False, output_weights: str = "native") -> dict:
    from engine import Engine, EngineConfig, SamplingParams, load_model

    t0 = time.perf_counter()
    model = load_model(None, dtype, batch_invariant=batch_invariant, weights=weights,
                       output_weights=output_weights)
    engine = Engine(model, EngineConfig(dtype=dtype, max_num_seqs=64, max_batched_tokens=512,
                                        batch_invariant=batch_invariant, weights=weights,
                                        output_weights=output_weights, compile=compile))
    load_s = time.perf_counter() - t0

    def run(prompts: list[list[int]], n: int) -> tuple[float, list]:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        reqs = engine.generate(prompts, params)
        dt = time.perf_counter() - t
        assert all(len(r.output_token_ids) == n for r in reqs)
        return dt, reqs

    run([w["batch1"]["prompt"]], 8)  # warm-up, excluded
    n = w["batch1"]["max_tokens"]
    dt, (req,) = run([w["batch1"]["prompt"]], n)
    decode_ms = (req.token_times_ns[-1] - req.token_times_ns[0]) / 1e6 / (n - 1)
    dt8, _ = run(w["streams"], w["streams_tokens"])
    dtm, _ = run(w["mixed"], w["mixed_tokens"])
    return {
        "load_s": load_s,
        "compile_s": engine.runner.compile_s,
        "weight_bytes": model.weight_bytes,
        "batch1_tok_s": n / dt,
        "batch1_decode_ms": decode_ms,
        "streams8_tok_s": len(w["streams"]) * w["streams_tokens"] / dt8,
        "mixed_tok_s": len(w["mixed"]) * w["mixed_tokens"] / dtm,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "bandwidth_gbs": copy_bandwidth_gbs(),
    }


def run_transformers(w: dict, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine import default_model_path

    path = default_model_path()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t0

    def run(prompts: list[list[int]], n: int) -> float:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t
        assert out.shape[1] == width + n
        return dt

    run([w["batch1"]["prompt"]], 8)
    n = w["batch1"]["max_tokens"]
    dt = run([w["batch1"]["prompt"]], n)
    dt8 = run(w["streams"], w["streams_tokens"])
    dtm = run(w["mixed"], w["mixed_tokens"])
    return {
        "load_s": load_s,
        "batch1_tok_s": n / dt,
        "batch1_decode_ms": 1000 * dt / n,
        "streams8_tok_s": len(w["streams"]) * w["streams_tokens"] / dt8,
        "mixed_tok_s": len(w["mixed"]) * w["mixed_tokens"] / dtm,
    }


def _measures(quick: bool) -> list[tuple[str, str]]:
    """(label, result key) of each figure, in the order both reports print them."""
    return [("batch 1 output tok/s", "batch1_tok_s"),
            ("batch 1 decode ms/token", "batch1_decode_ms"),
            ("8 streams aggregate output tok/s", "streams8_tok_s"),
            (f"{8 if quick else 32} mixed requests output tok/s", "mixed_tok_s")]


def report_invariant(off: dict, on: dict, args: argparse.Namespace) -> None:
    print(f"# engine_throughput --batch-invariant  dtype={args.dtype}  threads={args.threads}"
          f"{'  (quick)' if args.quick else ''}")
    print(f"load: off {off['load_s']:.1f} s, on {on['load_s']:.1f} s (the probe of each weight "
          "shape included)")
    print(f"{'measure':<40}{'mode off':>12}{'mode on':>12}{'cost':>9}")
    for label, key in _measures(args.quick):
        # cost: how much more time the same work takes with the mode on
        cost = on[key] / off[key] - 1 if key.endswith("_ms") else off[key] / on[key] - 1
        print(f"{label:<40}{off[key]:12.1f}{on[key]:12.1f}{cost:+8.1%}")
    print(f"peak RSS: off {off['peak_rss_mb']:.0f} MB, on {on['peak_rss_mb']:.0f} MB")


def child(part: str, args: argparse.Namespace) -> dict:
    dtype = args.reference_dtype if part == "transformers" and args.reference_dtype \
        else args.dtype
    cmd = [sys.executable, __file__, "--part", part, "--dtype", dtype, "--weights",
           args.weights, "--output-weights", args.output_weights, "--threads",
           str(args.threads)] + (["--quick"] if args.quick else []) \
        + (["--compile"] if args.compile else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(e: dict, h: dict | None, args: argparse.Namespace) -> None:
    floor_ms = e["weight_bytes"] / (e["bandwidth_gbs"] * 1e9) * 1e3
    print(f"# engine_throughput  dtype={args.dtype}  weights={args.weights}  "
          f"output_weights={args.output_weights}  "
          f"threads={args.threads}{'  compile' if args.compile else ''}"
          f"{'  (quick)' if args.quick else ''}")
    print(f"weights {e['weight_bytes'] / 1e6:.0f} MB, copy bandwidth {e['bandwidth_gbs']:.1f} GB/s"
          f" -> batch-1 floor {floor_ms:.1f} ms/token")
    theirs_load = f", transformers {h['load_s']:.1f} s" if h else ""
    compiled = f" (of which compile {e['compile_s']:.1f} s)" if args.compile else ""
    print(f"load: engine {e['load_s']:.1f} s{compiled}{theirs_load}")
    ref = args.reference_dtype or args.dtype
    if h and ref != args.dtype:
        print(f"transformers runs in {ref}, the engine in {args.dtype}")
    print(f"{'measure':<40}{'engine':>12}{'transformers':>14}{'ratio':>8}")
    for label, key in _measures(args.quick):
        ratio = ""
        theirs = ""
        if h:
            theirs = f"{h[key]:14.1f}"
            r = h[key] / e[key] if key.endswith("_ms") else e[key] / h[key]
            ratio = f"{r:7.2f}x"
        print(f"{label:<40}{e[key]:12.1f}{theirs:>14}{ratio:>8}")
    print(f"batch-1 decode vs bandwidth floor: {e['batch1_decode_ms'] / floor_ms:.2f}x")
    print(f"engine peak RSS: {e['peak_rss_mb']:.0f} MB")


def main() -> None:
    from engine.config import OUTPUT_FORMATS, WEIGHT_FORMATS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--weights", default="native", choices=WEIGHT_FORMATS,
                   help="the engine's linear-layer weights (EngineConfig.weights); transformers "
                        "always runs the dequantized model in --dtype")
    p.add_argument("--output-weights", default="native", choices=OUTPUT_FORMATS,
                   help="the engine's output matrix (EngineConfig.output_weights)")
    p.add_argument("--compile", action="store_true",
                   help="the engine's decode steps through torch.compile (EngineConfig.compile)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="small workload (smoke run)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--reference-dtype", choices=["float32", "bfloat16"],
                   help="transformers' dtype (default: --dtype), e.g. the engine in bfloat16 "
                        "against transformers in float32")
    p.add_argument("--batch-invariant", action="store_true",
                   help="measure engine.batch_invariant's cost (mode off vs on) instead of "
                        "transformers")
    p.add_argument("--part", choices=["engine", "engine-bi", "transformers"],
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part:
        import torch

        torch.set_num_threads(args.threads)
        w = workload(args.quick)
        if args.part == "transformers":
            print(json.dumps(run_transformers(w, args.dtype)))
        else:
            print(json.dumps(run_engine(w, args.dtype, args.part == "engine-bi", args.weights,
                                        args.compile, args.output_weights)))
        return
    if args.batch_invariant:
        report_invariant(child("engine", args), child("engine-bi", args), args)
        return
    e = child("engine", args)
    h = None if args.skip_transformers else child("transformers", args)
    report(e, h, args)


if __name__ == "__main__":
    main()
