"""bench/capture_switch.py, the harness behind bench/trace_overhead.py's one-gateway comparison
(``switched``): with capture switched off by SIGUSR1, a request served leaves no record and no
engine step row in the store, the writer is flushed and the harness says so in its file; with
it switched on again by SIGUSR2, both are written. It patches the gateway's internals (the
writer's emits, ``gateway.runtime.step_row``), so a change there that left "off" writing would make
the bench compare capture with itself: this test fails instead."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from tracing.client import GatewayProcess

ROOT = Path(__file__).resolve().parents[2]


def test_capture_switched_off_writes_nothing_and_on_again_writes_both(tmp_path):
    marker = tmp_path / "flushed"
    env = {"TAILSCOPE_STORE_DSN": f"chdb://{tmp_path}/store", "TAILSCOPE_STORE_PROCESS": "1",
           "TAILSCOPE_STORE_FLUSH_S": "0.2", "TAILSCOPE_KV_CACHE_MB": "16",
           "TAILSCOPE_BENCH_SWITCH_FILE": str(marker)}
    with GatewayProcess(["--model", "tiny:49152", "--tokenizer", "bundled"], env=env, cwd=ROOT,
                        quiet=True, module="bench.capture_switch") as gw:
        def complete() -> str:
            r = httpx.post(f"{gw.url}/v1/completions", json={
                "model": "SmolLM2-135M-Instruct", "prompt": "one two three", "max_tokens": 4,
                "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            return r.headers["x-tailscope-trace-id"]

        def counts(trace_id: str) -> tuple[int, int]:
            """(records, engine step rows) the store holds for the trace."""
            sql = ("SELECT (SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}),"
                   " (SELECT count() FROM tailscope.engine_steps WHERE has(member_traces, "
                   "{t:String}))")
            r = httpx.post(f"{gw.url}/debug/query", json={"sql": sql, "params": {"t": trace_id}},
                           timeout=30)
            assert r.status_code == 200, r.text
            return tuple(r.json()["rows"][0])

        def wait_for(trace_id: str) -> tuple[int, int]:
            deadline = time.monotonic() + 30
            while (got := counts(trace_id)) != (1, 4) and time.monotonic() < deadline:
                time.sleep(0.1)
            return got

        on = complete()
        assert wait_for(on) == (1, 4)  # the record, and a step row per token decoded
        os.kill(gw.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text() == "1"):
            assert time.monotonic() < deadline, "the harness did not say the flush was done"
            time.sleep(0.05)
        off = complete()
        time.sleep(1.0)  # five flush intervals: anything queued would be in the store
        assert counts(off) == (0, 0)
        os.kill(gw.proc.pid, signal.SIGUSR2)
        time.sleep(0.2)
        again = complete()
        assert wait_for(again) == (1, 4)
        assert counts(off) == (0, 0)
