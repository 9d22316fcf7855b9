"""What the gateway adds: short streamed requests through it vs straight to one replica.

    python bench/gateway_overhead.py [--rates 10,50,100,200] [--duration 5] [--quick]
    python bench/gateway_overhead.py --upstream [--rates 10,25,50,100,200] [--no-litellm]

``--upstream`` measures the gateway as a proxy instead: an instant OpenAI-compatible upstream
called directly, through Tailscope (``--backend``) and through the LiteLLM proxy, side by side
in one run (``bench/upstream_overhead.py`` says how).

Both paths drive the same engine (one replica process of the tiny model, vocabulary sized to
the bundled tokenizer) with the same prompts (token ids) and 4 output tokens (``ignore_eos``):

* direct: this process speaks the replica's own protocol (msgspec over ZeroMQ): AddRequest out,
  token deltas back; latency to the first token and to the terminal delta;
* gateway: ``tailscope serve`` with one replica; streamed ``/v1/completions`` over loopback HTTP
  with one httpx connection pool; latency to the first content chunk and to ``[DONE]``.

More: docs/benchmarks/methods.md#benchgateway_overhead."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracing.client import free_port  # noqa: E402

MAX_TOKENS = 4


THREADS = {"n": 1}


def replica_env() -> dict[str, str]:
    """The replica's (and the gateway's) environment: ``exact`` unless the caller's
    environment names a profile, since the default ``fast`` profile would build the tiny
    model's compiled decode step in the background during the run, whose CPU and memory
    would read as the gateway's."""
    return {"TAILSCOPE_PROFILE": "exact", **os.environ, "TAILSCOPE_THREADS": str(THREADS["n"])}


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 49000) for _ in range(rng.randrange(8, 24))] for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Result:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.errors = 0
        self.lag: list[float] = []  # how late the client actually sent, ms

    def summary(self) -> dict:
        return {"n": len(self.e2e), "errors": self.errors,
                "ttft_p50": pct(self.ttft, 50), "ttft_p99": pct(self.ttft, 99),
                "e2e_p50": pct(self.e2e, 50), "e2e_p99": pct(self.e2e, 99),
                "client_lag_p99": pct(self.lag, 99)}


async def open_loop(rate: float, duration: float, one) -> Result:
    """Fire ``one(i, scheduled_ns, result)`` at fixed times; never wait on responses."""
    res = Result()
    n = max(1, int(rate * duration))
    start = time.monotonic_ns() + 50_000_000
    tasks = []
    for i in range(n):
        at = start + int(i * 1e9 / rate)
        delay = (at - time.monotonic_ns()) / 1e9
        if delay > 0:
            await asyncio.sleep(delay)
        res.lag.append(max(0.0, (time.monotonic_ns() - at) / 1e6))
        tasks.append(asyncio.create_task(one(i, at, res)))
    await asyncio.gather(*tasks)
    return res


# ---- direct: the replica protocol ---------------------------------------------------------
def start_replica(tmp: str, model: str) -> tuple[subprocess.Popen, str, str]:
    inbox, outbox = f"ipc://{tmp}/bench-r0.in", f"ipc://{tmp}/bench.out"
    proc = subprocess.Popen([sys.executable, "-m", "engine.replica", "--id", "r0", "--model",
                             model, "--engine-config", '{"kv_cache_mb": 64}', "--inbox",
                             inbox, "--outbox", outbox], cwd=ROOT, env=replica_env())
    return proc, inbox, outbox


async def run_direct(rates: list[float], duration: float, model: str) -> dict[float, dict]:
    import zmq
    import zmq.asyncio

    from engine.protocol import AddRequest, Health, StepReport, decode_from_replica, encode
    from engine.sampling_params import SamplingParams

    tmp = tempfile.mkdtemp(prefix="tailscope-bench-")
    ctx = zmq.asyncio.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp}/bench.out")
    proc, inbox, _ = start_replica(tmp, model)
    push = ctx.socket(zmq.PUSH)
    push.connect(inbox)
    waiters: dict[str, tuple[asyncio.Future, asyncio.Future]] = {}

    async def reader() -> None:
        while True:
            msg = decode_from_replica(await pull.recv())
            if isinstance(msg, Health):
                ready.set()
            elif isinstance(msg, StepReport):
                for d in msg.deltas:
                    w = waiters.get(d.request_id)
                    if w is None:
                        continue
                    first, done = w
                    if d.token_ids and not first.done():
                        first.set_result(time.monotonic_ns())
                    if d.finish_reason is not None and not done.done():
                        done.set_result((time.monotonic_ns(), d.state))

    ready = asyncio.Event()
    task = asyncio.create_task(reader())
    await asyncio.wait_for(ready.wait(), 120)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    ps = prompts(64)
    out = {}
    try:
        for rate in rates:
            async def one(i: int, at: int, res: Result, rate=rate) -> None:
                rid = f"b{rate}-{i}"
                loop = asyncio.get_running_loop()
                first, done = loop.create_future(), loop.create_future()
                waiters[rid] = (first, done)
                await push.send(encode(AddRequest(rid, ps[i % len(ps)], params)))
                end, state = await asyncio.wait_for(done, 60)
                waiters.pop(rid, None)
                if state != "FINISHED":
                    res.errors += 1
                    return
                res.ttft.append((first.result() - at) / 1e6)
                res.e2e.append((end - at) / 1e6)

            await open_loop(rate, min(duration, 2.0), one)  # warm-up at this rate
            out[rate] = (await open_loop(rate, duration, one)).summary()
    finally:
        task.cancel()
        proc.terminate()
        proc.wait(10)
        ctx.destroy(linger=0)
    return out


# ---- gateway: HTTP ----------------------------------------------------------------------
async def timed_stream(http, url: str, body: dict, at: int, res: Result, is_content,
                       headers: dict | None = None, need_content: bool = False) -> None:
    """One streamed completion timed from its scheduled send ``at`` (ns): TTFT at the first
    line ``is_content`` accepts (the end when none does, unless ``need_content``: then an
    error), E2E at ``[DONE]``; a failed request counts as an error."""
    import httpx

    first = None
    try:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.errors += 1
                return
            async for line in r.aiter_lines():
                if first is None and is_content(line):
                    first = time.monotonic_ns()
                if line == "data: [DONE]":
                    break
    except httpx.HTTPError:
        res.errors += 1
        return
    end = time.monotonic_ns()
    if first is None and need_content:
        res.errors += 1
        return
    res.ttft.append(((first or end) - at) / 1e6)
    res.e2e.append((end - at) / 1e6)



def proxy_processes(pid: int) -> list:
    """The process ``pid`` and its descendants except engine replicas: a gateway with its
    store child (an embedded store runs there by default, ``TAILSCOPE_STORE_PROCESS``), or a
    proxy with whatever workers it starts: what serving as a proxy costs, the engine apart."""
    import psutil

    p = psutil.Process(pid)
    out = [p]
    for c in p.children(recursive=True):
        try:
            if "engine.replica" not in c.cmdline():
                out.append(c)
        except psutil.Error:  # it ended meanwhile
            pass
    return out


def cpu_ms(pid: int) -> float:
    """CPU milliseconds so far of ``proxy_processes(pid)``."""
    import psutil

    total = 0.0
    for p in proxy_processes(pid):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total * 1e3


def peak_rss_sampler(pid: int, stop: threading.Event, out: list[float]) -> None:
    """The peak of ``proxy_processes(pid)``'s summed RSS, sampled every 50 ms until ``stop``."""
    import psutil

    peak = 0
    while not stop.is_set():
        try:
            procs = proxy_processes(pid)
        except psutil.Error:  # the process is gone
            break
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        peak = max(peak, total)
        time.sleep(0.05)
    out.append(peak / 2**20)


async def run_gateway(rates: list[float], duration: float, model: str, tokenizer: str
                      ) -> tuple[dict[float, dict], float]:
    import httpx

    port = free_port()
    # full capture, as deployed: every record and engine step goes to a fresh chDB store
    store_dsn = f"chdb://{tempfile.mkdtemp(prefix='tailscope-bench-')}/store"
    proc = subprocess.Popen([sys.executable, "-m", "tailscope.cli", "serve", "--port",
                             str(port), "--model", model, "--tokenizer", tokenizer],
                            cwd=ROOT, env={**replica_env(), "TAILSCOPE_KV_CACHE_MB": "64",
                                           "TAILSCOPE_STORE_DSN": store_dsn},
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    stop, peak = threading.Event(), []
    sampler = threading.Thread(target=peak_rss_sampler, args=(proc.pid, stop, peak))
    out = {}
    try:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(
                max_connections=1000, max_keepalive_connections=1000)) as http:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if (await http.get(f"{url}/ready")).json().get("all_ready"):
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("gateway did not start")
                await asyncio.sleep(0.2)
            sampler.start()
            ps = prompts(64)
            for rate in rates:
                async def one(i: int, at: int, res: Result) -> None:
                    body = {"model": "SmolLM2-135M-Instruct", "prompt": ps[i % len(ps)],
                            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                            "stream": True}
                    await timed_stream(http, f"{url}/v1/completions", body, at, res,
                                       lambda line: line.startswith('data: {"id"')
                                       and '"text": ""' not in line)

                await open_loop(rate, min(duration, 2.0), one)
                cpu0 = cpu_ms(proc.pid)
                out[rate] = (await open_loop(rate, duration, one)).summary()
                out[rate]["gateway_cpu_ms_per_request"] = \
                    (cpu_ms(proc.pid) - cpu0) / max(1, out[rate]["n"] + out[rate]["errors"])
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out, (peak[0] if peak else float("nan"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="10,50,100,200")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per rate")
    ap.add_argument("--quick", action="store_true", help="rates 10,50 for 2 s each")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--replica-threads", type=int, default=1,
                    help="torch threads of the replica on both paths")
    ap.add_argument("--upstream", action="store_true",
                    help="the gateway as a proxy: an instant upstream direct, through "
                         "Tailscope and through LiteLLM")
    ap.add_argument("--no-litellm", action="store_true", help="with --upstream: skip LiteLLM")
    ap.add_argument("--litellm-version", default="1.108.7")
    args = ap.parse_args()
    if args.upstream:
        from bench import upstream_overhead as U

        rates = [10.0, 50.0] if args.quick else [
            float(r) for r in (args.rates if args.rates != "10,50,100,200"
                               else "10,25,50,100,200").split(",")]
        results = U.run(rates, 2.0 if args.quick else args.duration,
                        None if args.no_litellm else args.litellm_version)
        print(U.report(results))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str))
        return 0
    THREADS["n"] = args.replica_threads
    rates = [10.0, 50.0] if args.quick else [float(r) for r in args.rates.split(",")]
    duration = 2.0 if args.quick else args.duration

    from engine.loader.paths import resolve_model_path

    model, tokenizer = "tiny:49152", str(resolve_model_path("bundled"))
    direct = asyncio.run(run_direct(rates, duration, model))
    gateway, peak_mb = asyncio.run(run_gateway(rates, duration, model, tokenizer))
    print(f"\ngateway overhead: tiny model, {MAX_TOKENS} output tokens, streamed, open loop, "
          f"{duration:g} s per rate (ms, from the scheduled send time)")
    print(f"{'rate/s':>7} {'path':>8} {'n':>5} {'err':>4} {'ttft p50':>9} {'ttft p99':>9} "
          f"{'e2e p50':>9} {'e2e p99':>9} {'lag p99':>8}")
    rows = []
    for rate in rates:
        for name, res in (("direct", direct[rate]), ("gateway", gateway[rate])):
            print(f"{rate:7.0f} {name:>8} {res['n']:5d} {res['errors']:4d} "
                  f"{res['ttft_p50']:9.2f} {res['ttft_p99']:9.2f} {res['e2e_p50']:9.2f} "
                  f"{res['e2e_p99']:9.2f} {res['client_lag_p99']:8.2f}")
        d, g = direct[rate], gateway[rate]
        added = {"rate": rate, "added_e2e_p50_ms": g["e2e_p50"] - d["e2e_p50"],
                 "added_e2e_p99_ms": g["e2e_p99"] - d["e2e_p99"],
                 "added_ttft_p50_ms": g["ttft_p50"] - d["ttft_p50"],
                 "added_ttft_p99_ms": g["ttft_p99"] - d["ttft_p99"],
                 "gateway_errors": g["errors"],
                 "gateway_cpu_ms_per_request": g["gateway_cpu_ms_per_request"]}
        rows.append(added)
        print(f"{'':7} {'added':>8} {'':5} {'':4} {added['added_ttft_p50_ms']:9.2f} "
              f"{added['added_ttft_p99_ms']:9.2f} {added['added_e2e_p50_ms']:9.2f} "
              f"{added['added_e2e_p99_ms']:9.2f}   (gateway CPU "
              f"{added['gateway_cpu_ms_per_request']:.2f} ms/request)")
    print(f"\ngateway peak RSS: {peak_mb:.0f} MB (with its store child; its replica not included)")
    print(f"medians of added e2e p50 over rates: "
          f"{statistics.median(r['added_e2e_p50_ms'] for r in rows):.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"direct": direct, "gateway": gateway,
                                               "added": rows, "gateway_peak_rss_mb": peak_mb},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
