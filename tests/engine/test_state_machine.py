"""Request state machine: the transition table is enforced and every ending reclaims once."""

from __future__ import annotations

import itertools

import pytest

from engine import Engine, EngineConfig, IllegalTransition, RequestState, SamplingParams
from engine.observer import request_stats
from engine.request import TRANSITIONS, Request
from engine.sampling_params import SamplingParamsError
from tracing import timing
from tracing.record import RecordEvent

S = RequestState
ALL = [None, *S]


def test_states_are_ordered_with_terminals_last():
    assert len(S) == 14
    live = [s for s in S if not s.is_terminal]
    terminal = [s for s in S if s.is_terminal]
    assert {s.name for s in terminal} == {"REJECTED", "FINISHED", "CANCELLED", "TIMED_OUT",
                                          "FAILED"}
    assert min(terminal) > max(live)


@pytest.mark.parametrize("src,dst", list(itertools.product(ALL, S)))
def test_every_transition_outside_the_table_raises(src, dst):
    req = Request("r", [1, 2, 3], SamplingParams())
    req.state = src
    if dst in TRANSITIONS[src]:
        req.transition(dst)
        assert req.state == dst and req.events[-1].state == dst
    else:
        with pytest.raises(IllegalTransition):
            req.transition(dst)
        assert req.state == src and not req.events


def test_terminal_states_have_no_way_out():
    for s in S:
        assert (not TRANSITIONS[s]) == s.is_terminal


@pytest.fixture
def engine(tiny_model):
    # preemption "off": admission reserves prompt + max_tokens, which these tests rely on
    eng = Engine(tiny_model, EngineConfig(block_size=4, num_kv_blocks=8, max_batched_tokens=8,
                                          max_num_seqs=2, dtype="float64", preemption="off"))
    eng.reclaimed = []
    eng.on_reclaim = lambda r: eng.reclaimed.append(r.request_id)
    return eng


def _params(n=4):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _steps_until(engine, req, state, limit=50):
    for _ in range(limit):
        if req.state == state:
            return
        engine.step()
    raise AssertionError(f"{req.request_id} never reached {state.name}, is {req.state}")


def _assert_reclaimed_once(engine, req, state, reason):
    assert req.state == state and req.finish_reason == reason
    assert engine.reclaimed.count(req.request_id) == 1
    assert req.reclaim_count == 1
    assert not engine.kv.has_reservation(req.request_id)
    assert req not in engine.scheduler.running and req not in engine.scheduler.waiting


def test_finished_path(engine):
    req = engine.add_request("a", [5, 6, 7], _params(3))
    while engine.has_unfinished():
        engine.step()
    _assert_reclaimed_once(engine, req, S.FINISHED, "length")
    assert [e.state for e in req.events] == [S.QUEUED, S.RUNNABLE, S.PREFILLING, S.DECODING,
                                            S.FINISHED]
    stats = request_stats(req)
    assert len(stats.token_offsets_ms) == 3
    assert [e.state for e in stats.events] == [e.state.name for e in req.events]
    # the timing owner splits the engine's whole timeline into stages, nothing left over
    timeline = [RecordEvent(round(e.at_ms * 1000), e.state) for e in stats.events]
    stages = timing.durations([RecordEvent(0, "ROUTED"), *timeline,
                               RecordEvent(timeline[-1].ts_us, "END")])
    assert sum(stages[c] for c in timing.E2E_STAGES) == pytest.approx(
        timeline[-1].ts_us / 1000)
    assert stages["decode_ms"] > 0 and stages["prefill_ms"] > 0


def test_eos_and_stop_token_finish_with_stop(engine, tiny_model):
    first = engine.generate([[5, 6, 7]], _params(1))[0].output_token_ids[0]
    req = engine.add_request("s", [5, 6, 7], SamplingParams(max_tokens=5,
                                                            stop_token_ids=(first,)))
    while engine.has_unfinished():
        engine.step()
    assert req.finish_reason == "stop" and req.output_token_ids == [first]


def test_min_tokens_holds_off_stop_tokens_until_then(engine, tiny_model):
    free = engine.generate([[5, 6, 7]], _params(6))[0].output_token_ids
    stop = free[0]  # greedy's first token: without min_tokens it ends the request at once
    req = engine.add_request("m", [5, 6, 7], SamplingParams(max_tokens=6, min_tokens=3,
                                                            stop_token_ids=(stop,)))
    while engine.has_unfinished():
        engine.step()
    out = req.output_token_ids
    assert len(out) >= 3 and stop not in out[:3]  # masked: another token was chosen
    assert out[0] != free[0]
    if req.finish_reason == "stop":  # it may end on the stop token once past min_tokens
        assert out[-1] == stop and stop not in out[:-1]
    else:
        assert req.finish_reason == "length" and len(out) == 6
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert err.value.param == "min_tokens"


@pytest.mark.parametrize("when", [S.QUEUED, S.PREFILLING, S.DECODING])
def test_cancel_from_any_live_state(engine, when):
    blocker = engine.add_request("blocker", list(range(3, 23)), _params(8))  # fills the pool
    req = engine.add_request("c", [5, 6, 7, 8, 9, 10, 11, 12, 13], _params(8))
    if when == S.QUEUED:
        assert not engine.kv.has_reservation("c")
    else:
        engine.abort("blocker")
        engine.step()  # 8-token budget: the 9-token prompt needs two chunks
        assert req.state == S.PREFILLING and 0 < req.num_computed_tokens < 9
        if when == S.DECODING:
            _steps_until(engine, req, S.DECODING)
    reserved = engine.kv.reserved_total
    assert engine.abort("c") is True
    _assert_reclaimed_once(engine, req, S.CANCELLED, "cancelled")
    assert engine.abort("c") is False  # idempotent
    assert engine.kv.reserved_total <= reserved
    engine.abort("blocker")
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks and engine.kv.reserved_total == 0
    assert engine.reclaimed.count("blocker") == 1 and blocker.is_finished


def test_queued_request_ends_by_rolling_back_its_reservation(engine):
    req = engine.add_request("q", [5, 6, 7], _params(2))
    assert engine.kv.has_reservation("q") and engine.kv.pool.num_used == 0
    engine.abort("q")
    assert engine.kv.reserved_total == 0 and engine.kv.pool.num_used == 0
    _assert_reclaimed_once(engine, req, S.CANCELLED, "cancelled")


@pytest.mark.parametrize("steps_first", [0, 2])
def test_timeout_then_cancel_race_reclaims_once(engine, steps_first):
    req = engine.add_request("t", [5, 6, 7, 8], _params(8), deadline_s=3600)
    for _ in range(steps_first):
        engine.step()
    req.deadline_ns = 0  # the deadline passes...
    engine.step()
    _assert_reclaimed_once(engine, req, S.TIMED_OUT, "timeout")
    assert engine.abort("t") is False  # ...and a late cancel finds nothing to do
    _assert_reclaimed_once(engine, req, S.TIMED_OUT, "timeout")
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_forward_failure_fails_the_batch_and_engine_survives(engine):
    a = engine.add_request("f1", [5, 6, 7], _params(4))
    b = engine.add_request("f2", [8, 9], _params(4))
    real_execute = engine.runner.execute

    def faulty_execute(*args, **kwargs):  # fault injector: the forward raises once
        engine.runner.execute = real_execute
        raise RuntimeError("injected fault")

    engine.runner.execute = faulty_execute
    outputs = engine.step()
    for req in (a, b):
        _assert_reclaimed_once(engine, req, S.FAILED, "error")
        assert "injected fault" in req.error
    assert {o.request_id for o in outputs if o.finished} == {"f1", "f2"}
    ok = engine.generate([[5, 6, 7]], _params(2))[0]
    assert ok.state == S.FINISHED and engine.kv.pool.num_free == engine.kv.pool.num_blocks


class _ExplodingConstraint:
    """Fault injector: a grammar whose mask raises, standing in for any one request's bad
    sampling state."""

    def allowed_tokens(self, vocab_size):
        raise RuntimeError("injected sampling fault")

    def accept(self, token):
        pass


def test_a_failing_sample_fails_only_its_own_request(engine, tiny_model):
    alone = engine.generate([[8, 9, 10]], _params(6))[0].output_token_ids
    bad = engine.add_request("bad", [5, 6, 7], _params(6))
    good = engine.add_request("good", [8, 9, 10], _params(6))
    bad.constraint = _ExplodingConstraint()
    while engine.has_unfinished():
        engine.step()
    _assert_reclaimed_once(engine, bad, S.FAILED, "error")
    assert "injected sampling fault" in bad.error
    assert good.state == S.FINISHED and good.output_token_ids == alone
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_top_k_past_the_vocabulary_is_rejected_at_admission(engine, tiny_model):
    vocab = tiny_model.config.vocab_size
    req = engine.add_request("k", [5, 6], SamplingParams(max_tokens=2, top_k=vocab + 1,
                                                         temperature=1.0))
    _assert_reclaimed_once(engine, req, S.REJECTED, "rejected")
    assert "top_k" in req.error


def test_rejections_name_the_reason_and_reclaim_once(engine, tiny_model):
    cases = {
        "empty": ([], "empty"),
        "vocab": ([5, tiny_model.config.vocab_size], "outside the vocabulary"),
        "pool": (list(range(3, 30)), "KV blocks"),  # 27 + 8 tokens > 8 blocks of 4
        "ctx": (list(range(3, 10)), "exceeds the context length"),
    }
    for rid, (prompt, reason) in cases.items():
        n = 2000 if rid == "ctx" else 8
        req = engine.add_request(rid, prompt, _params(n))
        _assert_reclaimed_once(engine, req, S.REJECTED, "rejected")
        assert reason in req.error
    assert engine.kv.reserved_total == 0 and not engine.has_unfinished()


def test_duplicate_live_request_id_is_refused(engine):
    engine.add_request("dup", [5, 6], _params())
    with pytest.raises(ValueError, match="already live"):
        engine.add_request("dup", [5, 6], _params())


def test_finished_requests_leave_the_live_table_and_recent_history_is_bounded(engine):
    engine.recent_limit = 2
    reqs = [engine.add_request(f"h{i}", [5, 6], _params(1)) for i in range(3)]
    assert set(engine.requests) == {"h0", "h1", "h2"}
    while engine.has_unfinished():
        engine.step()
    assert not engine.requests
    assert engine.get_request("h0") is None  # evicted from the bounded history
    assert engine.get_request("h2") is reqs[2] and engine.abort("h2") is False
    engine.add_request("h0", [5, 6], _params(1))  # an ended id may be reused
