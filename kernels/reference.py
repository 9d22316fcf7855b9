"""Torch reference kernels: attention over a paged KV cache, norms, rotary, activation.

Cache layout: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
a sequence's token at position ``p`` lives in block ``block_table[p // block_size]`` at offset
``p % block_size``. These are the oracle for the Triton kernels and the CPU implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    if q.shape[0] == 1 and not masked:  # one sequence: cut to its length instead of masking
        return _attend(q, k_cache, v_cache, block_tables, None, int(context_lens[0]), scale)
    keys = block_tables.shape[1] * k_cache.shape[1]
    mask = torch.arange(keys, device=q.device)[None, :] < context_lens[:, None]
    return _attend(q, k_cache, v_cache, block_tables, mask[:, None, None, :], 0, scale)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, mask: torch.Tensor | None, length: int, scale: float
            ) -> torch.Tensor:
    """One query token per sequence over its gathered blocks: masked by ``mask``
    ``[B, 1, 1, keys]``, or (None) cut to the first ``length`` keys."""
    b, h, d = q.shape
    hk = k_cache.shape[2]
    k = _gather(k_cache, block_tables)
    v = _gather(v_cache, block_tables)
    # The query heads sharing one KV head ride along as a "query length" of h // hk: no K/V
    # repetition, and every one of them sees the same keys.
    qg = q.view(b, hk, h // hk, d)
    if mask is None:
        out = F.scaled_dot_product_attention(qg, k[:, :, :length], v[:, :, :length],
                                             scale=scale)
    else:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, h, d)


def paged_decode_attention_direct(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """``paged_decode_attention`` (masked) written for ``torch.compile``: inductor turns the
    indexing of the caches by the block tables into loads inside the fused score and output
    loops, so no gathered copy of the keys and values is made (eager, this materialises
    ``[B, keys, H, D]`` products: trace it, never call it as is). Scores, softmax and the
    weighted sum are float32 (or the inputs' wider type)."""
    b, m = block_tables.shape
    _, bs, hk, d = k_cache.shape
    h = q.shape[1]
    g = h // hk
    acc = torch.promote_types(q.dtype, torch.float32)
    k = k_cache[block_tables].view(b, m, bs, hk, 1, d).to(acc)
    v = v_cache[block_tables].view(b, m, bs, hk, 1, d).to(acc)
    s = (q.view(b, 1, 1, hk, g, d).to(acc) * k).sum(-1) * scale  # [b, m, bs, hk, g]
    pos = torch.arange(m * bs, device=q.device).view(1, m, bs, 1, 1)
    s = s.masked_fill(pos >= context_lens.view(b, 1, 1, 1, 1), float("-inf"))
    p = torch.softmax(s.view(b, m * bs, hk, g), dim=1).view(b, m, bs, hk, g, 1)
    return (p * v).sum((1, 2)).to(q.dtype).reshape(b, h, d)


# What one more group of decodes costs, in padded keys it would have to save to pay for itself
# (its gather, mask, attention call and output scatter in every layer). Tried on the bundled
# model (bf16, one thread) at 128, 384 and 1024 on 8 and 32 decodes of mixed lengths: the
# step times were within this VM's run-to-run noise of each other; the largest keeps a step
# in the fewest groups.
GROUP_COST_KEYS = 1024


@dataclass
class DecodeGroup:
    """Decodes of one step that attend together: ``rows`` of the step's decodes (None: all of
    them, in order), their block tables cut to the group's widest, and the mask of their
    context lengths (None for a single sequence, which is cut to its ``length`` instead)."""

    rows: torch.Tensor | None
    block_tables: torch.Tensor
    mask: torch.Tensor | None
    length: int


def decode_groups(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
                  ) -> list[DecodeGroup]:
    """The step's decodes split by context length, so that a short sequence does not gather
    and attend over the padding of the step's longest one. One batched call pads every
    sequence to the widest block table: eleven 30-token decodes beside one of 1,900 tokens
    gathered and attended 12 x 1,900 keys (540 ms for the bundled model's step, against 37 ms
    for either part alone). Sequences are sorted by length and cut into runs where a run's
    widest is at most twice its narrowest, and neighbouring runs joined where the padding that
    adds costs less than the groups it saves (``GROUP_COST_KEYS`` a group). Computed once per
    step: every layer reuses the groups, their tables and their masks. A step of sequences of
    about one length stays one group, in its own order (rows None)."""
    lens = context_lens.tolist()
    b = len(lens)
    order = sorted(range(b), key=lens.__getitem__, reverse=True)
    runs: list[list[int]] = []
    for i in order:
        if runs and 2 * lens[i] > lens[runs[-1][0]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    # neighbouring runs joined where the padding costs less than the groups it saves: the
    # cheapest cut of the runs into groups, a group costing GROUP_COST_KEYS plus its padding
    # (few runs: each starts at most half as long as the one before)
    count, total = [0], [0]
    for run in runs:
        count.append(count[-1] + len(run))
        total.append(total[-1] + sum(lens[i] for i in run))
    best, cut = [0.0], [0]  # best[j]: runs[:j] in groups; cut[j]: where its last group starts
    for j in range(1, len(runs) + 1):
        options = [(best[i] + GROUP_COST_KEYS + lens[runs[i][0]] * (count[j] - count[i])
                    - (total[j] - total[i]), i) for i in range(j)]
        cost, start = min(options)
        best.append(cost)
        cut.append(start)
    merged, j = [], len(runs)
    while j:
        merged.append([i for run in runs[cut[j]:j] for i in run])
        j = cut[j]
    merged.reverse()
    if len(merged) == 1:
        return [_group(None, block_tables, context_lens, lens[order[0]], block_size)]
    out = []
    for run in merged:
        rows = torch.tensor(run)
        out.append(_group(rows, block_tables.index_select(0, rows),
                          context_lens.index_select(0, rows), lens[run[0]], block_size))
    return out


def _group(rows, block_tables: torch.Tensor, context_lens: torch.Tensor, widest: int,
           block_size: int) -> DecodeGroup:
    tables = block_tables[:, :-(-widest // block_size)]
    if tables.shape[0] == 1:
        return DecodeGroup(rows, tables, None, widest)
    keys = tables.shape[1] * block_size
    mask = torch.arange(keys)[None, :] < context_lens[:, None]
    return DecodeGroup(rows, tables, mask[:, None, None, :], widest)


def grouped_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             groups: list[DecodeGroup], scale: float) -> torch.Tensor:
    """``paged_decode_attention`` over ``decode_groups``: each group gathers and attends only
    as far as its own widest sequence."""
    if len(groups) == 1:
        g = groups[0]
        return _attend(q, k_cache, v_cache, g.block_tables, g.mask, g.length, scale)
    out = torch.empty_like(q)
    for g in groups:
        out.index_copy_(0, g.rows, _attend(q.index_select(0, g.rows), k_cache, v_cache,
                                           g.block_tables, g.mask, g.length, scale))
    return out


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
