"""A tiny randomly initialised Llama for unit tests: fixed seed, loads in milliseconds."""

from __future__ import annotations

import dataclasses

import torch

from engine.config import ModelConfig

TINY_CONFIG = ModelConfig(
    architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
    max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    name="tiny-llama", revision="tiny-seed0",
)


def tiny_llama(config: ModelConfig = TINY_CONFIG, seed: int = 0, vocab_size: int | None = None
               ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``vocab_size`` widens the vocabulary (e.g. to a real tokenizer's, for gateway tests
    that need text) keeping everything else tiny."""
    if vocab_size is not None:
        config = dataclasses.replace(config, vocab_size=vocab_size,
                                     name=f"tiny-llama-v{vocab_size}")
    g = torch.Generator().manual_seed(seed)
    c = config

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1.0 + rand(c.hidden_size, scale=0.1)

    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    w = {"embed": rand(c.vocab_size, c.hidden_size, scale=1.0), "final_norm": norm()}
    if not c.tie_word_embeddings:
        w["lm_head"] = rand(c.vocab_size, c.hidden_size, scale=0.5)
    for i in range(c.num_layers):
        w |= {
            f"{i}.attn_norm": norm(), f"{i}.q": rand(qd, c.hidden_size, scale=0.3),
            f"{i}.k": rand(kd, c.hidden_size, scale=0.3), f"{i}.v": rand(kd, c.hidden_size),
            f"{i}.o": rand(c.hidden_size, qd), f"{i}.ffn_norm": norm(),
            f"{i}.gate": rand(c.intermediate_size, c.hidden_size),
            f"{i}.up": rand(c.intermediate_size, c.hidden_size),
            f"{i}.down": rand(c.hidden_size, c.intermediate_size),
        }
    return c, w
