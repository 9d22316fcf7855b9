"""More architectures, verified without any download: tiny random Qwen2, Qwen3, Mistral, Phi-3
and Gemma 3 models built with transformers' own config and modeling classes, saved as HF
directories and written as GGUF with the ``gguf`` writer (llama.cpp's tensor names; no Q/K
permutation for qwen), loaded by the engine: logits against transformers' forward, greedy
tokens against its forward's argmax, and (Qwen3, Gemma 3) served through the gateway with the
chat template of its ``tokenizer_config.json``."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, UnsupportedModelError, load_model
from tests.engine.helpers import gguf_writer

IDS = [3, 17, 255, 42, 99, 1, 0, 299, 150]


def tiny(arch: str, vocab: int = 300, **extra):
    """A random transformers model of ``arch`` (eval mode, float32)."""
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg_cls, model_cls = {"qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
                          "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
                          "mistral": (T.MistralConfig, T.MistralForCausalLM),
                          "phi3": (T.Phi3Config, T.Phi3ForCausalLM),
                          "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM)}[arch]
    if arch == "phi3":
        common.update(pad_token_id=0, eos_token_id=2, bos_token_id=1)
    if arch in ("qwen3", "gemma3"):
        common["head_dim"] = 16  # not hidden / heads (8): Qwen3 sets it on its own
    if arch == "gemma3":  # a local and a global layer, each with its own RoPE (one scaled)
        del common["rope_theta"]
        common.update(
            layer_types=["sliding_attention", "full_attention"], sliding_window=256,
            query_pre_attn_scalar=24, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                   "rope_theta": 5000.0}})
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**common, **extra})).eval()
    with torch.no_grad():  # random biases and norm weights, so a loader that drops them fails
        for name, p in model.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name or (
                    arch == "gemma3" and "norm" in name):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model


_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
         "mlp.gate_up_proj": "ffn_up"}


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def write_gguf(model, arch: str, path: Path, extra: dict | None = None,
               eos_eot: tuple[int, int] | None = None, qtype=None) -> None:
    """The model as llama.cpp's converter lays it out for ``arch`` (qwen2 / qwen3 / phi3: HF's
    Q/K row order kept; Qwen3's head size as ``attention.key_length``; Phi-3's fused qkv_proj
    and gate_up_proj as attn_qkv and ffn_up)."""
    c = model.config
    w = gguf_writer(path, arch, layers=c.num_hidden_layers, context=c.max_position_embeddings,
                    hidden=c.hidden_size, ffn=c.intermediate_size,
                    heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                    rope_theta=getattr(c, "rope_theta", None)
                    or c.rope_parameters["rope_theta"],
                    eps=c.rms_norm_eps, vocab=c.vocab_size, head_dim=head_dim(c))
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    if eos_eot is not None:
        w.add_eos_token_id(eos_eot[0])
        w.add_eot_token_id(eos_eot[1])
    _write_tensors(w, model, _GGUF, qtype=qtype)


def _write_tensors(w, model, modules: dict[str, str], norm_shift: float = 0.0,
                   qtype=None) -> None:
    """The model's tensors under llama.cpp's names (``modules``: HF module -> GGUF tensor),
    each norm weight plus ``norm_shift``, the layers' matrices quantized to ``qtype`` if given;
    then the file is written."""
    for name, t in model.state_dict().items():
        arr = t.float().numpy() + (norm_shift if name.endswith("norm.weight") else 0.0)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            out = f"blk.{idx}.{modules[module]}.{kind}"
        arr = np.ascontiguousarray(arr.astype(np.float32))
        if qtype is not None and out.startswith("blk.") and arr.ndim == 2:
            w.add_tensor(out, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_GEMMA3_GGUF = {**_GGUF, "post_attention_layernorm": "attn_post_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "ffn_post_norm"}


def write_gemma3_gguf(model, path: Path) -> None:
    """A Gemma 3 as llama.cpp's converter writes it (conversion/gemma.py): every norm stored as
    1 + w, the global layers' RoPE base as rope.freq_base with their linear scaling, the local
    ones' as rope.freq_base_swa, the window and its per-layer pattern."""
    c = model.config
    rp = c.rope_parameters
    w = gguf_writer(path, "gemma3", layers=c.num_hidden_layers,
                    context=c.max_position_embeddings, hidden=c.hidden_size,
                    ffn=c.intermediate_size, heads=c.num_attention_heads,
                    kv_heads=c.num_key_value_heads, rope_theta=rp["full_attention"]["rope_theta"],
                    eps=c.rms_norm_eps, vocab=c.vocab_size, head_dim=head_dim(c))
    w.add_rope_freq_base_swa(rp["sliding_attention"]["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(rp["full_attention"]["factor"])
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    _write_tensors(w, model, _GEMMA3_GGUF, norm_shift=1.0)


def greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' forward, argmax, full recompute each token (its ``generate`` gave other
    tokens than its own forward for the tiny Qwen3 here: its cache path, not the model)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


# (a Mistral GGUF is a 'llama' one to llama.cpp: the llama GGUF tests cover it)
@pytest.mark.parametrize("arch,fmt", [("qwen2", "hf"), ("qwen3", "hf"), ("mistral", "hf"),
                                      ("phi3", "hf"), ("gemma3", "hf"), ("qwen2", "gguf"),
                                      ("qwen3", "gguf"), ("phi3", "gguf"),
                                      ("gemma3", "gguf")])
def test_the_engine_matches_transformers(tmp_path, arch, fmt):
    # llama.cpp's Gemma 3 takes its softmax scale from the head size (no GGUF key for
    # query_pre_attn_scalar), as every released Gemma 3 but the 27B has it
    ref = tiny(arch, **({"query_pre_attn_scalar": 16} if (arch, fmt) == ("gemma3", "gguf")
                        else {}))
    if fmt == "hf":
        ref.save_pretrained(tmp_path)
        ours = load_model(tmp_path)
    elif arch == "gemma3":
        write_gemma3_gguf(ref, tmp_path / "m.gguf")
        ours = load_model(tmp_path / "m.gguf")
    else:
        write_gguf(ref, arch, tmp_path / "m.gguf")
        ours = load_model(tmp_path / "m.gguf")
    assert ours.config.qkv_bias is (arch == "qwen2")
    assert ours.config.qk_norm is (arch in ("qwen3", "gemma3"))
    assert ours.config.head_dim == head_dim(ref.config)
    with torch.no_grad():
        theirs = ref(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(ours.dense_forward(torch.tensor(IDS)), theirs, rtol=0,
                               atol=1e-4)
    # through the paged engine (prefill chunks, decode steps, the KV cache): the same tokens
    engine = Engine(ours, EngineConfig(num_kv_blocks=64, block_size=4, max_batched_tokens=5))
    prompts = [IDS, IDS[3:] + [7, 8, 9, 10, 11, 12]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0,
                                                   ignore_eos=True))
    assert [o.output_token_ids for o in outs] == [greedy(ref, p, 10) for p in prompts]


def test_sliding_windows_bound_the_context_and_partial_windows_are_refused(tmp_path):
    """Within its window full attention is sliding-window attention: the context is capped
    there (a longer prompt is refused as too long, never silently mis-attended)."""
    ref = tiny("mistral", sliding_window=64)
    ref.save_pretrained(tmp_path / "m")
    assert load_model(tmp_path / "m").config.max_position_embeddings == 64
    q = tiny("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=1)
    q.save_pretrained(tmp_path / "q")
    with pytest.raises(UnsupportedModelError, match="max_window_layers"):
        load_model(tmp_path / "q")
    # Gemma 3: local layers slide, global ones do not; capped at the window, both are exact
    g = tiny("gemma3", sliding_window=64)
    g.save_pretrained(tmp_path / "g")
    gm = load_model(tmp_path / "g")
    assert gm.config.max_position_embeddings == 64
    with torch.no_grad():
        torch.testing.assert_close(gm.dense_forward(torch.tensor(IDS * 7)),
                                   g(torch.tensor([IDS * 7])).logits[0], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="batch_invariant"):
        load_model(tmp_path / "g", batch_invariant=True)
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    (tmp_path / "g" / "config.json").write_text(json.dumps({**cfg,
                                                            "attn_logit_softcapping": 50.0}))
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        load_model(tmp_path / "g")


def test_every_eos_id_of_the_config_and_generation_config_ends_a_sequence(tmp_path):
    """HF configs list several EOS ids (Gemma 3: <eos> and <end_of_turn>): the first is the
    EOS, the others end a sequence just the same."""
    ref = tiny("gemma3")
    ref.save_pretrained(tmp_path)
    greedy_ids = Engine(load_model(tmp_path), EngineConfig(num_kv_blocks=64)).generate(
        [IDS], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    seq = greedy_ids.output_token_ids
    first = next(i for i in range(300) if i not in seq[:4])
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": first}))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [first, seq[3]]}))
    model = load_model(tmp_path)
    assert (model.config.eos_token_id, model.config.extra_eos_token_ids) == (first, (seq[3],))
    out = Engine(model, EngineConfig(num_kv_blocks=64)).generate(
        [IDS], SamplingParams(max_tokens=10, temperature=0.0))[0]
    k = seq.index(seq[3])
    assert out.output_token_ids == seq[:k + 1] and out.finish_reason == "stop"
    # GGUF: llama.cpp's end-of-turn id beside the EOS
    q = tiny("qwen3")
    write_gguf(q, "qwen3", tmp_path / "q.gguf", eos_eot=(2, 7))
    c = load_model(tmp_path / "q.gguf").config
    assert (c.eos_token_id, c.extra_eos_token_ids) == (2, (7,))


def test_unsupported_architectures_and_weights_are_named(tmp_path):
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma2ForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="Gemma2ForCausalLM.*not supported"):
        load_model(tmp_path / "gemma")
    phi = tiny("phi3")  # Phi-3's long-context variants scale RoPE: refused, not misread
    phi.save_pretrained(tmp_path / "phi")
    cfg = json.loads((tmp_path / "phi" / "config.json").read_text())
    cfg["rope_parameters"] = {**(cfg.get("rope_parameters") or {}), "rope_type": "longrope"}
    (tmp_path / "phi" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_model(tmp_path / "phi")
    ref = tiny("qwen3", attention_bias=True)  # adds an output-projection bias
    ref.save_pretrained(tmp_path / "q3")
    with pytest.raises(UnsupportedModelError, match="output"):
        load_model(tmp_path / "q3")
    write_gguf(ref, "qwen3", tmp_path / "q3.gguf")
    with pytest.raises(UnsupportedModelError, match="attn_output.bias"):
        load_model(tmp_path / "q3.gguf")
    # a Phi-3 128k GGUF carries longrope factors: refused, not run with plain RoPE
    write_gguf(phi, "phi3", tmp_path / "phi.gguf",
               extra={"blk.0.rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_model(tmp_path / "phi.gguf")
    gw = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")  # refused by its name
    gw.add_block_count(1)
    gw.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()
    with pytest.raises(UnsupportedModelError, match="gemma2.*not supported"):
        load_model(tmp_path / "g.gguf")


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\nQWEN-TEMPLATE "
            "{% endif %}")


@pytest.mark.bundled
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_model_directory_is_served_with_its_own_chat_template(tmp_path, bundled_path, arch):
    """A tiny Qwen3 / Gemma 3 with the bundled tokenizer's vocabulary, its tokenizer files
    beside it and a chat template of its own in tokenizer_config.json: served by the gateway,
    the prompt the engine got is that template's."""
    from transformers import AutoTokenizer

    from engine.text import load_tokenizer
    from tests.gateway.conftest import start_server, stop_server

    ref = tiny(arch, vocab=49152)
    ref.config.eos_token_id = 2
    ref.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(bundled_path.parent),
                                  gguf_file=bundled_path.name).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)  # one template: the config's
    server = start_server("--model", str(tmp_path), "--served-model-name", f"tiny-{arch}")
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": f"tiny-{arch}", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi there"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        trace = r.headers["x-tailscope-trace-id"]
        rec = httpx.get(f"{server.url}/debug/requests/{trace}", timeout=10).json()["record"]
        prompt = load_tokenizer(tmp_path).decode(rec["input_token_ids"])
        assert prompt.endswith("<|im_start|>assistant\nQWEN-TEMPLATE "), prompt
        assert "Hi there" in prompt
    finally:
        stop_server(server)
