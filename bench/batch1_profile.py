"""Where a batch-1 decode step of the ``fast`` profile goes, against the memory-bandwidth floor.

    python bench/batch1_profile.py [--tokens 128] [--threads 2] [--gb-s 35]

One engine on the bundled model with the settings ``fast`` chooses on this CPU (its compiled
step built first, or loaded from the cache), one request decoding ``--tokens`` greedy tokens
after an 8-token prompt (its prefill a small share of the time), under ``torch.profiler``.
Printed per token: the wall time, the time in each of our kernels (the 4-bit matmuls, the
output matrix, decode attention, the argmax) with the bytes of weights each reads and the
bandwidth that makes, and the rest (the compiled step's fused loops: norms, RoPE, residuals,
activations; the engine's Python around a step); then the floor (the weights a step reads,
``LlamaModel.weight_bytes``, at ``--gb-s``) and the step's ratio to it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# our kernels' operator names, and what they are
KERNELS = {"tailscope_native::int4_mm": "4-bit matmuls (decoder layers)",
           "tailscope_native::q8_mm": "output matrix (Q8_0)",
           "tailscope_native::paged_decode_attention": "decode attention",
           "tailscope_native::argmax": "argmax (greedy)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gb-s", type=float, default=35.0,
                    help="the machine's read bandwidth with --threads threads")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import Engine, EngineConfig, SamplingParams, load_configured
    from kernels.linear import Int4Linear

    torch.set_num_threads(args.threads)
    config = EngineConfig(profile="fast", kv_cache_mb=64, max_num_seqs=8)
    print(f"fast here: dtype {config.dtype}, weights {config.weights}, output_weights "
          f"{config.output_weights}, compile {config.compile} ({config.compile_mode})",
          flush=True)
    model = load_configured("bundled", config)
    engine = Engine(model, config)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompt = list(range(100, 108))
    engine.generate([prompt], params)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        out = engine.generate([prompt], params)
        wall = time.perf_counter() - t0
    assert len(out[0].output_token_ids) == args.tokens
    n = args.tokens
    totals = {name: 0.0 for name in KERNELS}
    calls = {name: 0 for name in KERNELS}
    for e in prof.key_averages():
        if e.key in totals:
            totals[e.key] += e.cpu_time_total / 1e3  # ms
            calls[e.key] += e.count
    per_token = wall * 1e3 / n
    packed = sum(m.nbytes for lw in model.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)
                 if isinstance(m, Int4Linear))
    head = getattr(model.lm_head, "nbytes", 0)
    reads = {"tailscope_native::int4_mm": packed, "tailscope_native::q8_mm": head}
    print(f"\none request, {n} tokens after a {len(prompt)}-token prompt: {per_token:.2f} ms a "
          "token (prefill included once)")
    kernel_ms = 0.0
    for name, label in KERNELS.items():
        ms = totals[name] / n
        kernel_ms += ms
        extra = ""
        if reads.get(name):
            extra = f", {reads[name] / 1e6:.1f} MB at {reads[name] / (ms * 1e6):.1f} GB/s" \
                if ms else ""
        print(f"  {label:<34} {ms:6.2f} ms  ({calls[name] / n:.0f} calls{extra})")
    print(f"  {'the rest (fused loops, Python)':<34} {per_token - kernel_ms:6.2f} ms")
    floor = model.weight_bytes / (args.gb_s * 1e9) * 1e3
    print(f"floor: {model.weight_bytes / 1e6:.1f} MB a token at {args.gb_s:g} GB/s = "
          f"{floor:.2f} ms; this step {per_token / floor:.2f}x it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
