"""What tracing costs: gateway+engine throughput with full capture vs capture off, and the record
writer's ingest rate into embedded ClickHouse (chDB).

    python bench/trace_overhead.py [--seconds 8] [--gateway-rounds 6] [--concurrency 16]
                                   [--records 100000] [--quick] [--detail-sample 0.1]
                                   [--skip-ingest | --skip-gateway] [--model tiny|bundled]
                                   [--flush-s 5] [--merge-flushes 300]
                                   [--switch-blocks 30] [--switch-window 5]

More: docs/benchmarks/methods.md#benchtrace_overhead."""

from __future__ import annotations

import argparse
import gc
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# per --model: the gateway's arguments, and about how many requests/s it serves here (to size a
# closed-loop run of --seconds; the run is timed, not assumed)
MODELS = {"tiny": (["--model", "tiny:49152", "--tokenizer", "bundled"], 150),
          "bundled": ([], 12)}


def model_args(model: str) -> list[str]:
    """``tailscope serve``'s arguments for ``model`` (a ``MODELS`` key), paths resolved."""
    from engine.loader.paths import resolve_model_path

    return [str(resolve_model_path(a)) if a == "bundled" else a for a in MODELS[model][0]]


def start_gateway(store: str | None, child: bool = False, model: str = "tiny",
                  flush_s: float | None = None, module: str = "tailscope.cli",
                  env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    from tracing.client import GatewayProcess

    gw = GatewayProcess(model_args(model), cwd=ROOT, quiet=True, module=module,
                        env={"TAILSCOPE_KV_CACHE_MB": "64", "TAILSCOPE_STORE_DSN": store or "none",
                             "TAILSCOPE_STORE_FLUSH_S": str(flush_s or FLUSH_S),
                             "TAILSCOPE_STORE_PROCESS": "1" if child else "0", **(env or {})},
                        ready_timeout_s=180).start()
    return gw.proc, gw.url


class PeakRss:
    """Peak RSS of a process (``gateway_mb``), apart of its store child if any (``store_mb``)
    and of its engine replicas (``replica_mb``: the largest one), and of the process with all
    its descendants summed (``tree_mb``: a gateway with its replica and store, or a server
    alone), sampled every 50 ms from a thread."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid, self.gateway_mb, self.store_mb, self.tree_mb = pid, 0.0, 0.0, 0.0
        self.replica_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        gw = psutil.Process(self.pid)
        while not self._stop.wait(0.05):
            try:
                own = gw.memory_info().rss / 2**20
                self.gateway_mb = max(self.gateway_mb, own)
                tree = own
                for c in gw.children(recursive=True):
                    mb = c.memory_info().rss / 2**20
                    tree += mb
                    cmd = c.cmdline()
                    if "store" in cmd:
                        self.store_mb = max(self.store_mb, mb)
                    if "engine.replica" in cmd:
                        self.replica_mb = max(self.replica_mb, mb)
                self.tree_mb = max(self.tree_mb, tree)
            except psutil.Error:
                pass

    def stop(self) -> PeakRss:
        self._stop.set()
        self._thread.join()
        return self


def closed_loop(url: str, seconds: float, concurrency: int, model: str = "tiny"
                ) -> tuple[float, float, int]:
    """(requests/s, output tokens/s, requests) of ``concurrency`` streams for about
    ``seconds``, with the load generator's closed mode (bench/loadgen.py)."""
    from bench import loadgen as L

    n = max(concurrency, int(seconds * MODELS[model][1]))
    items = L.workload(n, L.Dist.parse("uniform:8:63"), L.Dist.parse("fixed:16"), seed=n)
    rep = L.run(L.Target(url), "closed", items, concurrency=concurrency, warmup=0)
    return rep["request_throughput_rps"], rep["output_token_throughput_tps"], n


def _thread_cpu_s(pid: int, tid: int, psutil_s: float) -> float:
    """A thread's CPU seconds: the scheduler's own count in nanoseconds where Linux keeps it
    (``/proc/<pid>/task/<tid>/schedstat``), else psutil's (whole clock ticks, 10 ms here: a
    thread that ran 1 ms in each of 100 ticks can read 0 or 1 s)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return psutil_s


def capture_threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of the gateway's threads that exist only for capture: the record
    writer's two (``tracing.writer.WRITER`` / ``INSERTER``, named so) and the embedded store
    engine's own (chDB's C++ threads: every thread named neither ``python`` nor ZeroMQ's);
    and, apart, its main thread (``event_loop``: the request path, where capture's step rows
    and emits are made too). The times are the scheduler's (``_thread_cpu_s``); the names
    (which psutil does not give per thread) Linux's ``/proc/<pid>/task/<tid>/comm``, so
    elsewhere every thread counts as unnamed: zeros."""
    import psutil

    from tracing.writer import INSERTER, WRITER

    out = {"writer": 0.0, "store_engine": 0.0, "event_loop": 0.0}
    try:
        threads = psutil.Process(pid).threads()
    except psutil.Error:
        return out
    for t in threads:
        try:
            with open(f"/proc/{pid}/task/{t.id}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended, or no /proc
            continue
        cpu = _thread_cpu_s(pid, t.id, t.user_time + t.system_time)
        if t.id == pid:
            out["event_loop"] += cpu
        elif comm in (WRITER, INSERTER):
            out["writer"] += cpu
        elif not comm.startswith(("python", "ZMQ")):
            out["store_engine"] += cpu
    return out


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the gateway process, its store child and its
    replica(s), and of the gateway's capture threads (``capture_threads_cpu``)."""
    import psutil

    gw = psutil.Process(pid)
    out = {"gateway": 0.0, "store": 0.0, "replica": 0.0, **capture_threads_cpu(pid)}
    for p in [gw, *gw.children(recursive=True)]:
        try:
            t = p.cpu_times()
            kind = "gateway" if p.pid == pid else "store" if "store" in p.cmdline() else \
                "replica"
            out[kind] += t.user + t.system
        except psutil.Error:
            pass
    return out


def gc_seconds(url: str) -> float:
    """Seconds the gateway's process has spent in Python's garbage collector so far, all
    generations (``tailscope:gc_pause_seconds``: wall time, each collection stops every
    thread)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tailscope:gc_pause_seconds_sum{"))


class Throughput(NamedTuple):
    """One mode's figures from ``throughput``, each the median over the rounds: requests/s,
    output tokens/s, and CPU ms per request of the gateway (+ its store child), the replica,
    capture's own threads, the gateway's garbage collections and its main thread (event
    loop); and the highest peak RSS (MB) of the gateway and of its store child."""

    rps: float
    tps: float
    gw_mb: float
    store_mb: float
    gw_cpu: float
    rep_cpu: float
    own_ms: float
    gc_ms: float
    loop_ms: float


class Paired(NamedTuple):
    """A capture mode against capture off, round by round (each round loads both gateways, one
    after the other): the per-round differences, each as (median, least, greatest) over the
    rounds. ``rps``: throughput, % of capture off's; ``gw``: the CPU a request costs the
    gateway (+ its store child), ms; ``rep``: the same for the replica, whose work capture does
    not change (the same requests, the same tokens): what moves it is the machine within a
    round, and capture's threads taking turns with its spinning OpenMP threads on the cores;
    ``loop``: the gateway's main thread, ms per request."""

    rps: tuple[float, float, float]
    gw: tuple[float, float, float]
    rep: tuple[float, float, float]
    loop: tuple[float, float, float]


PARTS = {"store": "the store child", "writer": "the gateway's writer threads",
         "store_engine": "its other threads", "event_loop": "its event loop",
         "replica": "the replica (work unchanged: drift)"}
FLUSH_S = 5.0  # the gateways' TAILSCOPE_STORE_FLUSH_S here (the product default; --flush-s)
MODES = {"on": "capture on (store in the gateway)", "child": "capture on (store child)",
         "off": "capture off"}


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def throughput(seconds: float, concurrency: int, rounds: int, model: str = "tiny",
               flush_s: float = FLUSH_S) -> tuple[dict[str, Throughput], dict[str, Paired]]:
    """The three gateways (``MODES``) run side by side for the whole measurement, each with
    its replica, and take the load one at a time: ``rounds`` rounds, each loading every
    gateway once in a rotating order. Per mode the medians over the rounds
    (``Throughput``), and per capture mode its round-by-round differences from capture off
    (``Paired``). Pairing within a round is what makes the differences readable on this
    shared 2-core VM: the CPU a request costs drifts by +-10 % between minutes and between
    fresh processes (a gateway started afresh per run read its event loop 60-250 us a request
    dearer or cheaper than the run before with no change in it); within a round both
    gateways see the same minute. CPU is read after the writer's flush interval has passed,
    so the records' conversion and inserts are in it."""
    gateways: dict[str, tuple[subprocess.Popen, str, PeakRss]] = {}
    per_round: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for mode in MODES:
            store = f"chdb://{tempfile.mkdtemp(prefix='tailscope-bench-')}/store" \
                if mode != "off" else None
            proc, url = start_gateway(store, child=mode == "child", model=model,
                                      flush_s=flush_s)
            gateways[mode] = proc, url, PeakRss(proc.pid)
        for _, url, _ in gateways.values():
            closed_loop(url, 2.0, concurrency, model)  # warm-up
        time.sleep(flush_s + 1)  # the warm-ups' records written
        for r in range(rounds):
            order = list(MODES)[r % len(MODES):] + list(MODES)[:r % len(MODES)]
            for mode in order:
                proc, url, _ = gateways[mode]
                before, gc_before = cpu_seconds(proc.pid), gc_seconds(url)
                rps, tps, n = closed_loop(url, seconds, concurrency, model)
                time.sleep(flush_s + 1)  # this run's records written (their CPU counted)
                after, gc_after = cpu_seconds(proc.pid), gc_seconds(url)
                d = {k: (after[k] - before[k]) * 1000 / n for k in after}
                # capture's own threads: the writer's and the store engine's in the gateway,
                # and the whole store child; then the gateway's garbage collections
                per_round[mode].append({
                    "rps": rps, "tps": tps, "gw_cpu": d["gateway"] + d["store"],
                    "rep_cpu": d["replica"], "own_ms": d["writer"] + d["store_engine"] + d["store"],
                    "gc_ms": (gc_after - gc_before) * 1000 / n, "loop_ms": d["event_loop"]})
            # progress on stderr as each round ends (a round takes ~3 x (seconds + flush_s +
            # 1) s: a long run stopped early still leaves its rounds behind)
            print(f"round {r + 1}/{rounds}: " + "; ".join(
                f"{m} {per_round[m][-1]['rps']:.1f} req/s, gateway CPU "
                f"{per_round[m][-1]['gw_cpu']:.3f} ms, replica {per_round[m][-1]['rep_cpu']:.3f}"
                f" ms a request" for m in MODES), file=sys.stderr, flush=True)
    finally:
        for proc, _, peak in gateways.values():
            peak.stop()
            proc.terminate()
        for proc, _, _ in gateways.values():
            proc.wait(60)
    medians = {m: Throughput(
        *(statistics.median(r[f] for r in runs) for f in ("rps", "tps")),
        gateways[m][2].gateway_mb, gateways[m][2].store_mb,
        *(statistics.median(r[f] for r in runs) for f in Throughput._fields[4:]))
        for m, runs in per_round.items()}

    def against_off(mode: str, field: str, pct: bool = False) -> tuple[float, float, float]:
        """``field``'s differences from capture off, round by round (in % of off's with
        ``pct``), as ``_spread`` gives them."""
        return _spread([100 * (r[field] / o[field] - 1) if pct else r[field] - o[field]
                        for r, o in zip(per_round[mode], per_round["off"], strict=True)])

    paired = {m: Paired(against_off(m, "rps", pct=True), against_off(m, "gw_cpu"),
                        against_off(m, "rep_cpu"), against_off(m, "loop_ms"))
              for m in ("on", "child")}
    return medians, paired


class Switched(NamedTuple):
    """``switched``'s figures: per state the requests/s over all its windows, and per block
    (an "off" window against the two "on" windows around it) the throughput loss with capture
    on (% of off's) and the extra CPU a request costs the gateway with its store child (ms),
    each as (mean, low, high) of a 95 % interval over the blocks (``_mean_ci``)."""

    on_rps: float
    off_rps: float
    loss: tuple[float, float, float]
    gw_ms: tuple[float, float, float]
    base_ms: float  # the CPU a request costs with capture off: gateway + store child + replica
    blocks: int
    parts: dict[str, float]  # capture's extra CPU ms a request, mean: the store child, the
    # gateway's writer threads, its embedded store engine's, its event loop; the replica's


def _mean_ci(values: list[float]) -> tuple[float, float, float]:
    """The mean of a series of comparisons and a 95 % interval around it (mean +- 1.96
    standard errors). Neighbouring comparisons of ``switched`` share an "on" window, so the
    standard error counts their covariance too (lag 1, where it is positive; none further
    apart shares anything): (c0 + 2 c1) / n, not c0 / n."""
    n, m = len(values), statistics.fmean(values)
    if n < 3:
        return m, m, m
    c0 = sum((v - m) ** 2 for v in values) / (n - 1)
    c1 = sum((values[i] - m) * (values[i + 1] - m) for i in range(n - 1)) / (n - 1)
    half = 1.96 * ((c0 + 2 * max(c1, 0.0)) / n) ** 0.5
    return m, m - half, m + half


def switched(blocks: int, window_s: float, concurrency: int, model: str = "tiny") -> Switched:
    """Capture's throughput cost inside one gateway (store child, the product's default), its
    capture switched on and off under a steady closed-loop load (``bench.capture_switch``):
    ``2 * blocks + 1`` windows of ``window_s`` s, "on" and "off" in turn, each "off" window
    compared with the two "on" windows around it (a linear drift cancels). An "on" window ends
    when the writer has inserted the window's records and step rows (a flush asked at the
    switch), so all of capture's work for the window lies in it. The gateway's flush interval
    is set past the window, so that flush is the window's only insert: one batch a window, as
    the product's interval of ``FLUSH_S`` (5 s, the default window) makes one every 5 s under
    load (a 4 s window inserts a quarter more often). A window's throughput: the requests completed
    in it over its length; its CPU: the gateway's, its store child's and the replica's over
    the window. Three gateways side by side (``throughput``) differ by their processes' own
    offsets too."""
    import asyncio
    import os
    import signal

    from bench import loadgen as L

    marker = Path(tempfile.mkdtemp(prefix="tailscope-bench-")) / "flushed"
    store = f"chdb://{marker.parent}/store"
    proc, url = start_gateway(store, child=True, model=model, module="bench.capture_switch",
                              flush_s=window_s + 5,
                              env={"TAILSCOPE_BENCH_SWITCH_FILE": str(marker)})
    items = L.workload(4096, L.Dist.parse("uniform:8:63"), L.Dist.parse("fixed:16"), seed=7)
    windows: list[dict] = []

    async def drive() -> None:
        done: list[float] = []
        stop = asyncio.Event()
        target = L.Target(url)

        async def worker(k: int) -> None:
            i = k
            while not stop.is_set():
                s = await L.one_request(http, target, items[i % len(items)], time.monotonic())
                if not s.ok:
                    raise RuntimeError(f"a request failed: {s.status} {s.error}")
                done.append(time.monotonic())
                i += concurrency

        async def flushed() -> None:  # the "on" window before ends with its flush
            nonlocal flushes
            flushes += 1
            while not marker.exists() or marker.read_text() != str(flushes):
                await asyncio.sleep(0.005)

        def boundary(on: bool | None) -> None:  # one window ends and the next starts
            now, cpu = time.monotonic(), cpu_seconds(proc.pid)
            if windows:
                windows[-1].update(end=now, cpu1=cpu)
            if on is not None:
                windows.append({"on": on, "start": now, "cpu0": cpu})

        flushes = 0
        async with L._client(concurrency) as http:
            tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
            await asyncio.sleep(3.0)  # warm-up, capture on
            os.kill(proc.pid, signal.SIGUSR1)  # the warm-up's records out of the way
            await flushed()
            for on in (i % 2 == 0 for i in range(2 * blocks + 1)):  # on, off, ..., off, on
                os.kill(proc.pid, signal.SIGUSR2 if on else signal.SIGUSR1)
                if not on:
                    await flushed()
                boundary(on)
                await asyncio.sleep(window_s)
            os.kill(proc.pid, signal.SIGUSR1)
            await flushed()
            boundary(None)
            stop.set()
            await asyncio.gather(*tasks)
        for w in windows:
            w["n"] = sum(w["start"] <= t < w["end"] for t in done)

    try:
        asyncio.run(drive())
    finally:
        proc.terminate()
        proc.wait(60)

    def per_request(ws: list[dict], kinds: tuple[str, ...]) -> float:  # CPU ms a request
        return sum(w["cpu1"][k] - w["cpu0"][k] for w in ws for k in kinds) * 1000 / sum(
            w["n"] for w in ws)

    def rate(ws: list[dict]) -> float:
        return sum(w["n"] for w in ws) / sum(w["end"] - w["start"] for w in ws)

    # each "off" window against the two "on" windows around it: a linear drift cancels
    losses, gw_ms, base = [], [], []
    parts: dict[str, list[float]] = {k: [] for k in PARTS}
    gw = ("gateway", "store")
    for b in range(blocks):
        off, ons = windows[2 * b + 1], [windows[2 * b], windows[2 * b + 2]]
        losses.append(100 * (1 - rate(ons) / rate([off])))
        gw_ms.append(per_request(ons, gw) - per_request([off], gw))
        base.append(per_request([off], (*gw, "replica")))
        for part in parts:
            parts[part].append(per_request(ons, (part,)) - per_request([off], (part,)))
        print(f"block {b + 1}/{blocks}: on {rate(ons):.1f} req/s, off {rate([off]):.1f} req/s "
              f"({losses[-1]:+.1f} %); CPU a request: gateway + store {gw_ms[-1]:+.3f} ms ("
              + ", ".join(f"{k} {v[-1]:+.3f}" for k, v in parts.items()) + ")",
              file=sys.stderr, flush=True)

    return Switched(rate([w for w in windows if w["on"]]),
                    rate([w for w in windows if not w["on"]]), _mean_ci(losses),
                    _mean_ci(gw_ms), statistics.median(base), blocks,
                    {k: statistics.fmean(v) for k, v in parts.items()})


def make_records(n: int) -> list:
    """``n`` records as a gateway makes them: 128 prompt and 128 output token ids, the engine
    step of each output token, 127 ITLs and 12 events, each record its own values and objects
    (what is on disk and what the conversion touches depend on it: ITLs at the gateway's
    nanosecond resolution barely compress, the steps are runs of consecutive ids)."""
    import numpy as np

    from tracing.record import RecordEvent, RequestRecord

    rng = np.random.default_rng(0)
    # every record its own ids (drawn from a pool larger than the compressor's window), so the
    # bytes on disk are those of real, varied token ids
    pool = rng.integers(0, 49152, 1 << 20).tolist()
    starts = rng.integers(0, len(pool) - 256, n).tolist()
    now = time.time_ns() // 1000
    itls = np.round(rng.lognormal(np.log(25.0), 0.3, (n, 127)), 6).tolist()  # ms, ns resolution
    # a decode step per token, now and then a few steps the sequence sat out
    steps = np.cumsum(1 + (rng.random((n, 128)) < 0.1) * rng.integers(1, 5, (n, 128)), axis=1)
    steps = (steps + rng.integers(0, 10 ** 6, (n, 1))).tolist()
    gaps = np.cumsum(rng.integers(5, 4000, (n, 12)), axis=1).tolist()  # us between events
    states = ["RECEIVED", "ADMITTED", "TOKENIZED", "ROUTED", "QUEUED", "RUNNABLE", "PREFILLING",
              "DECODING", "FINISHED", "FIRST_FLUSH", "END", "END"]
    e2e = rng.lognormal(5.3, 0.5, n).tolist()
    ttft = rng.lognormal(3.5, 0.5, n).tolist()
    return [RequestRecord(trace_id=secrets.token_hex(16), span_id=secrets.token_hex(8),
                          request_id=f"r{i}", arrival_ts_us=now + 40 * i,
                          final_state="FINISHED", finish_reason="length", model="m",
                          replica="r0", input_token_ids=pool[starts[i]:starts[i] + 128],
                          output_token_ids=pool[starts[i] + 128:starts[i] + 256],
                          token_steps=steps[i], itl_ms=itls[i], ttft_ms=ttft[i],
                          e2e_ms=e2e[i], events=[RecordEvent(now + 40 * i + g, st) for g, st
                                                 in zip(gaps[i], states, strict=True)])
                   for i in range(n)]


def conversion(n: int, rounds: int = 3) -> tuple[float, float]:
    """Microseconds per record to turn ``n`` records into the requests and request_events
    Arrow tables: the writer's columnar conversion (``records_to_arrow``: row chunks, typed
    buffers, event columns taken from their request's) against the plain one it replaced (one
    ``pa.array`` per column over the whole batch, events built row by row); best of rounds,
    each on records made just before."""
    import operator

    import pyarrow as pa

    from tracing.arrow import arrow_type, records_to_arrow
    from tracing.schema import TABLES

    def plain(records):
        def table(name, rows):
            return pa.table({c: pa.array(list(map(operator.attrgetter(f), rows)),
                                         type=arrow_type(t)) for c, t, f in TABLES[name].columns})
        events = [(r.trace_id, e.ts_us, e.state, e.detail, i, r.ttl_days, r.tenant, r.instance)
                  for r in records for i, e in enumerate(r.events)]
        cols = dict(zip(("trace_id", "ts", "state", "detail", "seq", "ttl_days", "tenant",
                         "instance"), zip(*events, strict=True), strict=True))
        return table("requests", records), pa.table(
            {c: pa.array(cols[c], type=arrow_type(t))
             for c, t, _ in TABLES["request_events"].columns})

    best = {"columnar": float("inf"), "plain": float("inf")}
    for _ in range(rounds):
        for name, convert in (("columnar", records_to_arrow), ("plain", plain)):
            records = make_records(n)
            gc.freeze()  # as in ingest(): the heap of records made up front is not walked
            t = time.perf_counter()
            convert(records)
            best[name] = min(best[name], (time.perf_counter() - t) / n * 1e6)
            gc.unfreeze()
    return best["columnar"], best["plain"]


def step_rows(requests: int, seqs: int, seed: int = 0) -> list:
    """The ``engine_steps`` rows of one replica serving ``requests`` requests with ``seqs``
    running at a time (continuous batching: a request joins with its prompt in one step, then
    decodes a token a step, 64-192 tokens; each step row lists its members' trace ids and
    tokens, as the engine records them)."""
    import numpy as np

    from tracing.schema import EngineStepRow

    rng = np.random.default_rng(seed)
    now, rows, running, sent, step = time.time_ns() // 1000, [], [], 0, 0
    while sent < requests or running:
        while len(running) < seqs and sent < requests:
            running.append([secrets.token_hex(16), -1, int(rng.integers(64, 193))])
            sent += 1
        prefill = [256 if r[1] < 0 else 0 for r in running]
        decode = [int(p == 0) for p in prefill]
        for r in running:
            r[1] += 1
        dur = float(rng.uniform(20, 25))
        rows.append(EngineStepRow(
            replica="gw/r0", incarnation=0, step=step, ts_us=now + step * 22_500,
            duration_ms=dur, num_seqs=len(running), prefill_tokens=sum(prefill),
            decode_tokens=sum(decode), kv_blocks_used=int(rng.integers(100, 900)),
            kv_blocks_total=1024, forward_ms=dur * 0.9, sample_ms=float(rng.uniform(0.5, 1.5)),
            host_ms=float(rng.uniform(1, 2)), running=len(running),
            waiting=int(rng.integers(0, 6)), member_traces=[r[0] for r in running],
            member_prefill=prefill, member_decode=decode,
            instance="gw"))
        running = [r for r in running if r[1] < r[2]]
        step += 1
    return rows


def step_bytes(requests: int, seqs: int) -> tuple[int, float]:
    """Steps and ``engine_steps`` bytes on disk per request (after a merge) for ``step_rows``."""
    from tracing.store import Store

    rows = step_rows(requests, seqs)
    store = Store(f"chdb://{tempfile.mkdtemp(prefix='tailscope-steps-')}/store")
    store.migrate()
    for i in range(0, len(rows), 10_000):
        store.insert_rows("engine_steps", rows[i:i + 10_000], f"s{i}")
    store.command("OPTIMIZE TABLE tailscope.engine_steps FINAL")
    on_disk = bytes_on_disk(store, "engine_steps")
    store.close()
    return len(rows), on_disk / requests


def bytes_on_disk(store, *tables: str) -> int:
    """The compressed bytes of ``tables``' active parts in the store."""
    _, rows = store.select("SELECT sum(bytes_on_disk) FROM system.parts WHERE active AND "
                           "database = 'tailscope' AND table IN {t:Array(String)}",
                           {"t": list(tables)})
    return int(rows[0][0])


def short_records(n: int) -> list:
    """``make_records`` cut to a tiny-model gateway's requests (bench/loadgen's uniform 8-63
    prompt words: ~35 prompt token ids, 16 output ids, their steps and 15 ITLs, 11 events)."""
    records = make_records(n)
    for r in records:
        r.input_token_ids, r.output_token_ids = r.input_token_ids[:35], r.output_token_ids[:16]
        r.token_steps, r.itl_ms, r.events = r.token_steps[:16], r.itl_ms[:15], r.events[:11]
    return records


def store_steady(flushes: int, base: float | None, batch: int = 600, gap_s: float = 0.1) -> dict:
    """The store's CPU per record over ``flushes`` flushes of a gateway's batch of ``batch``
    short records (and their events and steps), each table written to an Arrow file and
    inserted as the store child does (``Store.insert_file``), ``gap_s`` apart, then 6 s for the
    merges they set off; with ``base`` the three tables' ``merge_selector_base`` is set to it
    (None: as declared; 0: merges stopped). Run in a process of its own: the CPU is this
    process's (the conversion is done once, before; writing the files is in it, ~3 us a
    record). Returns the CPU in us per record, the rows merges wrote per row inserted, and the
    most parts a table held at the looks taken every 25 flushes."""
    import uuid

    from tracing.arrow import records_to_arrow, to_arrow, write_arrow_file
    from tracing.schema import MERGE_SETTINGS, TABLES
    from tracing.store import Store

    d = Path(tempfile.mkdtemp(prefix="tailscope-merges-"))
    store = Store(f"chdb://{d}/store")
    store.migrate()
    if base == 0:
        store.command("SYSTEM STOP MERGES")
    elif base is not None:
        for t in MERGE_SETTINGS:  # the tables whose merge setting is declared
            store.command(f"ALTER TABLE tailscope.{t} MODIFY SETTING merge_selector_base = "
                          f"{float(base)}")
    requests, events = records_to_arrow(short_records(batch))
    steps = to_arrow(TABLES["engine_steps"], step_rows(batch, 15)[:batch * 11 // 10])
    data = {"requests": requests, "request_events": events, "engine_steps": steps}
    counters = ("SELECT event, value FROM system.events WHERE event IN ('InsertedRows', "
                "'MergedRows')")
    parts_sql = ("SELECT max(n) FROM (SELECT count() AS n FROM system.parts WHERE active AND "
                 "database = 'tailscope' AND table IN {t:Array(String)} GROUP BY table)")
    before, most_parts = dict(store.select(counters)[1]), 0
    cpu0 = time.process_time()
    for i in range(flushes):
        for name, table in data.items():
            path = d / f"{uuid.uuid4().hex}.{name}.arrow"
            write_arrow_file(path, table)
            store.insert_file(name, path, uuid.uuid4().hex)
            path.unlink()
        if i % 25 == 24:
            parts = store.select(parts_sql, {"t": list(MERGE_SETTINGS)})[1][0][0]
            most_parts = max(most_parts, parts)
        time.sleep(gap_s)
    time.sleep(6)
    cpu = time.process_time() - cpu0
    after = dict(store.select(counters)[1])
    inserted = after["InsertedRows"] - before.get("InsertedRows", 0)
    return {"us_per_record": cpu / (flushes * batch) * 1e6, "most_parts": int(most_parts),
            "amplification": (after.get("MergedRows", 0) - before.get("MergedRows", 0)) / inserted}


def merges(flushes: int, rounds: int = 1) -> dict[str, dict]:
    """``store_steady`` with the tables as declared, at ClickHouse's default base and with
    merges stopped, each in a process of its own (chDB: one store per process); the three
    alternate for ``rounds`` rounds and each keeps its cheapest run. One run of each, one after
    the other, drifted with the machine: merges stopped cost 46-103 us a record across runs of
    the same code, so a single round could show the merges as a negative cost."""
    import json

    out: dict[str, dict] = {}
    for _ in range(rounds):
        for label, base in (("declared", None), ("default", 5), ("stopped", 0)):
            code = ("import json, sys; from bench.trace_overhead import store_steady; "
                    f"print(json.dumps(store_steady({flushes}, {base!r})))")
            got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                                 text=True, timeout=3600)
            if got.returncode:
                raise RuntimeError(f"store_steady({base}) failed: {got.stderr[-2000:]}")
            run = json.loads(got.stdout.strip().splitlines()[-1])
            if label not in out or run["us_per_record"] < out[label]["us_per_record"]:
                out[label] = run
    return out


def ingest(n: int, detail_sample: float = 1.0, child: bool = False,
           warmup: int = 0) -> tuple[float, dict]:
    """The writer draining ``n`` records into a fresh chDB store: in this process, or with
    ``child`` in a store process (``TAILSCOPE_STORE_PROCESS=1``'s ``StoreProcess``: this
    process converts each batch to Arrow while the child inserts the previous one, on another
    core). With ``warmup``, that many records are emitted and drained first, untimed: the rate
    is then the sustained one, without what only the first batch of a fresh process and store
    pays (the first batch's conversion took 440-500 ms of CPU against ~260 for each later one,
    the store child's first insert ~400 ms against ~150)."""
    from tracing import queries as Q
    from tracing.retention import TailRetention
    from tracing.store import Store
    from tracing.writer import RecordWriter

    d = Path(tempfile.mkdtemp(prefix="tailscope-ingest-"))
    proc = None
    if child:
        from gateway.store_api import StoreProcess
        from tracing.store_server import RemoteStore

        proc = StoreProcess(f"chdb://{d}/store")
        proc.start()
        store = RemoteStore(proc.url, proc.key, timeout_s=600, inbox=proc.inbox)
    else:
        store = Store(f"chdb://{d}/store")
    store.migrate()
    # the bounds are lifted: this measures how fast the writer drains a flood, not its limits
    writer = RecordWriter(store, d / "spool", max_queue=n + 1,
                          max_queue_bytes=1 << 40)
    if warmup:
        for r in make_records(warmup):
            writer.emit(r)
        assert writer.flush(timeout_s=600)
    records = make_records(n)
    retention = TailRetention(detail_sample, warmup=0, seed=0)
    # the records made up front are not the writer's to pay for: a gateway emits each record as
    # it finishes, not from a heap of n of them that every collection of the cyclic GC walks
    gc.freeze()
    t0 = time.monotonic()
    for r in records:
        retention.decide(r)  # on the request path, as in the gateway
        writer.emit(r)
    emit_s = time.monotonic() - t0
    writer.close(timeout_s=600)
    total_s = time.monotonic() - t0
    gc.unfreeze()
    count = store.select(Q.REQUEST_COUNT)[1][0][0]
    assert count == n + warmup, (count, n, warmup)
    on_disk = bytes_on_disk(store, "requests", "request_events")
    if proc is not None:
        store.close()
        proc.close()
    kept = sum(r.detail_kept for r in records)
    return n / total_s, {"emit_us_per_record": emit_s / n * 1e6, **writer.stats,
                         "bytes_per_record": on_disk / (n + warmup), "kept": kept}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0,
                    help="part 1's load on a gateway in each round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2,
                    help="part 5's alternating runs of each merge setting")
    ap.add_argument("--gateway-rounds", type=int, default=6,
                    help="part 1's rounds: each loads every gateway once (--quick: 2)")
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--detail-sample", type=float, default=0.1)
    ap.add_argument("--skip-ingest", action="store_true", help="only the gateway runs")
    ap.add_argument("--skip-gateway", action="store_true",
                    help="only the conversion, the writer's ingest and engine_steps' bytes "
                         "(parts 2-4)")
    ap.add_argument("--flush-s", type=float, default=FLUSH_S,
                    help="the gateways' TAILSCOPE_STORE_FLUSH_S (default: the product's, 5)")
    ap.add_argument("--merge-flushes", type=int, default=300,
                    help="part 5's flushes of a gateway's batch into a fresh store (--quick: "
                         "100)")
    ap.add_argument("--switch-blocks", type=int, default=30,
                    help="part 6's comparisons: capture switched within one gateway, each "
                         "'off' window against the 'on' windows around it (0: none; --quick: 8)")
    ap.add_argument("--switch-window", type=float, default=FLUSH_S,
                    help="part 6's window, s: one insert each (default: the product's flush "
                         "interval, 5 s)")
    ap.add_argument("--model", choices=list(MODELS), default="tiny",
                    help="the gateways' model: tiny (the gateway's own cost dominates) or the "
                         "bundled SmolLM2 (the engine's does)")
    args = ap.parse_args()
    from tracing.arrow import skip_pandas_probe, use_arrow_pool

    skip_pandas_probe()  # as the gateway and the store process do
    use_arrow_pool()
    if args.quick:
        args.seconds, args.rounds, args.records, args.merge_flushes = 5.0, 1, 20_000, 100
        args.gateway_rounds, args.switch_blocks = 2, 8
    if not args.skip_ingest:
        col, plain = conversion(10_000)
        print(f"conversion to Arrow (requests + request_events), 10,000 records: columnar "
              f"{col:.1f} us/record, plain per-column {plain:.1f} us/record: {plain / col:.2f}x")
    warm = args.records // 5
    runs = [(1.0, False, 0), (1.0, True, 0), (args.detail_sample, False, 0), (1.0, False, warm),
            (1.0, True, warm)]
    for sample, child, warmup in () if args.skip_ingest else runs:
        rate, stats = ingest(args.records, sample, child, warmup)
        what = "full detail" if sample >= 1 else (
            f"tail-based retention (p99 + {sample:g} sample: {stats['kept']:,} kept)")
        if warmup:
            what += f", sustained (after {warmup:,} records drained first)"
        where = "a store child process" if child else "this process"
        print(f"writer ingest into chDB in {where}, {what}: {rate:,.0f} records/s, "
              f"{stats['bytes_per_record']:.0f} bytes/record on disk ({args.records:,} records "
              f"with 256 token ids and 12 events each; emit {stats['emit_us_per_record']:.2f} "
              f"us/record on the request path; written {stats['written']:,}, dropped "
              f"{stats['dropped']})")
    for seqs in () if args.skip_ingest else (8, 32):
        steps, per_request = step_bytes(2000, seqs)
        print(f"engine_steps on disk: {per_request:.0f} bytes per request (2,000 requests of "
              f"64-192 output tokens, {seqs} sequences a step: {steps:,} step rows, each "
              "listing its members' trace ids and tokens)")
    merged = {} if args.skip_ingest else merges(args.merge_flushes, args.rounds)
    # the merges' CPU per record: each setting's against merges stopped
    merge_us = {k: m["us_per_record"] - merged["stopped"]["us_per_record"]
                for k, m in merged.items()}
    if merged:
        from tracing.schema import MERGE_SELECTOR_BASE

        for label, what in (("declared", f"the tables' merge setting (base "
                                         f"{MERGE_SELECTOR_BASE})"),
                            ("default", "ClickHouse's default merge setting (base 5)"),
                            ("stopped", "merges stopped")):
            m = merged[label]
            print(f"store in steady state, {what}: {m['us_per_record']:.1f} us of CPU per "
                  f"record, merges wrote {m['amplification']:.2f} rows per row inserted, at "
                  f"most {m['most_parts']} parts a table ({args.merge_flushes} flushes of 600 "
                  "short records, their events and steps, 0.1 s apart; the cheapest of "
                  f"{args.rounds} alternating run(s))")
        print(f"the merges' CPU per record: {merge_us['declared']:.1f} us as declared, "
              f"{merge_us['default']:.1f} us at ClickHouse's default (each against merges "
              "stopped: a figure near or below 0 is within the machine's drift)")
    if args.skip_gateway:
        return 0
    if args.switch_blocks:
        sw = switched(args.switch_blocks, args.switch_window, args.concurrency, args.model)
        print(f"capture switched within one gateway (store child; {sw.blocks} 'off' windows of "
              f"{args.switch_window:g} s, each against the 'on' windows before and after it, "
              f"an 'on' window ending when its records are inserted): on {sw.on_rps:.1f} req/s, "
              f"off {sw.off_rps:.1f} req/s; throughput loss {sw.loss[0]:+.2f} % (95 % interval "
              f"{sw.loss[1]:+.2f} to {sw.loss[2]:+.2f} %); the gateway's CPU with its store child "
              f"{sw.gw_ms[0]:+.3f} ms a request ({sw.gw_ms[1]:+.3f} to {sw.gw_ms[2]:+.3f}) = "
              f"{100 * sw.gw_ms[0] / sw.base_ms:+.2f} % of the {sw.base_ms:.2f} ms a request "
              "costs with capture off (gateway + store child + replica); of it (means, ms a "
              "request): " + ", ".join(f"{PARTS[k]} {v:+.3f}" for k, v in sw.parts.items()))
    if not args.gateway_rounds:
        return 0
    tp, paired = throughput(args.seconds, args.concurrency, args.gateway_rounds, args.model,
                            args.flush_s)
    print()
    for mode, label in MODES.items():
        t = tp[mode]
        child = f" + store child {t.store_mb:.0f} MB" if mode == "child" else ""
        print(f"{label:34}: {t.rps:7.1f} req/s {t.tps:8.1f} output tok/s   gateway peak RSS "
              f"{t.gw_mb:.0f} MB{child}; CPU per request: gateway{' + store' if child else ''} "
              f"{t.gw_cpu:.2f} ms (of it in garbage collections {t.gc_ms:.3f}), replica "
              f"{t.rep_cpu:.2f} ms")
    off = tp["off"]
    base = off.gw_cpu + off.rep_cpu  # the CPU a request costs without capture

    def fmt_spread(v: tuple[float, float, float], fmt: str, scale: float = 1.0) -> str:
        return (f"{v[0] * scale:{fmt}} [{v[1] * scale:{fmt}}, {v[2] * scale:{fmt}}]")

    # each round loads every gateway once, so a round's difference holds little drift between
    # minutes or processes; the median over the rounds and the least and greatest of them
    for mode in ("on", "child"):
        pr = paired[mode]
        print(f"capture cost, {MODES[mode]}, round by round (median [least, greatest] of "
              f"{args.gateway_rounds}): throughput {fmt_spread(pr.rps, '+.1f')} %; the gateway's "
              f"CPU{' (+ store child)' if mode == 'child' else ''} {fmt_spread(pr.gw, '+.3f')} ms "
              f"per request = {fmt_spread(pr.gw, '+.2f', 100 / base)} % of the CPU a request costs "
              f"without capture (gateway + replica); the replica's {fmt_spread(pr.rep, '+.3f')} "
              "ms (capture does not change its work: the machine's drift within a round, and "
              "capture's threads taking turns with its threads on the cores)")
    # the threads that exist only for capture, read apart: no request-path drift in them
    for mode in ("on", "child"):
        own = tp[mode].own_ms
        print(f"capture's own threads, {MODES[mode]} (the writer's, the store engine's"
              f"{', the store child' if mode == 'child' else ''}): {own:.3f} ms per request = "
              f"{100 * own / base:.2f}% of the CPU a request costs without "
              f"capture (the same threads with capture off: {off.own_ms:.3f} ms)")
    # what capture adds to the collections of the gateway's own threads (its queued records and
    # the emit path's objects): they run in whichever thread allocates, mostly the event loop
    for mode in ("on", "child"):
        gc_extra = tp[mode].gc_ms - off.gc_ms
        total = tp[mode].own_ms + gc_extra
        print(f"plus the garbage collections capture adds in the gateway, {MODES[mode]}: "
              f"{gc_extra:+.3f} ms per request ({tp[mode].gc_ms:.3f} against {off.gc_ms:.3f}); "
              f"with its own threads {total:.3f} ms = {100 * total / base:.2f}%")
    # what the own threads leave out: capture's work on the event loop (each step's
    # engine_steps row, each emit) and its threads' interference with it
    for mode in ("on", "child"):
        loop = paired[mode].loop
        print(f"the gateway's event loop (its main thread), {MODES[mode]}, round by round: "
              f"{fmt_spread(loop, '+.3f')} ms per request = "
              f"{fmt_spread(loop, '+.2f', 100 / base)} % "
              f"(median {tp[mode].loop_ms:.3f} ms against {off.loop_ms:.3f} with capture off; "
              "capture's step rows and emits there and its threads' interference)")
    if merged:  # what a fresh store's short run leaves out (part 5)
        for label, what in (("declared", "as declared"), ("default", "at ClickHouse's default")):
            cost = merge_us[label]
            print(f"plus the store's merges in steady state ({what}; part 5, measured apart on "
                  f"an otherwise idle machine): {cost / 1000:.3f} ms per request = "
                  f"{100 * cost / 1000 / base:.2f}% of the CPU a request costs "
                  "without capture")
    print(f"({args.model} model; {args.gateway_rounds} rounds of {args.seconds:g} s on each "
          f"gateway, {args.concurrency} streams, 16 output tokens; figures per mode are the "
          "medians over the rounds, peak RSS the highest over the gateway's life)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
