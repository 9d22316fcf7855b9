"""Batch-invariant kernels: a row's result depends on that row alone, bit for bit.

The engine's ``batch_invariant`` mode runs on these. What varies otherwise, measured on this
machine kind (torch 2.13, 2 threads):

- **Matmuls choose their kernel by the number of rows.** MKL's fp32 ``F.linear`` gives other
  last bits for 1 row (a gemv), 2-3, 4-15 and 16+ rows; oneDNN with a prepacked weight is the
  same kernel for every row count from 2 up in fp32, but 1 row is a gemv; in bf16 it is the same
  kernel for 1-32 rows and another above. So ``InvariantLinear`` prepacks for oneDNN in both
  dtypes and feeds it rows in chunks of 2..32 (one row is padded to two). ``verify_linear``
  checks that premise on the CPU at hand when a model loads, and falls back to fixed two-row
  calls if it does not hold.
- **Attention's reductions run over a length that changes with the batch.** A prefill chunk's
  queries attend over the whole chunk's context, a decode query over its own; SDPA picks its
  blocking by those lengths, and a masked batch of decodes takes another path than one decode.
  ``attention`` computes every query the same way whatever else is in the call: scores as a
  matmul with at least two rows and a fixed reduction (the head dim), the max (exact in any
  order), ``exp``, then sums over fixed blocks of ``KEY_BLOCK`` keys (zeros past a query's
  context, so a longer padded context adds exact zeros) folded across blocks in key order by
  ``cumsum`` (a sequential scan). All in fp32.
- **Elementwise ops with a vector tail.** ``F.silu`` gives other bits for elements in the
  scalar tail of a tensor whose size is not a multiple of the vector width; ``silu_and_mul``
  here is built from ``exp`` and exact IEEE ops, which agree in both paths.

Norms (``F.rms_norm``: a per-row reduction of a fixed length, then exact ops), RoPE, the
embedding and residual adds are row-invariant as they stand (the engine tests check the whole
forward, not these premises one by one).
"""

from __future__ import annotations

import functools

import torch

CHUNK = 32  # rows per oneDNN call: the kernel is the same for every count in 2..CHUNK
KEY_BLOCK = 64  # keys per partial sum of the softmax and of P @ V


def _prepack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or not hasattr(
            torch.ops.mkldnn, "_reorder_linear_weight") or weight.dtype not in (
            torch.float32, torch.bfloat16):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


class InvariantLinear:
    """``y = x @ weight.T`` whose every row is what that row alone gives."""

    def __init__(self, weight: torch.Tensor, chunk: int = CHUNK) -> None:
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        packed = _prepack(weight)
        self.prepacked = packed is not None
        self.weight = packed if packed is not None else weight.contiguous()
        self.chunk = max(2, chunk)

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return torch.nn.functional.linear(x, self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m == 1:  # a gemv otherwise: pad to the two-row kernel
            return self._mm(torch.cat([x, torch.zeros_like(x)]))[:1]
        if m <= self.chunk:
            return self._mm(x)
        out = x.new_empty((m, self.shape[0]))
        for a in range(0, m, self.chunk):
            b = min(a + self.chunk, m)
            if b - a == 1:
                out[a:b] = self._mm(torch.cat([x[a:b], torch.zeros_like(x[a:b])]))[:1]
            else:
                out[a:b] = self._mm(x[a:b])
        return out


def verify_linear(weight: torch.Tensor, chunk: int = CHUNK, seed: int = 0) -> bool:
    """Whether ``InvariantLinear(weight, chunk)`` is row-invariant on this CPU: random rows in
    calls of every size up to ``chunk`` (and a few above) against each row alone."""
    return _verify(tuple(weight.shape), weight.dtype, chunk, seed, weight)


@functools.lru_cache(maxsize=64)
def _verify_shape(shape: tuple[int, int], dtype: torch.dtype, chunk: int, seed: int) -> bool:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * shape[1] ** -0.5).to(dtype)
    return _verify(shape, dtype, chunk, seed, w)


def _verify(shape, dtype, chunk, seed, weight) -> bool:
    g = torch.Generator().manual_seed(seed + 1)
    lin = InvariantLinear(weight, chunk)
    n = 2 * chunk + 3
    x = torch.randn((n, shape[1]), generator=g).to(dtype)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(n)])
    for m in (*range(2, chunk + 1), chunk + 1, n):
        for at in (0, n - m):  # the rows' place in memory does not count either
            if not torch.equal(lin(x[at:at + m]), alone[at:at + m]):
                return False
    return True


def invariant_chunk(shape: tuple[int, int], dtype: torch.dtype) -> int:
    """The row chunk ``InvariantLinear`` may use for this weight shape on this CPU: ``CHUNK``
    if the probe holds, else 2 (every call the same two-row shape); raises if neither holds."""
    for chunk in (CHUNK, 2):
        if _verify_shape(tuple(shape), dtype, chunk, 0):
            return chunk
    raise RuntimeError(f"batch_invariant: this CPU's {dtype} matmul of a {shape} weight is not "
                       "row-invariant even in fixed two-row calls; turn the mode off")


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` from ``exp`` and exact ops (no vector-tail dependence)."""
    return gate / (1 + torch.exp(-gate)) * up


def _softmax_pv(scores: torch.Tensor, valid: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``scores [..., R, L]`` (L a multiple of KEY_BLOCK), ``valid`` broadcastable to them,
    ``v [..., L, D]``: softmax(scores) @ v with every sum in blocks of KEY_BLOCK keys folded
    in key order. Padding past a row's valid keys contributes exact zeros."""
    s = scores.masked_fill(~valid, float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    *lead, r, length = e.shape
    nb = length // KEY_BLOCK
    eb = e.view(*lead, r, nb, KEY_BLOCK)
    denom = eb.sum(-1).cumsum(-1)[..., -1:]  # [..., R, 1]
    # P @ V per key block: [..., nb, R, K] @ [..., nb, K, D] -> [..., nb, R, D], then the fold
    vb = v.reshape(*lead, nb, KEY_BLOCK, v.shape[-1])
    partial = torch.matmul(eb.movedim(-2, -3).contiguous(), vb)
    num = partial.cumsum(-3).select(-3, nb - 1)
    return num / denom


def _padded_len(n: int) -> int:
    return -(-n // KEY_BLOCK) * KEY_BLOCK


def _keys(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, M]`` block tables -> fp32 ``[B, Hk, length, D]`` (``length`` padded up to a
    multiple of KEY_BLOCK by repeating blocks; those keys are masked)."""
    b, m = block_tables.shape
    _, bs, hk, d = cache.shape
    need = -(-length // bs)
    if need > m:
        block_tables = torch.cat([block_tables, block_tables[:, :1].expand(b, need - m)], 1)
    rows = cache.index_select(0, block_tables[:, :need].reshape(-1))
    return rows.view(b, need * bs, hk, d)[:, :length].transpose(1, 2).float()


def _two_rows(q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """At least two rows per matmul (one row is a gemv with other rounding)."""
    r = q.shape[-2]
    if r >= 2:
        return q, r
    return torch.cat([q, torch.zeros_like(q)], -2), r


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """As ``kernels.reference.paged_decode_attention``, batch-invariant."""
    b, h, d = q.shape
    hk = k_cache.shape[2]
    length = _padded_len(int(context_lens.max()))
    k = _keys(k_cache, block_tables, length)
    v = _keys(v_cache, block_tables, length)
    qg, r = _two_rows(q.float().view(b, hk, h // hk, d))
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hk, G, L]
    valid = (torch.arange(length)[None, :] < context_lens[:, None])[:, None, None, :]
    out = _softmax_pv(scores, valid, v)[:, :, :r]
    return out.reshape(b, h, d).to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float
                            ) -> torch.Tensor:
    """As ``kernels.reference.paged_prefill_attention``, batch-invariant: query ``i`` of the
    chunk gives what it would as a decode at its position."""
    n, h, d = q.shape
    hk = k_cache.shape[2]
    g = h // hk
    length = _padded_len(context_len)
    k = _keys(k_cache, block_table[None], length)[0]  # [Hk, L, D]
    v = _keys(v_cache, block_table[None], length)[0]
    rows = q.float().view(n, hk, g, d).permute(1, 0, 2, 3).reshape(hk, n * g, d)
    rows, r = _two_rows(rows)
    scores = torch.matmul(rows, k.transpose(-1, -2)) * scale  # [Hk, n*G (+1), L]
    q_pos = torch.arange(context_len - n, context_len).repeat_interleave(g)
    if rows.shape[-2] > r:
        q_pos = torch.cat([q_pos, q_pos[-1:]])
    valid = torch.arange(length)[None, :] <= q_pos[:, None]
    out = _softmax_pv(scores, valid[None], v)[:, :r]  # [Hk, n*G, D]
    return out.view(hk, n, g, d).permute(1, 0, 2, 3).reshape(n, h, d).to(q.dtype)
