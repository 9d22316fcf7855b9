"""What-if across replicas (tailscope.whatif): simulated replicas behind the gateway's own router,
load shedding as the gateway sheds, and sizing (N = ceil(peak / (c * rho)), confirmed by
what-if runs at N - 1, N and N + 1). On hand-built windows with a known step cost, so every
figure is deterministic."""

from __future__ import annotations

import dataclasses
import random

import pytest

from bench.loadgen import arrival_times, percentile
from engine import EngineConfig, SamplingParams
from engine.whatif import Arrival, SimReplica, SimRequest, StepCost, simulate
from tailscope import whatif as W
from tracing.timing import Slo

COST = StepCost((2.0, 0.05, 0.4, 0.3, 0.01))  # ms: intercept, per prefill token, decode, seq, KV


def window(arrivals: list[Arrival], config: EngineConfig) -> W.Window:
    return W.Window.of_arrivals(arrivals, config, COST)


def prompts(n: int, length: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(5, 40000) for _ in range(length)] for _ in range(n)]


CFG = EngineConfig(num_kv_blocks=512, block_size=16, max_num_seqs=4, max_batched_tokens=128)


def test_two_replicas_split_a_burst_by_the_gateways_rule_and_cut_its_queueing():
    burst = [Arrival(f"q{i}", 0.0, p, 16) for i, p in enumerate(prompts(8, 100, 1))]
    w = window(burst, CFG)
    one = W.predict(w, CFG, 1)
    two = W.predict(w, CFG, 2)
    assert all(s.state == "FINISHED" for s in one.sims + two.sims)
    # least expected work: equal requests alternate between the two replicas
    assert [s.request_id for s in two.sims] == [a.request_id for a in burst]
    assert percentile(two.values("queue_ms"), 99) < 0.6 * percentile(one.values("queue_ms"), 99)
    assert percentile(two.values("ttft_ms"), 99) < percentile(one.values("ttft_ms"), 99)


def test_a_shared_prefix_follows_its_replica_as_the_router_sends_it():
    """Requests with one 64-token prefix go where the first went (its prefix cache has the
    blocks: the engine there serves them from it); another prompt goes to the other replica."""
    shared = prompts(1, 64, 2)[0]
    arrivals = [Arrival("a0", 0.0, prompts(1, 40, 3, shared)[0], 4),
                Arrival("b0", 0.1, prompts(1, 40, 4)[0], 4),
                Arrival("a1", 50.0, prompts(1, 40, 5, shared)[0], 4),
                Arrival("a2", 100.0, prompts(1, 40, 6, shared)[0], 4)]
    sims, reps = simulate(arrivals, CFG, COST, W.STAND_IN, 2, W._route(CFG, None))
    assert all(s.state == "FINISHED" for s in sims)
    placed = {rid: k for k, r in enumerate(reps) for step in r.runner.steps for rid, _ in step}
    assert placed["a0"] == placed["a1"] == placed["a2"] != placed["b0"]
    hits = [r.engine.kv.pool.counters.hits for r in reps]
    assert hits[placed["a0"]] >= 2 * 4 and hits[placed["b0"]] == 0  # 4 blocks of 16, twice


def test_the_simulated_router_counts_work_as_the_gateway_does_not_by_recorded_lengths():
    """The gateway counts a request's work as its whole prompt until its first token plus what
    its max_tokens still allows; it cannot know the output will stop early. "long" (50 tokens
    out, allowed 50) goes to r0, "short" (5 out, allowed 500) to r1; then "next" goes where
    the gateway's estimate is smaller: r0 (~50 left against ~500). Routed by recorded
    lengths (r1 ~5 left) it would go to r1."""
    p = prompts(3, 30, 21)
    arrivals = [Arrival("long", 0.0, p[0], 50, max_tokens=50),
                Arrival("short", 0.0, p[1], 5, max_tokens=500),
                Arrival("next", 6.0, p[2], 4, max_tokens=4)]
    for allowed, where in ((True, 0), (False, 1)):
        arr = arrivals if allowed else [dataclasses.replace(a, max_tokens=None)
                                        for a in arrivals]
        sims, reps = simulate(arr, CFG, COST, W.STAND_IN, 2, W._route(CFG, None))
        assert all(s.state == "FINISHED" for s in sims)
        placed = {rid: k for k, r in enumerate(reps) for step in r.runner.steps
                  for rid, _ in step}
        assert (placed["long"], placed["short"], placed["next"]) == (0, 1, where)
        assert all(not r.allowed and not r.inflight for r in reps)
    # a request's prompt counts in full until its first token, prefilled or not (64-token
    # chunks of a 200-token prompt), then only its allowance is left
    one = dataclasses.replace(CFG, max_batched_tokens=64)
    rep = SimReplica("r0", one, COST, W.STAND_IN, {"a": SimRequest("a", 0.0)})
    rep.engine.add_request("a", prompts(1, 200, 22)[0], SamplingParams(max_tokens=3,
                                                                       ignore_eos=True))
    rep.inflight.add("a")
    rep.allowed["a"] = 9
    seen = []
    while rep.engine.has_unfinished():
        seen.append(rep.pending_tokens)
        rep.engine.step()
    assert seen == [200 + 9, 200 + 9, 200 + 9, 200 + 9, 9 - 1, 9 - 2]


def test_past_max_inflight_the_simulated_gateway_sheds_as_the_real_one_does():
    burst = [Arrival(f"q{i}", 0.0, p, 8) for i, p in enumerate(prompts(6, 30, 7))]
    pred = W.predict(window(burst, CFG), CFG, 2, max_inflight=2)
    states = [s.state for s in pred.sims]
    assert states.count("FINISHED") == 4 and states.count("SHED") == 2
    assert pred.summary(None)["shed"] == 2


def test_size_finds_the_replica_count_its_own_what_if_runs_confirm():
    rng = random.Random(9)
    times = arrival_times(120, 20.0, seed=9)
    arrivals = [Arrival(f"q{i}", t * 1000, [rng.randrange(5, 40000)
                                            for _ in range(rng.randrange(50, 300))],
                        rng.randrange(8, 40)) for i, t in enumerate(times)]
    w = window(arrivals, CFG)
    slo = Slo(ttft_ms=150.0, tpot_ms=30.0)
    cap = W.capacity(w, CFG, slo, 0.95)
    assert cap["goodput_rps"] > 0
    # at the capacity's rate one replica meets the target; 30% faster it does not
    at = W.predict(w, CFG, 1, cap["rate_scale"]).slo(slo)["attainment"]
    over = W.predict(w, CFG, 1, cap["rate_scale"] * 1.3).slo(slo)["attainment"]
    assert at >= 0.95 > over
    peak = 2.5 * cap["goodput_rps"]
    out = W.size(w, CFG, slo, peak, utilisation=1.0, target=0.95)
    assert out["replicas"] == 3  # ceil(2.5)
    checks = {c["replicas"]: c["attainment"] for c in out["checks"]}
    assert set(checks) == {2, 3, 4}
    assert checks[2] < 0.95 <= checks[3] <= checks[4] + 1e-9
    with pytest.raises(ValueError, match="utilisation"):
        W.size(w, CFG, slo, peak, utilisation=1.5)


FLAT = StepCost((10.0, 0.0, 0.0, 0.0, 0.0))  # every step 10 ms


def test_replicas_on_one_host_slow_each_others_steps_by_the_contention_factor():
    """Two requests of 4 tokens, one per replica, side by side: each of their 4 steps starts
    while the other replica is mid-step, so with beta 0.5 each costs 15 ms instead of 10; one
    replica alone is not slowed, and a request that arrives after the other replica went idle
    runs at full speed."""
    burst = [Arrival(f"q{i}", 0.0, p, 4) for i, p in enumerate(prompts(2, 20, 11))]
    route = W._route(CFG, None)
    for beta, e2e in ((0.0, 40.0), (0.5, 60.0)):
        sims, _ = simulate(burst, CFG, FLAT, W.STAND_IN, 2, route, contention=beta)
        assert [s.e2e_ms for s in sims] == [e2e, e2e], beta
    alone, _ = simulate(burst[:1], CFG, FLAT, W.STAND_IN, 2, route, contention=0.5)
    assert alone[0].e2e_ms == 40.0
    later = [burst[0], Arrival("late", 100.0, prompts(1, 20, 12)[0], 4)]
    sims, _ = simulate(later, CFG, FLAT, W.STAND_IN, 2, route, contention=0.5)
    assert [s.e2e_ms for s in sims] == [40.0, 40.0]
    with pytest.raises(ValueError, match="contention"):
        simulate(burst, CFG, FLAT, W.STAND_IN, 2, route, contention=-1)


def test_a_faster_replica_takes_each_step_in_a_fraction_of_the_time_and_queues_less():
    """``--step-speed``: a lone request of 4 tokens takes 4 steps of 10 ms, 20 ms at twice the
    speed; a burst on one replica queues less; the candidate alone is sped up in ``compare``
    (the recorded config's prediction is the window's), and ``size`` on the faster window
    names fewer replicas."""
    burst = [Arrival(f"q{i}", 0.0, p, 4) for i, p in enumerate(prompts(12, 100, 13))]
    w = W.Window.of_arrivals(burst[:1], CFG, FLAT)
    assert W.faster(w, 1.0) is w
    assert [s.e2e_ms for s in W.predict(w, CFG).sims] == [40.0]
    assert [s.e2e_ms for s in W.predict(W.faster(w, 2.0), CFG).sims] == [20.0]
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="step-speed"):
            W.faster(w, bad)
    w = window(burst, CFG)
    slow, fast = W.predict(w, CFG), W.predict(W.faster(w, 2.0), CFG)
    assert percentile(fast.values("queue_ms"), 50) < 0.6 * percentile(slow.values("queue_ms"), 50)
    params, results = W.compare(w, CFG, step_speed=2.0)
    (point,) = results["points"]
    assert params["step_speed"] == 2.0 and params["candidate_changes"] == {}
    assert point["recorded_config"] == slow.summary(None)
    assert point["candidate"] == fast.summary(None)
    rng = random.Random(9)
    arrivals = [Arrival(f"q{i}", t * 1000, [rng.randrange(5, 40000) for _ in range(120)], 16)
                for i, t in enumerate(arrival_times(120, 20.0, seed=9))]
    w, slo = window(arrivals, CFG), Slo(ttft_ms=150.0, tpot_ms=30.0)
    peak = 3 * W.capacity(w, CFG, slo, 0.95)["goodput_rps"]
    n = W.size(w, CFG, slo, peak, utilisation=1.0, target=0.95)["replicas"]
    assert W.size(W.faster(w, 2.0), CFG, slo, peak, utilisation=1.0, target=0.95)["replicas"] < n


def test_contention_is_fitted_from_steps_that_ran_beside_another_replica():
    from engine.whatif import fit_contention, overlaps

    spans = [("r0", 0, 10), ("r1", 5, 10), ("r0", 10, 10), ("r1", 30, 10)]
    steps = [{"replica": r, "ts_us": t * 1000, "duration_ms": d} for r, t, d in spans]
    assert overlaps(steps) == [0, 1, 1, 0]  # r1's first began inside r0's; r0's second too
    rng = random.Random(5)
    beta, rows = 0.3, []
    for k in range(200):  # r0 steps at 100k ms; r1's begin 1 ms into one (b = 1) or after it
        for r, at in (("r0", 100 * k), ("r1", 100 * k + rng.choice([1, 50]))):
            x = {"prefill_tokens": rng.choice([0, 0, 64, 200]),
                 "decode_tokens": rng.randrange(1, 8), "kv_blocks_used": rng.randrange(0, 50)}
            x["num_seqs"] = x["decode_tokens"] + (x["prefill_tokens"] > 0)
            base = COST.predict(x["prefill_tokens"], x["decode_tokens"], x["num_seqs"],
                                x["kv_blocks_used"])  # 2.7-17.7 ms: no step reaches the next
            rows.append({"replica": r, "ts_us": at * 1000, **x,
                         "duration_ms": base * (1 + beta * (r == "r1" and at % 100 == 1))})
    b = overlaps(rows)
    assert b == [int(r["replica"] == "r1" and r["ts_us"] % 100_000 == 1000) for r in rows]
    assert 20 < sum(b) < 380
    assert abs(fit_contention(rows, COST) - beta) < 1e-9
    assert fit_contention(rows[::2], COST) is None  # one replica: nothing to fit on


def test_a_prediction_says_how_much_of_its_time_runs_batch_sizes_beyond_its_window():
    """A window of 4-sequence steps and a few 1-sequence ones: the recorded config's simulated
    burst runs mostly 4-sequence steps (its tail of 2 and 3 below the pinned range: a little
    extrapolated), a one-sequence candidate only steps below it (all); with SEEN_MIN
    1-sequence steps recorded, nothing of either is, and a wider config is past the top."""
    burst = [Arrival(f"q{i}", 0.0, p, 16) for i, p in enumerate(prompts(12, 40, 9))]
    w = window(burst, CFG)
    w.step_rows = [{"num_seqs": 4}] * (W.SEEN_MIN + 5) + [{"num_seqs": 1}] * (W.SEEN_MIN - 1)
    narrow = dataclasses.replace(CFG, max_num_seqs=1)
    same, cand = W.predict(w, CFG, 1), W.predict(w, narrow, 1)
    assert 0.0 < same.extrapolated < 0.5  # the tail of the burst runs fewer than 4
    assert cand.extrapolated == 1.0
    assert cand.summary(None)["extrapolated"] == 1.0
    w.step_rows += [{"num_seqs": 1}]  # now SEEN_MIN of them
    assert W.predict(w, narrow, 1).extrapolated == 0.0
    # sizes between two well-recorded ones are interpolated, not extrapolated: none of the
    # window's steps had 2 or 3 sequences, and the burst's tail runs them
    assert W.predict(w, CFG, 1).extrapolated == 0.0
    # the wider end is pinned down the same way: 8 sequences, beyond every recorded step
    wide = dataclasses.replace(CFG, max_num_seqs=8)
    assert W.predict(w, wide, 1).extrapolated > 0.5
    w.step_rows = [{"num_seqs": 1}] * (W.SEEN_MIN - 1)  # too few to pin anything down
    assert W.predict(w, narrow, 1).extrapolated == 1.0
    w.step_rows = []  # a hand-built window without steps: nothing to say
    assert W.predict(w, narrow, 1).extrapolated == 0.0
