"""Load an HF Llama-family directory: ``config.json`` + ``*.safetensors``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.loader.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
_LAYER = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
}


def read_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or [cfg.get("model_type")]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {archs[0]!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    rope_scaling = cfg.get("rope_scaling") or {}
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(f"{path}: rope scaling {rope_type!r} is not supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{path}: attention/MLP biases are not supported")
    n_head = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    rope_theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4))
    return ModelConfig(
        architecture="llama",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=n_head,
        num_kv_heads=cfg.get("num_key_value_heads", n_head),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=cfg.get("_name_or_path") or path.name,
        revision=hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:12],
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
    for f in files:
        for name, t in load_file(f).items():
            t = t.float()
            if name == "model.embed_tokens.weight":
                weights["embed"] = t
            elif name == "lm_head.weight":
                weights["lm_head"] = t
            elif name == "model.norm.weight":
                weights["final_norm"] = t
            elif name.startswith("model.layers."):
                idx, rest = name[len("model.layers."):].split(".", 1)
                if rest in _LAYER:
                    weights[f"{idx}.{_LAYER[rest]}"] = t
    if config.tie_word_embeddings:
        weights.pop("lm_head", None)
    elif "lm_head" not in weights:
        raise UnsupportedModelError(f"{path}: untied model without lm_head.weight")
    return config, weights
