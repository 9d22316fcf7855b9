"""The comparison's statistics and verdicts on constructed runs, and engine config files."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from evals.compare import Thresholds, compare, mcnemar_one_sided, render


def run(rid: str) -> dict:
    return {"run_id": rid, "suite": "s", "config_id": f"cfg-{rid}"}


def results(passed: list[bool], latency: list[float], outputs: list[str] | None = None
            ) -> pd.DataFrame:
    n = len(passed)
    return pd.DataFrame({"case_id": [f"c{i}" for i in range(n)],
                         "trace_id": [f"t{i}-{id(passed)}" for i in range(n)],
                         "score": [float(p) for p in passed], "passed": passed,
                         "detail": ["" if p else "wrong" for p in passed],
                         "output": outputs or [f"o{i}" for i in range(n)],
                         "finish_reason": ["stop"] * n, "weight": [1.0] * n,
                         "tags": [[] for _ in range(n)], "ttft_ms": [x / 4 for x in latency],
                         "e2e_ms": latency})


def test_mcnemar_exact_one_sided():
    assert mcnemar_one_sided(0, 0) == 1.0 and mcnemar_one_sided(0, 4) == 1.0
    assert mcnemar_one_sided(5, 0) == pytest.approx(1 / 32)
    assert mcnemar_one_sided(3, 3) == pytest.approx(42 / 64)
    assert mcnemar_one_sided(1, 0) == 0.5


def test_quality_verdicts_with_and_without_significance():
    rng = np.random.default_rng(0)
    lat = list(rng.uniform(100, 120, 40))
    a = results([True] * 40, lat)
    six_fail = results([False] * 6 + [True] * 34, lat)
    c = compare(run("a"), a, run("b"), six_fail)
    assert c.regressed == [f"c{i}" for i in range(6)] and c.fixed == []
    assert c.mcnemar_p == pytest.approx(1 / 64) and c.quality_regressed
    assert c.verdict == "regressed" and "REGRESSED" in render(c)
    one_fail = results([False] + [True] * 39, lat)
    c = compare(run("a"), a, run("b"), one_fail)
    assert not c.quality_regressed and c.verdict == "ok"  # p = 0.5: could be noise
    strict = compare(run("a"), a, run("b"), one_fail, Thresholds(alpha=1.0))
    assert strict.quality_regressed and strict.verdict == "regressed"
    tolerant = compare(run("a"), a, run("b"), six_fail, Thresholds(max_pass_drop=0.2))
    assert not tolerant.quality_regressed
    same = compare(run("a"), a, run("b"), results([True] * 40, lat))
    assert same.verdict == "ok" and same.changed_output == []


def test_latency_regression_needs_a_shift_beyond_the_limit_and_the_noise():
    rng = np.random.default_rng(1)
    lat = rng.lognormal(math.log(500), 0.3, 60)
    a = results([True] * 60, list(lat))
    noisy = results([True] * 60, list(lat * rng.uniform(0.8, 1.25, 60)))
    c = compare(run("a"), a, run("b"), noisy)
    assert not c.latency_regressed and c.verdict == "ok"
    slow = results([True] * 60, list(lat * 3.0))
    c = compare(run("a"), a, run("b"), slow)
    table = c.latency.set_index(["metric", "quantile"])
    assert table.loc[("e2e_ms", "p50"), "ratio"] == pytest.approx(3.0)
    assert table.loc[("e2e_ms", "p50"), "regressed"] and c.latency_regressed
    assert not c.quality_regressed and c.verdict == "regressed"
    # the same 3x shift under a limit of +250% passes
    assert compare(run("a"), a, run("b"), slow,
                   Thresholds(max_p50_increase=2.5, max_p99_increase=2.5)).verdict == "ok"


def test_cases_missing_from_one_run_are_reported_not_compared():
    a = results([True] * 5, [1.0, 2, 3, 4, 5])
    b = results([True] * 3, [1.0, 2, 3])
    c = compare(run("a"), a, run("b"), b)
    assert c.only_a == ["c3", "c4"] and len(c.cases) == 3
    assert "2 cases only in A" in render(c)


def test_engine_config_files(tmp_path):
    from tailscope.engine_config import ConfigFileError, load

    p = tmp_path / "c.yaml"
    p.write_text("name: x\nmodel: tiny\nengine: {max_num_seqs: 2, dtype: float32}\n"
                 "sampling: {overrides: {temperature: 1.5}}\n")
    cfg = load(p)
    assert cfg.model == "tiny" and cfg.engine == {"max_num_seqs": 2, "dtype": "float32"}
    assert cfg.sampling_overrides == {"temperature": 1.5} and cfg.name == "x"
    for text, match in (("engine: {max_seqs: 2}\n", "unknown engine keys"),
                        ("modle: tiny\n", "unknown keys"),
                        ("engine: {max_num_seqs: two}\n", "must be int"),
                        ("replicas: 0\n", "positive integer"),
                        ("sampling: {forced: {}}\n", "unknown sampling keys")):
        p.write_text(text)
        with pytest.raises(ConfigFileError, match=match):
            load(p)


def test_config_id_hashes_the_resolved_config_not_its_name():
    from engine.config import EngineConfig
    from gateway.app import GatewayConfig, config_id

    base = config_id(GatewayConfig(config_name="a"))
    assert base == config_id(GatewayConfig(config_name="b"))
    assert base != config_id(GatewayConfig(sampling_overrides={"temperature": 1.5}))
    assert base != config_id(GatewayConfig(engine=EngineConfig(max_num_seqs=4)))
