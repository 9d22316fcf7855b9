"""What-if on a virtual clock: the step-cost fit, and the simulation being the engine's own
scheduling (the same steps as a real engine given the same arrivals and step costs)."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from bench.loadgen import percentile
from engine import Engine, EngineConfig, SamplingParams
from engine.whatif import Arrival, StepCost, simulate

# ms: intercept, per prefill token, decode, seq, KV block, prefill context (key per token)
TRUE = (2.0, 0.05, 0.4, 0.3, 0.01, 0.0001)


def _steps(n: int, noise: float, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, d = rng.choice([0, 16, 64, 256, 512]), rng.randrange(0, 32)
        s, kv = d + (p > 0) * rng.randrange(1, 4), rng.randrange(10, 400)
        ctx = p * (p + rng.choice([0, 0, 256, 1024, 2048]))  # a chunk late in a long prompt
        ms = sum(c * x for c, x in zip(TRUE, (1, p, d, s, kv, ctx), strict=True))
        out.append({"duration_ms": ms * (1 + rng.gauss(0, noise)), "prefill_tokens": p,
                    "decode_tokens": d, "num_seqs": s, "kv_blocks_used": kv,
                    "prefill_context": ctx})
    return out


def test_the_step_cost_fit_recovers_the_costs_and_reports_its_held_out_error():
    exact = StepCost.fit(_steps(200, 0.0))
    assert exact.coef == pytest.approx(TRUE, abs=1e-6)
    assert exact.error.median_rel < 1e-9 and exact.error.n_test == 40
    noisy = StepCost.fit(_steps(400, 0.05))
    assert noisy.coef[1] == pytest.approx(TRUE[1], rel=0.1)  # the prefill token cost
    assert 0.01 < noisy.error.median_rel < 0.06 and noisy.error.p95_rel < 0.15
    with pytest.raises(ValueError, match="too few"):
        StepCost.fit(_steps(5, 0.0))
    # steps stored before the engine recorded prefill_context: that feature costs nothing
    old = [{k: v for k, v in x.items() if k != "prefill_context"} for x in _steps(100, 0.0)]
    assert StepCost.fit(old).coef[5] == 0.0
    assert StepCost(TRUE[:5]).predict(64, 1, 2, 10, 10**6) == StepCost(TRUE[:5]).predict(
        64, 1, 2, 10)


def test_a_token_count_the_window_ran_often_gets_its_own_offset():
    """Decode steps whose time is not linear in their rows (on a CPU, 2 sequences took longer
    than 3): the counts seen often get an offset of about their residual, shrunk toward 0;
    a count seen rarely gets the linear cost alone; scaling a cost scales its offsets."""
    bump = {2: 4.0, 3: -1.5}
    rng = random.Random(3)
    steps = []
    for k in range(600):
        d = rng.randrange(1, 7) if k % 3 else 0
        p = 0 if d else rng.choice([16, 64, 256])
        s, kv = max(d, 1), rng.randrange(10, 200)
        ms = sum(c * x for c, x in zip(TRUE, (1, p, d, s, kv, 0), strict=True))
        steps.append({"duration_ms": ms + bump.get(d, 0.0) if not p else ms,
                      "prefill_tokens": p, "decode_tokens": d, "num_seqs": s,
                      "kv_blocks_used": kv, "prefill_context": 0})
    steps.append({**steps[1], "decode_tokens": 40, "num_seqs": 40})  # one step of 40 tokens
    cost = StepCost.fit(steps)
    n2 = sum(1 for k, x in enumerate(steps) if k % 5 != 4 and x["decode_tokens"] == 2
             and not x["prefill_tokens"])
    assert n2 > 30
    # the linear part is fitted on every step, so the bump is shared with it a little
    assert cost.offsets[2] - cost.offsets.get(1, 0.0) == pytest.approx(
        4.0 * n2 / (n2 + 5), rel=0.15)
    assert cost.offsets[3] < cost.offsets[4] - 1.0
    assert 40 not in cost.offsets
    linear = replace(cost, offsets={})
    assert cost.predict(0, 40, 40, 50) == linear.predict(0, 40, 40, 50)
    assert cost.predict(0, 2, 2, 50) == pytest.approx(linear.predict(0, 2, 2, 50)
                                                      + cost.offsets[2])
    held = [x for k, x in enumerate(steps) if k % 5 == 4]

    def err(c):
        return statistics.median(abs(c.step(x) - x["duration_ms"]) / x["duration_ms"]
                                 for x in held)
    assert cost.error.median_rel == pytest.approx(err(cost))
    assert err(cost) < 0.5 * err(linear)
    half = cost.scaled(2.0)
    assert half.predict(0, 2, 2, 50) == pytest.approx(cost.predict(0, 2, 2, 50) / 2)
    assert cost.as_dict()["offsets"]["2"] == cost.offsets[2]


def test_the_engine_records_each_steps_prefill_context(tiny49k):
    """A 40-token prompt in 16-token chunks: its chunks attend to 16, 32 and 40 keys per
    token, and each step's record says so (the what-if prices the same sum per step)."""
    engine = Engine(tiny49k, EngineConfig(num_kv_blocks=64, block_size=4,
                                          max_batched_tokens=16))
    engine.add_request("a", list(range(5, 45)), SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    steps = list(engine.observer.steps)
    assert [s.prefill_tokens for s in steps] == [16, 16, 8, 0]
    assert [s.prefill_context for s in steps] == [16 * 16, 16 * 32, 8 * 40, 0]
    _, (replica,) = simulate([Arrival("a", 0.0, list(range(5, 45)), 2)],
                             EngineConfig(num_kv_blocks=64, block_size=4,
                                          max_batched_tokens=16),
                             StepCost((0, 0, 0, 0, 0, 1.0)), tiny49k.config)
    assert replica.runner.now_ms == 16 * 16 + 16 * 32 + 8 * 40  # each step: its context


def _arrivals(seed: int = 1) -> list[tuple[int, str, list[int], int]]:
    rng = random.Random(seed)
    out = []
    for i, step in enumerate([0, 0, 1, 3, 3, 4, 6, 8, 9, 11]):
        n = rng.randrange(5, 30)
        out.append((step, f"r{i}", [rng.randrange(5, 500) for _ in range(n)],
                    rng.randrange(3, 14)))
    return out


@pytest.mark.parametrize("policy,preemption", [("fcfs", "recompute"), ("fcfs", "swap"),
                                               ("fair", "recompute")])
def test_the_what_if_engine_schedules_the_arrivals_as_the_real_engine_does(
        tiny49k, policy, preemption):
    """The real engine (the tiny model) and the what-if engine (no model, each step 1 ms on
    the virtual clock) get the same arrivals at the same steps: every step runs the same
    requests with the same token counts, preemptions included."""
    cfg = EngineConfig(num_kv_blocks=24, block_size=4, max_batched_tokens=16, max_num_seqs=4,
                       preemption=preemption, scheduling_policy=policy)
    arrivals = _arrivals()
    real = Engine(tiny49k, cfg)
    steps: list[list[tuple[str, int]]] = []
    execute = real.runner.execute

    def recording(sched, kv):  # a test shim: notes what each real step ran
        steps.append([(s.request.request_id, s.num_new_tokens) for s in sched.all])
        return execute(sched, kv)

    real.runner.execute = recording
    pending = list(arrivals)
    while pending or real.has_unfinished():
        while pending and pending[0][0] <= len(steps):
            _, rid, prompt, out = pending.pop(0)
            real.add_request(rid, prompt, SamplingParams(max_tokens=out, ignore_eos=True,
                                                         tenant=rid[-1:]))
        assert real.has_unfinished(), "the test's arrivals must keep the engine busy"
        real.step()
    assert real.preemptions > 0  # the pool is small enough to preempt
    sims, (replica,) = simulate(
        [Arrival(rid, float(step), prompt, out, tenant=rid[-1:])
         for step, rid, prompt, out in arrivals], cfg, StepCost((1.0, 0, 0, 0, 0)),
        tiny49k.config)
    assert replica.runner.steps == steps
    assert all(s.state == "FINISHED" and len(s.token_ms) == out
               for s, (_, _, _, out) in zip(sims, arrivals, strict=True))


def test_a_candidate_config_changes_the_prediction_the_way_it_should(tiny49k):
    """A burst of 12 requests: with one sequence per step they queue behind each other."""
    rng = random.Random(3)
    burst = [Arrival(f"q{i}", 0.0, [rng.randrange(5, 500) for _ in range(40)], 20)
             for i in range(12)]
    cost = StepCost(TRUE)
    wide, _ = simulate(burst, EngineConfig(num_kv_blocks=256, block_size=16), cost,
                       tiny49k.config)
    narrow, _ = simulate(burst, EngineConfig(num_kv_blocks=256, block_size=16,
                                             max_num_seqs=1), cost, tiny49k.config)
    p_wide = percentile([s.ttft_ms for s in wide], 99)
    p_narrow = percentile([s.ttft_ms for s in narrow], 99)
    assert p_narrow > 5 * p_wide
    assert max(s.queue_ms for s in narrow) > 10 * max(s.queue_ms for s in wide)
    # one at a time: each request's decode steps cost one sequence's, the TPOT is lower
    assert percentile([s.tpot_ms for s in narrow], 50) < \
        percentile([s.tpot_ms for s in wide], 50)


def test_loop_times_count_the_gap_to_a_step_that_followed_at_once():
    steps = [{"ts_us": 0, "duration_ms": 4.0}, {"ts_us": 4_500, "duration_ms": 3.0},
             {"ts_us": 100_000, "duration_ms": 2.0}]
    from engine.whatif import loop_times

    assert [s["duration_ms"] for s in loop_times(steps)] == [4.5, 3.0, 2.0]  # idle after #2


def test_queue_timeouts_fire_on_the_virtual_clock(tiny49k):
    """The same burst, one sequence per step, the gateway's queue timeout at 60 ms of virtual
    time: the requests that reach a step before it finish, the rest end TIMED_OUT at the
    timeout (on the virtual clock, though the simulation takes far less real time), and a
    later arrival is still served."""
    rng = random.Random(3)
    burst = [Arrival(f"q{i}", 0.0, [rng.randrange(5, 500) for _ in range(40)], 20,
                     queue_timeout_s=0.06) for i in range(12)]
    late = Arrival("late", 5000.0, [7] * 40, 5, queue_timeout_s=0.06)
    cfg = EngineConfig(num_kv_blocks=256, block_size=16, max_num_seqs=1)
    sims, _ = simulate([*burst, late], cfg, StepCost(TRUE), tiny49k.config)
    by = {s.request_id: s for s in sims}
    done = [s for s in sims if s.state == "FINISHED"]
    out = [s for s in sims if s.state == "TIMED_OUT"]
    assert len(done) + len(out) == 13 and 1 <= len(out) <= 11 and by["late"] in done
    assert all(s.first_scheduled_ms is not None and s.first_scheduled_ms <= 60.0 + 1e-6
               for s in done if s is not by["late"])
    # ended at the timeout, give or take the step that was running when it came due
    step = max(StepCost(TRUE).predict(40, 1, 1, 256), 1.0)
    assert all(60.0 <= s.end_ms <= 60.0 + step and s.first_token_ms is None for s in out)
    untimed, _ = simulate([replace(a, queue_timeout_s=None) for a in burst], cfg,
                          StepCost(TRUE), tiny49k.config)
    assert {s.state for s in untimed} == {"FINISHED"}
