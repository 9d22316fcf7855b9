"""``kernels.linear.Q8Output``: an output matrix kept as GGUF's Q8_0 blocks and multiplied as
stored by our kernel (``csrc/q8_gemm.c``), against float64 products of the dequantized values;
its tied embedding reads the same values a copy in the model's dtype holds; and the bundled
model in bfloat16 with ``output_weights: q8_0`` runs it for every step."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import load_model
from engine.quant import q8_0_from_gguf
from kernels import native
from kernels.linear import Q8Output

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built here")


def _matrix(rows: int, cols: int, seed: int = 0, raw: bool = False):
    """(the dequantized values, a bfloat16 ``Q8Output``), or with ``raw`` (codes, scales)."""
    w = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    blocks = gguf.quantize(w, Q.Q8_0)
    codes, scale = q8_0_from_gguf(blocks, Q.Q8_0, (rows, cols))
    if raw:
        return codes, scale
    values = torch.from_numpy(gguf.dequantize(blocks, Q.Q8_0).reshape(rows, cols))
    return values, Q8Output(codes, scale, torch.bfloat16)


@pytest.mark.parametrize("rows,cols", [(300, 128), (37, 32), (1000, 576)])
def test_every_logit_is_the_exact_product_summed_in_float32(rows, cols):
    """Every step size the kernel splits differently (1 row: four chains; 2-3: two; 4-8: one;
    more: blocks of 8), and a row count that is not a multiple of the kernel's 16-output tiles:
    float32 sums of exact products, within 1e-5 of the float64 result's scale, each output its
    own row's (no tile's padding leaks into a column)."""
    values, out = _matrix(rows, cols)
    for m in (1, 2, 3, 5, 8, 9, 20):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        got = out(x)
        want = x.double() @ values.double().T
        assert got.dtype == torch.float32 and got.shape == (m, rows)
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert out.numel == rows * cols and out.nbytes == rows * cols + rows * cols // 16


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it():
    """The same sums in the same order at every step size: a row's logits in a step of 20 are
    bitwise its logits alone (a seeded request's tokens do not hang on its neighbours here)."""
    _, out = _matrix(1000, 576)
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = out(x)
    assert all(torch.equal(whole[i], out(x[i:i + 1])[0]) for i in range(20))
    assert torch.equal(whole[8:13], out(x[8:13]))


def test_the_embedding_reads_the_dtypes_copy_of_each_row():
    values, out = _matrix(300, 128)
    emb = out.embedding()
    idx = torch.tensor([[3, 299, 0], [7, 7, 150]])
    assert torch.equal(emb[idx], values[idx].to(torch.bfloat16))
    assert emb[idx].shape == (2, 3, 128) and emb.numel() == 300 * 128


def test_a_shape_the_blocks_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="cols a multiple of 32"):
        Q8Output(torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 1), torch.bfloat16)
    _, out = _matrix(64, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.q8_mm(torch.zeros(1, 64), out.codes, out.scale, 64)
    with pytest.raises(RuntimeError, match="codes"):
        native.q8_mm(torch.zeros(1, 64, dtype=torch.bfloat16), out.codes, out.scale, 80)


def test_the_bundled_model_runs_its_output_matrix_as_stored(bundled_path):
    """bfloat16 with ``output_weights: q8_0``: the tied Q8_0 embedding is one ``Q8Output``
    for both ends (no bf16 copy; a step reads 1.06 bytes a weight of it, not 2), and its logits
    are the float32 model's (the same stored values) to float32 sums of bfloat16 inputs."""
    model = load_model(bundled_path, "bfloat16", weights="int4", output_weights="q8_0")
    exact = load_model(bundled_path, "float32")
    assert isinstance(model.lm_head, Q8Output) and model.embed.matrix is model.lm_head
    ids = torch.tensor([0, 1, 2, 500, 49151])
    assert torch.equal(model.embed[ids], exact.embed[ids].to(torch.bfloat16))
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got, want = model.lm_head(x), exact.lm_head(x.float())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    n = model.lm_head.numel
    assert model.weight_bytes == sum(
        m.nbytes for lw in model.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)
    ) + n + n // 16 + 2 * (model.num_parameters - n - sum(
        m.numel for lw in model.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)))


def test_a_model_stored_in_float_gets_its_output_matrix_quantized_per_block():
    """q8_0 on a model with no Q8_0 tensor (the tiny random one, untied): its output matrix
    quantized by GGUF's Q8_0 rule, logits within that rounding of the float model's; in
    float32 (no kernel for it) a dense copy of the same values, bit-equal to the kernel's up
    to float32 sums."""
    from engine.quant import quantize_q8_0

    q8 = load_model("tiny", "bfloat16", output_weights="q8_0")
    plain = load_model("tiny", "float32")
    f32 = load_model("tiny", "float32", output_weights="q8_0")
    assert isinstance(q8.lm_head, Q8Output) and not isinstance(f32.lm_head, Q8Output)
    codes, scale = quantize_q8_0(plain.lm_head.weight)
    assert torch.equal(q8.lm_head.codes, native.pack_q8(codes, scale)[0])
    x = torch.randn(3, plain.config.hidden_size, generator=torch.Generator().manual_seed(1))
    xb = x.to(torch.bfloat16)
    got, dense = q8.lm_head(xb), f32.lm_head(xb.float())
    assert (got - dense).abs().max() <= 1e-5 * dense.abs().max()
    want = plain.lm_head(xb.float())
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    with pytest.raises(ValueError, match="output_format must be one of"):
        load_model("tiny", output_weights="q4_0")
