"""KV accounting under random add / abort / timeout / step sequences (property-based)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig, SamplingParams
from engine.block_pool import BlockAccountingError, BlockPool
from engine.request import RequestState

NUM_BLOCKS, BLOCK_SIZE = 12, 4

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("timeout"), st.integers(0, 40)),
        st.tuples(st.just("race"), st.integers(0, 40)),  # timeout and cancel in one tick
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=60,
)


def check_invariants(engine: Engine, all_requests: list) -> None:
    kv, pool = engine.kv, engine.kv.pool
    entries = kv._entries
    holders = Counter(b for e in entries.values() for b in e.table.blocks)
    holders.update(op.blocks[0] for op in kv._ops if op.kind == "copy")  # pinned for a copy
    free, evictable = list(pool._free), list(pool._evictable)
    assert len(set(free)) == len(free), "a block is on the free list twice"
    assert not set(free) & set(holders), "a free block is still in a block table"
    assert not set(evictable) & set(holders), "an evictable block is still held"
    assert len(free) + len(evictable) + len(holders) == pool.num_blocks, "a block leaked"
    assert all(pool.ref_counts[b] == n for b, n in holders.items()), "ref count != holders"
    assert all(pool.ref_counts[b] == 0 for b in free + evictable)
    assert all(pool.block_key[b] is not None for b in evictable)
    c = pool.counters
    assert c.allocated + c.revived - c.released == len(holders), "a block was freed twice"
    assert kv.reserved_total == sum(e.reserved for e in entries.values())
    assert pool.num_used + kv.reserved_total <= pool.num_blocks
    for req in all_requests:
        if req.is_finished:
            assert req.reclaim_count == 1, f"{req.request_id} reclaimed {req.reclaim_count}x"
            assert not kv.has_reservation(req.request_id)
        else:
            assert req.reclaim_count == 0


@pytest.mark.parametrize("mode", ["off", "recompute", "swap"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=ops)
def test_random_operations_never_leak_or_double_free(tiny_model, mode, operations):
    """Prompts here share prefixes (all start 3, 4, 5, ...), so the prefix cache, its LRU
    eviction and, in the preempting modes, recompute or swap are all exercised."""
    engine = Engine(tiny_model, EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
                                             max_batched_tokens=8, max_num_seqs=3,
                                             dtype="float64", preemption=mode))
    reclaims: list[str] = []
    engine.on_reclaim = lambda r: reclaims.append(r.request_id)
    ids: list[str] = []
    reqs: list = []
    for op in operations:
        if op[0] == "add":
            rid = f"r{len(ids)}"
            ids.append(rid)
            reserved_before = engine.kv.reserved_total
            req = engine.add_request(rid, list(range(3, 3 + op[1])),
                                     SamplingParams(max_tokens=op[2], ignore_eos=True))
            reqs.append(req)
            if req.state == RequestState.REJECTED:
                assert engine.kv.reserved_total == reserved_before
                assert "KV blocks" in req.error
        elif op[0] in ("abort", "timeout", "race") and ids:
            req = engine.get_request(ids[op[1] % len(ids)])
            reserved_before = engine.kv.reserved_total
            entry = engine.kv._entries.get(req.request_id)
            held = entry.reserved if entry else 0
            if op[0] in ("timeout", "race"):
                req.deadline_ns = 0
            if op[0] in ("abort", "race"):
                was_live = not req.is_finished
                assert engine.abort(req.request_id) is was_live
                if was_live:  # the reservation rolls back at once
                    assert engine.kv.reserved_total == reserved_before - held
            if op[0] == "race":
                engine.step()
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
        check_invariants(engine, reqs)
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine, reqs)
    assert engine.kv.pool.num_free == NUM_BLOCKS
    assert engine.kv.reserved_total == 0
    assert sorted(reclaims) == sorted(ids), "each request is reclaimed exactly once"


def test_pool_refuses_double_free_and_foreign_ids():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    pool.incref(a)
    pool.free([a])
    assert pool.num_free == 2  # a still has a holder
    pool.free([a, b])
    assert pool.num_free == 4
    with pytest.raises(BlockAccountingError, match="double free"):
        pool.free([a])
    with pytest.raises(BlockAccountingError, match="outside pool"):
        pool.free([9])
    with pytest.raises(BlockAccountingError, match="is free"):
        pool.incref(b)
