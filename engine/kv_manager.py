"""The scheduler's narrow window onto the KV cache: reservations and physical slots.

Admission *reserves* the blocks a request can ever need (prompt + max_tokens): accounting only,
no block changes hands. When a scheduler tick picks the request, blocks are *allocated* from the
pool as its computed tokens grow, always within its reservation, so physical allocation cannot
fail mid-decode while every running request holds a full reservation. (Preemption, a later issue,
relaxes this by letting reservations overcommit and reclaiming blocks from a victim.)
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockAccountingError, BlockPool, BlockTable


@dataclass(frozen=True, slots=True)
class KVUsage:
    blocks_total: int
    blocks_used: int
    blocks_reserved: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self._reserved: dict[str, int] = {}
        self._tables: dict[str, BlockTable] = {}
        self.reserved_total = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return self.pool.blocks_for(num_tokens)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def has_reservation(self, request_id: str) -> bool:
        return request_id in self._reserved

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Reserve capacity for ``num_tokens``; False (and nothing changes) if it does not fit."""
        if request_id in self._reserved:
            raise BlockAccountingError(f"request {request_id} already holds a reservation")
        n = self.blocks_needed(num_tokens)
        if self.reserved_total + n > self.pool.num_blocks:
            return False
        self._reserved[request_id] = n
        self.reserved_total += n
        self._tables[request_id] = BlockTable(self.block_size)
        return True

    def allocate_slots(self, request_id: str, num_tokens: int) -> BlockTable | None:
        """Make the request's table cover ``num_tokens`` positions; None if the pool is short."""
        table = self._tables[request_id]
        need = self.blocks_needed(num_tokens) - len(table.blocks)
        if need <= 0:
            return table
        if len(table.blocks) + need > self._reserved[request_id]:
            raise BlockAccountingError(
                f"request {request_id} needs {len(table.blocks) + need} blocks, "
                f"reserved {self._reserved[request_id]}"
            )
        if not self.pool.can_allocate(need):
            return None
        table.blocks.extend(self.pool.allocate(need))
        return table

    def block_table(self, request_id: str) -> BlockTable:
        return self._tables[request_id]

    def free(self, request_id: str) -> None:
        """Return the request's blocks and roll back its reservation. Safe to call for a request
        that never got a reservation; the request-level reclaim guarantees a single call."""
        table = self._tables.pop(request_id, None)
        if table is not None:
            self.pool.free(table.blocks)
            table.blocks.clear()
        self.reserved_total -= self._reserved.pop(request_id, 0)

    def usage(self) -> KVUsage:
        return KVUsage(self.pool.num_blocks, self.pool.num_used, self.reserved_total)
