"""Our 4-bit matmul (``kernels/csrc/q4_gemm.c``) against oneDNN's prepacked bf16 matmul of the
same values, side by side in one run, on one decoder layer's four matrices of the bundled model
(QKV 960x576, O 576x576, gate/up 3072x576, down 576x1536), at the row counts a step has: decode
batches (1-16 rows: the few-rows path, exact 4-bit values) and prefill chunks (32-512 rows: the
many-rows path, each tile dequantized to bf16 once). The bf16 column is what a model kept as a
dense bf16 copy for those steps before: the many-rows path is why it keeps none now. The int4a8
column is the same kernel with a step's inputs rounded to int8 per 32 below 32 rows
(``weights: int4a8``, ``int4_mm_a8``: AVX-512 VNNI, not exact); from 32 rows it is int4's.

    python bench/int4_matmul.py [--rows 1,8,16,32,64,128,256,512] [--rounds 5]

Each round times every row count for the three, alternating; the medians over rounds are
printed with their ratio (the VM's speed drifts between minutes here: only the ratio in one run
means anything).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): QKV, O, gate/up, down


def per_call_ms(fn, calls: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def main() -> int:
    from engine.quant import GROUP, quantize_int4
    from kernels import native
    from kernels.linear import Int4Linear, Linear

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16,32,64,128,256,512")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not native.available():
        print("our kernels are not built on this machine (TAILSCOPE_NATIVE_KERNELS, AVX-512 BF16 "
              "and a C/C++ compiler are needed): nothing to compare")
        return 0
    torch.manual_seed(0)
    layers = []
    for n, k in SHAPES:
        q = quantize_int4(torch.randn(n, k) * 0.02)
        values = q.dequantize().to(torch.bfloat16)
        packed = Int4Linear(q.codes, q.scale, q.zero, values, GROUP)
        a8 = Int4Linear(q.codes, q.scale, q.zero, values, GROUP, int8_inputs=True)
        assert packed.native and packed.dense is None and a8.int8_inputs
        layers.append((packed, Linear(values), a8))
    rows = [int(r) for r in args.rows.split(",")]
    xs = {m: [torch.randn(m, k).to(torch.bfloat16) for _, k in SHAPES] for m in rows}
    kinds = (("int4", 0), ("bf16", 1), ("int4a8", 2))
    times = {(m, which): [] for m in rows for which, _ in kinds}
    for _ in range(args.rounds):
        for m in rows:
            calls = max(3, 2048 // m)
            for which, i in kinds:
                fns = [(layer[i], x) for layer, x in zip(layers, xs[m], strict=True)]
                times[m, which].append(per_call_ms(lambda fns=fns: [f(x) for f, x in fns],
                                                   calls))
    print(f"one decoder layer's four matrices, {torch.get_num_threads()} threads, medians of "
          f"{args.rounds} rounds (ms a layer)")
    print(f"{'rows':>5} {'int4 (ours)':>12} {'bf16 prepacked':>15} {'ratio':>7} "
          f"{'int4a8':>8} {'int4a8/int4':>12}")
    for m in rows:
        a, b, c = (statistics.median(times[m, which]) for which, _ in kinds)
        print(f"{m:5d} {a:12.3f} {b:15.3f} {a / b:7.2f} {c:8.3f} {c / a:12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
