"""KV lifecycle on the tiny float64 model: prefix caching (exactness, tenant namespaces, the
fully cached prompt, LRU eviction, collisions), preemption by recompute and swap (exact outputs,
every block back), and n > 1 branches sharing the prompt's blocks."""

from __future__ import annotations

import random

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.block_pool import BlockKey
from engine.request import RequestState as S

BS = 4


def make(tiny_model, **kw) -> Engine:
    cfg = dict(block_size=BS, num_kv_blocks=256, max_batched_tokens=64, max_num_seqs=8,
               dtype="float64")
    return Engine(tiny_model, EngineConfig(**(cfg | kw)))


def run_one(engine: Engine, rid: str, prompt: list[int], params: SamplingParams,
            salt: str = "") -> object:
    req = engine.add_request(rid, prompt, params, cache_salt=salt)
    while engine.has_unfinished():
        engine.step()
    return req


def all_free(engine: Engine) -> bool:
    pool = engine.kv.pool
    c = pool.counters
    return (pool.num_free == pool.num_blocks and sum(pool.ref_counts) == 0
            and engine.kv.reserved_total == 0 and c.released == c.allocated + c.revived)


GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
BASE = [7 + (i * 13) % 90 for i in range(40)]


@pytest.mark.parametrize("shared", [0, 3, 4, 7, 8, 16, 17, 40])
def test_prefix_cache_outputs_equal_no_cache(tiny_model, shared):
    """A second prompt sharing ``shared`` leading tokens (block-aligned or not, the whole
    prompt included) gives the tokens it gives with caching off."""
    second = BASE[:shared] + [5 + (i * 7) % 80 for i in range(40 - shared)]
    outs = {}
    for caching in (False, True):
        engine = make(tiny_model, prefix_caching=caching)
        run_one(engine, "a", BASE, GREEDY)
        req = run_one(engine, "b", second, GREEDY)
        outs[caching] = (req.output_token_ids, req.num_cached_tokens)
        assert all_free(engine)
    assert outs[True][0] == outs[False][0]
    expected = min(shared // BS * BS, len(second) - 1)  # a fully cached prompt recomputes one
    assert outs[True][1] == expected and outs[False][1] == 0


def test_fully_cached_prompt_recomputes_its_last_token_in_a_private_copy(tiny_model):
    engine = make(tiny_model)
    first = run_one(engine, "a", BASE[:16], GREEDY)
    shared_block = engine.kv.pool.lookup(BlockKey(engine.kv._root(""),
                                                  tuple(BASE[:4])))
    assert shared_block is not None
    second = run_one(engine, "b", BASE[:16], GREEDY)
    assert second.num_cached_tokens == 15 and second.output_token_ids == first.output_token_ids
    assert all_free(engine)


def test_tenant_namespaces_never_share_unless_they_opt_in(tiny_model):
    engine = make(tiny_model)
    run_one(engine, "a", BASE, GREEDY, salt="tenant:acme")
    other = run_one(engine, "b", BASE, GREEDY, salt="tenant:globex")
    assert other.num_cached_tokens == 0
    same = run_one(engine, "c", BASE, GREEDY, salt="tenant:acme")
    assert same.num_cached_tokens == 39
    run_one(engine, "d", BASE, GREEDY, salt="shared:public")
    shared = run_one(engine, "e", BASE, GREEDY, salt="shared:public")
    assert shared.num_cached_tokens == 39
    assert other.output_token_ids == same.output_token_ids == shared.output_token_ids


def test_a_hash_match_with_other_tokens_is_refused(tiny_model):
    engine = make(tiny_model)
    run_one(engine, "a", BASE[:8], GREEDY)
    pool = engine.kv.pool
    root = engine.kv._root("")
    forged = BlockKey(root, (1, 2, 3, 4))
    real = pool.lookup(BlockKey(root, tuple(BASE[:4])))
    pool.cache[forged.hash] = real  # as if (1, 2, 3, 4) hashed like BASE[:4]
    req = run_one(engine, "b", [1, 2, 3, 4, 9, 9, 9, 9, 9], GREEDY)
    assert req.num_cached_tokens == 0 and pool.counters.collisions == 1
    assert all_free(engine)


def test_cached_blocks_are_evicted_least_recently_used_first(tiny_model):
    engine = make(tiny_model, num_kv_blocks=12, max_num_seqs=1)
    a, b = BASE[:8], [50 + i for i in range(8)]
    run_one(engine, "a", a, SamplingParams(max_tokens=1))  # caches a's 2 blocks
    run_one(engine, "b", b, SamplingParams(max_tokens=1))  # caches b's 2 blocks
    run_one(engine, "a2", a, SamplingParams(max_tokens=1))  # touches a: b is now LRU
    assert engine.kv.pool.counters.evictions == 0
    big = [60 + i % 30 for i in range(36)]  # needs 10 blocks: evicts down to a's blocks
    run_one(engine, "big", big, SamplingParams(max_tokens=1))
    assert engine.kv.pool.counters.evictions > 0
    again_b = run_one(engine, "b2", b, SamplingParams(max_tokens=1))
    assert again_b.num_cached_tokens == 0  # b was evicted first
    assert all_free(engine)


def _storm(tiny_model, mode: str, num_blocks: int, params: list[SamplingParams]):
    engine = make(tiny_model, num_kv_blocks=num_blocks, preemption=mode, max_num_seqs=6,
                  max_batched_tokens=16)
    rng = random.Random(3)
    reqs = [engine.add_request(f"r{i}", [rng.randrange(3, 90) for _ in range(rng.randrange(5, 14))],
                               p) for i, p in enumerate(params)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 5000
    return engine, reqs


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_preemption_keeps_outputs_exact_and_returns_every_block(tiny_model, mode):
    params = [SamplingParams(max_tokens=24, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=i)
              for i in range(6)]
    roomy, want = _storm(tiny_model, "off", 256, params)
    tight, got = _storm(tiny_model, mode, 16, params)
    assert tight.preemptions > 0 and roomy.preemptions == 0
    if mode == "swap":
        assert tight.swaps == tight.preemptions
    if mode == "recompute":
        assert tight.swaps == 0
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    for r in got:
        assert r.state == S.FINISHED and r.reclaim_count == 1
    preempted = [r for r in got if any(e.state in (S.PREEMPTED, S.SWAPPED) for e in r.events)]
    assert preempted and all(any(e.state == S.RESUMED for e in r.events) for r in preempted)
    assert all_free(tight)


def test_branches_share_the_prompt_blocks_and_sample_like_separate_requests(tiny_model):
    prompt = BASE[:10]  # 2 full blocks + a partial one
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=s)
              for s in (11, 12, 13)]
    alone = []
    for i, p in enumerate(params):
        engine = make(tiny_model, prefix_caching=False)
        alone.append(run_one(engine, f"x{i}", prompt, p).output_token_ids)
    engine = make(tiny_model, prefix_caching=False)
    lead = engine.add_request("b0", prompt, params[0])
    branches = [engine.add_request(f"b{i}", prompt, p, branch_of="b0")
                for i, p in enumerate(params[1:], 1)]
    assert all(b.branch_parent == "b0" for b in branches)
    engine.step()  # the whole prompt in one tick: every branch samples its first token
    assert all(len(r.output_token_ids) == 1 for r in [lead, *branches])
    # 2 shared full blocks + the parent's partial block + one private copy per branch
    assert engine.kv.pool.num_used == 2 + 1 + 2
    assert engine.kv.pool.ref_counts[engine.kv.block_table("b0").blocks[0]] == 3
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in [lead, *branches]] == alone
    assert all_free(engine)


def test_a_branch_whose_parent_is_cancelled_runs_on_its_own(tiny_model):
    engine = make(tiny_model)
    engine.add_request("p", BASE[:10], GREEDY)
    child = engine.add_request("c", BASE[:10], GREEDY, branch_of="p")
    engine.abort("p")
    while engine.has_unfinished():
        engine.step()
    assert child.state == S.FINISHED and len(child.output_token_ids) == 6
    assert all_free(engine)


def test_a_branch_waiting_for_its_parent_still_times_out(tiny_model):
    engine = make(tiny_model, max_batched_tokens=4)  # the parent prefills 4 tokens a tick
    parent = engine.add_request("p", BASE[:20], GREEDY)
    child = engine.add_request("c", BASE[:20], GREEDY, branch_of="p")
    child.deadline_ns = 0  # already past
    engine.step()
    assert child.state == S.TIMED_OUT and child.reclaim_count == 1
    assert parent.pending_branches == []
    while engine.has_unfinished():
        engine.step()
    assert parent.state == S.FINISHED and all_free(engine)


def test_the_pool_hands_out_the_lowest_free_block_first():
    """Freed blocks are reused before untouched ones (the KV tensors become resident only
    where written, so this keeps a replica's memory at its high-water mark)."""
    from engine.block_pool import BlockPool

    pool = BlockPool(8, BS)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1])
    assert pool.allocate(1) == [1]
    pool.free([2, 0])
    assert pool.allocate(3) == [0, 2, 3]


def test_the_kv_pool_costs_memory_only_where_blocks_are_written(tiny_model):
    """A 256 MiB pool adds a few MiB of resident memory when the engine is built and after it
    served requests (``torch.zeros`` wrote all of it at start); a block never used reads zero,
    and a used one does not."""
    import psutil

    proc = psutil.Process()
    before = proc.memory_info().rss
    engine = make(tiny_model, num_kv_blocks=None, kv_cache_mb=256)
    assert engine.runner.kv_cache_bytes >= 255 << 20
    built = proc.memory_info().rss
    assert built - before < 32 << 20, (built - before) >> 20
    for i in range(4):
        req = run_one(engine, f"r{i}", [3 + i, *BASE], GREEDY)
        assert req.state == S.FINISHED and len(req.output_token_ids) == 6
    assert proc.memory_info().rss - before < 32 << 20
    k0 = engine.runner.kv_caches[0][0]
    assert k0[0].abs().sum() > 0 and k0[-1].abs().sum() == 0
    assert all_free(engine)
