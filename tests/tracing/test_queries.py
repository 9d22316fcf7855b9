"""The drill-down query library on a seeded embedded store: numbers checked against the seed
itself, the regression explained, parameters never SQL."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from tracing import queries as Q
from tracing import timing
from tracing.seed import synthetic_records, synthetic_steps

# two days ago at 10:00 (other tests write "now"; older rows would fall to the 30-day TTL)
T0 = (dt.datetime.now(dt.UTC) - dt.timedelta(days=2)).replace(hour=10, minute=0, second=0,
                                                             microsecond=0)
BASE = (T0, T0 + dt.timedelta(minutes=10))
SUSPECT = (T0 + dt.timedelta(hours=1), T0 + dt.timedelta(hours=1, minutes=10))


def us(t: dt.datetime) -> int:
    return int(t.timestamp() * 1e6)


@pytest.fixture(scope="module")
def seeded(store):
    base = synthetic_records(600, us(BASE[0]), us(BASE[1]), seed=1)
    # the same traffic an hour later, except that 6% of r1's requests queue 200 ms longer
    suspect = synthetic_records(600, us(SUSPECT[0]), us(SUSPECT[1]), seed=1, slow_replica="r1",
                                slow_fraction=0.06, slow_queue_ms=200.0)
    store.insert_rows("requests", base + suspect)
    store.insert_rows("engine_steps", synthetic_steps(us(BASE[0]), us(BASE[1])))
    return store, base, suspect


def test_percentiles_match_the_seed(seeded):
    store, base, _ = seeded
    df = Q.percentiles(store, *BASE, metric="e2e_ms", by="replica")
    assert list(df["replica"]) == ["r0", "r1"]
    for _, row in df.iterrows():
        vals = [r.e2e_ms for r in base if r.replica == row["replica"]]
        assert row["n"] == len(vals)
        assert row["p99"] == pytest.approx(np.quantile(vals, 0.99, method="inverted_cdf"),
                                           rel=0.02)
        assert row["max"] == pytest.approx(max(vals))
    itl = Q.percentiles(store, *BASE, metric="itl_ms")
    assert itl.at[0, "n"] == sum(len(r.itl_ms) for r in base)
    buckets = Q.percentiles(store, *BASE, metric="ttft_ms", bucket_s=60, by="tenant")
    assert buckets["n"].sum() == len(base) and buckets["t"].nunique() == 10


def test_tail_breakdown_adds_up(seeded):
    store, base, _ = seeded
    df = Q.tail_breakdown(store, *BASE, metric="e2e_ms")
    assert set(df["stage"]) == {"ingress", "tokenize", "routing", "engine queue time",
                                "prefill", "decode", "preemption", "streaming"}
    assert df["share"].sum() == pytest.approx(1.0)
    cut = np.quantile([r.e2e_ms for r in base], 0.99, method="inverted_cdf")
    assert df.attrs["cut_ms"] == pytest.approx(cut, rel=0.02)
    assert df.attrs["tail_n"] == sum(r.e2e_ms >= df.attrs["cut_ms"] for r in base)


def test_regression_names_engine_queue_time_on_r1(seeded):
    store, _, _ = seeded
    cmp = Q.compare_windows(store, BASE, SUSPECT, metric="e2e_ms", by="replica")
    top = cmp.iloc[0]
    assert top["replica"] == "r1" and top["stage"] == "engine queue time", cmp.head()
    assert top["share"] > 0.5
    assert cmp["share"].sum() == pytest.approx(1.0)
    r0_queue = cmp[(cmp["replica"] == "r0") & (cmp["stage"] == "engine queue time")]
    assert abs(r0_queue["delta_ms"].iloc[0]) < 1e-6  # r0's traffic did not change at all
    sentence = Q.explain(cmp)
    assert sentence.startswith("p99 E2E +") and "engine queue time on r1" in sentence
    ttft = Q.compare_windows(store, BASE, SUSPECT, metric="ttft_ms", by="replica")
    assert "engine queue time on r1" in Q.explain(ttft)


def test_slowest_trace_slo_and_rates(seeded):
    store, base, suspect = seeded
    slow = Q.slowest(store, *SUSPECT, limit=5)
    assert list(slow["e2e_ms"]) == sorted((r.e2e_ms for r in suspect), reverse=True)[:5]
    t = Q.trace(store, base[0].trace_id)
    assert t["record"]["trace_id"] == base[0].trace_id and len(t["steps"]) > 0
    assert set(t["steps"].columns) >= {"num_seqs", "kv_blocks_used"}
    assert Q.trace(store, "0" * 32)["record"] is None
    s = Q.slo(store, *BASE, ttft_ms=60, tpot_ms=15)
    rule = timing.Slo(ttft_ms=60, tpot_ms=15)  # the Python rule and the SQL rule agree
    good = sum(rule.met(r.final_state == "FINISHED", r.ttft_ms, r.tpot_ms) for r in base)
    assert 0 < good < len(base)
    assert s.at[0, "good"] == good and s.at[0, "goodput_rps"] == pytest.approx(good / 600)
    rates = Q.rates(store, *BASE, bucket_s=300)
    assert len(rates) == 2 and rates["n"].sum() == len(base)
    hit = sum(r.cached_tokens for r in base) / sum(r.prompt_tokens for r in base)
    assert (rates["prefix_hit_rate"] * rates["n"]).sum() / rates["n"].sum() == \
        pytest.approx(hit, rel=0.2)


def test_identifiers_are_checked_and_values_bound(seeded):
    store, _, _ = seeded
    with pytest.raises(Q.QueryError):
        Q.percentiles(store, *BASE, metric="e2e_ms; DROP TABLE tailscope.requests")
    with pytest.raises(Q.QueryError):
        Q.percentiles(store, *BASE, by="replica) OR (1")
    df = Q.percentiles(store, *BASE, filters={"replica": "r0' OR '1'='1"})
    assert df.at[0, "n"] == 0
    assert Q.percentiles(store, *BASE, filters={"replica": "r0"}).at[0, "n"] == 300
