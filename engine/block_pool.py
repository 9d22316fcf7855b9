"""Paged KV bookkeeping: a pool of ref-counted fixed-size blocks, a prefix cache over full
blocks, and per-request block tables.

The pool only hands out block *ids*; the K/V tensors live in the model runner. Each block has a
ref count (prefix sharing and forked branches hold one block from several tables). A block whose
last holder frees it goes back to the free list, unless it is *cached*: a full block registered
under the chained hash of its tokens (``BlockKey``) stays where it is, evictable, so a later
request with the same prefix can take it back; ``allocate`` evicts cached blocks least recently
used first, only when the free list is empty. The free list hands out the lowest block id first
(a heap): the model runner's KV tensors become resident only where written
(``engine.model_runner.zero_pages``), so reusing low ids keeps the engine's memory at the
high-water mark of the blocks in use and cached instead of cycling through the whole pool.
Freeing a block nobody holds raises instead of corrupting the free list; the counters
(allocations, releases, hits, evictions) let tests check the books balance.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field


class BlockAccountingError(RuntimeError):
    """Double free, or use of a block id outside the pool: a bug, never a user error."""


class NoFreeBlocks(RuntimeError):
    """Physical allocation asked for more blocks than are free."""


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What a cached block holds: its tokens, after the chain of blocks before it, in a salt
    namespace (model revision, dtype, tenant). ``parent`` is the previous block's hash (or the
    salt's for the first block). Lookups compare the whole key, so a hash collision can never
    serve a different prefix."""

    parent: int
    tokens: tuple[int, ...]

    @property
    def hash(self) -> int:
        return hash((self.parent, self.tokens))


@dataclass
class PoolCounters:
    allocated: int = 0  # blocks handed out by allocate
    released: int = 0  # blocks whose ref count reached zero
    evictions: int = 0  # cached blocks reused for something else
    revived: int = 0  # evictable cached blocks taken back by a new holder
    queries: int = 0  # prompt tokens looked up in the prefix cache
    hits: int = 0  # of those, tokens served from cached blocks
    collisions: int = 0  # hash matched, key did not: refused


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks))  # a heap (sorted is one)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0, LRU first
        self.ref_counts = [0] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.cache: dict[int, int] = {}  # BlockKey.hash -> block id
        self.counters = PoolCounters()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cache)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = heapq.heappop(self._free)
            else:  # evict the least recently used cached block
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
                self.counters.evictions += 1
            self.ref_counts[b] = 1
            out.append(b)
        self.counters.allocated += n
        return out

    def incref(self, block_id: int) -> None:
        """Share a block. A cached block nobody holds is taken back from the evictable set."""
        self._check(block_id)
        if self.ref_counts[block_id] == 0:
            if block_id not in self._evictable:
                raise BlockAccountingError(f"block {block_id} is free; cannot share it")
            del self._evictable[block_id]
            self.counters.revived += 1
        self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self._check(b)
            if self.ref_counts[b] == 0:
                raise BlockAccountingError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.counters.released += 1
                if self.block_key[b] is not None:
                    self._evictable[b] = None  # most recently used end
                else:
                    heapq.heappush(self._free, b)

    # ---- the prefix cache -------------------------------------------------------------------
    def lookup(self, key: BlockKey) -> int | None:
        b = self.cache.get(key.hash)
        if b is None:
            return None
        if self.block_key[b] != key:
            self.counters.collisions += 1
            return None
        return b

    def register(self, block_id: int, key: BlockKey) -> bool:
        """Cache a full, computed block under its key. False when the key is cached already
        (by another block: this one stays private) or the block is cached under another key."""
        self._check(block_id)
        if self.ref_counts[block_id] == 0:
            raise BlockAccountingError(f"block {block_id} is free; cannot cache it")
        if key.hash in self.cache or self.block_key[block_id] is not None:
            return False
        self.cache[key.hash] = block_id
        self.block_key[block_id] = key
        return True

    def _uncache(self, b: int) -> None:
        key = self.block_key[b]
        if key is not None and self.cache.get(key.hash) == b:
            del self.cache[key.hash]
        self.block_key[b] = None

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
