"""Torch reference kernels: attention over a paged KV cache, norms, rotary, activation.

Cache layout: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
a sequence's token at position ``p`` lives in block ``block_table[p // block_size]`` at offset
``p % block_size``. These are the oracle for the Triton kernels and the CPU implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys/values ``[T, Hk, D]`` at flat slots ``block * block_size + offset``."""
    num_blocks, block_size, hk, d = k_cache.shape
    k_cache.view(num_blocks * block_size, hk, d).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, hk, d).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """``[B, M]`` block tables -> ``[B, Hk, M*block_size, D]`` keys or values.
    (``index_select`` is ~3x faster than advanced indexing for this copy on CPU.)"""
    b, m = block_tables.shape
    _, block_size, hk, d = cache.shape
    rows = cache.index_select(0, block_tables.reshape(-1))
    return rows.view(b, m * block_size, hk, d).transpose(1, 2)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, masked: bool = False,
) -> torch.Tensor:
    """One query token per sequence. ``q`` is ``[B, H, D]``, block tables ``[B, M]`` (padded with
    any valid block id), ``context_lens`` ``[B]`` counts the keys each query may see.
    ``masked``: a batch of one is masked like any other rather than cut to its length (no
    read of ``context_lens`` on the host: what a traced step needs)."""
    b, h, d = q.shape
    hk = k_cache.shape[2]
    k = _gather(k_cache, block_tables)
    v = _gather(v_cache, block_tables)
    # The query heads sharing one KV head ride along as a "query length" of h // hk: no K/V
    # repetition, and every one of them sees the same keys.
    qg = q.view(b, hk, h // hk, d)
    if b == 1 and not masked:  # one sequence: cut to its length instead of masking
        n = int(context_lens[0])
        out = F.scaled_dot_product_attention(qg, k[:, :, :n], v[:, :, :n], scale=scale)
    else:
        mask = torch.arange(k.shape[2], device=q.device)[None, :] < context_lens[:, None]
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :],
                                             scale=scale)
    return out.reshape(b, h, d)


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, context_len: int, scale: float,
) -> torch.Tensor:
    """A chunk of ``n`` queries ``[n, H, D]`` of one sequence, the last ``n`` of its
    ``context_len`` positions, attending to the cached prefix and causally to the chunk."""
    n = q.shape[0]
    k = _gather(k_cache, block_table[None])[:, :, :context_len]
    v = _gather(v_cache, block_table[None])[:, :, :context_len]
    q_pos = torch.arange(context_len - n, context_len, device=q.device)
    mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """Dense causal attention over one whole sequence: ``q [n, H, D]``, ``k, v [n, Hk, D]``."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` normalised, and that sum (the next residual)."""
    h = residual + x
    return F.rms_norm(h, (h.shape[-1],), weight, eps), h


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleaved: bool = False) -> None:
    """Rotate ``x [T, heads, D]`` in place; ``cos``/``sin`` are ``[max_pos, D/2]`` tables.
    Pairs are ``(i, i + D/2)`` (half-split, Llama/NeoX) or ``(2i, 2i + 1)`` (interleaved,
    GPT-J)."""
    half = x.shape[-1] // 2
    c = cos[positions].unsqueeze(1).to(torch.float32)
    s = sin[positions].unsqueeze(1).to(torch.float32)
    xf = x.to(torch.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    if interleaved:
        x[..., 0::2], x[..., 1::2] = o1.to(x.dtype), o2.to(x.dtype)
    else:
        x[..., :half], x[..., half:] = o1.to(x.dtype), o2.to(x.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def paged_prefill_attention_varlen(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_starts: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Chunks of several sequences back to back in ``q [T, H, D]`` (``query_starts [S+1]``);
    sequence ``s``'s chunk is the last of its ``context_lens[s]`` positions."""
    out = torch.empty_like(q)
    for s in range(block_tables.shape[0]):
        a, b = int(query_starts[s]), int(query_starts[s + 1])
        if b > a:
            out[a:b] = paged_prefill_attention(q[a:b], k_cache, v_cache, block_tables[s],
                                               int(context_lens[s]), scale)
    return out
