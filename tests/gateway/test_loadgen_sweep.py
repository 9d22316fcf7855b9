"""A short sweep of `tailscope serve` (tiny model) through the CLI writes its report."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from tests.gateway.test_faults import wait_for


def test_short_sweep_writes_results_summary_and_plot(tiny_server, tmp_path):
    out = tmp_path / "sweep"
    r = subprocess.run(
        [sys.executable, "-m", "tailscope.cli", "bench", "--url", tiny_server.url + "/v1",
         "--mode", "sweep", "--steps", "2", "--duration", "2", "--prompt-len", "fixed:16",
         "--output-len", "fixed:4", "--slo", "ttft_ms=2000,tpot_ms=500", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((out / "results.json").read_text())
    assert result["serial"]["succeeded"] == 16 and result["burst"]["succeeded"] == 32
    assert len(result["points"]) == 2
    for p in result["points"]:  # near the burst throughput the gateway may shed (503)
        assert p["succeeded"] > 0 and p["e2e_ms"]["n"] == p["succeeded"]
        assert set(p["errors"]) <= {"503"}, p["error_examples"]
        assert p["requests"] >= 20
        assert 0 <= p["slo"]["attainment"] <= 1 and "p99_ci95" in p["e2e_ms"]
    summary = (out / "summary.md").read_text()
    assert "| serial |" in summary and "Saturation" in summary
    # the run is in bench_runs, and its requests' records carry its id
    assert "stored in bench_runs" in r.stderr, r.stderr[-500:]
    n_sent = sum(p["requests"] + len(p.get("cold_start", {}).get("e2e_ms", []))
                 for p in (result["serial"], result["burst"], *result["points"]))

    def stored() -> list:
        return httpx.post(f"{tiny_server.url}/debug/query", json={
            "sql": "SELECT mode, config_id, (SELECT count() FROM tailscope.requests WHERE "
                   "bench_run = {r:String}) FROM tailscope.bench_runs WHERE run_id = {r:String}",
            "params": {"r": result["run_id"]}}).json()["rows"]

    config_id = httpx.get(f"{tiny_server.url}/debug/config").json()["config_id"]
    assert wait_for(lambda: stored() == [["sweep", config_id, n_sent]], 10), (stored(), n_sent)
    png = (out / "frontier.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
