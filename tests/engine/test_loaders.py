"""Loaders: GGUF (permuted Q/K, quantized types), HF directories, and clear errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import UnsupportedModelError, load_model
from engine.loader.tiny import TINY_CONFIG, tiny_llama
from tests.engine.helpers import gguf_writer

_GGUF_NAMES = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v",
               "o": "attn_output", "ffn_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up",
               "down": "ffn_down"}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path: Path, qtype: Q = Q.F32, arch: str = "llama",
                    raw_override: dict[str, tuple[np.ndarray, Q]] | None = None) -> dict:
    c, weights = tiny_llama()
    w = gguf_writer(path, arch, layers=c.num_layers, context=c.max_position_embeddings,
                    hidden=c.hidden_size, ffn=c.intermediate_size, heads=c.num_heads,
                    kv_heads=c.num_kv_heads, rope_theta=c.rope_theta, eps=c.rms_norm_eps,
                    vocab=c.vocab_size)
    w.add_eos_token_id(c.eos_token_id)
    tensors = {"token_embd.weight": weights["embed"], "output.weight": weights["lm_head"],
               "output_norm.weight": weights["final_norm"]}
    for i in range(c.num_layers):
        for ours, theirs in _GGUF_NAMES.items():
            t = weights[f"{i}.{ours}"].numpy()
            if ours == "q":
                t = llamacpp_permute(t, c.num_heads)
            elif ours == "k":
                t = llamacpp_permute(t, c.num_kv_heads)
            tensors[f"blk.{i}.{theirs}.weight"] = torch.from_numpy(np.ascontiguousarray(t))
    for name, t in tensors.items():
        arr = t.numpy().astype(np.float32)
        if raw_override and name in raw_override:
            data, raw = raw_override[name]
            w.add_tensor(name, data, raw_dtype=raw)
        elif arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def _logits(model, ids):
    return model.dense_forward(torch.tensor(ids))


IDS = [5, 99, 300, 7, 42, 511, 3, 256, 128, 64, 1, 2]


def test_gguf_f32_roundtrip_undoes_qk_permutation(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    loaded = load_model(path)
    original = load_model("tiny")
    assert loaded.config.num_kv_heads == TINY_CONFIG.num_kv_heads
    assert loaded.config.tie_word_embeddings is False
    torch.testing.assert_close(_logits(loaded, IDS), _logits(original, IDS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_quantized_weights_dequantize_exactly(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    weights = write_tiny_gguf(path, qtype)
    loaded = load_model(path)
    c = loaded.config
    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i, layer in enumerate(loaded.layers):
        qkv, gate_up = layer.qkv.weight, layer.gate_up.weight
        got = {"q": qkv[:qd], "k": qkv[qd:qd + kd], "v": qkv[qd + kd:], "o": layer.o.weight,
               "gate": gate_up[:c.intermediate_size], "up": gate_up[c.intermediate_size:],
               "down": layer.down.weight}
        for name, tensor in got.items():
            ref = weights[f"{i}.{name}"].numpy().astype(np.float32)
            if qtype == Q.F16:
                expect = ref.astype(np.float16).astype(np.float32)
            else:
                expect = gguf.quants.dequantize(gguf.quants.quantize(ref, qtype), qtype)
            np.testing.assert_array_equal(tensor.numpy(), expect.reshape(tensor.shape),
                                          err_msg=f"layer {i} {name}")
    if qtype in (Q.F16, Q.Q8_0):  # 4-bit error on this random model is large by nature
        original = _logits(load_model("tiny"), IDS)
        diff = (_logits(loaded, IDS) - original).abs().max().item()
        assert diff < 0.02 * original.abs().max().item()


def test_gguf_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, arch="mamba")
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba'"):
        load_model(path)


def test_gguf_unsupported_quantization_type_is_named(tmp_path):
    path = tmp_path / "q8_1.gguf"
    c = TINY_CONFIG
    block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_1][1]
    raw = np.zeros((c.vocab_size, c.hidden_size // 32 * block_bytes), dtype=np.uint8)
    write_tiny_gguf(path, raw_override={"token_embd.weight": (raw, Q.Q8_1)})
    with pytest.raises(UnsupportedModelError, match="token_embd.weight.*Q8_1"):
        load_model(path)


def test_missing_and_unknown_paths_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope.gguf")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(UnsupportedModelError, match="expected a .gguf file"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(UnsupportedModelError, match="config.json"):
        load_model(tmp_path / "emptydir")


@pytest.mark.parametrize("tied", [False, True])
def test_hf_directory_matches_transformers(tmp_path, tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                      max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=tied)
    ref = LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.num_heads == 6 and ours.config.num_kv_heads == 2
    assert ours.config.tie_word_embeddings is tied
    ids = [3, 17, 255, 42, 99, 1, 0, 299, 150]
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(ours, ids), theirs, rtol=0, atol=1e-4)


def test_hf_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(tmp_path)


@pytest.mark.bundled
def test_hf_tokenizer_json_matches_gguf_tokenizer(tmp_path, bundled_path, bundled_tokenizer):
    from transformers import AutoTokenizer

    from engine.text import load_tokenizer

    AutoTokenizer.from_pretrained(str(bundled_path.parent),
                                  gguf_file=bundled_path.name).save_pretrained(tmp_path)
    hf = load_tokenizer(tmp_path)
    for text in ["Hello 123 world", "naïve 東京 🤖", "<|im_start|>user\nhi<|im_end|>"]:
        assert hf.encode(text) == bundled_tokenizer.encode(text)
    assert hf.eos_token_id == bundled_tokenizer.eos_token_id == 2
    msgs = [{"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(msgs) == bundled_tokenizer.apply_chat_template(msgs)


@pytest.mark.bundled
def test_the_bundled_tokenizer_by_name(bundled_tokenizer):
    """``--tokenizer bundled`` (a tiny test model with the bundled model's vocabulary)."""
    from engine.text import load_tokenizer

    named = load_tokenizer("bundled")
    assert named.revision == bundled_tokenizer.revision
    assert named.encode("Hello world") == bundled_tokenizer.encode("Hello world")


def _fields_and_tensors(reader) -> tuple[dict, list]:
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, int(t.tensor_type), tuple(int(x) for x in t.shape), t.data.dtype,
                t.data.shape, t.data.tobytes()) for t in reader.tensors]
    return fields, tensors


def test_the_header_reader_gives_what_gguf_reader_gives(tmp_path, bundled_path):
    """engine.loader.gguf_read (one pass over the header) against gguf.GGUFReader, on the
    bundled model (Q4_1 and F32 tensors, 49k vocabulary strings) and on a file with every
    value type, arrays of them, a custom alignment and plain and quantized tensors."""
    from gguf import GGUFReader

    from engine.loader.gguf_read import GGUFFile, GGUFFormatError

    assert _fields_and_tensors(GGUFFile(bundled_path)) == \
        _fields_and_tensors(GGUFReader(bundled_path))
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((2, 4)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fast, ref = _fields_and_tensors(GGUFFile(path)), _fields_and_tensors(GGUFReader(path))
    assert fast == ref and fast[0]["t.strs"] == ["a", "", "ü"] and len(fast[1]) == 3
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(GGUFFormatError, match="bad magic"):
        GGUFFile(bad)
    bad.write_bytes(path.read_bytes()[:200])
    with pytest.raises(GGUFFormatError, match="past the end"):
        GGUFFile(bad)
