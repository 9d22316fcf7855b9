"""``kernels.linear.Int8Rows``: a matrix kept as GGUF's Q8_0 blocks, read a row at a time (a
tied embedding's lookups and the rescoring of a packed output matrix's top logits), with the
values a copy in the model's dtype holds; its rescoring kernel (``csrc/q8_rows.c``) against
float64 sums of those values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.quant import q8_0_from_gguf
from kernels import native
from kernels.linear import Int8Rows

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels not built here")


def _rows(rows: int = 300, cols: int = 128, seed: int = 0) -> tuple[np.ndarray, Int8Rows]:
    w = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    codes, scale = q8_0_from_gguf(gguf.quantize(w, Q.Q8_0), Q.Q8_0, (rows, cols))
    return gguf.dequantize(gguf.quantize(w, Q.Q8_0), Q.Q8_0).reshape(rows, cols), \
        Int8Rows(codes, scale, torch.bfloat16)


def test_q8_0_blocks_are_kept_as_stored_and_read_as_the_dequantized_values():
    """Codes and float16 scales from a GGUF tensor's raw blocks: scale * code is exactly what
    gguf dequantizes, and a row read (any index shape) is that value cast to the dtype, as a
    copy in that dtype holds it."""
    want, rows = _rows()
    assert rows.codes.dtype == torch.int8 and rows.scale.dtype == torch.float16
    exact = (rows.codes.view(300, 4, 32).float() * rows.scale.float()[..., None]).view(300, 128)
    assert torch.equal(exact, torch.from_numpy(want))
    idx = torch.tensor([[3, 299, 0], [7, 7, 150]])
    assert torch.equal(rows[idx], torch.from_numpy(want)[idx].to(torch.bfloat16))
    assert rows[idx].shape == (2, 3, 128)
    assert torch.equal(rows.dequantize(chunk=64), torch.from_numpy(want).to(torch.bfloat16))
    f32 = Int8Rows(rows.codes, rows.scale, torch.float32)
    assert torch.equal(f32.dequantize(), torch.from_numpy(want))
    assert rows.numel() == 300 * 128 and rows.row_bytes == 128 + 8
    assert q8_0_from_gguf(gguf.quantize(want, Q.F16), Q.F16, (300, 128)) is None


def test_int8_rows_refuses_a_shape_it_cannot_hold():
    with pytest.raises(ValueError, match="cols a multiple of 32"):
        Int8Rows(torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="scale"):
        Int8Rows(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3), torch.bfloat16)


@pytest.mark.parametrize("use_native", [True, False])
def test_rows_dot_is_the_bf16_copys_product(use_native):
    """``rows_dot``: each row's chosen rows times the row, the products of the bfloat16 values.
    Our kernel sums them in float32 (within 1e-5 of the float64 sums' scale); the fallback is a
    bf16 bmm (its result rounded to bfloat16)."""
    if use_native and not native.available():
        pytest.skip("native kernels not built here")
    want, rows = _rows(rows=500, cols=576)
    rows.native = use_native
    w = torch.from_numpy(want).to(torch.bfloat16).double()
    for b in (1, 3, 8, 33):
        x = torch.randn(b, 576, generator=torch.Generator().manual_seed(b)).to(torch.bfloat16)
        idx = torch.randint(0, 500, (b, 64), generator=torch.Generator().manual_seed(b + 1))
        got = rows.rows_dot(idx, x)
        ref = torch.einsum("bkh,bh->bk", w[idx], x.double())
        assert got.dtype == torch.float32 and got.shape == (b, 64)
        tol = 1e-5 if use_native else 8e-3  # float32 sums / one bfloat16 rounding
        assert (got.double() - ref).abs().max() <= tol * ref.abs().max()


@needs_native
def test_rows_dot_refuses_an_index_outside_the_matrix():
    _, rows = _rows()
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    for bad in (300, -1):
        with pytest.raises(RuntimeError, match="a row index outside 0 .. 299"):
            native.q8_rows_dot(x, rows.codes, rows.scale, torch.tensor([[0, bad]]))
