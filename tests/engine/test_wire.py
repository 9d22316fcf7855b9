"""The replica's messages are typed end to end: stats cross as structs, whole."""

from __future__ import annotations

import dataclasses

from engine.observer import RequestStats, StepStats, TimelineEvent
from engine.protocol import StepReport, TokenDelta, decode_from_replica, encode
from tracing.schema import EngineStepRow


def test_step_and_request_stats_round_trip_as_structs():
    step = StepStats(step=3, wall_ns=1_700_000_000_000_000_000, duration_ms=1.5, num_seqs=2,
                     prefill_tokens=16, decode_tokens=1, kv_blocks_used=4, kv_blocks_total=64,
                     forward_ms=1.0, sample_ms=0.25, host_ms=0.25, prefix_queries=16,
                     prefix_hits=8, evictions=1, preemptions=0)
    ev = TimelineEvent
    req = RequestStats(events=(ev("QUEUED", 0.1), ev("RUNNABLE", 0.3), ev("DECODING", 3.3),
                               ev("FINISHED", 7.3, "length")),
                       token_offsets_ms=(3.3, 5.0, 7.3), cached_tokens=8)
    msg = StepReport("r0", [TokenDelta("a", [5], "FINISHED", "length", stats=req)], step)
    back = decode_from_replica(encode(msg))
    assert back.stats == step and back.deltas[0].stats == req
    assert isinstance(back.stats.step, int) and back.deltas[0].stats.token_offsets_ms == (
        3.3, 5.0, 7.3)
    assert back.deltas[0].stats.events[-1] == TimelineEvent("FINISHED", 7.3, "length")


def test_every_step_stat_has_its_engine_steps_column():
    columns = {f.name for f in dataclasses.fields(EngineStepRow)}
    # wall_ns becomes the row's ts; members become three parallel arrays (trace id, prefill
    # and decode tokens); every other field is stored under its own name
    assert set(StepStats.__struct_fields__) - {"wall_ns", "members"} <= columns
    assert {"member_traces", "member_prefill", "member_decode"} <= columns
