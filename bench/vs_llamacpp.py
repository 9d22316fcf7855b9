"""Tailscope against llama.cpp's ``llama-server``, side by side in one run, through both
servers' OpenAI endpoints.

    python bench/vs_llamacpp.py [--dtypes float32,bfloat16,bfloat16+int4] [--threads 2]
        [--quick]

``llama-server`` is built natively from the ``llama-cpp-python`` source distribution on PyPI
(``--llama-cpp-python``, default 0.3.36; ``bench/upstream_llamacpp.build_llama_server``: about
10 minutes on 2 cores, once, cached under ``~/.cache/tailscope-bench``). It serves the bundled
model's own GGUF (Q4_1) with ``-t/-tb <threads>`` and 32 slots; Tailscope serves the same file
(``tailscope serve``, one replica with ``TAILSCOPE_THREADS=<threads>``, a fresh embedded store
with full capture) once per ``--dtypes`` entry (``DTYPE+int4`` / ``DTYPE+int8``: with
``--weights int4`` / ``int8``; int4 keeps the GGUF's Q4_1 blocks packed for small decode
steps; ``+compile``: with ``--compile``, decode steps through ``torch.compile``, e.g.
``bfloat16+int4+compile``). The servers run one after the other, never at the same time,
each warmed up with one request first.

The workload is ``bench/engine_throughput.workload`` (random token-id prompts, fixed seed),
sent as token-id prompts to ``/v1/completions`` so both servers see the same tokens, greedy,
streamed, with ``ignore_eos`` so every request emits exactly its ``max_tokens``:

* batch 1: a 64-token prompt, 128 output tokens: output tok/s, decode ms/token
  ((E2E - TTFT) / (tokens - 1)) and TTFT;
* 8 concurrent streams of 128 tokens (32-96-token prompts): aggregate output tok/s;
* 32 requests with prompts of 16..512 tokens, 128 output tokens each, all sent at once:
  aggregate output tok/s and TTFT p50/p99.

llama-server's prompt cache is off (``cache_prompt: false``); Tailscope's prefix cache stays on
(its default), which these distinct random prompts never hit. Printed: each server's figures,
each Tailscope column's ratio to llama-server, the peak RSS of each server (Tailscope: gateway
and replica together), and the issue's targets, met or not. No pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


async def _one(http, url: str, model: str, prompt: list[int], max_tokens: int,
               extra: dict) -> dict:
    from tracing.client import sse_json

    t0 = time.monotonic_ns()
    first, tokens, chunks = None, None, 0
    async with http.stream("POST", f"{url}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
            **extra}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            chunk = sse_json(line)
            if chunk is None:
                continue
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens", tokens)
            choice = (chunk.get("choices") or [{}])[0]
            if choice.get("text"):
                chunks += 1
                if first is None:
                    first = time.monotonic_ns()
    end = time.monotonic_ns()
    return {"ttft": ((first or end) - t0) / 1e6, "e2e": (end - t0) / 1e6,
            "tokens": tokens if tokens is not None else chunks}


async def _batch(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                 extra: dict) -> tuple[list[dict], float]:
    """Every prompt at once; (per request, wall seconds)."""
    import httpx

    # a connection per request: llama-server closes kept-alive connections now and then, and a
    # request sent on one it just closed fails (both servers get the same treatment)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(
            max_connections=64, max_keepalive_connections=0)) as http:
        await _one(http, url, model, [1, 2, 3, 4], 4, extra)  # warm-up
        t0 = time.monotonic()
        got = await asyncio.gather(*(_one(http, url, model, p, max_tokens, extra)
                                     for p in prompts))
        return list(got), time.monotonic() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(url: str, model: str, w: dict, extra: dict) -> dict:
    out: dict[str, float] = {}
    (one,), _ = asyncio.run(_batch(url, model, [w["batch1"]["prompt"]],
                                   w["batch1"]["max_tokens"], extra))
    short = int(one["tokens"] != w["batch1"]["max_tokens"])
    out["batch1_tok_s"] = one["tokens"] / (one["e2e"] / 1000)
    out["batch1_ms_token"] = (one["e2e"] - one["ttft"]) / max(1, one["tokens"] - 1)
    out["batch1_ttft_ms"] = one["ttft"]
    got, wall = asyncio.run(_batch(url, model, w["streams"], w["streams_tokens"], extra))
    out["streams_tok_s"] = sum(g["tokens"] for g in got) / wall
    short += sum(g["tokens"] != w["streams_tokens"] for g in got)
    got, wall = asyncio.run(_batch(url, model, w["mixed"], w["mixed_tokens"], extra))
    short += sum(g["tokens"] != w["mixed_tokens"] for g in got)
    if short:  # tok/s count what came back, but the workloads differ then
        print(f"  {url}: {short} requests did not emit exactly their max_tokens", flush=True)
    out["mixed_tok_s"] = sum(g["tokens"] for g in got) / wall
    out["mixed_ttft_p50"] = pct([g["ttft"] for g in got], 0.5)
    out["mixed_ttft_p99"] = pct([g["ttft"] for g in got], 0.99)
    return out


def run_llama(exe: Path, threads: int, w: dict) -> dict:
    from bench.trace_overhead import PeakRss
    from bench.upstream_llamacpp import start_llama_server
    from bench.upstream_overhead import _wait_http
    from tracing.client import stop_process

    slots = max(len(w["mixed"]), len(w["streams"]))
    # per slot 1024 tokens: the longest prompt (512) and its output fit
    proc, url = start_llama_server(exe, threads, slots, ctx=1024 * slots)
    rss = PeakRss(proc.pid)
    try:
        _wait_http(f"{url}/health", 120, proc)
        got = measure(url, "x", w, {"cache_prompt": False})
    finally:
        rss.stop()
        stop_process(proc, 30)
    return {**got, "rss_mb": rss.tree_mb}


def run_tailscope(spec: str, threads: int, w: dict) -> dict:
    """``spec``: an engine dtype, then optionally ``+int4`` / ``+int8`` (the weights) and
    ``+compile`` (``bfloat16+int4+compile``)."""
    from bench.trace_overhead import PeakRss
    from tracing.client import GatewayProcess

    dtype, *extra = spec.split("+")
    weights = [x for x in extra if x != "compile"]
    if len(weights) > 1:
        raise SystemExit(f"--dtypes: {spec!r} is not DTYPE[+WEIGHTS][+compile]")
    args = ["--dtype", dtype, "--weights", weights[0] if weights else "native"]
    args += ["--compile"] if "compile" in extra else []
    store = tempfile.mkdtemp(prefix="tailscope-vs-llamacpp-")
    gw = GatewayProcess(args, cwd=ROOT, quiet=True, ready_timeout_s=600,
                        env={"TAILSCOPE_THREADS": str(threads),
                             "TAILSCOPE_STORE_DSN": f"chdb://{store}/store"}).start()
    rss = PeakRss(gw.proc.pid)
    try:
        import httpx

        model = httpx.get(f"{gw.url}/v1/models").json()["data"][0]["id"]
        got = measure(gw.url, model, w, {})
    finally:
        rss.stop()
        gw.stop()
    return {**got, "rss_mb": rss.tree_mb}


ROWS = [("batch1_tok_s", "batch 1 output tok/s", True),
        ("batch1_ms_token", "batch 1 decode ms/token", False),
        ("batch1_ttft_ms", "batch 1 TTFT ms", False),
        ("streams_tok_s", "8 streams aggregate output tok/s", True),
        ("mixed_tok_s", "32 mixed requests output tok/s", True),
        ("mixed_ttft_p50", "32 mixed TTFT p50 ms", False),
        ("mixed_ttft_p99", "32 mixed TTFT p99 ms", False),
        ("rss_mb", "server peak RSS MB", False)]


def report(results: dict[str, dict]) -> None:
    names = list(results)
    print(f"{'measure':36}" + "".join(f"{n:>20}" for n in names))
    for key, label, _ in ROWS:
        print(f"{label:36}" + "".join(f"{results[n][key]:20.1f}" for n in names))
    base = results["llama.cpp"]
    print(f"\n{'ratio to llama-server (>1: better)':36}" + "".join(f"{n:>20}" for n in names[1:]))
    for key, label, higher_better in ROWS:
        ratios = [results[n][key] / base[key] if higher_better else base[key] / results[n][key]
                  for n in names[1:]]
        print(f"{label:36}" + "".join(f"{r:19.2f}x" for r in ratios))
    print("\ntargets (issue 23):")
    for n in names[1:]:
        r = results[n]
        print(f"  {n}: 8 streams >= 3x llama-server: "
              f"{r['streams_tok_s'] / base['streams_tok_s']:.2f}x "
              f"({'met' if r['streams_tok_s'] >= 3 * base['streams_tok_s'] else 'not met'}); "
              f"batch-1 ms/token <= llama-server's: {r['batch1_ms_token']:.1f} vs "
              f"{base['batch1_ms_token']:.1f} "
              f"({'met' if r['batch1_ms_token'] <= base['batch1_ms_token'] else 'not met'}); "
              f"32 mixed >= 2x llama-server: {r['mixed_tok_s'] / base['mixed_tok_s']:.2f}x "
              f"({'met' if r['mixed_tok_s'] >= 2 * base['mixed_tok_s'] else 'not met'})")


def main() -> int:
    from bench.engine_throughput import workload
    from bench.upstream_llamacpp import build_llama_server

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-python", default="0.3.36", help="sdist version to build from")
    ap.add_argument("--dtypes", default="float32,bfloat16,bfloat16+int4",
                    help="Tailscope runs, one per engine dtype, DTYPE+int4 / DTYPE+int8 for "
                         "packed weights, +compile for compiled decode steps "
                         "(comma-separated)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="8 mixed requests of 32 tokens")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    exe = build_llama_server(args.llama_cpp_python)
    w = workload(args.quick)
    results = {"llama.cpp": run_llama(exe, args.threads, w)}
    for spec in args.dtypes.split(","):
        results[f"tailscope {spec}"] = run_tailscope(spec, args.threads, w)
    print(f"# vs_llamacpp  llama-server {exe.parent.parent.parent.name}/{exe.parent.parent.name}, "
          f"threads={args.threads}, "
          f"bundled Q4_1 GGUF; {len(w['mixed'])} mixed requests, "
          f"{w['mixed_tokens']} output tokens each")
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
