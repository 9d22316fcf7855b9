"""``tailscope bench``: a load generator for any OpenAI-compatible endpoint, with honest
percentiles.

Modes: ``serial`` (one request at a time), ``burst`` (N at once), ``rate`` (open loop at
``--rate`` req/s, Poisson arrivals, or gamma with ``--burstiness``), ``closed`` (a fixed number of
concurrent streams) and ``sweep`` (rates between the serial and the burst throughput).

Open loop means the send schedule is drawn up front and never waits on responses; every latency
is measured from the request's *scheduled* send time, so a server that stalls cannot hide the
stall by slowing the sender down (coordinated omission). If the generator itself falls behind
its schedule, each report says by how much (``send_lag_ms``).

Requests are streamed ``/v1/completions`` over one httpx connection pool, with
``ignore_eos`` so output lengths are what the workload asks for; each carries an
``x-tailscope-bench-run`` header so the gateway's trace records join to the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from engine.cpus import move_threads
from tracing import timing
from tracing.client import sse_json

# ---- placement ------------------------------------------------------------------------------


@contextmanager
def replica_core():
    """On a machine with 2 or more CPUs: the replicas on the last CPU (``TAILSCOPE_REPLICA_CPUS``,
    the env to pass the gateways), this process (every thread) and so the gateways it starts on
    the others, put back afterwards. Otherwise the load generator and the gateway take the
    replica's core now and then, and those pauses land in the engine's step times: not what
    the engine or its policy does. Yields {} on one CPU and where there is no CPU affinity."""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if len(mine) < 2:  # one CPU, or a platform without affinity (not Linux)
        yield {}
        return
    replica, rest = max(mine), mine - {max(mine)}
    before = move_threads(rest)
    try:
        yield {"TAILSCOPE_REPLICA_CPUS": str(replica)}
    finally:
        for t, cpus in before.items():
            try:
                os.sched_setaffinity(t, cpus)
            except ProcessLookupError:
                pass


# ---- schedules ------------------------------------------------------------------------------


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (seconds from the start) of ``n`` requests at ``rate`` req/s.

    Inter-arrival gaps are gamma distributed with shape ``burstiness`` and mean ``1/rate``:
    shape 1 is a Poisson process (exponential gaps), below 1 is burstier, above 1 smoother.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


@dataclass(frozen=True)
class Dist:
    """A length distribution: ``fixed:N``, ``uniform:A:B`` or ``lognormal:MEDIAN:SIGMA``."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Dist:
        parts = text.split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                return cls("fixed", float(parts[1]))
            if parts[0] == "uniform" and len(parts) == 3:
                return cls("uniform", float(parts[1]), float(parts[2]))
            if parts[0] == "lognormal" and len(parts) == 3:
                return cls("lognormal", float(parts[1]), float(parts[2]))
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
        except ValueError:
            pass
        raise ValueError(f"length distribution {text!r}: use fixed:N, uniform:A:B or "
                         "lognormal:MEDIAN:SIGMA")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return max(1, int(self.a))
        if self.kind == "uniform":
            return max(1, rng.randint(int(self.a), int(self.b)))
        return max(1, int(round(rng.lognormvariate(math.log(self.a), self.b))))


@dataclass
class Item:
    prompt: list[int] | str
    max_tokens: int
    at: float | None = None  # a trace's own send offset (seconds)
    api_key: str | None = None


def workload(n: int, prompt_len: Dist, output_len: Dist, seed: int = 0,
             shared_prefix: float = 0.0, prefix_len: int = 64,
             api_keys: list[str] | None = None, vocab: tuple[int, int] = (100, 49000)
             ) -> list[Item]:
    """Prompts as random token ids (so lengths are exact); a ``shared_prefix`` fraction of them
    start with the same ``prefix_len`` tokens (to exercise prefix caching); keys round-robin."""
    rng = random.Random(seed)
    prefix = [rng.randrange(*vocab) for _ in range(prefix_len)]
    items = []
    for i in range(n):
        length = prompt_len.draw(rng)
        body = [rng.randrange(*vocab) for _ in range(length)]
        if rng.random() < shared_prefix:
            body = (prefix + body)[:max(length, prefix_len)]
        items.append(Item(body, output_len.draw(rng),
                          api_key=api_keys[i % len(api_keys)] if api_keys else None))
    return items


def load_trace(path: str | Path) -> list[Item]:
    """JSONL with ``timestamp`` (seconds; replayed relative to the first), ``prompt`` (text or
    token ids) and ``max_tokens`` per line."""
    items, t0 = [], None
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ts = float(row["timestamp"])
            items.append(Item(row["prompt"], int(row["max_tokens"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from None
        t0 = ts if t0 is None else t0
        items[-1].at = ts - t0
    return items


# ---- results and statistics ---------------------------------------------------------------


@dataclass
class Sample:
    scheduled: float  # monotonic seconds
    sent: float
    status: int = 0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def tpot_ms(self) -> float | None:
        return sum(self.itl_ms) / len(self.itl_ms) if self.itl_ms else None


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (the value at rank ceil(q/100 * n)): every reported value is a
    latency that some request actually had."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def bootstrap_ci(xs: list[float], q: float = 99, n_boot: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    if len(xs) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    stats = sorted(percentile(rng.choices(xs, k=len(xs)), q) for _ in range(n_boot))
    lo = stats[int((1 - level) / 2 * n_boot)]
    hi = stats[min(n_boot - 1, int((1 + level) / 2 * n_boot))]
    return lo, hi


def summarize(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    lo, hi = bootstrap_ci(values)
    return {"n": len(values), "mean": statistics.fmean(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p95": percentile(values, 95),
            "p99": percentile(values, 99), "max": max(values), "p99_ci95": [lo, hi]}


def slo_stats(samples: list[Sample], duration_s: float, ttft_ms: float | None,
              tpot_ms: float | None) -> dict:
    """Attainment: the fraction of all requests (failed ones count as misses) that succeeded
    within both thresholds; goodput: such requests per second of the run."""
    rule = timing.Slo(ttft_ms, tpot_ms)
    n_good = sum(rule.met(s.ok, s.ttft_ms, s.tpot_ms) for s in samples)
    return {"attainment": n_good / len(samples) if samples else float("nan"),
            "goodput_rps": n_good / duration_s if duration_s > 0 else float("nan"),
            "ttft_ms": ttft_ms, "tpot_ms": tpot_ms}


def report(samples: list[Sample], duration_s: float, slo: dict | None = None) -> dict:
    ok = [s for s in samples if s.ok]
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}  # the first message of each kind, to tell what broke
    for s in samples:
        if not s.ok:
            key = str(s.status) if s.status else (s.error.split(":")[0] or "error")
            errors[key] = errors.get(key, 0) + 1
            examples.setdefault(key, s.error or f"HTTP {s.status}")
    out_tokens = sum(s.output_tokens for s in ok)
    total_tokens = out_tokens + sum(s.prompt_tokens for s in ok)
    lag = [max(0.0, (s.sent - s.scheduled) * 1e3) for s in samples]
    rep = {
        "requests": len(samples), "succeeded": len(ok), "errors": errors,
        "error_examples": examples,
        "duration_s": duration_s,
        "request_throughput_rps": len(ok) / duration_s if duration_s > 0 else float("nan"),
        "output_token_throughput_tps": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput_tps": total_tokens / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": summarize([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        "tpot_ms": summarize([s.tpot_ms for s in ok if s.tpot_ms is not None]),
        "itl_ms": summarize([g for s in ok for g in s.itl_ms]),
        "e2e_ms": summarize([s.e2e_ms for s in ok if s.e2e_ms is not None]),
        "send_lag_ms": {"p50": percentile(lag, 50), "p99": percentile(lag, 99),
                        "max": max(lag) if lag else float("nan")},
    }
    if slo:
        rep["slo"] = slo_stats(samples, duration_s, slo.get("ttft_ms"), slo.get("tpot_ms"))
    return rep


# ---- the client -----------------------------------------------------------------------------


@dataclass
class Target:
    url: str  # the server's base, with or without /v1
    model: str = "SmolLM2-135M-Instruct"
    api_key: str | None = None
    run_id: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:12]}")
    timeout_s: float = 300.0
    run_token: str = ""  # lets requests of several tenants tag one run (open_run)

    @property
    def completions_url(self) -> str:
        base = self.url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/completions"


async def one_request(http, target: Target, item: Item, scheduled: float) -> Sample:
    """Stream one completion; times are measured from ``scheduled`` (monotonic seconds)."""
    import httpx

    s = Sample(scheduled=scheduled, sent=time.monotonic())
    headers = {"x-tailscope-bench-run": target.run_id}
    if target.run_token:
        headers["x-tailscope-bench-token"] = target.run_token
    key = item.api_key or target.api_key
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = {"model": target.model, "prompt": item.prompt, "max_tokens": item.max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    last = None
    try:
        async with http.stream("POST", target.completions_url, json=body,
                               headers=headers) as r:
            s.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                s.e2e_ms = (time.monotonic() - scheduled) * 1e3
                return s
            async for line in r.aiter_lines():
                chunk = sse_json(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    s.error = f"stream error: {chunk['error'].get('message')}"
                    continue
                if chunk.get("usage"):
                    s.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    s.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.monotonic()
                    if last is None:
                        s.ttft_ms = (now - scheduled) * 1e3
                    else:
                        s.itl_ms.append((now - last) * 1e3)
                    last = now
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.e2e_ms = (time.monotonic() - scheduled) * 1e3
    return s


def _client(concurrency: int):
    import httpx

    # Idle connections are dropped after 2 s, short of uvicorn's 5 s keep-alive (vLLM, SGLang,
    # a Tailscope gateway): at httpx's default of 5 s too, a connection idle for just under 5 s
    # by the client's clock (it starts when the response is read) was reused as the server,
    # whose clock started when it sent the response, closed it: a ReadError with no response,
    # counted as a server error (seen in CI in an open-loop point at a low rate).
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                          keepalive_expiry=2.0)
    return httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0), limits=limits)


async def run_open_loop(target: Target, items: list[Item], offsets: list[float]) -> tuple[
        list[Sample], float]:
    """Fire each item at ``start + offset`` whatever the server does; never wait on responses."""
    async with _client(max(64, len(items))) as http:
        start = time.monotonic() + 0.05
        tasks = []
        for item, off in zip(items, offsets, strict=True):
            at = start + off
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(http, target, item, at)))
        samples = await asyncio.gather(*tasks)
    end = max((s.scheduled + (s.e2e_ms or 0) / 1e3 for s in samples), default=start)
    return list(samples), end - start


async def run_closed_loop(target: Target, items: list[Item], concurrency: int) -> tuple[
        list[Sample], float]:
    """``concurrency`` streams, each sending its next request when the previous one ends
    (latency from the moment it is sent: closed loops hide server stalls by design)."""
    queue = list(reversed(items))
    samples: list[Sample] = []
    async with _client(concurrency) as http:
        start = time.monotonic()

        async def worker() -> None:
            while queue:
                item = queue.pop()
                samples.append(await one_request(http, target, item, time.monotonic()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.monotonic() - start


def run(target: Target, mode: str, items: list[Item], *, rate: float | None = None,
        burstiness: float = 1.0, concurrency: int = 1, seed: int = 0, warmup: int = 0,
        slo: dict | None = None) -> dict:
    """One run of a mode; ``warmup`` requests go first, serially, and are reported apart."""
    cold: list[Sample] = []
    cpu0 = _cpu_ms()
    if warmup:
        cold, _ = asyncio.run(run_closed_loop(target, items[:warmup], 1))
        items = items[warmup:]
    if mode == "serial":
        samples, dur = asyncio.run(run_closed_loop(target, items, 1))
    elif mode == "closed":
        samples, dur = asyncio.run(run_closed_loop(target, items, concurrency))
    elif mode == "burst":
        samples, dur = asyncio.run(run_open_loop(target, items, [0.0] * len(items)))
    elif mode == "rate":
        if any(it.at is not None for it in items):  # a replayed trace keeps its own times
            offsets = [it.at or 0.0 for it in items]
        else:
            if not rate:
                raise ValueError("--mode rate needs --rate")
            offsets = arrival_times(len(items), rate, burstiness, seed)
        samples, dur = asyncio.run(run_open_loop(target, items, offsets))
    else:
        raise ValueError(f"unknown mode {mode!r}")
    rep = report(samples, dur, slo)
    rep.update(mode=mode, rate=rate, burstiness=burstiness, concurrency=concurrency,
               run_id=target.run_id)
    rep["client_cpu_ms_per_request"] = (_cpu_ms() - cpu0) / max(1, len(samples))
    if cold:
        rep["cold_start"] = {"requests": len(cold),
                             "ttft_ms": [s.ttft_ms for s in cold],
                             "e2e_ms": [s.e2e_ms for s in cold]}
    return rep


def _cpu_ms() -> float:
    """This process's CPU time: the generator's own cost, reported with every run."""
    t = os.times()
    return (t.user + t.system) * 1e3


def saturation(points: list[dict], metric: str = "e2e_ms", factor: float = 2.0) -> dict | None:
    """The first sweep point whose p99 exceeds ``factor`` times the lowest-rate point's p99:
    where the latency-throughput curve turns steep. None when it never does."""
    pts = [p for p in points if p[metric].get("n")]
    if not pts:
        return None
    base = pts[0][metric]["p99"]
    return next((p for p in pts[1:] if p[metric]["p99"] > factor * base), None)


def sweep(target: Target, items_for, steps: int, seed: int = 0, slo: dict | None = None,
          burst_n: int = 32, point_s: float = 10.0) -> dict:
    """Serial for the minimum latency, burst for the maximum throughput, then ``steps``
    open-loop rates spaced evenly between the two throughputs, ``point_s`` seconds each."""
    serial = run(target, "serial", items_for(16, seed), slo=slo)
    burst = run(target, "burst", items_for(burst_n, seed + 1), slo=slo)
    lo = max(serial["request_throughput_rps"], 0.1)
    hi = max(burst["request_throughput_rps"], lo * 1.5)
    points = []
    for i in range(steps):
        r = lo + (hi - lo) * (i + 1) / (steps + 1) if steps > 1 else (lo + hi) / 2
        n = max(20, int(r * point_s))
        points.append(run(target, "rate", items_for(n, seed + 2 + i), rate=r, seed=seed + i,
                          slo=slo))
    sat = saturation(points)
    return {"serial": serial, "burst": burst, "points": points,
            "saturation_rps": sat["rate"] if sat else None}


def plot_frontier(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    x = [p["request_throughput_rps"] for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for q, style in (("p50", "o-"), ("p99", "s--")):
        ax.plot(x, [p["e2e_ms"].get(q, float("nan")) for p in pts], style, label=f"E2E {q}")
        ax.plot(x, [p["ttft_ms"].get(q, float("nan")) for p in pts], style, alpha=0.6,
                label=f"TTFT {q}")
    if result.get("saturation_rps"):
        ax.axvline(next(p["request_throughput_rps"] for p in pts
                        if p["rate"] == result["saturation_rps"]), color="grey", ls=":",
                   label="saturation")
    ax.set_xlabel("achieved throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("latency-throughput frontier")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_md(result: dict) -> str:
    def row(name: str, rep: dict) -> str:
        e, t = rep["e2e_ms"], rep["ttft_ms"]
        return (f"| {name} | {rep['requests']} | {sum(rep['errors'].values())} | "
                f"{rep['request_throughput_rps']:.2f} | {rep['output_token_throughput_tps']:.1f} "
                f"| {t.get('p50', float('nan')):.1f} | {t.get('p99', float('nan')):.1f} | "
                f"{e.get('p50', float('nan')):.1f} | {e.get('p99', float('nan')):.1f} | "
                f"{rep['send_lag_ms']['p99']:.2f} |")

    lines = ["| run | requests | errors | req/s | output tok/s | TTFT p50 | TTFT p99 | "
             "E2E p50 | E2E p99 | send lag p99 (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    if "points" in result:
        lines.append(row("serial", result["serial"]))
        lines.append(row("burst", result["burst"]))
        lines += [row(f"rate {p['rate']:.2f}/s", p) for p in result["points"]]
        sat = result.get("saturation_rps")
        lines.append("")
        lines.append(f"Saturation (p99 E2E > 2x its lowest-rate value): "
                     f"{f'{sat:.2f} req/s offered' if sat else 'not reached'}.")
    else:
        lines.append(row(result["mode"], result))
    return "\n".join(lines) + "\n"


def open_run(target: Target, admin_key: str | None) -> bool:
    """Ask a Tailscope gateway for the run's token, so that the requests of every tenant key
    in the workload are tagged into it (a gateway with tenants otherwise gives a run to the
    first tenant that tags it). False where the target gave none (not a Tailscope gateway, or
    no admin access): the run is then one tenant's."""
    import httpx

    base = target.url.rstrip("/").removesuffix("/v1")
    try:
        r = httpx.post(f"{base}/debug/bench-runs/open", timeout=10, json={
            "run_id": target.run_id}, headers={"Authorization": f"Bearer {admin_key}"}
            if admin_key else {})
        target.run_token = str(r.json()["token"]) if r.status_code == 200 else ""
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        target.run_token = ""
    return bool(target.run_token)


def record_run(target: Target, result: dict, params: dict, admin_key: str | None) -> str:
    """Store the run in the target gateway's ``bench_runs`` table (a Tailscope gateway only);
    returns what happened, in words."""
    import httpx

    base = target.url.rstrip("/").removesuffix("/v1")
    summary = {k: result[k] for k in ("request_throughput_rps", "output_token_throughput_tps",
                                      "ttft_ms", "e2e_ms", "errors") if k in result}
    if "points" in result:
        summary = {"saturation_rps": result.get("saturation_rps"),
                   "points": [{k: p[k] for k in ("rate", "request_throughput_rps", "e2e_ms",
                                                 "ttft_ms")} for p in result["points"]]}
    try:
        r = httpx.post(f"{base}/debug/bench-runs", timeout=30, headers={
            "Authorization": f"Bearer {admin_key}"} if admin_key else {}, json={
            "run_id": target.run_id, "mode": result.get("mode", "sweep"), "target": base,
            "params": params, "results": summary})
    except httpx.HTTPError as exc:
        return f"not stored in bench_runs ({exc})"
    if r.status_code != 200:
        return f"not stored in bench_runs (HTTP {r.status_code}: not a Tailscope gateway?)"
    return f"stored in bench_runs as {target.run_id}"


def write_outputs(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "results.json", out / "summary.md"]
    files[0].write_text(json.dumps(result, indent=2, default=str))
    files[1].write_text(summary_md(result))
    if "points" in result:
        png = out / "frontier.png"
        plot_frontier(result, png)
        files.append(png)
    return files


