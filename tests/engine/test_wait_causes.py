"""Why a request waited: the scheduler's wait notes (``Request.waits``) name the binding
constraint at every tick a request spends waiting, and the timing owner splits the queue and
preempted time by them, so the causes add up to exactly that time (a tested identity)."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.request import WAIT_CAUSES
from tracing import timing
from tracing.record import RecordEvent

CAUSE_COLUMNS = [c.column for c in timing.CAUSES]


def record_events(stats) -> list[RecordEvent]:
    """The replica's timeline as the gateway places it (ROUTED at 0, µs), closed by END."""
    events = [RecordEvent(0, "ROUTED")]
    events += [RecordEvent(round(e.at_ms * 1000), e.state, e.detail) for e in stats.events]
    events.append(RecordEvent(events[-1].ts_us + 1000, "END"))
    return events


def run(engine: Engine, prompts: dict[str, int], outputs: dict[str, int]) -> dict:
    for i, (rid, n) in enumerate(prompts.items()):
        engine.add_request(rid, [(7 * i + k) % 1000 + 5 for k in range(n)],
                           SamplingParams(max_tokens=outputs[rid], ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return dict(engine.observer.finished)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_causes_add_up_to_queue_and_preempted_time_in_a_mixed_run_with_preemption(
        tiny49k, preemption):
    engine = Engine(tiny49k, EngineConfig(num_kv_blocks=12, block_size=4, max_batched_tokens=12,
                                        max_num_seqs=3, preemption=preemption,
                                        prefix_caching=False))
    sizes = [5, 18, 9, 3, 14, 7, 11, 4, 16, 6]
    prompts = {f"r{i}": n for i, n in enumerate(sizes)}
    outputs = {f"r{i}": 4 + (5 * i) % 11 for i in range(len(sizes))}
    finished = run(engine, prompts, outputs)
    assert set(finished) == set(prompts)
    assert engine.preemptions > 0
    seen: set[str] = set()
    for rid, stats in finished.items():
        d = timing.durations(record_events(stats))
        waited = d["engine_queue_ms"] + d["preempted_ms"]
        assert sum(d[c] for c in CAUSE_COLUMNS) == pytest.approx(waited, abs=1e-6), rid
        for e in stats.events:
            if e.state == "WAIT":
                cause = e.detail.split(":")[0]
                assert cause in WAIT_CAUSES
                seen.add(cause)
                assert rid not in e.holders  # nobody waits on itself
                assert set(e.holders) <= set(prompts)
                if cause in ("budget", "kv", "hol"):
                    assert e.holders, e
    assert {"budget", "kv", "seqs", "hol"} <= seen


def test_a_request_behind_a_long_prefill_waits_on_the_budget_it_holds(tiny49k):
    engine = Engine(tiny49k, EngineConfig(num_kv_blocks=64, block_size=16, max_batched_tokens=32,
                                        prefix_caching=False))
    finished = run(engine, {"long": 200, "short": 5}, {"long": 2, "short": 2})
    notes = [e for e in finished["short"].events if e.state == "WAIT"]
    assert notes and notes[0].detail.startswith("budget") and notes[0].holders == ("long",)
    d = timing.durations(record_events(finished["short"]))
    assert d["wait_budget_ms"] > 0 and d["wait_kv_ms"] == d["wait_hol_ms"] == 0


def test_a_request_without_kv_waits_on_its_holders_and_the_next_one_behind_it(tiny49k):
    # 8 blocks of 4 tokens: "big" holds 5 (and grows), "blocked" needs 5 to start, "behind"
    # (which alone would fit) waits behind it in arrival order
    engine = Engine(tiny49k, EngineConfig(num_kv_blocks=8, block_size=4, max_batched_tokens=64,
                                        prefix_caching=False))
    engine.add_request("big", list(range(10, 30)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # big is running
    engine.add_request("blocked", list(range(40, 58)),
                       SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("behind", [60, 61], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    finished = dict(engine.observer.finished)
    kv = [e for e in finished["blocked"].events if e.state == "WAIT"]
    assert kv[0].detail.startswith("kv") and kv[0].holders == ("big",)
    hol = [e for e in finished["behind"].events if e.state == "WAIT"]
    assert hol[0].detail.startswith("hol") and hol[0].holders == ("blocked",)
    assert timing.durations(record_events(finished["blocked"]))["wait_kv_ms"] > 0
    assert timing.durations(record_events(finished["behind"]))["wait_hol_ms"] > 0


def test_step_detail_off_records_neither_members_nor_wait_notes(tiny49k):
    engine = Engine(tiny49k, EngineConfig(num_kv_blocks=64, block_size=16, max_batched_tokens=32,
                                        prefix_caching=False, step_detail=False))
    finished = run(engine, {"long": 200, "short": 5}, {"long": 2, "short": 2})
    assert not any(e.state == "WAIT" for s in finished.values() for e in s.events)
    assert all(s.members == () for s in engine.observer.steps)
    d = timing.durations(record_events(finished["short"]))  # all of it is unattributed "step"
    assert d["wait_step_ms"] == pytest.approx(d["engine_queue_ms"] + d["preempted_ms"])


def test_under_fair_share_a_request_overtaken_by_another_tenant_waits_on_its_share(tiny49k):
    engine = Engine(tiny49k, EngineConfig(num_kv_blocks=64, block_size=4, max_batched_tokens=12,
                                        max_num_seqs=2, prefix_caching=False,
                                        scheduling_policy="fair"))
    tenants = {f"a{i}": "a" for i in range(5)} | {"b0": "b", "b1": "b"}
    for i, (rid, tenant) in enumerate(tenants.items()):  # a's five first, then b's two
        engine.add_request(rid, [(7 * i + k) % 1000 + 5 for k in range(10)],
                           SamplingParams(max_tokens=6, ignore_eos=True, tenant=tenant))
    order = []
    while engine.has_unfinished():
        engine.step()
        order += [r.request_id for r in engine.scheduler.running if r.request_id not in order]
    finished = dict(engine.observer.finished)
    assert order.index("b0") < order.index("a1")  # b went ahead of a's earlier arrivals
    shared = set()
    for rid, stats in finished.items():
        d = timing.durations(record_events(stats))
        waited = d["engine_queue_ms"] + d["preempted_ms"]
        assert sum(d[c] for c in CAUSE_COLUMNS) == pytest.approx(waited, abs=1e-6), rid
        for e in stats.events:
            if e.state == "WAIT" and e.detail.startswith("share"):
                shared.add(rid)
                assert e.holders and all(tenants[h] != tenants[rid] for h in e.holders), e
                assert d["wait_share_ms"] > 0
    assert shared and all(tenants[r] == "a" for r in shared)
