"""Our own 4-bit kernel (``kernels/csrc/q4_gemm.c`` through ``kernels.native``) against the
exact product of the dequantized weights, and its build and fallback rules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import native

ROOT = Path(__file__).resolve().parents[2]


def _weights(n: int, k: int, fp16_scales: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
    zero = torch.randn(n, k // 32, generator=g) * 0.01
    if fp16_scales:  # as GGUF's Q4_0 / Q4_1 store them
        scale, zero = scale.half().float(), zero.half().float()
    else:  # a value float16 cannot hold
        scale[0, 0] = 1.0 + 2 ** -20
    zero = zero + 8 * scale  # engine.quant's form: w = (code - 8) * scale + zero
    w = ((codes.float() - 8).view(n, k // 32, 32) * scale[..., None]
         + zero[..., None]).view(n, k)
    return codes, scale, zero, w


def test_the_kernel_is_built_on_a_cpu_and_toolchain_that_allow_it():
    """On this project's machines (AVX-512 BF16, a C compiler) the kernel must be there: a test
    that passed because everything silently fell back to torch's kernel would prove nothing."""
    ok, why = native.cpu_supported()
    if not ok or shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip(f"not this machine kind: {why or 'no C compiler'}")
    assert native.available()


needs_kernel = pytest.mark.skipif(not native.available(),
                                  reason="the native kernel is not available here")


@needs_kernel
@pytest.mark.parametrize("fp16_scales", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17])
def test_products_equal_the_dequantized_matrix_in_float32(rows, fp16_scales):
    n, k = 208, 320
    codes, scale, zero, w = _weights(n, k, fp16_scales, seed=rows)
    packed = native.pack_int4(codes, scale, zero, 32)
    assert packed is not None
    assert packed[1].dtype == (torch.float16 if fp16_scales else torch.float32)
    x = torch.randn(rows, k).to(torch.bfloat16)
    want = x.double() @ w.double().T
    got = native.int4_mm(x, *packed, n, torch.float32)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # float32 accumulation: ~1e-6 of the largest value (a bf16 weight copy would be ~4e-3)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    out16 = native.int4_mm(x, *packed, n, torch.bfloat16)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16, got.to(torch.bfloat16), atol=0, rtol=0)


@needs_kernel
def test_a_few_rows_step_gives_each_row_what_it_gives_it_alone():
    """Up to 31 rows the sums run in the same order at every step size: a row's outputs in a
    step of 31 are bitwise its outputs alone."""
    codes, scale, zero, _ = _weights(208, 320, True, seed=5)
    packed = native.pack_int4(codes, scale, zero, 32)
    x = torch.randn(31, 320, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    whole = native.int4_mm(x, *packed, 208, torch.float32)
    assert all(torch.equal(whole[i], native.int4_mm(x[i:i + 1], *packed, 208, torch.float32)[0])
               for i in range(31))


@needs_kernel
@pytest.mark.parametrize("fp16_scales", [True, False])
@pytest.mark.parametrize("rows", [32, 33, 47, 64, 130])
def test_many_rows_multiply_the_weights_rounded_to_bfloat16(rows, fp16_scales):
    """From 32 rows on, the kernel dequantizes each tile of 16 outputs to bfloat16 once and
    multiplies every row by it: the products of the weights rounded to bf16 (a dense bf16 copy's
    values), to float32's rounding, for full row blocks of 16 and tails of 1-15 rows, and not
    the exact weights' (which is what shows it is the other path)."""
    n, k = 208, 320
    codes, scale, zero, w = _weights(n, k, fp16_scales, seed=rows)
    packed = native.pack_int4(codes, scale, zero, 32)
    x = torch.randn(rows, k).to(torch.bfloat16)
    rounded = x.double() @ w.to(torch.bfloat16).double().T
    got = native.int4_mm(x, *packed, n, torch.float32)
    assert got.shape == (rows, n)
    err = (got.double() - rounded).abs().max()
    assert err <= 1e-5 * rounded.abs().max()
    exact = x.double() @ w.double().T
    assert (got.double() - exact).abs().max() > 10 * err
    out16 = native.int4_mm(x, *packed, n, torch.bfloat16)
    torch.testing.assert_close(out16, got.to(torch.bfloat16), atol=0, rtol=0)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` as int8 per group of 32 and back, in the kernel's float32 steps
    (``d = max |x| / 127``, ``q = round(x * (127 / max |x|))``, ties to even): the inputs
    ``int4_mm_a8`` multiplies."""
    # numpy's float32 operations, each rounded once (torch's vectorised ones can differ in the
    # last bit, which moves a value sitting on a .5 to the other integer)
    v = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(v).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)),
                   np.float32(0)).astype(np.float32)
    q = np.rint(v * inv)
    return torch.from_numpy(q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)
                            ).view(x.shape)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 31, 32, 40])
def test_int8_inputs_are_the_q8_0_rounding_of_the_rows(rows):
    """``int4_mm_a8`` (``weights: int4a8``): below 32 rows the inputs are rounded to int8 per
    group of 32 and multiplied by the exact 4-bit weights; each output within float32's rounding
    of that product (the group sums of the exact inputs carry the zeros), ~1% from the exact
    one; from 32 rows on the many-rows path, the same as ``int4_mm``."""
    n, k = 208, 320
    codes, scale, zero, w = _weights(n, k, True, seed=100 + rows)
    packed = native.pack_int4(codes, scale, zero, 32)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    x[0, :32] = 0  # a group of zeros: d = 0
    got = native.int4_mm_a8(x, *packed, n, torch.float32)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    if rows >= 32:
        assert torch.equal(got, native.int4_mm(x, *packed, n, torch.float32))
        return
    # S d sum(q c) + Z sum(x): w's zero part times the exact inputs, its code part the rounded
    z = (zero - 8 * scale).repeat_interleave(32, dim=1).double()  # the kernel's Z
    want = _q8_0(x) @ (w.double() - z).T + x.double() @ z.T
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    exact = x.double() @ w.double().T
    rel = ((got.double() - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.03  # rounded inputs: not the exact product, but near it
    out16 = native.int4_mm_a8(x, *packed, n, torch.bfloat16)
    torch.testing.assert_close(out16, got.to(torch.bfloat16), atol=0, rtol=0)


@needs_kernel
def test_the_operator_refuses_what_it_cannot_run():
    codes, scale, zero, _ = _weights(32, 64, True)
    packed = native.pack_int4(codes, scale, zero, 32)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.int4_mm(x.float(), *packed, 32, torch.float32)
    with pytest.raises(RuntimeError, match="does not hold"):
        native.int4_mm(torch.randn(2, 96).to(torch.bfloat16), *packed, 32, torch.float32)
    with pytest.raises(RuntimeError, match="groups"):
        native.int4_mm(x, packed[0], packed[1][:1], packed[2][:1], 32, torch.float32)
    with pytest.raises(RuntimeError, match="out_dtype"):
        native.int4_mm(x, *packed, 32, torch.float16)
    assert native.int4_mm(x[:0], *packed, 32, torch.float32).shape == (0, 32)


def test_shapes_the_kernel_cannot_run_are_left_to_torch():
    codes, scale, zero, _ = _weights(32, 64, True)
    assert native.pack_int4(codes[:24], scale[:24], zero[:24], 32) is None  # N % 16
    assert native.pack_int4(codes[:, :48], scale[:, :1], zero[:, :1], 48) is None  # group


def _probe(env: dict[str, str]) -> str:
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from kernels import native\nprint('LIB', native.available())")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env}).stdout


def test_off_switch_and_a_failing_compiler_fall_back_with_a_reason(tmp_path):
    if native.cpu_supported()[0]:  # built into an empty cache, and says so
        out = _probe({"TAILSCOPE_CACHE_DIR": str(tmp_path / "fresh")})
        assert "LIB True" in out and "native kernels loaded" in out
        assert len(list((tmp_path / "fresh" / "kernels").glob("tailscope_native-*.so"))) == 1
    out = _probe({"TAILSCOPE_NATIVE_KERNELS": "0", "TAILSCOPE_CACHE_DIR": str(tmp_path)})
    assert "LIB False" in out and "TAILSCOPE_NATIVE_KERNELS" in out
    if not native.cpu_supported()[0]:
        return
    out = _probe({"CC": "false", "TAILSCOPE_CACHE_DIR": str(tmp_path)})  # a compiler that fails
    assert "LIB False" in out and "not built" in out
    assert not any(p.suffix == ".so" for p in (tmp_path / "kernels").iterdir())  # nothing half-made
