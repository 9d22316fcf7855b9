"""`tailscope whatif` end to end: open-loop traffic that queues on a tiny-model gateway with
a store, then the recorded window through the engine's own scheduler on a virtual clock, under
the recorded config and a candidate."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from bench.loadgen import Dist, Target, arrival_times, run_open_loop, workload
from tests.gateway.conftest import start_server, stop_server


def test_whatif_replays_the_recorded_window_and_a_candidate_config(bundled_path):
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--max-inflight", "1000",
                          env={"TAILSCOPE_MAX_NUM_SEQS": "4",
                               "TAILSCOPE_MAX_BATCHED_TOKENS": "64"})
    try:
        start = time.time() - 1
        items = workload(60, Dist("uniform", 60, 300), Dist("uniform", 8, 24), seed=4)
        samples, _ = asyncio.run(run_open_loop(Target(server.url), items,
                                               arrival_times(60, 60.0, seed=4)))
        assert all(s.ok for s in samples)
        time.sleep(1.5)  # the store's flush
        window = f"{start}..{time.time() + 1}"

        def whatif(*extra: str) -> dict:
            proc = subprocess.run(
                [sys.executable, "-m", "tailscope.cli", "whatif", "--url", server.url,
                 "--window", window, "--json", *extra], capture_output=True, text=True,
                timeout=300, env={**os.environ, "TAILSCOPE_GATEWAY_URL": server.url})
            assert proc.returncode == 0, proc.stderr[-2000:]
            return json.loads(proc.stdout)

        same = whatif()
        assert same["requests"] == 60 and same["recorded_config_known"]
        assert same["candidate_changes"] == {}
        err = same["step_cost"]["error"]
        assert err["n_test"] >= 10 and err["median_rel"] < 0.5
        t = same["table"]
        recorded, predicted = t["TTFT (engine)"]["recorded"], \
            t["TTFT (engine)"]["predicted_recorded_config"]
        assert recorded["p90"] > 20  # it queued
        # fidelity on its own config, loosely (measured 0.86-1.0x at p50; README)
        assert 0.5 < predicted["p50"] / recorded["p50"] < 2.0, t
        assert t["TTFT (engine)"]["predicted_candidate"] == predicted  # same config, same run
        narrow = whatif("--set", "max_num_seqs=1")
        assert narrow["candidate_changes"] == {"max_num_seqs": 1}
        q = narrow["table"]["queue"]
        assert q["predicted_candidate"]["p50"] > 2 * q["predicted_recorded_config"]["p50"]
        faster = whatif("--rate-scale", "2")
        assert faster["table"]["queue"]["predicted_recorded_config"]["p90"] > \
            q["predicted_recorded_config"]["p90"]
    finally:
        stop_server(server)
