"""Llama-family decoder in plain PyTorch (Llama, SmolLM, Mistral-style checkpoints).

Weights use the HF layout (``rotate_half`` RoPE); the GGUF loader un-permutes llama.cpp's Q/K
rows on load so both loaders feed the same module. Q/K/V and gate/up projections are fused
into one matrix each so a decoder layer is a handful of large matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import kernels
from engine.config import ModelConfig


@dataclass
class PrefillSeq:
    start: int  # token range [start, end) in the flattened batch
    end: int
    context_len: int  # keys visible to the last query of the chunk (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass
class AttentionMetadata:
    """How the flattened tokens of one step map onto sequences and KV slots.

    Decode tokens come first (one per sequence, ``num_decodes`` of them), then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [T] flat KV slot of every token
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, M]
    decode_context_lens: torch.Tensor | None = None  # [B]
    prefills: list[PrefillSeq] = field(default_factory=list)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2*Hk) * D, hidden]
    o: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * ffn, hidden]
    down: torch.Tensor


class LlamaModel:
    """Inference-only decoder. ``forward`` reads and writes K/V through block tables;
    ``dense_forward`` is the no-cache full-recompute reference used by tests."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.dtype = dtype
        c = config
        w = {k: v.to(dtype) for k, v in weights.items()}
        self.embed = w["embed"]
        self.lm_head = self.embed if c.tie_word_embeddings else w["lm_head"]
        self.final_norm = w["final_norm"]
        self.layers = [
            LayerWeights(
                attn_norm=w[f"{i}.attn_norm"],
                qkv=torch.cat([w[f"{i}.q"], w[f"{i}.k"], w[f"{i}.v"]]).contiguous(),
                o=w[f"{i}.o"],
                ffn_norm=w[f"{i}.ffn_norm"],
                gate_up=torch.cat([w[f"{i}.gate"], w[f"{i}.up"]]).contiguous(),
                down=w[f"{i}.down"],
            )
            for i in range(c.num_layers)
        ]
        self.scale = c.head_dim ** -0.5
        inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        )
        t = torch.arange(c.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    @property
    def num_parameters(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for lw in self.layers:
            tensors += [lw.attn_norm, lw.qkv, lw.o, lw.ffn_norm, lw.gate_up, lw.down]
        return sum(t.numel() for t in tensors)

    @property
    def weight_bytes(self) -> int:
        return self.num_parameters * self.embed.element_size()

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, lw: LayerWeights, h: torch.Tensor, positions: torch.Tensor):
        c = self.config
        x = F.rms_norm(h, (c.hidden_size,), lw.attn_norm, c.rms_norm_eps)
        qkv = F.linear(x, lw.qkv)
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = qkv[:, :nq].view(-1, c.num_heads, c.head_dim)
        k = qkv[:, nq:nq + nk].view(-1, c.num_kv_heads, c.head_dim)
        v = qkv[:, nq + nk:].view(-1, c.num_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _mlp_residual(self, lw: LayerWeights, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = h + F.linear(attn.reshape(attn.shape[0], -1), lw.o)
        x = F.rms_norm(h, (c.hidden_size,), lw.ffn_norm, c.rms_norm_eps)
        gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, lw.down)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        c = self.config
        return F.linear(F.rms_norm(h, (c.hidden_size,), self.final_norm, c.rms_norm_eps),
                        self.lm_head).float()

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step over the flattened tokens; returns float32 logits only at
        ``logits_indices`` (the positions that sample a token this step)."""
        h = self.embed[input_ids]
        nd = meta.num_decodes
        for lw, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            q, k, v = self._qkv(lw, h, positions)
            kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = torch.empty_like(q)
            if nd:
                attn[:nd] = kernels.paged_decode_attention(
                    q[:nd], k_cache, v_cache, meta.decode_block_tables,
                    meta.decode_context_lens, self.scale,
                )
            for p in meta.prefills:
                n = p.end - p.start
                if p.context_len == n:  # nothing cached before this chunk: attend to it directly
                    attn[p.start:p.end] = kernels.causal_attention(
                        q[p.start:p.end], k[p.start:p.end], v[p.start:p.end], self.scale
                    )
                else:
                    attn[p.start:p.end] = kernels.paged_prefill_attention(
                        q[p.start:p.end], k_cache, v_cache, p.block_table, p.context_len,
                        self.scale,
                    )
            h = self._mlp_residual(lw, h, attn)
        return self._logits(h[logits_indices])

    @torch.inference_mode()
    def dense_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """No cache, full recompute: logits ``[n, vocab]`` for every position of one sequence."""
        positions = torch.arange(input_ids.shape[0])
        h = self.embed[input_ids]
        for lw in self.layers:
            q, k, v = self._qkv(lw, h, positions)
            h = self._mlp_residual(lw, h, kernels.causal_attention(q, k, v, self.scale))
        return self._logits(h)
