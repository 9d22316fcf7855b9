"""Our AVX2 kernels (``kernels/csrc/q4_gemm_avx2.c`` and ``q8_gemm_avx2.c``: float32
activations, for CPUs without AVX-512 BF16) against the exact products of the dequantized
weights, and a float32 model served on them. Run in a child process with
``TAILSCOPE_NATIVE_KERNELS=avx2`` (the AVX2 library alone), as on an AVX2 machine: this process
has the AVX-512 library loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import native

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, torch
from kernels import native
from kernels.linear import AVX2_MAX_ROWS, Int4Linear
from tests.kernels.test_native_int4 import _weights
out = {"avx512": native.available(), "avx2": native.avx2_available(), "err": {}}
for rows in (1, 3, 4, 5, 8, 9):
    for fp16 in (True, False):
        n, k = 208, 320
        codes, scale, zero, w = _weights(n, k, fp16, seed=rows)
        packed = native.pack_int4(codes, scale, zero, 32)
        x = torch.randn(rows, k)
        want = x.double() @ w.double().T
        got = native.int4_mm_f32(x, *packed, n)
        out["err"][f"{rows}-{fp16}"] = float((got.double() - want).abs().max()
                                             / want.abs().max())
# the Q8_0 output matrix on float32 inputs (csrc/q8_gemm_avx2.c): a row count that is not a
# multiple of its 16-output tiles, every step size; each row's logits as it gets them alone
from kernels.linear import Q8Output
from tests.kernels.test_q8_output import _matrix
values, _ = _matrix(1000, 576)
q8 = Q8Output(*_matrix(1000, 576, raw=True), torch.float32)
out["q8_err"], out["q8_alone"] = {}, []
for rows in (1, 2, 3, 8, 9):
    x = torch.randn(rows, 576)
    want = x.double() @ values.double().T
    got = q8(x)
    out["q8_err"][rows] = float((got.double() - want).abs().max() / want.abs().max())
    out["q8_alone"].append(all(torch.equal(got[i], q8(x[i:i + 1])[0]) for i in range(rows)))
# a float32 model on 4-bit weights: steps up to AVX2_MAX_ROWS rows on the kernel, larger ones
# on the dense copy of the same values; greedy tokens against the dense model's recompute
from engine import Engine, EngineConfig, SamplingParams, load_model
from tests.engine.helpers import reference_greedy
model = load_model("tiny", weights="int4")
lin = model.layers[0].qkv
out["layer"] = {"avx2": lin.avx2, "native": lin.native, "max_rows": lin.max_rows,
                "dense": lin.dense is not None, "AVX2_MAX_ROWS": AVX2_MAX_ROWS}
x = torch.randn(3, lin.shape[1])
out["layer_err"] = float((lin(x) - lin.dense(x)).abs().max())
prompts = [[5, 17, 300, 42, 9, 88, 123, 7], [3, 4, 5], [9, 9, 9, 1]]
engine = Engine(model, EngineConfig(weights="int4", num_kv_blocks=64, max_num_seqs=3))
reqs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
out["same"] = [r.output_token_ids == reference_greedy(model, p, 8)
               for r, p in zip(reqs, prompts)]
print("RESULT " + json.dumps(out))
"""


def _child() -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "TAILSCOPE_NATIVE_KERNELS": "avx2"})
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line[7:])


@pytest.mark.skipif(not native.cpu_supported(native.AVX2_CPU_FLAGS)[0],
                    reason="the CPU lacks AVX2, FMA or F16C")
def test_the_avx2_kernel_gives_the_dequantized_products_and_serves_a_float32_model():
    got = _child()
    assert got["avx512"] is False and got["avx2"] is True  # the switch selects it alone
    # exact products, float32 sums: within float32 rounding of the float64 reference
    assert max(got["err"].values()) < 1e-5, got["err"]
    assert got["layer"] == {"avx2": True, "native": False, "max_rows": got["layer"][
        "AVX2_MAX_ROWS"], "dense": True, "AVX2_MAX_ROWS": got["layer"]["AVX2_MAX_ROWS"]}
    assert got["layer_err"] < 1e-4
    assert got["same"] == [True, True, True]
    assert max(got["q8_err"].values()) < 1e-5, got["q8_err"]
    assert all(got["q8_alone"])


def test_with_the_avx512_library_the_avx2_one_stays_unloaded():
    """One 4-bit kernel per process: where the AVX-512 library runs, it takes every step."""
    if native.available():
        assert native.avx2_available() is False
