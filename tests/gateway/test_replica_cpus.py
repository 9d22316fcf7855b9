"""``TAILSCOPE_REPLICA_CPUS``: each local replica process runs on its own CPU set."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import psutil
import pytest

from engine import cpus as C
from engine.cpus import format_cpus, parse_cpus, replica_cpus, split_cpus
from tests.gateway.conftest import start_server, stop_server


def serves(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_cpu_lists_parse_and_print_as_taskset_writes_them():
    assert parse_cpus("3") == {3}
    assert parse_cpus("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpus(" 1 , 4-5") == {1, 4, 5}
    assert format_cpus({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"
    assert parse_cpus(format_cpus({0, 2, 3, 7})) == {0, 2, 3, 7}
    for bad in ("", "a", "3-1", "-1", "1-", "0,,2"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpus(bad)


def test_one_list_for_all_replicas_or_one_each():
    first, last = 0, os.cpu_count() - 1
    assert replica_cpus("", 2) is None
    assert replica_cpus(str(first), 3) == [{first}] * 3
    assert replica_cpus(f"{first}|{last}", 2) == [{first}, {last}]
    with pytest.raises(ValueError, match="2 CPU lists for 3 replicas"):
        replica_cpus(f"{first}|{last}", 3)
    with pytest.raises(ValueError, match=f"CPU\\(s\\) {last + 1} do not exist here"):
        replica_cpus(f"0,{last + 1}", 1)


def test_auto_splits_the_cpus_in_consecutive_groups():
    assert split_cpus([0, 1, 2, 3, 4, 5, 6, 7], 2) == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    assert split_cpus([0, 1, 2, 3, 4], 2) == [{0, 1}, {2, 3}]  # CPU 4 left to the rest
    assert split_cpus([2, 3, 8], 3) == [{2}, {3}, {8}]
    with pytest.raises(ValueError, match="3 CPU\\(s\\) \\(0-2\\) for 4 replicas"):
        split_cpus([0, 1, 2], 4)
    mine = sorted(os.sched_getaffinity(0))
    assert replica_cpus("auto", 1) == [set(mine)]


def test_local_replicas_share_the_cores_out_unless_told(monkeypatch):
    """engine.cpus.replica_threads: TAILSCOPE_THREADS wins, then one per CPU of a replica's
    set, then cores // replicas for two or more unpinned replicas (at least one), else 0
    (torch's default) for a replica alone."""
    monkeypatch.delenv("TAILSCOPE_THREADS", raising=False)
    monkeypatch.setattr(C, "usable_cores", lambda: 8)
    assert [C.replica_threads(None, n) for n in (1, 2, 3, 8, 16)] == [0, 4, 2, 1, 1]
    assert C.replica_threads(frozenset({0, 1, 2}), 4) == 3  # pinned: one per CPU of its set
    monkeypatch.setenv("TAILSCOPE_THREADS", "5")
    assert C.replica_threads(None, 2) == C.replica_threads(frozenset({0}), 2) == 5
    monkeypatch.undo()
    cores = C.usable_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))


def test_two_unpinned_replicas_each_get_their_share_of_the_cores(bundled_path, monkeypatch):
    """Two replicas of torch's default threads on this machine's cores served the tiny model
    at a tenth of the rate of one thread each (engine.cpus.replica_threads): the gateway now
    gives each its share, which the replica reports and /debug/replicas shows."""
    monkeypatch.delenv("TAILSCOPE_THREADS", raising=False)
    monkeypatch.delenv("TAILSCOPE_REPLICA_CPUS", raising=False)
    share = max(1, C.usable_cores() // 2)
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--replicas", "2", env={"TAILSCOPE_STORE_DSN": "none"})
    try:
        desc = httpx.get(f"{server.url}/debug/replicas", timeout=10).json()
        assert {rid: (d["threads"], d["cpus"]) for rid, d in desc.items()} == \
            {"r0": (share, None), "r1": (share, None)}
        for child in psutil.Process(server.proc.pid).children(recursive=True):
            if "engine.replica" in child.cmdline():
                assert child.environ()["TAILSCOPE_THREADS"] == str(share)
        serves(server.url)
    finally:
        stop_server(server)


def test_the_gateway_refuses_a_cpu_list_it_cannot_use(bundled_path):
    out = subprocess.run([sys.executable, "-m", "tailscope.cli", "serve", "--model", "tiny:49152",
                          "--tokenizer", str(bundled_path), "--port", "1"],
                         env={**os.environ, "TAILSCOPE_REPLICA_CPUS": "0|1|2",
                              "TAILSCOPE_STORE_DSN": "none"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "TAILSCOPE_REPLICA_CPUS='0|1|2' gives 3 CPU lists for 1 replicas" in out.stderr


def test_each_replica_runs_on_its_cpus_with_a_thread_per_cpu(bundled_path):
    cpu = sorted(os.sched_getaffinity(0))[-1]
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--replicas", "2",
                          env={"TAILSCOPE_REPLICA_CPUS": f"{cpu}|0"})
    try:
        replicas = {}
        for child in psutil.Process(server.proc.pid).children(recursive=True):
            cmd = child.cmdline()
            if "engine.replica" in cmd:
                replicas[cmd[cmd.index("--id") + 1]] = child
        assert sorted(replicas) == ["r0", "r1"]
        assert replicas["r0"].cpu_affinity() == [cpu]
        assert replicas["r1"].cpu_affinity() == [0]
        # torch's pool: one intra-op thread per CPU, created inside the set (the main thread
        # included, every thread of the process is on the replica's CPUs)
        for r, want in ((replicas["r0"], {cpu}), (replicas["r1"], {0})):
            for t in r.threads():
                assert os.sched_getaffinity(t.id) == want
        # /debug/replicas says where each runs
        desc = httpx.get(f"{server.url}/debug/replicas", timeout=10).json()
        assert (desc["r0"]["cpus"], desc["r1"]["cpus"]) == (str(cpu), "0")
        assert (desc["r0"]["threads"], desc["r1"]["threads"]) == (1, 1)  # one per CPU
        # and they serve
        serves(server.url)
    finally:
        stop_server(server)
