"""The scheduling-policy seam, model-free: the scheduler owns its sets, asks its policy for the
queue order and the victim, and returns each preemption as a decision it already carried out
(KV released, or queued for a copy to host memory ahead of anything that could overwrite it)."""

from __future__ import annotations

import pytest

from engine.config import SCHEDULING_POLICIES, EngineConfig
from engine.kv_manager import KVCacheManager
from engine.policy import POLICIES, Fcfs
from engine.request import Request, RequestState
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

S = RequestState


def _setup(policy=None, **kw):
    cfg = EngineConfig(**({"block_size": 4, "num_kv_blocks": 4, "max_batched_tokens": 64,
                           "max_num_seqs": 4, "prefix_caching": False} | kw))
    kv = KVCacheManager(cfg.num_kv_blocks, cfg.block_size)
    return Scheduler(cfg, kv, policy), kv


def _add(sched: Scheduler, rid: str, arrival: int, prompt_len: int = 6) -> Request:
    req = Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=8),
                  arrival_ns=arrival)
    req.transition(S.QUEUED)
    sched.add(req)
    return req


def _tick(sched: Scheduler, kv: KVCacheManager):
    """What the engine does around ``schedule`` (a forward would run the queued copies)."""
    out = sched.schedule()
    ops = kv.take_ops()
    kv.ops_done(ops)
    for s in out.all:
        req = s.request
        if req.state in (S.RUNNABLE, S.RESUMED):
            req.transition(S.PREFILLING)
        req.num_computed_tokens += s.num_new_tokens
        if req.num_computed_tokens == req.num_tokens:
            if req.state == S.PREFILLING:
                req.transition(S.DECODING)
            req.output_token_ids.append(7)
    return out, ops


def test_fcfs_preemption_is_a_returned_decision_and_the_victim_waits_at_its_place():
    sched, kv = _setup()
    a, b = _add(sched, "a", 1), _add(sched, "b", 2)
    for _ in range(3):  # prefill 6 tokens, decode positions 7 and 8: 2 blocks each, pool full
        out, _ = _tick(sched, kv)
        assert not out.preempted
    assert (a.state, b.state) == (S.DECODING, S.DECODING) and kv.pool.num_free == 0
    out, _ = _tick(sched, kv)  # a needs a third block: the latest arrival gives way
    assert [(p.request, p.mode, p.blocks) for p in out.preempted] == [(b, "recompute", 2)]
    assert b.state == S.PREEMPTED and b.num_computed_tokens == 0
    assert sched.running == [a] and sched.waiting == [b]
    assert not kv.has_reservation("b") and len(kv.block_table("a").blocks) == 3
    assert [s.request for s in out.decodes] == [a]


def test_a_plugged_in_policy_decides_the_order_and_the_victim():
    class NewestFirst(Fcfs):  # a test policy: last come, first served, the oldest yields
        name = "newest-first"

        def key(self, req):
            return (-req.arrival_ns, req.seq)

        def victim(self, candidates):
            return min(candidates, key=lambda r: r.arrival_ns)

    sched, kv = _setup(NewestFirst(), num_kv_blocks=64)
    for i in range(3):
        _add(sched, f"r{i}", i, prompt_len=2)
    assert [r.request_id for r in sched.waiting] == ["r2", "r1", "r0"]
    sched, kv = _setup(NewestFirst())
    a, b = _add(sched, "a", 1), _add(sched, "b", 2)
    for _ in range(4):
        out, _ = _tick(sched, kv)
    assert [p.request for p in out.preempted] == [a]  # b needed a block; the oldest yields
    assert sched.running == [b] and a.state == S.PREEMPTED and sched.waiting == [a]


def test_swap_frees_at_once_and_queues_the_copy_ahead_of_later_writes():
    sched, kv = _setup(preemption="swap")
    a, b = _add(sched, "a", 1), _add(sched, "b", 2)
    for _ in range(3):
        _tick(sched, kv)
    out = sched.schedule()  # a takes a block from b, whose KV goes to host memory
    (p,) = out.preempted
    assert (p.request, p.mode, p.blocks) == (b, "swap", 2) and b.state == S.SWAPPED
    ops = kv.take_ops()
    assert [op.kind for op in ops] == ["out"] and ops[0].host is b.swapped_kv
    assert a.state == S.DECODING and sched.running == [a]
    assert set(ops[0].blocks) & set(kv.block_table("a").blocks)  # already reused by a
    kv.ops_done(ops)


def test_every_configured_policy_exists_and_unknown_ones_are_refused():
    assert set(POLICIES) == set(SCHEDULING_POLICIES)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lottery")
