"""Scheduler policy: token budget, chunked prefill, seat limit, FCFS, continuous refill."""

from __future__ import annotations

from engine import Engine, EngineConfig, RequestState, SamplingParams

S = RequestState


def _engine(tiny_model, **kw):
    cfg = dict(block_size=4, num_kv_blocks=64, max_batched_tokens=8, max_num_seqs=2,
               dtype="float64")
    return Engine(tiny_model, EngineConfig(**(cfg | kw)))


def test_long_prompt_is_chunked_within_the_token_budget(tiny_model):
    engine = _engine(tiny_model)
    req = engine.add_request("long", list(range(3, 23)), SamplingParams(max_tokens=2))
    engine.step()
    engine.step()
    assert req.state == S.PREFILLING and req.num_computed_tokens == 16
    engine.step()  # last 4 prompt tokens: the same forward yields the first token
    assert req.state == S.DECODING and len(req.output_token_ids) == 1
    assert [s.prefill_tokens for s in engine.observer.steps] == [8, 8, 4]


def _split_tick(tiny_model, split: str, reserve: int = 2) -> list[tuple[int, int]]:
    """Three streams decoding, then a long prompt arrives: each tick's (decode, prefill)
    tokens under the budget split (budget 8, four seats)."""
    engine = _engine(tiny_model, budget_split=split, decode_reserve_tokens=reserve,
                     max_num_seqs=4)
    for i in range(3):
        engine.add_request(f"d{i}", [5 + i, 6, 7], SamplingParams(max_tokens=12))
    engine.step()
    engine.step()
    engine.add_request("long", list(range(3, 40)), SamplingParams(max_tokens=2))
    engine.step()
    engine.step()
    return [(s.decode_tokens, s.prefill_tokens) for s in list(engine.observer.steps)[-2:]]


def test_the_budget_split_decides_who_gets_a_tick_first(tiny_model):
    assert _split_tick(tiny_model, "decode_first") == [(3, 5), (3, 5)]
    assert _split_tick(tiny_model, "prefill_first") == [(0, 8), (0, 8)]  # decodes starve
    assert _split_tick(tiny_model, "decode_reserve", 2) == [(2, 6), (2, 6)]
    # greedy outputs do not depend on the split (only the timing does)
    outs = {}
    for split in ("decode_first", "prefill_first", "decode_reserve"):
        engine = _engine(tiny_model, budget_split=split, max_num_seqs=4)
        reqs = engine.generate([[5, 6, 7], list(range(3, 30)), [9, 8]],
                               SamplingParams(max_tokens=6, ignore_eos=True))
        outs[split] = [r.output_token_ids for r in reqs]
    assert outs["prefill_first"] == outs["decode_first"] == outs["decode_reserve"]


def test_decodes_are_served_before_prefill_chunks(tiny_model):
    engine = _engine(tiny_model)
    a = engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5))
    engine.step()
    assert a.state == S.DECODING
    engine.add_request("b", list(range(3, 40)), SamplingParams(max_tokens=2))
    engine.step()
    last = engine.observer.steps[-1]
    assert (last.decode_tokens, last.prefill_tokens) == (1, 7)


def test_max_num_seqs_caps_running_and_freed_slots_refill_next_tick(tiny_model):
    engine = _engine(tiny_model, max_batched_tokens=64)
    reqs = [engine.add_request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=2 + i))
            for i in range(4)]
    engine.step()
    assert [r.state for r in reqs] == [S.DECODING, S.DECODING, S.QUEUED, S.QUEUED]
    engine.step()  # r0 finishes (2 tokens)
    assert reqs[0].state == S.FINISHED
    engine.step()  # r2 takes the freed seat at once, in arrival order
    assert reqs[2].state == S.DECODING and reqs[3].state == S.QUEUED
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 2


def test_fcfs_head_waiting_for_kv_is_not_overtaken(tiny_model):
    engine = _engine(tiny_model, num_kv_blocks=6, max_num_seqs=4, max_batched_tokens=64,
                     preemption="off")  # admission reserves prompt + max_tokens
    engine.add_request("big1", list(range(3, 15)), SamplingParams(max_tokens=4))  # 4 blocks
    big2 = engine.add_request("big2", list(range(3, 15)), SamplingParams(max_tokens=4))
    small = engine.add_request("small", [5], SamplingParams(max_tokens=1))  # 1 block: fits
    engine.step()
    assert big2.state == S.QUEUED and small.state == S.QUEUED
    assert not engine.kv.has_reservation("small")
    while engine.has_unfinished():
        engine.step()
    assert big2.events[1].ts_ns < small.events[1].ts_ns  # RUNNABLE in arrival order


def test_observer_step_stats_describe_the_batch(tiny_model):
    engine = _engine(tiny_model, max_batched_tokens=64)
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3))
    first = engine.observer.steps[0]
    assert (first.num_seqs, first.prefill_tokens, first.decode_tokens) == (2, 5, 0)
    assert first.kv_blocks_total == 64 and first.kv_blocks_used == 2
    assert first.forward_ms > 0 and first.duration_ms >= first.forward_ms
    assert all(s.decode_tokens == 2 for s in list(engine.observer.steps)[1:])


def test_kv_blocks_copy_out_and_back_into_other_blocks(tiny_model):
    """What swap-based preemption needs: a sequence's blocks saved to host memory, the pool
    blocks reused, then restored into different physical blocks, decoding on unchanged."""
    engine = _engine(tiny_model, max_batched_tokens=64)
    req = engine.add_request("s", list(range(3, 20)), SamplingParams(max_tokens=6))
    engine.step()
    engine.step()
    table = engine.kv.block_table("s")
    saved = engine.runner.copy_blocks_out(table.blocks)
    for k, v in engine.runner.kv_caches:  # clobber everything
        k.normal_()
        v.normal_()
    pool = engine.kv.pool
    new_blocks = pool.allocate(len(table.blocks))
    assert not set(new_blocks) & set(table.blocks)
    engine.runner.copy_blocks_in(new_blocks, saved)
    pool.free(table.blocks)
    table.blocks[:] = new_blocks
    while engine.has_unfinished():
        engine.step()
    reference = _engine(tiny_model, max_batched_tokens=64).generate(
        [list(range(3, 20))], SamplingParams(max_tokens=6))[0]
    assert req.output_token_ids == reference.output_token_ids
    assert pool.num_free == pool.num_blocks
