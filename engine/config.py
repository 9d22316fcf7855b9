"""Frozen, validated configuration dataclasses for the model and the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture values, always read from the checkpoint (never hard-coded)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "unknown"
    revision: str = "unknown"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


PREEMPTION_MODES = ("recompute", "swap", "auto", "off")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler and KV settings of one engine replica.

    ``kv_cache_bytes`` is the memory budget for the paged KV cache; the number of blocks is
    derived from it unless ``num_kv_blocks`` pins it (tests use tiny pools).
    """

    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024 * 1024
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    max_model_len: int | None = None  # defaults to the model's context length
    dtype: str = "float32"
    # reuse cached full KV blocks of a prompt's prefix (keyed per tenant namespace)
    prefix_caching: bool = True
    # when KV runs out mid-decode: "recompute" (free the victim's blocks, prefill it again),
    # "swap" (copy its blocks to host memory and back), "auto" (the cost rule in
    # engine.scheduler), or "off" (admission reserves prompt + max_tokens: never preempts)
    preemption: str = "recompute"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {self.max_batched_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        parse_dtype(self.dtype)
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got "
                             f"{self.preemption!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def num_blocks_for(self, model: ModelConfig) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        per_block = model.kv_bytes_per_token(self.torch_dtype) * self.block_size
        n = self.kv_cache_bytes // per_block
        if n < 1:
            raise ValueError(
                f"kv_cache_bytes={self.kv_cache_bytes} holds no {per_block}-byte block"
            )
        return int(n)
