"""Batch-invariant kernels: a row's result depends on that row alone, bit for bit.

The engine's ``batch_invariant`` mode runs on these. What varies otherwise, measured on this
machine kind (torch 2.13, 2 threads):

More: docs/design/engine-notes.md#kernelsinvariant."""

from __future__ import annotations

import functools

import torch

from kernels.linear import can_prepack

CHUNKS = (512, 32)  # rows per oneDNN call, largest first: the probe picks the first that holds
CHUNK = 32
KEY_BLOCK = 64  # keys per partial sum of the softmax and of P @ V


def _prepack(weight: torch.Tensor) -> torch.Tensor | None:
    if not can_prepack(weight, (torch.float32, torch.bfloat16)):
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

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """One call of at most ``chunk`` rows; a single row is a gemv otherwise, so it is padded
        to the two-row kernel."""
        if x.shape[0] == 1:
            return self._mm(torch.cat([x, torch.zeros_like(x)]))[:1]
        return self._mm(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m <= self.chunk:
            return self._rows(x)
        out = x.new_empty((m, self.shape[0]))
        for a in range(0, m, self.chunk):
            out[a:a + self.chunk] = self._rows(x[a:a + self.chunk])
        return out


def verify_linear(weight: torch.Tensor, chunk: int = CHUNK, seed: int = 0) -> bool:
    """Whether ``InvariantLinear(weight, chunk)`` is row-invariant on this CPU: random rows in
    calls of many sizes up to ``chunk`` (and above), at two places in memory, against each row
    computed alone."""
    g = torch.Generator().manual_seed(seed + 1)
    lin = InvariantLinear(weight, chunk)
    n = chunk + 3
    x = torch.randn((n, weight.shape[1]), generator=g).to(weight.dtype)
    alone: dict[int, torch.Tensor] = {}

    def rows(a: int, b: int) -> torch.Tensor:
        for i in range(a, b):
            if i not in alone:
                alone[i] = lin(x[i:i + 1])[0]
        return torch.stack([alone[i] for i in range(a, b)])

    for m in [s for s in _PROBE_SIZES if s <= chunk + 1] + [n]:
        for at in ((0, n - m) if m <= 33 else (n - m,)):  # small calls at two offsets
            if not torch.equal(lin(x[at:at + m]), rows(at, at + m)):
                return False
    return True


# every row count up to 33 (kernels change at small counts), then around the powers of two
_PROBE_SIZES = (*range(2, 34), 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513)


@functools.lru_cache(maxsize=64)
def _verify_shape(shape: tuple[int, int], dtype: torch.dtype, chunk: int, seed: int) -> bool:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * shape[1] ** -0.5).to(dtype)
    return verify_linear(w, chunk, seed)


def invariant_chunk(shape: tuple[int, int], dtype: torch.dtype) -> int:
    """The row chunk ``InvariantLinear`` may use for this weight shape on this CPU: the
    largest of ``CHUNKS`` the probe holds for (fp32 oneDNN: 512; bf16: 32, where its kernel
    changes), else 2 (every call the same two-row shape); raises if none holds."""
    for chunk in (*CHUNKS, 2):
        if _verify_shape(tuple(shape), dtype, chunk, 0):
            return chunk
    raise RuntimeError(f"batch_invariant: this CPU's {dtype} matmul of a {shape} weight is not "
                       "row-invariant even in fixed two-row calls; turn the mode off")


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` from ``exp`` and exact ops (no vector-tail dependence)."""
    return gate / (1 + torch.exp(-gate)) * up


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
            ) -> torch.Tensor:
    """softmax(q k^T) v for rows ``q [..., R, D]`` (R >= 2, already scaled) over key blocks
    ``k, v [..., nb, KEY_BLOCK, D]``; ``valid`` broadcasts to the scores ``[..., nb, R,
    KEY_BLOCK]``. The max is exact in any order; every sum runs over one block of KEY_BLOCK keys
    and the blocks are folded in key order (``cumsum``), so blocks past a row's context (all
    masked: exact zeros) change nothing and any number of them may follow."""
    s = torch.matmul(q.unsqueeze(-3), k.transpose(-1, -2))
    s = s.masked_fill(~valid, float("-inf"))
    m = s.amax(-1, keepdim=True).amax(-3, keepdim=True)
    e = torch.exp(s - m)
    denom = e.sum(-1).cumsum(-2).select(-2, -1)  # [..., R]
    num = torch.matmul(e, v).cumsum(-3).select(-3, -1)  # [..., R, D]
    return num / denom.unsqueeze(-1)


def _block_index(tables: torch.Tensor, nb: int, block_size: int) -> torch.Tensor:
    """``tables [B, M]`` -> the flat cache block ids holding the first ``nb * KEY_BLOCK``
    positions of each row (past a table's end its first block repeats: those keys are
    masked). Once per step, shared by every layer's K and V."""
    b = tables.shape[0]
    need = -(-nb * KEY_BLOCK // block_size)
    if need > tables.shape[1]:
        tables = torch.cat([tables, tables[:, :1].expand(b, need - tables.shape[1])], 1)
    return tables[:, :need].reshape(-1)


def _blocks(cache: torch.Tensor, index: torch.Tensor, b: int, nb: int) -> torch.Tensor:
    """fp32 key blocks ``[B, Hk, nb, KEY_BLOCK, D]`` of ``b`` sequences from their
    ``_block_index`` (one gather, one copy)."""
    _, bs, hk, d = cache.shape
    length = nb * KEY_BLOCK
    rows = cache.index_select(0, index).view(b, -1, hk, d)
    rows = rows[:, :length].transpose(1, 2).to(torch.float32,
                                               memory_format=torch.contiguous_format)
    return rows.view(b, hk, nb, KEY_BLOCK, d)


# row counts whose matmuls may round alike, tried in this order by ``row_multiple``
ROW_MULTIPLES = (2, 4, 8, 16)


@functools.lru_cache(maxsize=16)
def row_multiple(head_dim: int) -> int:
    """The row multiple ``p`` that attention's matmuls are padded to on this CPU: the
    smallest of ``ROW_MULTIPLES`` for which every call of ``k * p`` rows (at any offset) gives
    each row the bits one large call gives it, for both of attention's shapes (scores:
    ``head_dim`` x ``KEY_BLOCK``; P @ V: ``KEY_BLOCK`` x ``head_dim``). Measured: with AVX-512
    every row count from 2 up agrees (p = 2: one row is a gemv); MKL's AVX2 sgemm rounds 1-3,
    5-7 and 9-11 rows otherwise than 4, 8 and 12 and more (p = 4). Raises if none holds."""
    g = torch.Generator().manual_seed(7)
    n = 16 * 17
    shapes = ((head_dim, KEY_BLOCK), (KEY_BLOCK, head_dim))
    probes = [(torch.randn(n + 16, a, generator=g), torch.randn(a, b, generator=g))
              for a, b in shapes]
    fulls = [x @ w for x, w in probes]
    for p in ROW_MULTIPLES:
        if all(torch.equal(x[s:s + m] @ w, full[s:s + m])
               for (x, w), full in zip(probes, fulls, strict=True)
               for m in range(p, n + 1, p) for s in (0, 3)):
            return p
    raise RuntimeError(f"batch_invariant: this CPU's fp32 matmuls for attention (head_dim "
                       f"{head_dim}) are not row-invariant at any row multiple of "
                       f"{ROW_MULTIPLES}; turn the mode off")


def _pad_rows(q: torch.Tensor, p: int) -> tuple[torch.Tensor, int]:
    """Zero rows up to a multiple of ``p`` (``row_multiple``), so every matmul has a row count
    that rounds alike (one row is a gemv with other rounding)."""
    r = q.shape[-2]
    extra = -r % p
    if not extra:
        return q, r
    pad = q.new_zeros((*q.shape[:-2], extra, q.shape[-1]))
    return torch.cat([q, pad], -2), r


class DecodePlan:
    """What every layer's decode attention of one step shares: the padded block tables, the
    number of key blocks and the mask (built once per forward, not once per layer)."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 block_size: int) -> None:
        self.b = block_tables.shape[0]
        self.nb = -(-int(context_lens.max()) // KEY_BLOCK)
        self.index = _block_index(block_tables, self.nb, block_size)
        pos = torch.arange(self.nb * KEY_BLOCK).view(self.nb, 1, KEY_BLOCK)
        self.valid = (pos[None] < context_lens.view(-1, 1, 1, 1))[:, None]  # [B,1,nb,1,K]


class PrefillPlan:
    """The same for one sequence's prefill chunk: its queries in tiles of ``QUERY_TILE``
    tokens, each attending only over the key blocks up to its last position (the causal
    triangle's empty blocks are skipped, which the fold allows)."""

    def __init__(self, block_table: torch.Tensor, context_len: int, n: int, group: int,
                 block_size: int, rows: int = 2) -> None:
        """``rows``: the row multiple of this CPU's attention matmuls (``row_multiple``)."""
        self.n, self.group, self.rows = n, group, rows
        self.nb = -(-context_len // KEY_BLOCK)
        self.index = _block_index(block_table[None], self.nb, block_size)
        first = context_len - n
        self.tiles = []  # (row start, row end, key blocks, valid [nb, R, K])
        for a in range(0, n, QUERY_TILE):
            b = min(a + QUERY_TILE, n)
            nb = -(-(first + b) // KEY_BLOCK)
            q_pos = torch.arange(first + a, first + b).repeat_interleave(group)
            if q_pos.numel() % rows:  # the padding rows (zeros) see the last one's keys
                q_pos = torch.cat([q_pos, q_pos[-1:].expand(-q_pos.numel() % rows)])
            pos = torch.arange(nb * KEY_BLOCK).view(nb, 1, KEY_BLOCK)
            self.tiles.append((a * group, b * group, nb, pos <= q_pos.view(1, -1, 1)))


QUERY_TILE = 64


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: DecodePlan, scale: float) -> torch.Tensor:
    b, h, d = q.shape
    hk = k_cache.shape[2]
    k = _blocks(k_cache, plan.index, plan.b, plan.nb)
    v = _blocks(v_cache, plan.index, plan.b, plan.nb)
    rows, r = _pad_rows((q.float() * scale).view(b, hk, h // hk, d), row_multiple(d))
    return _attend(rows, k, v, plan.valid)[:, :, :r].reshape(b, h, d).to(q.dtype)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      plan: PrefillPlan, scale: float) -> torch.Tensor:
    n, h, d = q.shape
    hk = k_cache.shape[2]
    g = plan.group
    k = _blocks(k_cache, plan.index, 1, plan.nb)[0]  # [Hk, nb, K, D]
    v = _blocks(v_cache, plan.index, 1, plan.nb)[0]
    rows = (q.float() * scale).view(n, hk, g, d).transpose(0, 1).reshape(hk, n * g, d)
    out = torch.empty_like(rows)
    for a, b, nb, valid in plan.tiles:
        tile, r = _pad_rows(rows[:, a:b], plan.rows)
        out[:, a:b] = _attend(tile, k[:, :nb], v[:, :nb], valid)[:, :r]
    return out.view(hk, n, g, d).transpose(0, 1).reshape(n, h, d).to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """As ``kernels.reference.paged_decode_attention``, batch-invariant."""
    plan = DecodePlan(block_tables, context_lens, k_cache.shape[1])
    return decode_attention(q, k_cache, v_cache, plan, scale)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float
                            ) -> torch.Tensor:
    """As ``kernels.reference.paged_prefill_attention``, batch-invariant: query ``i`` of the
    chunk gives what it would as a decode at its position."""
    plan = PrefillPlan(block_table, context_len, q.shape[0], q.shape[1] // k_cache.shape[2],
                       k_cache.shape[1], row_multiple(k_cache.shape[-1]))
    return prefill_attention(q, k_cache, v_cache, plan, scale)
