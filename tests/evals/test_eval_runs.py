"""Eval runs end to end on the bundled model: `tailscope eval run` (a gateway started from a
config file, and a running gateway via --url), results joined to request records in chDB, and
`tailscope eval compare` as a gate (exit 0 for the same config, 1 for a broken one).

Every `tailscope` command runs in its own process: the embedded store is one chDB directory per
process, and this test process already has one open (the session `store` fixture).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from evals.runner import CONFIGS_DIR, SUITES_DIR, GatewayProcess, load_suite

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = CONFIGS_DIR / "bundled.yaml"
BROKEN = Path(__file__).parent / "configs" / "broken-forced-temperature.yaml"
SLOW = Path(__file__).parent / "configs" / "slow-tiny-budget.yaml"


def tailscope(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tailscope.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def run_id(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def subset(d: Path, suite: str, keep) -> Path:
    """The built-in ``suite`` cut to the cases ``keep(index, case)`` says, as a file of the
    same name (so its runs carry the suite's name; compare works on the cases both runs
    have)."""
    import yaml

    data = yaml.safe_load((SUITES_DIR / f"{suite}.yaml").read_text())
    data["cases"] = [c for i, c in enumerate(data["cases"]) if keep(i, c)]
    (d / "suites").mkdir(exist_ok=True)
    path = d / "suites" / f"{suite}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# Run time (this is the slowest module, and CI's budget is 30 minutes): both baselines and the
# broken config run smoke-qa's first 16 cases (the gate compares the cases both runs have; the
# whole suite, 51 cases, cost ~70 s more); the determinism suite's two seeded cases (they need
# the batch-invariant kernels) and two greedy ones, one of them streamed. `tailscope eval run`
# runs any suite whole; protocol runs whole here.
SMOKE_SUBSET = 16
DETERMINISM_SUBSET = ("short-qa", "streamed", "seeded-fun-fact", "seeded-completion")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Baseline smoke-qa twice (started from the file; through --url), the
    broken config once (the subset), the protocol suite on the default config and on one
    with a tiny token budget, and part of the determinism suite on batch-invariant kernels."""
    d = tmp_path_factory.mktemp("evals")
    smoke = subset(d, "smoke-qa", lambda i, c: i < SMOKE_SUBSET)
    determinism = subset(d, "determinism", lambda i, c: c["id"] in DETERMINISM_SUBSET)
    # no engine-queue time limit: on a loaded machine the 2-token-budget config's requests
    # waited past the 60 s default and failed as timeouts, which is not what these runs test
    env = {**os.environ, "TAILSCOPE_STORE_DSN": f"chdb://{d}/store",
           "TAILSCOPE_STORE_FLUSH_S": "0.5", "TAILSCOPE_GATEWAY_URL": "http://127.0.0.1:9",
           "TAILSCOPE_QUEUE_TIMEOUT_S": "0"}
    out = {"env": env, "smoke": smoke, "dir": d}
    out["a"] = tailscope(env, "eval", "run", "--suite", str(smoke), "--config", str(BUNDLED),
                         "--gateway-log", str(d / "a.log"))
    with GatewayProcess(BUNDLED, env=env, log_path=d / "b.log") as gw:
        out["b"] = tailscope(env, "eval", "run", "--suite", str(smoke), "--url", gw.url)
        out["protocol"] = tailscope(env, "eval", "run", "--suite", "protocol", "--url", gw.url)
        out["gateway_config"] = httpx.get(f"{gw.url}/debug/config").json()
        out["bad_post"] = httpx.post(f"{gw.url}/debug/eval-runs", json={"run": {}})
        out["listed"] = tailscope(env, "eval", "list", "--url", gw.url)
    # the determinism suite's seeded cases hold only with batch-invariant kernels
    out["determinism"] = tailscope(env, "eval", "run", "--suite", str(determinism), "--config",
                                   str(CONFIGS_DIR / "bundled-batch-invariant.yaml"))
    out["broken"] = tailscope(env, "eval", "run", "--suite", str(smoke), "--config",
                              str(BROKEN))
    out["slow"] = tailscope(env, "eval", "run", "--suite", "protocol", "--config",
                              str(SLOW))
    return out


def test_baseline_runs_pass_every_case_and_name_their_config(runs):
    for key, n in (("a", SMOKE_SUBSET), ("b", SMOKE_SUBSET), ("protocol", 15),
                   ("determinism", len(DETERMINISM_SUBSET))):
        proc = runs[key]
        run_id(proc)
        line = next(x for x in proc.stdout.splitlines() if x.startswith("passed "))
        passed, total = line.split()[1].split("/")
        assert passed == total, proc.stdout  # every built-in case holds on the default config
        if n:
            assert int(total) == n
        assert f"{total}/{total} request records joined" in line
    cfg = runs["gateway_config"]
    assert f"({cfg['config_id']})" in runs["a"].stdout  # the file and the gateway agree
    assert cfg["name"] == "bundled-default" and cfg["config"]["engine"]["max_num_seqs"] == 64
    assert runs["bad_post"].status_code == 400
    assert run_id(runs["a"]) in runs["listed"].stdout


def test_same_config_twice_passes_the_gate(runs):
    proc = tailscope(runs["env"], "eval", "compare", run_id(runs["a"]), run_id(runs["b"]))
    if proc.returncode == 1 and "quality: pass rate 100.0% -> 100.0%" in proc.stdout \
            and " 0 outputs changed" in proc.stdout:
        # The same outputs, slower wall clocks: this VM's speed moves by up to 2x between two
        # minutes (a full `make test` once measured the second run's E2E p50 at 1.79x the
        # first's, every output equal). The latency gate compares wall clocks, so the second
        # run is measured once more, on a gateway of its own, and the gate must pass on it.
        with GatewayProcess(BUNDLED, env=runs["env"], log_path=runs["dir"] / "b2.log") as gw:
            runs["b_again"] = tailscope(runs["env"], "eval", "run", "--suite",
                                        str(runs["smoke"]), "--url", gw.url)
        proc = tailscope(runs["env"], "eval", "compare", run_id(runs["a"]),
                         run_id(runs["b_again"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: OK" in proc.stdout and "0 newly failing" in proc.stdout


def test_a_config_that_breaks_behaviour_fails_the_gate(runs):
    broken = run_id(runs["broken"])
    proc = tailscope(runs["env"], "eval", "compare", run_id(runs["a"]), broken)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    quality = next(x for x in proc.stdout.splitlines() if x.startswith("quality:"))
    assert "REGRESSED" in quality and "verdict: REGRESSED" in proc.stdout
    assert "now fails" in proc.stdout  # the failing cases are named, with their traces


def test_a_config_that_only_slows_down_fails_on_latency(runs):
    proc = tailscope(runs["env"], "eval", "compare", run_id(runs["protocol"]),
                     run_id(runs["slow"]))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    quality = next(x for x in proc.stdout.splitlines() if x.startswith("quality:"))
    assert quality.endswith("-> ok")  # a smaller token budget changes no output
    # a latency line says it: the smaller budget slows prefill, so TTFT or E2E (which of them
    # clears the gate's one-sided bound depends on the run: once TTFT x3.36 and E2E only x2.43
    # with a lower bound of 1.27 under the 1.5 limit)
    regressed = [x for x in proc.stdout.splitlines() if x.endswith("REGRESSED") or
                 "REGRESSED  n=" in x]
    assert any(m in x for x in regressed for m in ("ttft_ms p50", "ttft_ms p99", "e2e_ms p50",
                                                     "e2e_ms p99")), proc.stdout


QUERY = """
import json, sys
from tracing.store import Store
s = Store(sys.argv[1])
cols, rows = s.select(
    "SELECT e.run_id, e.case_id, e.trace_id, r.c, r.cfg, r.bench, run.config_id FROM "
    "tailscope.eval_results e "
    "LEFT JOIN (SELECT trace_id, count() AS c, any(config_id) AS cfg, any(bench_run) AS bench "
    "FROM tailscope.requests GROUP BY trace_id) r ON e.trace_id = r.trace_id "
    "JOIN tailscope.eval_runs run ON run.run_id = e.run_id")
print(json.dumps([list(r) for r in rows]))
"""


def test_every_result_joins_exactly_one_request_with_the_runs_config(runs):
    smoke_runs = [k for k in ("a", "b", "b_again", "broken") if k in runs]  # b_again: above
    ids = {run_id(runs[k]) for k in (*smoke_runs, "protocol", "determinism", "slow")}
    dsn = runs["env"]["TAILSCOPE_STORE_DSN"]
    proc = subprocess.run([sys.executable, "-c", QUERY, dsn], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert {r[0] for r in rows} == ids
    assert len(rows) == len(smoke_runs) * SMOKE_SUBSET + 2 * len(load_suite("protocol")[1]) + \
        len(DETERMINISM_SUBSET)
    for run, case, trace, count, record_cfg, bench_run, run_cfg in rows:
        assert trace and count == 1, (run, case, trace, count)
        assert record_cfg == run_cfg and bench_run == run, (run, case)
    by_run = {}
    for r in rows:
        by_run.setdefault(r[0], set()).add(r[6])
    a, broken = run_id(runs["a"]), run_id(runs["broken"])
    assert by_run[a] != by_run[broken]  # a different config, a different config_id
    assert by_run[a] == by_run[run_id(runs["b"])]
