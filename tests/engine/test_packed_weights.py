"""``weights: int4`` / ``int8``: GGUF's 4-bit blocks kept as codes, scales and zeros (no float on
the way), float weights quantized per group of 32 (int4) or per row (int8), and the model on
torch's packed kernels for small steps and a dense copy of the same values for large ones."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.quant import GROUP, from_gguf, quantize_int4, quantize_int8
from kernels import native
from kernels.linear import (
    NATIVE_MAX_ROWS,
    PACKED_MAX_ROWS,
    Int4Linear,
    Int8Linear,
    Linear,
    RescoredOutput,
)
from tests.engine.helpers import reference_greedy
from tests.engine.test_loaders import write_tiny_gguf

# Steps of up to PACKED_MAX_ROWS rows run the int4 kernel on bfloat16 activations, so a float32
# model's logits move by bf16 rounding: measured 0.34-0.38 at most on the bundled model's
# logits (spread ~25-30), 0.0 on steps past PACKED_MAX_ROWS rows (the dense copy holds the same
# values as the dequantized model).
DECODE_LOGIT_ATOL = 0.75
# ``output_weights: int4``: logits outside a step's rescored top 64 keep the 4-bit output
# matrix's rounding, measured 2.39 at most on the bundled model's
OUTPUT_INT4_ATOL = 4.0


def _random_q4k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Q4_K super-blocks (144 bytes per 256 values) with random codes and 6-bit scales and
    sane float16 d / dmin: gguf can decode Q4_K but not quantize to it."""
    nb = rows * cols // 256
    raw = rng.integers(0, 256, (nb, 144), dtype=np.uint8)
    for col in (0, 2):
        raw[:, col:col + 2] = np.frombuffer(
            rng.uniform(1e-3, 1e-2, nb).astype(np.float16).tobytes(), np.uint8).reshape(nb, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_4bit_blocks_decode_to_exactly_what_gguf_dequantizes(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 24, 512
    if qtype == Q.Q4_K:
        blocks = _random_q4k_blocks(rng, rows, cols)
    else:
        blocks = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                      qtype)
    ref = gguf.quants.dequantize(blocks, qtype).reshape(rows, cols)
    got = from_gguf(blocks, qtype, (rows, cols))
    assert got.codes.dtype == torch.uint8 and int(got.codes.max()) <= 15
    assert got.scale.shape == (rows, cols // GROUP)
    np.testing.assert_array_equal(got.dequantize().numpy(), ref)
    assert from_gguf(blocks, Q.Q8_0, (rows, cols)) is None or qtype == Q.Q8_0


def test_float_weights_are_quantized_per_group_of_32_within_half_a_step():
    w = torch.randn(96, 256) * 0.05
    q = quantize_int4(w)
    err = (q.dequantize() - w).abs().view(96, 256 // GROUP, GROUP)
    # half a step, and the float16 rounding of Q4_1's stored scale and minimum
    assert torch.all(err <= 0.55 * q.scale.unsqueeze(-1))
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.randn(8, 40))


def test_int8_quantization_is_per_row_within_half_a_step():
    w = torch.randn(96, 256) * 0.05
    w[3] = 0.0  # an all-zero row keeps a usable scale
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (96,) and torch.all(scale > 0)
    assert torch.all((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-9)


def _packed(kind: str, dtype: torch.dtype):
    w = torch.randn(192, 256) * 0.05
    if kind.startswith("int4"):
        q = quantize_int4(w)
        values = q.dequantize()
        lin = Int4Linear(q.codes, q.scale, q.zero, values.to(dtype), GROUP,
                         use_native=kind == "int4")
        assert lin.native == (kind == "int4" and native.available())
        return lin, values
    q8, s8 = quantize_int8(w)
    values = q8.float() * s8[:, None]
    return Int8Linear(q8, s8, values.to(dtype)), values


@pytest.mark.parametrize("kind", ["int4", "int4-aten", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_runs_small_steps_packed_and_large_ones_dense(kind, dtype):
    """Small steps on the packed kernel; large ones on a dense copy of the same values, except
    our own 4-bit kernel in bfloat16, which keeps none and runs every step itself (from 32 rows
    on, on the weights rounded to bf16: the dense copy's values)."""
    lin, values = _packed(kind, dtype)
    dense = Linear(values.to(dtype))
    rows = lin.max_rows
    assert rows == (NATIVE_MAX_ROWS if getattr(lin, "native", False) else PACKED_MAX_ROWS)
    no_copy = kind == "int4" and lin.native and dtype == torch.bfloat16
    assert (lin.dense is None) == no_copy
    big = torch.randn(rows + 1, 256, dtype=dtype)
    if not no_copy:
        assert torch.equal(lin(big), dense(big))  # the dense copy: the same values
    many = torch.randn(40, 256, dtype=dtype)
    if no_copy:  # the same products as the copy's, summed in another order, rounded to bf16
        got, want = lin(many).float(), dense(many).float()
        assert ((got - want).abs() <= 2 ** -8 * want.abs() + 1e-4).all()
    small = torch.randn(rows, 256, dtype=dtype)
    got, want = lin(small), dense(small)
    assert got.dtype == dtype and got.shape == (rows, 192)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
    # int4 ~0.6 bytes a weight (codes, scales, zeros); int8 ~1
    assert lin.nbytes < (0.7 if kind == "int4" else 1.1) * 192 * 256


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_low_bit_output_matrix_gives_its_top_logits_exactly(kind, dtype):
    """``RescoredOutput``: a small step scores every token on the packed matrix, then its top
    ``top_k`` tokens' logits are the exact matrix's own; every other logit stays within the
    packed matrix's rounding of the exact one, and large steps are exact everywhere where the
    packed matrix keeps a dense copy, else rescored as small ones are."""
    torch.manual_seed(0)
    exact = (torch.randn(512, 256) * 0.05).to(dtype)
    if kind == "int4":
        q = quantize_int4(exact.float())
        packed = Int4Linear(q.codes, q.scale, q.zero, exact, GROUP)
    else:
        q8, s8 = quantize_int8(exact.float())
        packed = Int8Linear(q8, s8, exact)
    head, ref = RescoredOutput(packed, exact, top_k=16), Linear(exact)
    rows = packed.max_rows
    big = torch.randn(rows + 1, 256, dtype=dtype)
    if packed.dense is not None:  # large steps on the dense copy: the exact values
        assert torch.equal(head(big), ref(big))
    else:  # our 4-bit kernel in bf16 keeps no copy: every step is rescored
        assert kind == "int4" and dtype == torch.bfloat16
        rows = 40  # the kernel's many-rows path
    small = torch.randn(rows, 256, dtype=dtype)
    got, want, low = head(small).float(), ref(small).float(), packed(small).float()
    assert got.shape == (rows, 512)
    for row in range(rows):
        # the candidates: torch's topk, or our kernel's on bf16 (ties to the lower index)
        top = torch.sort(low[row], descending=True, stable=True).indices[:16] \
            if dtype == torch.bfloat16 and native.available() else low[row].topk(16).indices
        tail = torch.ones(512, dtype=torch.bool)
        tail[top] = False
        # the same products as the exact matrix's (bmm against F.linear: rounding apart)
        torch.testing.assert_close(got[row, top], want[row, top], atol=2e-2, rtol=1e-2)
        assert torch.equal(got[row, tail], low[row, tail])
        assert not torch.equal(low[row, top], want[row, top])  # the packed values differ
        # the exact argmax is among the rescored: greedy picks the exact matrix's token
        assert int(got[row].argmax()) == int(want[row].argmax())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_a_q4_gguf_is_loaded_from_its_codes_as_stored(tmp_path, qtype):
    """Every projection's values are the file's, exactly (Q/K un-permuted like the float
    path); Q4_0 proves no float round trip: re-quantizing its values by the float rule (min /
    max per group) would give other ones."""
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_gguf(path, qtype)
    plain, packed = load_model(path), load_model(path, weights="int4")
    for a, b in zip(plain.layers, packed.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(b, name)
            assert isinstance(lin, Int4Linear), name
            assert torch.equal(lin.dense.weight, getattr(a, name).weight), name
    rows = packed.layers[0].qkv.max_rows + 1  # past the packed kernel's rows: the dense copy
    ids = torch.tensor([5, 17, 300, 42, 9, 88, 123] * 3)[:rows]
    assert torch.equal(packed.dense_forward(ids), plain.dense_forward(ids))
    one = packed.dense_forward(ids[:1]) - plain.dense_forward(ids[:1])  # 1 row: packed
    assert 0 < one.abs().max() < 0.05 * plain.dense_forward(ids[:1]).abs().max()
    if qtype == Q.Q4_0:
        requantized = quantize_int4(plain.layers[0].o.weight).dequantize()
        assert not torch.equal(requantized, plain.layers[0].o.weight)


def test_a_phi3_q4_gguf_splits_its_fused_matrices_from_the_codes(tmp_path):
    """Phi-3's fused attn_qkv and ffn_up (gate first) are split into Q, K, V and gate, up on
    load: under int4 from the stored codes, row ranges as the float path cuts them."""
    from tests.engine.test_architectures import tiny, write_gguf

    ref = tiny("phi3", hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2)  # widths that are whole Q4 blocks
    write_gguf(ref, "phi3", tmp_path / "p.gguf", qtype=Q.Q4_0)
    plain, packed = load_model(tmp_path / "p.gguf"), load_model(tmp_path / "p.gguf",
                                                                weights="int4")
    for a, b in zip(plain.layers, packed.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(getattr(b, name).dense.weight, getattr(a, name).weight), name
    rows = packed.layers[0].qkv.max_rows + 1  # past the packed kernel's rows: the dense copy
    ids = torch.tensor([3, 17, 255, 42, 99, 1] * 3)[:rows]
    assert torch.equal(packed.dense_forward(ids), plain.dense_forward(ids))


def test_float_weights_are_quantized_on_load_and_served_by_the_paged_engine():
    """An unquantized model (the tiny one; an HF directory loads the same way) under
    ``weights: int4``: each projection holds its float weights quantized by the Q4_1 rule (Q, K,
    V and gate, up each quantized alone, then stacked), and the paged engine's greedy tokens
    equal a full recompute of the same int4 model (decode steps packed, prefill dense)."""
    from engine.loader.tiny import tiny_llama

    _, floats = tiny_llama()
    model = load_model("tiny", weights="int4")
    lw = model.layers[1]
    want = torch.cat([quantize_int4(floats[f"1.{n}"]).dequantize() for n in ("q", "k", "v")])
    assert torch.equal(lw.qkv.dense.weight, want)
    assert torch.equal(lw.down.dense.weight, quantize_int4(floats["1.down"]).dequantize())
    prompts = [[5, 17, 300, 42, 9, 88, 123, 7], [3, 4, 5]]
    engine = Engine(model, EngineConfig(weights="int4", num_kv_blocks=64, max_num_seqs=2))
    reqs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    # the packed kernel's bf16 activations move this model's logits by ~0.03 (spread ~15)
    assert _greedy_agrees(reqs, prompts, model, 6, tie=0.1) >= 1


def _greedy_agrees(reqs, prompts, ref_model, n: int, tie: float) -> int:
    """How many requests' greedy tokens equal ``ref_model``'s full recompute; a request that
    parts from it must do so where the reference's top two logits are within ``tie``."""
    same = 0
    for req, prompt in zip(reqs, prompts, strict=True):
        ref = reference_greedy(ref_model, prompt, n)
        got = req.output_token_ids
        at = next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), None)
        if at is None:
            same += 1
            continue
        top2 = ref_model.dense_forward(torch.tensor(prompt + ref[:at]))[-1].topk(2).values
        assert top2[0] - top2[1] < tie, (req.request_id, at, float(top2[0] - top2[1]))
    return same


@pytest.mark.parametrize("output", ["native", "int4"])
def test_the_bundled_model_on_its_own_q4_1_weights(bundled_model, bundled_tokenizer,
                                                   bundled_path, output):
    """Greedy tokens through the paged engine (decode steps of up to 4 rows on the packed
    kernel) equal the dequantized float32 model's, except where that model itself is within
    the stated tolerance of a tie, and nowhere before it; with ``output_weights: int4`` too
    (the output matrix at 4 bits alone parted from them in 7 of 8 prompts; its top logits
    rescored exactly, in none more than the native output matrix)."""
    model = load_model(bundled_path, "float32", weights="int4", output_weights=output)
    assert model.weight_bytes < (0.45 if output == "native" else 0.2) * \
        bundled_model.weight_bytes
    texts = ["Once upon a time", "The capital of France is", "def fibonacci(n):\n    ",
             "Water boils at a temperature of", "List three colours: red,",
             "In 1969, the first humans landed on the Moon. The mission was called",
             "Translate to French: 'Good morning, my friend.' ->",
             "The quick brown fox jumps over the lazy dog. " * 6 + "Summary:"]
    prompts = [bundled_tokenizer.encode(t) for t in texts]
    n = 16
    engine = Engine(model, EngineConfig(weights="int4", output_weights=output,
                                        num_kv_blocks=256, max_num_seqs=4))
    reqs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    assert _greedy_agrees(reqs, prompts, bundled_model, n, 2 * DECODE_LOGIT_ATOL) >= \
        len(prompts) // 2
    ids = torch.tensor(prompts[5])
    got, want = model.dense_forward(ids[:1]), bundled_model.dense_forward(ids[:1])
    top = got[0].topk(model.lm_head.top_k).indices if output == "int4" else slice(None)
    assert (got[0, top] - want[0, top]).abs().max() < DECODE_LOGIT_ATOL
    # the rest at 4 bits: measured 2.39 at most
    assert (got - want).abs().max() < (OUTPUT_INT4_ATOL if output == "int4" else
                                       DECODE_LOGIT_ATOL)


def test_int8_weights_from_float_serve_the_paged_engine():
    """``weights: int8`` on the tiny float model: each projection's rows quantized with their
    own scale (Q, K, V stacked first: one row, one scale), logits near the float model's, and
    greedy tokens through the paged engine against a full recompute of the int8 model."""
    from engine.loader.tiny import tiny_llama

    _, floats = tiny_llama()
    native, model = load_model("tiny"), load_model("tiny", weights="int8")
    q8, s8 = quantize_int8(torch.cat([floats[f"0.{n}"] for n in ("q", "k", "v")]))
    assert isinstance(model.layers[0].qkv, Int8Linear)
    assert torch.equal(model.layers[0].qkv.dense.weight, q8.float() * s8[:, None])
    assert model.weight_bytes < 0.5 * native.weight_bytes + native.embed.numel() * 4
    ids = torch.tensor([5, 17, 300, 42, 9, 88, 123])
    want = native.dense_forward(ids)
    assert (model.dense_forward(ids) - want).abs().max() < 0.02 * want.abs().max()
    prompts = [[5, 17, 300, 42, 9, 88, 123, 7], [3, 4, 5]]
    engine = Engine(model, EngineConfig(weights="int8", num_kv_blocks=64, max_num_seqs=2))
    reqs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert _greedy_agrees(reqs, prompts, model, 6, tie=0.1) >= 1


def test_weight_bytes_counts_what_a_batch_1_step_reads():
    """Every matrix once (packed ones as codes and scales, the output matrix with its rescored
    rows), the norms, and of an untied embedding nothing: its lookup reads one row a token."""
    native = load_model("tiny")
    assert not native.config.tie_word_embeddings
    assert native.weight_bytes == (native.num_parameters - native.embed.numel()) * 4
    packed = load_model("tiny", weights="int4", output_weights="int4")
    mats = [m for lw in packed.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    norms = packed.num_parameters - packed.embed.numel() - packed.lm_head.numel - \
        sum(m.numel for m in mats)
    assert packed.weight_bytes == sum(m.nbytes for m in mats) + packed.lm_head.nbytes + \
        norms * 4
    assert packed.weight_bytes < 0.4 * native.weight_bytes


def test_the_weights_setting_is_checked():
    # (an env var, a flag, a YAML key and part of config_id: tests/cli/test_settings.py)
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int3")
    with pytest.raises(ValueError, match="output_weights must be one of"):
        EngineConfig(output_weights="int2")
    for kind in ("int4", "int4a8", "int8"):
        assert EngineConfig(weights=kind).weights == kind
        assert EngineConfig(output_weights=kind).output_weights == kind
        for name in ("weights", "output_weights"):
            with pytest.raises(ValueError, match=f"{name}: {kind} cannot run batch_invariant"):
                EngineConfig(**{name: kind}, batch_invariant=True)


def test_the_bundled_models_q8_0_embedding_is_kept_as_stored(bundled_path, bundled_tokenizer,
                                                             monkeypatch):
    """A tied Q8_0 embedding (the bundled model's) stays int8 codes and scales where the packed
    output matrix keeps no dense copy (bfloat16 on our kernel): lookups give the bf16 values,
    every step's top logits are rescored from it, and greedy tokens are the dense
    embedding's. A float32 model (its packed output keeps a dense copy) keeps a tensor."""
    from engine.loader import gguf_loader
    from kernels.linear import Int8Rows

    model = load_model(bundled_path, "bfloat16", weights="int4", output_weights="int4")
    assert isinstance(load_model(bundled_path, "float32", weights="int4",
                                 output_weights="int4").embed, torch.Tensor)
    if not native.available():
        assert isinstance(model.embed, torch.Tensor)  # torch's int4 kernel keeps a dense copy
        return
    assert isinstance(model.embed, Int8Rows) and model.lm_head.exact is model.embed
    assert model.lm_head.packed.dense is None
    # the same weights with the embedding read as a float tensor (the path before Int8Rows)
    monkeypatch.setattr(gguf_loader._Tensor, "int8_rows", lambda self: None)
    dense = load_model(bundled_path, "bfloat16", weights="int4", output_weights="int4")
    assert isinstance(dense.embed, torch.Tensor)
    ids = torch.arange(dense.embed.shape[0])
    assert torch.equal(model.embed[ids], dense.embed)
    assert model.weight_bytes < dense.weight_bytes  # 64 rows of 612 bytes, not 1,152
    prompts = [bundled_tokenizer.encode(t) for t in
               ["The capital of France is", "def fibonacci(n):\n    ", "List three colours:"]]
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got, want = model.lm_head(x), dense.lm_head(x)
    top = got.topk(64).indices
    # the same rows rescored and rounded to bf16 (float32 sums here, a bf16 bmm there: only a
    # sum on a rounding boundary can differ, by one bf16 step; none did in 2,560 here)
    a, b = got.gather(1, top), want.gather(1, top)
    assert (a == b).float().mean() >= 0.99
    assert (a - b).abs().max() <= 2.0 ** (torch.log2(b.abs().max()).floor() - 7)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = EngineConfig(dtype="bfloat16", weights="int4", output_weights="int4",
                       num_kv_blocks=128, max_num_seqs=4)
    assert [r.output_token_ids for r in Engine(model, cfg).generate(prompts, params)] == \
        [r.output_token_ids for r in Engine(dense, cfg).generate(prompts, params)]


def test_rescoring_from_int8_rows_needs_a_packed_matrix_without_a_dense_copy():
    from kernels.linear import Int8Rows

    rows = Int8Rows(torch.zeros(64, 64, dtype=torch.int8), torch.ones(64, 2), torch.float32)
    q = quantize_int4(torch.randn(64, 64))
    packed = Int4Linear(q.codes, q.scale, q.zero, q.dequantize(), GROUP)  # float32: a copy
    with pytest.raises(ValueError, match="without a dense copy"):
        RescoredOutput(packed, rows)


def test_an_untied_q8_0_embedding_is_looked_up_from_its_codes(tmp_path, monkeypatch):
    """An untied embedding is only looked up: kept as the file's Q8_0 blocks in any dtype and
    weight format, with logits equal to the same model's with a float embedding."""
    from engine.loader import gguf_loader
    from kernels.linear import Int8Rows

    path = tmp_path / "tiny-q8_0.gguf"
    write_tiny_gguf(path, Q.Q8_0)
    kept = load_model(path)
    assert isinstance(kept.embed, Int8Rows) and not kept.config.tie_word_embeddings
    monkeypatch.setattr(gguf_loader._Tensor, "int8_rows", lambda self: None)
    plain = load_model(path)
    assert isinstance(plain.embed, torch.Tensor)
    ids = torch.tensor([5, 17, 300, 42, 9, 88, 123])
    assert torch.equal(kept.dense_forward(ids), plain.dense_forward(ids))
    assert kept.num_parameters == plain.num_parameters
    assert kept.weight_bytes == plain.weight_bytes  # a lookup reads a row either way
    engine = Engine(kept, EngineConfig(num_kv_blocks=64, max_num_seqs=2))
    reqs = engine.generate([ids.tolist(), [3, 4, 5]], SamplingParams(max_tokens=6,
                                                                      ignore_eos=True))
    assert _greedy_agrees(reqs, [ids.tolist(), [3, 4, 5]], plain, 6, tie=1e-4) == 2


@pytest.mark.skipif(not native.available(), reason="native kernels not built here")
def test_int4a8_quantizes_small_steps_inputs_and_keeps_the_rescored_top_exact(
        bundled_path, bundled_tokenizer):
    """``weights: int4a8``: the same 4-bit matrices, small steps on inputs rounded to int8
    (``int4_mm_a8``): each layer's product within a few percent of int4's, not equal to it;
    large steps (prefill chunks of 32+ rows) the same as int4's. As ``output_weights`` only
    the candidate scores change, and their top 64 are rescored exactly: the greedy tokens stay
    int4's (smoke-qa: 0 of 51 outputs changed)."""
    a8 = load_model(bundled_path, "bfloat16", weights="int4a8", output_weights="int4a8")
    q4 = load_model(bundled_path, "bfloat16", weights="int4", output_weights="int4")
    lin, ref = a8.layers[3].gate_up, q4.layers[3].gate_up
    assert lin.int8_inputs and not ref.int8_inputs and a8.lm_head.packed.int8_inputs
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got, want = lin(x).float(), ref(x).float()
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-3 < rel < 0.05
    big = torch.randn(40, 576, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert torch.equal(lin(big), ref(big))
    head_only = load_model(bundled_path, "bfloat16", weights="int4", output_weights="int4a8")
    prompts = [bundled_tokenizer.encode(t) for t in
               ["The capital of France is", "def fibonacci(n):\n    ", "List three colours:"]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = EngineConfig(dtype="bfloat16", weights="int4", num_kv_blocks=128, max_num_seqs=4)
    assert [r.output_token_ids for r in Engine(head_only, cfg).generate(prompts, params)] == \
        [r.output_token_ids for r in Engine(q4, cfg).generate(prompts, params)]
