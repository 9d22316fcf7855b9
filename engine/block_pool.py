"""Paged KV bookkeeping: a pool of ref-counted fixed-size blocks and per-request block tables.

The pool only hands out block *ids*; the K/V tensors live in the model runner. Each block has a
ref count (prefix sharing and forked branches hold one block from several tables) and a hash
slot (the prefix cache of a later issue keys full blocks by it). A block returns to the free list
only when its last holder frees it; freeing a block nobody holds raises instead of corrupting
the free list.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class BlockAccountingError(RuntimeError):
    """Double free, or use of a block id outside the pool: a bug, never a user error."""


class NoFreeBlocks(RuntimeError):
    """Physical allocation asked for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def incref(self, block_id: int) -> None:
        self._check(block_id)
        if self.ref_counts[block_id] == 0:
            raise BlockAccountingError(f"block {block_id} is free; cannot share it")
        self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self._check(b)
            if self.ref_counts[b] == 0:
                raise BlockAccountingError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.block_hash[b] = None
                self._free.append(b)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockAccountingError(f"block id {block_id} outside pool of {self.num_blocks}")


@dataclass
class BlockTable:
    """Logical-to-physical block map of one request: token ``p`` lives in
    ``blocks[p // block_size]`` at offset ``p % block_size``."""

    block_size: int
    blocks: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def slot(self, position: int) -> int:
        return self.blocks[position // self.block_size] * self.block_size + \
            position % self.block_size
