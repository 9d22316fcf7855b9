"""Paged attention reference kernels against plain dense attention."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference


def dense_attention(q, k, v, scale):
    """q [n, H, D] (the last n positions), k/v [L, Hk, D]; causal, GQA by repetition."""
    n, h, _ = q.shape
    length, hk, _ = k.shape
    k = k.repeat_interleave(h // hk, dim=1)
    v = v.repeat_interleave(h // hk, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    q_pos = torch.arange(length - n, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def paged_copy(seqs, block_size, num_blocks, g):
    """Write each sequence's K/V into shuffled physical blocks; returns caches and tables."""
    hk, d = seqs[0][0].shape[1:]
    k_cache = torch.randn(num_blocks, block_size, hk, d, dtype=torch.float64, generator=g)
    v_cache = torch.randn_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for k, v in seqs:
        nb = -(-k.shape[0] // block_size)
        table = [free.pop() for _ in range(nb)]
        pos = torch.arange(k.shape[0])
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        kernels.write_kv(k, v, k_cache, v_cache, slots)
        tables.append(table)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_attention_over_ragged_paged_contexts(heads, kv_heads, block_size):
    g = torch.Generator().manual_seed(block_size * 10 + heads)
    lens = [1, 7, 16, 33]
    d, scale = 8, 8 ** -0.5
    seqs = [(torch.randn(n, kv_heads, d, dtype=torch.float64, generator=g),
             torch.randn(n, kv_heads, d, dtype=torch.float64, generator=g)) for n in lens]
    k_cache, v_cache, tables = paged_copy(seqs, block_size, 64, g)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, d, dtype=torch.float64, generator=g)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                         torch.tensor(lens), scale)
    for i, (k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i], dense_attention(q[i:i + 1], k, v, scale)[0])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("lens", [[33], [1, 7, 16, 33]])
def test_direct_decode_attention_gives_the_gathered_ones_values(heads, kv_heads, lens):
    """The compiled batch-1 step's attention (indexing the caches by the block tables, no
    gathered copy) against dense attention and the gathering kernel, padding masked."""
    g = torch.Generator().manual_seed(heads + len(lens))
    d, bs, scale = 8, 16, 8 ** -0.5
    seqs = [(torch.randn(n, kv_heads, d, dtype=torch.float64, generator=g),
             torch.randn(n, kv_heads, d, dtype=torch.float64, generator=g)) for n in lens]
    k_cache, v_cache, tables = paged_copy(seqs, bs, 16, g)
    width = max(map(len, tables)) + 1  # one block of padding past the widest
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, d, dtype=torch.float64, generator=g)
    out = reference.paged_decode_attention_direct(q, k_cache, v_cache, block_tables,
                                                  torch.tensor(lens), scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    for i, (k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i], dense_attention(q[i:i + 1], k, v, scale)[0])
    torch.testing.assert_close(out, reference.paged_decode_attention(
        q, k_cache, v_cache, block_tables, torch.tensor(lens), scale, masked=True))


@pytest.mark.parametrize("lens,groups", [
    ([1, 7, 16, 33], 1),  # little padding to save: one group, in the step's own order
    ([30, 2000, 31, 29, 1500, 3], 2),  # long ones, then short ones (widest 31: + 3 merged)
    ([5000, 40, 1200, 300, 9], 3),  # each run at most 2x wide, merged while padding is cheap
    ([2000], 1),
])
def test_decodes_attend_in_groups_of_similar_length_as_if_alone(lens, groups):
    """The torch path splits a step's decodes by context length (a short sequence does not
    attend over the padding of the longest); each gets what it would alone."""
    g = torch.Generator().manual_seed(len(lens))
    heads, kv_heads, d, bs, scale = 6, 2, 8, 16, 8 ** -0.5
    seqs = [(torch.randn(n, kv_heads, d, dtype=torch.float64, generator=g),
             torch.randn(n, kv_heads, d, dtype=torch.float64, generator=g)) for n in lens]
    k_cache, v_cache, tables = paged_copy(seqs, bs, sum(-(-n // bs) for n in lens) + 4, g)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    plan = reference.decode_groups(block_tables, torch.tensor(lens), bs)
    assert len(plan) == groups
    rows = sorted(r for p in plan for r in (range(len(lens)) if p.rows is None
                                             else p.rows.tolist()))
    assert rows == list(range(len(lens)))  # every decode in exactly one group
    for p in plan:  # each group gathers only as far as its widest sequence
        mine = range(len(lens)) if p.rows is None else p.rows.tolist()
        assert p.block_tables.shape[1] == -(-max(lens[i] for i in mine) // bs)
    q = torch.randn(len(lens), heads, d, dtype=torch.float64, generator=g)
    out = reference.grouped_decode_attention(q, k_cache, v_cache, plan, scale)
    for i, (k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i], dense_attention(q[i:i + 1], k, v, scale)[0])
    torch.testing.assert_close(out, kernels.paged_decode_attention(
        q, k_cache, v_cache, block_tables, torch.tensor(lens), scale))


@pytest.mark.parametrize("context_len,chunk", [(9, 9), (20, 5), (33, 1), (17, 16)])
def test_prefill_chunk_attends_to_cached_prefix_and_itself(context_len, chunk):
    g = torch.Generator().manual_seed(context_len)
    heads, kv_heads, d, bs = 6, 3, 8, 4
    k = torch.randn(context_len, kv_heads, d, dtype=torch.float64, generator=g)
    v = torch.randn(context_len, kv_heads, d, dtype=torch.float64, generator=g)
    k_cache, v_cache, (table,) = paged_copy([(k, v)], bs, 32, g)
    q = torch.randn(chunk, heads, d, dtype=torch.float64, generator=g)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, torch.tensor(table),
                                          context_len, 0.3)
    torch.testing.assert_close(out, dense_attention(q, k, v, 0.3))


def test_causal_attention_matches_dense():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(11, 4, 8, dtype=torch.float64, generator=g)
    k = torch.randn(11, 2, 8, dtype=torch.float64, generator=g)
    v = torch.randn(11, 2, 8, dtype=torch.float64, generator=g)
    torch.testing.assert_close(kernels.causal_attention(q, k, v, 0.5),
                               dense_attention(q, k, v, 0.5))


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv("TAILSCOPE_KERNELS", "cuda-magic")
    with pytest.raises(ValueError, match="cuda-magic"):
        kernels.kernel_backend()
    monkeypatch.setenv("TAILSCOPE_KERNELS", "torch")
    assert kernels.kernel_backend() == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_prepared_linear_gives_the_values_of_f_linear(dtype, m):
    from kernels.linear import Linear

    g = torch.Generator().manual_seed(m)
    w = torch.randn(96, 64, generator=g).to(dtype)
    x = torch.randn(m, 64, generator=g).to(dtype)
    lin = Linear(w)
    assert lin.shape == (96, 64) and lin.nbytes == w.numel() * w.element_size()
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w), rtol=0, atol=0)


def test_engine_refuses_unknown_kernel_backend(monkeypatch, tiny_model):
    from engine import Engine, EngineConfig

    monkeypatch.setenv("TAILSCOPE_KERNELS", "cuda-magic")
    with pytest.raises(ValueError, match="TAILSCOPE_KERNELS='cuda-magic'"):
        Engine(tiny_model, EngineConfig(num_kv_blocks=4, dtype="float64"))
