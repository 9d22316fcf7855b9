"""Load an HF Llama-family directory: ``config.json`` + ``*.safetensors``.

Llama, Mistral (its sliding window bounds the context: within it full attention is exact),
Qwen2 / Qwen2.5 (Q/K/V biases), Qwen3 (Q/K norms), Phi-3 (Llama with fused ``qkv_proj`` and
``gate_up_proj``, split here; its long-context rope scaling and partial rotary are refused) and
Gemma 3 text models (``Gemma3ForCausalLM``: scaled embeddings, norms before and after each
sub-layer stored as ``w`` for ``1 + w``, GELU gating, per-layer local/global RoPE; its sliding
window bounds the context as Mistral's does). Anything else is refused by name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.loader.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM")
GEMMA3 = "Gemma3ForCausalLM"
_LAYER = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}
# Gemma 3 names its four layer norms otherwise: post_attention_layernorm is on the attention
# output there (Llama's is the MLP's input norm, pre_feedforward_layernorm in Gemma)
_GEMMA3_LAYER = {**_LAYER, "post_attention_layernorm.weight": "post_attn_norm",
                 "pre_feedforward_layernorm.weight": "ffn_norm",
                 "post_feedforward_layernorm.weight": "post_ffn_norm"}


def read_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or [cfg.get("model_type")]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {archs[0]!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if archs[0] == GEMMA3:
        return _gemma3_config(path, cfg)
    ropes = (cfg.get("rope_scaling") or {}, cfg.get("rope_parameters") or {})
    for rope in ropes:
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"{path}: rope scaling {rope_type!r} is not supported")
    if any(float(d.get("partial_rotary_factor", 1.0)) != 1.0 for d in (cfg, *ropes)):
        raise UnsupportedModelError(f"{path}: partial rotary embeddings are not supported")
    arch = archs[0]
    # Qwen2 always has Q/K/V biases (and no output bias); elsewhere attention_bias would add
    # an output-projection bias too, which this engine does not have
    if (cfg.get("attention_bias") and arch != "Qwen2ForCausalLM") or cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{path}: attention output / MLP biases are not supported")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise UnsupportedModelError(f"{path}: activation {act!r} is not supported (silu only)")
    max_pos = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM" or arch == "Qwen3ForCausalLM":
        window = window if cfg.get("use_sliding_window") else None
    if window is not None and window < max_pos:
        if cfg.get("max_window_layers") is not None and \
                cfg["max_window_layers"] < cfg["num_hidden_layers"]:
            raise UnsupportedModelError(
                f"{path}: sliding-window attention on some layers only (max_window_layers "
                f"{cfg['max_window_layers']} of {cfg['num_hidden_layers']}) is not supported")
        # full attention equals sliding-window attention up to the window: serve that much
        max_pos = int(window)
    rope_theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4))
    return ModelConfig(
        **_shared(path, cfg, eps=1e-5, tied=False),
        architecture="llama",
        rope_theta=float(rope_theta),
        max_position_embeddings=max_pos,
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
    )


def _shared(path: Path, cfg: dict, eps: float, tied: bool) -> dict:
    """The ModelConfig fields every architecture reads the same way (``eps`` and ``tied``: the
    architecture's defaults for rms_norm_eps and tie_word_embeddings)."""
    n_head = cfg["num_attention_heads"]
    eos, extra_eos = eos_ids(path, cfg)
    return dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=n_head, num_kv_heads=cfg.get("num_key_value_heads", n_head),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head,
        rms_norm_eps=float(cfg.get("rms_norm_eps", eps)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos, extra_eos_token_ids=extra_eos,
        name=cfg.get("_name_or_path") or path.name,
        revision=hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:12])


def eos_ids(path: Path, cfg: dict) -> tuple[int | None, tuple[int, ...]]:
    """The EOS id and the other ids that end a sequence: ``config.json``'s ``eos_token_id``
    (an id or a list) and ``generation_config.json``'s, first one first."""
    ids: list[int] = []
    gen = path / "generation_config.json"
    for source in (cfg, json.loads(gen.read_text()) if gen.exists() else {}):
        value = source.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return (ids[0] if ids else None), tuple(ids[1:])


def _gemma3_config(path: Path, cfg: dict) -> ModelConfig:
    """Gemma 3 (text): RoPE per layer type (transformers 5's ``rope_parameters`` keyed by
    ``sliding_attention`` / ``full_attention``, or the older ``rope_theta`` +
    ``rope_local_base_freq`` + ``rope_scaling`` of the global layers), default or linear."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UnsupportedModelError(f"{path}: {key} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{path}: bidirectional attention is not supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{path}: attention / MLP biases are not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{path}: activation {act!r} is not supported "
                                    "(gelu_pytorch_tanh for Gemma 3)")
    n_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0
        else "sliding_attention" for i in range(n_layers)]
    params = cfg.get("rope_parameters") or {}
    if not {"sliding_attention", "full_attention"} & set(params):
        params = {"full_attention": {"rope_theta": cfg.get("rope_theta", 1e6),
                                     **(cfg.get("rope_scaling") or {})},
                  "sliding_attention": {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}}
    theta, scale = [], []
    for t in types:
        p = params[t]
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ("default", "linear"):
            raise UnsupportedModelError(f"{path}: rope scaling {kind!r} is not supported")
        theta.append(float(p["rope_theta"]))
        scale.append(float(p.get("factor", 1.0)) if kind == "linear" else 1.0)
    max_pos = cfg.get("max_position_embeddings", 131072)
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and window is not None and window < max_pos:
        max_pos = int(window)  # within the window, sliding attention is full attention
    shared = _shared(path, cfg, eps=1e-6, tied=True)
    return ModelConfig(
        **shared,
        architecture="gemma3",
        rope_theta=theta[0],
        max_position_embeddings=max_pos,
        qk_norm=True,
        embed_scale=cfg["hidden_size"] ** 0.5,
        post_norms=True,
        hidden_act="gelu_tanh",
        attn_scale=float(cfg.get("query_pre_attn_scalar", shared["head_dim"])) ** -0.5,
        layer_rope_theta=tuple(theta),
        layer_rope_scale=tuple(scale),
    )


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    if not (path / "config.json").exists():
        raise UnsupportedModelError(f"{path}: no config.json (not an HF model directory)")
    config = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path}: no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    gemma = config.architecture == "gemma3"
    layer_names = _GEMMA3_LAYER if gemma else _LAYER
    for f in files:
        for name, t in load_file(f).items():
            t = t.float()
            if gemma and name.endswith("norm.weight"):
                t = 1.0 + t  # Gemma's RMSNorm scales by 1 + w
            if name == "model.embed_tokens.weight":
                weights["embed"] = t
            elif name == "lm_head.weight":
                weights["lm_head"] = t
            elif name == "model.norm.weight":
                weights["final_norm"] = t
            elif name.startswith("model.layers."):
                idx, rest = name[len("model.layers."):].split(".", 1)
                if rest in layer_names:
                    weights[f"{idx}.{layer_names[rest]}"] = t
                elif rest == "self_attn.qkv_proj.weight":  # Phi-3: [q; k; v] rows
                    c = config
                    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
                    weights[f"{idx}.q"], weights[f"{idx}.k"], weights[f"{idx}.v"] = \
                        t.split([q, kv, kv])
                elif rest == "mlp.gate_up_proj.weight":  # Phi-3: [gate; up] rows
                    weights[f"{idx}.gate"], weights[f"{idx}.up"] = t.chunk(2)
                elif rest.endswith((".weight", ".bias")):
                    raise UnsupportedModelError(f"{path}: tensor {name} is not one this engine "
                                                "runs (an architecture variant it does not "
                                                "support)")
    if config.tie_word_embeddings:
        weights.pop("lm_head", None)
    elif "lm_head" not in weights:
        raise UnsupportedModelError(f"{path}: untied model without lm_head.weight")
    return config, weights
