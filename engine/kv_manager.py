"""The scheduler's narrow window onto the KV cache: admission, physical slots, the prefix cache,
copy-on-write, and the books that keep allocation from failing where it must not.

Accounting. ``reserved_total`` is the sum of the blocks requests may still take under their
reservations; admission keeps ``pool.num_used + reserved_total <= num_blocks`` (evictable cached
blocks count as free), so an allocation within a reservation can never fail. How much admission
reserves is the engine's choice: everything a request can ever need (``preemption="off"``: never
preempts) or only its prompt (the other modes: decode blocks come from what is unreserved, and
when none is left the scheduler preempts a victim).

More: docs/design/engine-notes.md#enginekv_manager."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from engine.block_pool import BlockAccountingError, BlockKey, BlockPool, BlockTable


@dataclass(frozen=True, slots=True)
class KVUsage:
    blocks_total: int
    blocks_used: int
    blocks_reserved: int
    blocks_cached: int = 0


@dataclass(slots=True, eq=False)  # compared by identity (``data`` holds tensors)
class SwappedKV:
    """A preempted request's computed KV in host memory: ``data`` is filled by the model runner
    when the queued swap-out runs, and read back by the queued swap-in."""

    num_blocks: int
    data: Any = None


@dataclass(frozen=True, slots=True)
class BlockOp:
    """One queued data movement: ``copy`` (blocks = (src, dst), src pinned until it has run),
    ``out`` (blocks -> host) or ``in`` (host -> blocks)."""

    kind: str
    owner: str  # the request it is for
    blocks: tuple[int, ...]
    host: SwappedKV | None = None


@dataclass
class _Entry:
    table: BlockTable
    reserved: int  # blocks it may still allocate under its reservation
    root: int  # hash of its salt: the chain's start
    chain: list[int] = field(default_factory=list)  # hashes of its leading full blocks


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 salt: str = "") -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.salt = salt
        self._entries: dict[str, _Entry] = {}
        self._ops: list[BlockOp] = []  # run in order before the next forward
        self.reserved_total = 0

    # ---- queries -------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return self.pool.blocks_for(num_tokens)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def has_reservation(self, request_id: str) -> bool:
        return request_id in self._entries

    @property
    def num_holders(self) -> int:
        """Requests holding a reservation or blocks."""
        return len(self._entries)

    def block_table(self, request_id: str) -> BlockTable:
        return self._entries[request_id].table

    def headroom(self) -> int:
        """Blocks neither in use nor promised to a reservation."""
        return self.pool.num_blocks - self.pool.num_used - self.reserved_total

    def usage(self) -> KVUsage:
        return KVUsage(self.pool.num_blocks, self.pool.num_used, self.reserved_total,
                       self.pool.num_cached)

    def _root(self, cache_salt: str) -> int:
        digest = hashlib.sha256(f"{self.salt}\x00{cache_salt}".encode()).digest()
        return int.from_bytes(digest[:8], "little")

    # ---- admission -------------------------------------------------------------------------
    def admit(self, request_id: str, token_ids: list[int], reserve_tokens: int,
              cache_salt: str = "", use_cache: bool = True, headroom: int = 0) -> int | None:
        """Reserve for a request whose first ``len(token_ids)`` tokens need KV, taking the
        longest cached prefix. Returns how many tokens are already computed (cached), or None
        when it does not fit now (nothing changes). ``headroom`` blocks must stay unpromised
        (admission's watermark, so new requests do not starve running ones)."""
        if request_id in self._entries:
            raise BlockAccountingError(f"request {request_id} already holds a reservation")
        bs, n = self.block_size, len(token_ids)
        root = self._root(cache_salt)
        hits: list[int] = []
        chain: list[int] = []
        if self.prefix_caching and use_cache and n:
            parent = root
            for i in range(n // bs):
                key = BlockKey(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
                b = self.pool.lookup(key)
                if b is None:
                    break
                hits.append(b)
                parent = key.hash
                chain.append(parent)
        cow_src = None
        if hits and len(hits) * bs == n:  # all cached: recompute the last token, privately
            cow_src = hits.pop()
            chain.pop()
        total = self.blocks_needed(max(reserve_tokens, n))
        new = total - len(hits)
        revived = sum(1 for b in {*hits, *([cow_src] if cow_src is not None else [])}
                      if self.pool.ref_counts[b] == 0)
        if self.pool.num_used + self.reserved_total + new + revived + headroom > \
                self.pool.num_blocks:
            return None
        for b in hits:
            self.pool.incref(b)
        entry = _Entry(BlockTable(bs, list(hits)), new, root, chain)
        self._entries[request_id] = entry
        self.reserved_total += new
        cached = len(hits) * bs
        if cow_src is not None:
            self.pool.incref(cow_src)  # pinned until the copy has run
            dst = self._take(entry, 1)[0]
            entry.table.blocks.append(dst)
            self._ops.append(BlockOp("copy", request_id, (cow_src, dst)))
            cached = n - 1
        if self.prefix_caching and use_cache:
            self.pool.counters.queries += n
            self.pool.counters.hits += cached
        return cached

    def admit_blocks(self, request_id: str, num_blocks: int, reserve_tokens: int,
                     headroom: int = 0) -> BlockTable | None:
        """Swap-in: ``num_blocks`` fresh private blocks now, plus the reservation for
        ``reserve_tokens`` in all; None if it does not fit."""
        total = max(self.blocks_needed(reserve_tokens), num_blocks)
        if self.pool.num_used + self.reserved_total + total + headroom > self.pool.num_blocks:
            return None
        entry = _Entry(BlockTable(self.block_size), total, -1)  # private: never cached
        self._entries[request_id] = entry
        self.reserved_total += total
        entry.table.blocks.extend(self._take(entry, num_blocks))
        return entry.table

    def fork(self, parent_id: str, child_id: str, num_tokens: int, reserve_tokens: int) -> bool:
        """A branch of ``parent_id`` whose first ``num_tokens`` tokens are the parent's: share
        its full blocks, copy its last partial block (copy-on-write), and reserve for the
        branch's own suffix. False (nothing changes) if that does not fit."""
        parent = self._entries[parent_id]
        full = num_tokens // self.block_size
        partial = num_tokens % self.block_size
        shared = parent.table.blocks[:full]
        new = self.blocks_needed(max(reserve_tokens, num_tokens)) - full
        if self.pool.num_used + self.reserved_total + new > self.pool.num_blocks:
            return False
        for b in shared:
            self.pool.incref(b)
        entry = _Entry(BlockTable(self.block_size, list(shared)), new, parent.root,
                       list(parent.chain[:full]))
        self._entries[child_id] = entry
        self.reserved_total += new
        if partial:
            src = parent.table.blocks[full]
            self.pool.incref(src)  # pinned until the copy has run
            dst = self._take(entry, 1)[0]
            entry.table.blocks.append(dst)
            self._ops.append(BlockOp("copy", child_id, (src, dst)))
        return True

    def take_ops(self) -> list[BlockOp]:
        """The queued data movements, in order, to run before the next forward; call
        ``ops_done`` with them afterwards (whatever happened)."""
        ops, self._ops = self._ops, []
        return ops

    def ops_done(self, ops: list[BlockOp]) -> None:
        self.pool.free([op.blocks[0] for op in ops if op.kind == "copy"])  # unpin the sources

    def swap_out(self, request_id: str, num_blocks: int) -> SwappedKV:
        """Preemption by swap: queue a copy of the request's first ``num_blocks`` blocks to host
        memory and release everything it holds now (its own queued copies still run first)."""
        host = SwappedKV(num_blocks)
        blocks = tuple(self._entries[request_id].table.blocks[:num_blocks])
        self._ops.append(BlockOp("out", request_id, blocks, host))
        self._release(request_id, keep_ops=True)
        return host

    def swap_in(self, request_id: str, host: SwappedKV) -> None:
        """Queue the copy of a swapped-out request's KV into the blocks ``admit_blocks`` gave
        it (dropped, like its other queued copies, if it is freed before they run)."""
        blocks = tuple(self._entries[request_id].table.blocks[:host.num_blocks])
        self._ops.append(BlockOp("in", request_id, blocks, host))

    # ---- growth ------------------------------------------------------------------------------
    def _take(self, entry: _Entry, n: int) -> list[int]:
        from_reservation = min(n, entry.reserved)
        entry.reserved -= from_reservation
        self.reserved_total -= from_reservation
        return self.pool.allocate(n)

    def allocate_slots(self, request_id: str, num_tokens: int) -> BlockTable | None:
        """Make the request's table cover ``num_tokens`` positions: within its reservation this
        cannot fail; beyond it, only from unpromised blocks (None when there are none: the
        caller preempts someone or waits)."""
        entry = self._entries[request_id]
        need = self.blocks_needed(num_tokens) - len(entry.table.blocks)
        if need <= 0:
            return entry.table
        beyond = need - min(need, entry.reserved)
        if beyond and self.headroom() < beyond:
            return None
        entry.table.blocks.extend(self._take(entry, need))
        return entry.table

    def commit(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.prefix_caching:
            return
        entry = self._entries[request_id]
        if entry.root == -1:
            return
        bs = self.block_size
        parent = entry.chain[-1] if entry.chain else entry.root
        for i in range(len(entry.chain), min(num_computed // bs, len(entry.table.blocks))):
            key = BlockKey(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            self.pool.register(entry.table.blocks[i], key)
            parent = key.hash
            entry.chain.append(parent)

    def free(self, request_id: str) -> None:
        """Return the request's blocks (cached ones stay evictable) and roll back its
        reservation. Safe to call for a request that holds nothing."""
        self._release(request_id, keep_ops=False)

    def _release(self, request_id: str, keep_ops: bool) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        if not keep_ops:  # its queued copies will never run (a swap-out still does: harmless)
            keep = [op.owner != request_id or op.kind == "out" for op in self._ops]
            self.ops_done([op for op, k in zip(self._ops, keep, strict=True) if not k])
            self._ops = [op for op, k in zip(self._ops, keep, strict=True) if k]
        self.pool.free(entry.table.blocks)
        entry.table.blocks.clear()
        self.reserved_total -= entry.reserved
