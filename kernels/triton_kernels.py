"""Triton kernels for the engine's hot path, each with the signature of its torch reference in
``kernels.reference`` (the oracle; ``tests/kernels`` compares them under ``TRITON_INTERPRET=1``).

- ``write_kv``: new K/V rows into their paged slots.
- ``paged_decode_attention``: one query per sequence, GQA, K/V gathered through block tables
  token by token (so any block size works), ragged context lengths; the context is split into
  partitions (split-K) computed in parallel, each with an online softmax, then merged with the
  usual stable rule (rescale by ``exp(m_i - max m)``).
- ``paged_prefill_attention_varlen``: a chunk of queries per sequence, ragged across the batch
  (``query_starts``), attending to the cached prefix and causally to the chunk, read through the
  block table; ``paged_prefill_attention`` is its one-sequence form (the engine's signature).
- ``rms_norm`` / ``add_rms_norm`` (fused residual add), ``rotary`` (in place, half-split or
  interleaved pairs), ``silu_and_mul``.

Every kernel accumulates in fp32 whatever the storage dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PARTITION = 256  # keys per split-K partition of the decode kernel
BLOCK_N = 64  # keys per inner iteration


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# ---- KV write ----------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, HK: tl.constexpr, D: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    slot = tl.load(slot_ptr + t)
    src = (t * HK + h) * D + d
    dst = (slot * HK + h) * D + d
    tl.store(kc_ptr + dst, tl.load(k_ptr + src, mask=m), mask=m)
    tl.store(vc_ptr + dst, tl.load(v_ptr + src, mask=m), mask=m)


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    t, hk, d = k.shape
    if t == 0:
        return
    _write_kv_kernel[(t, hk)](k.contiguous(), v.contiguous(), k_cache, v_cache,
                              slot_mapping.contiguous(), hk, d, _pow2(d))


# ---- paged decode attention (split-K) ---------------------------------------------------------
@triton.jit
def _decode_partition_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, m_ptr, l_ptr,
                             scale, H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                             BS: tl.constexpr, MAXB: tl.constexpr, S: tl.constexpr,
                             PART: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kvh = h // (H // HK)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    ctx = tl.load(ctx_ptr + b)
    q = tl.load(q_ptr + (b * H + h) * D + d, mask=dm, other=0.0).to(tl.float32)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    start = s * PART
    for n0 in range(start, tl.minimum(start + PART, ctx), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < ctx
        blk = tl.load(bt_ptr + b * MAXB + n // BS, mask=valid, other=0)
        row = (blk * BS + n % BS) * HK + kvh
        kv_off = row[:, None] * D + d[None, :]
        kvm = valid[:, None] & dm[None, :]
        k = tl.load(kc_ptr + kv_off, mask=kvm, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        # no valid key yet keeps m = -inf: subtract a finite stand-in so nothing turns nan
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.where(valid, tl.exp(scores - m_safe), 0.0)
        v = tl.load(vc_ptr + kv_off, mask=kvm, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    idx = (b * H + h) * S + s
    tl.store(out_ptr + idx * D + d, acc, mask=dm)
    tl.store(m_ptr + idx, m_i)
    tl.store(l_ptr + idx, l_i)


@triton.jit
def _decode_merge_kernel(part_ptr, m_ptr, l_ptr, out_ptr, H: tl.constexpr, D: tl.constexpr,
                         S: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sidx = tl.arange(0, BLOCK_S)
    sm = sidx < S
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    base = (b * H + h) * S
    m = tl.load(m_ptr + base + sidx, mask=sm, other=-float("inf"))
    big = tl.max(m, axis=0)
    w = tl.where(m == -float("inf"), 0.0, tl.exp(m - tl.where(big == -float("inf"), 0.0, big)))
    lsum = tl.sum(tl.load(l_ptr + base + sidx, mask=sm, other=0.0) * w, axis=0)
    parts = tl.load(part_ptr + (base + sidx)[:, None] * D + d[None, :],
                    mask=sm[:, None] & dm[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / lsum
    tl.store(out_ptr + (b * H + h) * D + d, out.to(out_ptr.dtype.element_ty), mask=dm)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float):
    b, h, d = q.shape
    _, bs, hk, _ = k_cache.shape
    maxb = block_tables.shape[1]
    max_ctx = int(context_lens.max()) if b else 0
    splits = max(1, -(-max_ctx // PARTITION))
    part = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
    m = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
    ls = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if b == 0:
        return out
    bt = block_tables.to(torch.int64).contiguous()
    ctx = context_lens.to(torch.int64).contiguous()
    _decode_partition_kernel[(b, h, splits)](
        q.contiguous(), k_cache, v_cache, bt, ctx, part, m, ls, float(scale), h, hk, d, bs,
        maxb, splits, PARTITION, BLOCK_N, _pow2(d))
    _decode_merge_kernel[(b, h)](part, m, ls, out, h, d, splits, _pow2(splits), _pow2(d))
    return out


# ---- paged prefill attention (varlen) ---------------------------------------------------------
@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, qstart_ptr, ctx_ptr, out_ptr, scale,
                    H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                    MAXB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    sq = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // (H // HK)
    q0 = tl.load(qstart_ptr + sq)
    n_q = tl.load(qstart_ptr + sq + 1) - q0
    ctx = tl.load(ctx_ptr + sq)
    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    qm = i < n_q
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q_pos = ctx - n_q + i  # the chunk is the last n_q of the sequence's ctx positions
    q = tl.load(q_ptr + ((q0 + i) * H + h)[:, None] * D + d[None, :],
                mask=qm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last = tl.minimum(ctx, ctx - n_q + (mb + 1) * BLOCK_M)  # keys any query here may see
    for n0 in range(0, last, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < ctx
        blk = tl.load(bt_ptr + sq * MAXB + n // BS, mask=valid, other=0)
        row = (blk * BS + n % BS) * HK + kvh
        kvm = valid[:, None] & dm[None, :]
        k = tl.load(kc_ptr + row[:, None] * D + d[None, :], mask=kvm, other=0.0)
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        see = (n[None, :] <= q_pos[:, None]) & valid[None, :] & qm[:, None]
        scores = tl.where(see, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.where(see, tl.exp(scores - m_safe[:, None]), 0.0)
        v = tl.load(vc_ptr + row[:, None] * D + d[None, :], mask=kvm, other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + ((q0 + i) * H + h)[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qm[:, None] & dm[None, :])


def paged_prefill_attention_varlen(q, k_cache, v_cache, block_tables, query_starts,
                                   context_lens, scale: float):
    """``q [T, H, D]`` holds the chunks of ``S`` sequences back to back (``query_starts [S+1]``);
    sequence ``s``'s chunk is the last ``n_s`` of its ``context_lens[s]`` positions."""
    t, h, d = q.shape
    _, bs, hk, _ = k_cache.shape
    s = block_tables.shape[0]
    out = torch.empty_like(q)
    if t == 0:
        return out
    counts = query_starts[1:] - query_starts[:-1]
    block_m = 16
    grid = (s, max(1, -(-int(counts.max()) // block_m)), h)
    _prefill_kernel[grid](q.contiguous(), k_cache, v_cache,
                          block_tables.to(torch.int64).contiguous(),
                          query_starts.to(torch.int64).contiguous(),
                          context_lens.to(torch.int64).contiguous(), out, float(scale), h, hk,
                          d, bs, block_tables.shape[1], block_m, BLOCK_N, _pow2(d))
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_table, context_len: int, scale: float):
    n = q.shape[0]
    starts = torch.tensor([0, n], dtype=torch.int64, device=q.device)
    ctx = torch.tensor([int(context_len)], dtype=torch.int64, device=q.device)
    return paged_prefill_attention_varlen(q, k_cache, v_cache, block_table[None], starts, ctx,
                                          scale)


# ---- norms, rotary, activation ------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, eps, N: tl.constexpr,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(x_ptr + r * N + c, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + r * N + c, mask=m, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + r * N + c, x.to(res_out_ptr.dtype.element_ty), mask=m)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * N + c, (x * inv * w).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x, weight, eps: float):
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, x2, weight, out, float(eps), n, False,
                                         _pow2(n))
    return out.view(x.shape)


def add_rms_norm(x, residual, weight, eps: float):
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n).contiguous(), residual.reshape(-1, n).contiguous()
    out, res_out = torch.empty_like(x2), torch.empty_like(r2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, res_out, weight, out, float(eps), n, True,
                                         _pow2(n))
    return out.view(x.shape), res_out.view(residual.shape)


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, NH: tl.constexpr, D: tl.constexpr,
                   INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    i = tl.arange(0, BLOCK)
    m = i < half
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_ptr + pos * half + i, mask=m, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * half + i, mask=m, other=0.0).to(tl.float32)
    base = (t * NH + h) * D
    if INTERLEAVED:
        i1 = 2 * i
        i2 = 2 * i + 1
    else:
        i1 = i
        i2 = i + half
    x1 = tl.load(x_ptr + base + i1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + i2, mask=m, other=0.0).to(tl.float32)
    tl.store(x_ptr + base + i1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(x_ptr + base + i2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=m)


def rotary(x, positions, cos, sin, interleaved: bool = False) -> None:
    t, nh, d = x.shape
    if not x.is_contiguous():
        raise ValueError("rotary works in place on a contiguous [T, heads, D] tensor")
    if t:
        _rotary_kernel[(t, nh)](x, positions.to(torch.int64).contiguous(), cos.contiguous(),
                                sin.contiguous(), nh, d, bool(interleaved), _pow2(d // 2))


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c0 = tl.program_id(1) * BLOCK
    c = c0 + tl.arange(0, BLOCK)
    m = c < N
    g = tl.load(g_ptr + r * N + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * N + c, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + r * N + c, y.to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul(gate, up):
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n).contiguous(), up.reshape(-1, n).contiguous()
    out = torch.empty_like(g2)
    block = min(1024, _pow2(n))
    if g2.shape[0]:
        _silu_mul_kernel[(g2.shape[0], -(-n // block))](g2, u2, out, n, block)
    return out.view(gate.shape)
