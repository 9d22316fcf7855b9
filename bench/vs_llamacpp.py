"""Tailscope against llama.cpp's ``llama-server``, side by side in one run, through both
servers' OpenAI endpoints.

    python bench/vs_llamacpp.py [--dtypes default,exact,bfloat16+int4] [--threads 2]
        [--rounds 3] [--quick] [--no-avx2] [--fidelity]

A second table (unless ``--no-avx2``) compares the AVX2 path: llama-server built without
AVX-512 (``upstream_llamacpp.AVX2_FLAGS``, built once like the native one) against Tailscope
with the settings its ``fast`` profile chooses on an AVX2 CPU, under ``AVX2_ENV`` (our AVX2
kernel alone, torch's own kernels held to AVX2).

More: docs/benchmarks/methods.md#benchvs_llamacpp."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
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


class Server:
    """One server under test, started once and measured round after round: ``url``, the
    ``model`` name to ask for, ``extra`` request fields, its peak RSS sampler and how to stop
    it."""

    def __init__(self, name: str, url: str, model: str, extra: dict, rss, stop) -> None:
        self.name, self.url, self.model, self.extra = name, url, model, extra
        self.rss, self._stop = rss, stop
        self.rounds: list[dict] = []

    def stop(self) -> None:
        self.rss.stop()
        self._stop()


def start_llama(exe: Path, threads: int, w: dict) -> Server:
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
    except BaseException:
        rss.stop()
        stop_process(proc, 30)
        raise
    return Server("llama.cpp", url, "x", {"cache_prompt": False}, rss,
                  lambda: stop_process(proc, 30))


def serve_args(spec: str) -> list[str]:
    """``spec``: ``default`` (no engine flags: the product's fast profile), ``exact`` (the
    exact profile), or an engine dtype, then optionally ``+int4`` / ``+int8`` (the weights),
    ``+out=int4`` / ``+out=int8`` (the output matrix) and ``+compile`` or ``+aot`` (compiled
    ahead of time: ``compile_mode: aot``) (``bfloat16+int4+out=int4+compile``)."""
    if spec == "default":
        return []
    if spec == "avx2":  # what the fast profile chooses on an AVX2 CPU, run here as there
        from engine.config import AVX2_FLAGS
        from engine.profiles import choose

        chosen = choose("fast", set(AVX2_FLAGS))[0]
        return ["--dtype", chosen["dtype"], "--weights", chosen["weights"],
                "--output-weights", chosen["output_weights"]]
    if spec == "exact":
        return ["--profile", "exact"]
    dtype, *extra = spec.split("+")
    outputs = [x.removeprefix("out=") for x in extra if x.startswith("out=")]
    weights = [x for x in extra if x not in ("compile", "aot") and not x.startswith("out=")]
    if len(weights) > 1 or len(outputs) > 1:
        raise SystemExit(f"--dtypes: {spec!r} is not default, exact or "
                         "DTYPE[+WEIGHTS][+out=WEIGHTS][+compile|+aot]")
    args = ["--dtype", dtype, "--weights", weights[0] if weights else "native",
            "--output-weights", outputs[0] if outputs else "native"]
    args += ["--compile"] if "compile" in extra or "aot" in extra else []
    args += ["--compile-mode", "aot"] if "aot" in extra else []
    return args


# The AVX2 row's environment: our AVX2 library alone, and torch's own kernels (ATen's vectorised
# loops, MKL, oneDNN) held to AVX2, so the whole engine runs as on an AVX2-only CPU.
AVX2_ENV = {"TAILSCOPE_NATIVE_KERNELS": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def start_tailscope(spec: str, threads: int) -> Server:
    """Tailscope serving the bundled model as ``spec`` says (``serve_args``; ``avx2``: the
    fast profile's AVX2 settings under ``AVX2_ENV``)."""
    import httpx

    from bench.trace_overhead import PeakRss
    from tracing.client import GatewayProcess

    store = tempfile.mkdtemp(prefix="tailscope-vs-llamacpp-")
    gw = GatewayProcess(serve_args(spec), cwd=ROOT, quiet=True, ready_timeout_s=600,
                        # the product's default profile, whatever this shell's says
                        env={"TAILSCOPE_THREADS": str(threads), "TAILSCOPE_PROFILE": "fast",
                             "TAILSCOPE_STORE_DSN": f"chdb://{store}/store",
                             **(AVX2_ENV if spec == "avx2" else {})}).start()
    rss = PeakRss(gw.proc.pid)
    try:
        model = httpx.get(f"{gw.url}/v1/models").json()["data"][0]["id"]
        # a replica serves on the eager step while its compiled step builds: measure the
        # compiled one (a build takes ~2 minutes once, then it is cached)
        gw.wait_compiled()
    except BaseException:
        rss.stop()
        gw.stop()
        raise
    return Server(f"tailscope {spec}", gw.url, model, {}, rss, gw.stop)


def summarise(server: Server) -> dict:
    """The median over the rounds of each figure, and the peak RSS: of the server process
    tree (Tailscope: gateway, replica and store together) and of the engine alone (Tailscope's
    replica process; llama-server is one process)."""
    out = {key: statistics.median(r[key] for r in server.rounds)
           for key, _, _ in ROWS if key in server.rounds[0]}
    out["rss_mb"] = server.rss.tree_mb
    out["engine_rss_mb"] = server.rss.replica_mb or server.rss.tree_mb
    return out


ROWS = [("batch1_tok_s", "batch 1 output tok/s", True),
        ("batch1_ms_token", "batch 1 decode ms/token", False),
        ("batch1_ttft_ms", "batch 1 TTFT ms", False),
        ("streams_tok_s", "8 streams aggregate output tok/s", True),
        ("mixed_tok_s", "32 mixed requests output tok/s", True),
        ("mixed_ttft_p50", "32 mixed TTFT p50 ms", False),
        ("mixed_ttft_p99", "32 mixed TTFT p99 ms", False),
        ("rss_mb", "server peak RSS MB (all processes)", False),
        ("engine_rss_mb", "engine peak RSS MB", False)]


def report(results: dict[str, dict], avx2: bool = False) -> None:
    names = list(results)
    width = max(20, *(len(n) + 2 for n in names))
    print(f"{'measure':36}" + "".join(f"{n:>{width}}" for n in names))
    for key, label, _ in ROWS:
        print(f"{label:36}" + "".join(f"{results[n][key]:{width}.1f}" for n in names))
    base = results["llama.cpp"]
    print(f"\n{'ratio to llama-server (>1: better)':36}"
          + "".join(f"{n:>{width}}" for n in names[1:]))
    for key, label, higher_better in ROWS:
        ratios = [results[n][key] / base[key] if higher_better else base[key] / results[n][key]
                  for n in names[1:]]
        print(f"{label:36}" + "".join(f"{r:{width - 1}.2f}x" for r in ratios))
    if avx2:
        print("\ntargets (issue 71, the AVX2 path):")
        for n in names[1:]:
            r = results[n]
            streams = r["streams_tok_s"] / base["streams_tok_s"]
            b1 = base["batch1_tok_s"] / r["batch1_tok_s"]
            print(f"  {n}: 8 streams >= llama-server's: {streams:.2f}x "
                  f"({'met' if streams >= 1 else 'not met'}); batch 1 within 1.25x of it: "
                  f"{b1:.2f}x its time ({'met' if b1 <= 1.25 else 'not met'})")
        return
    print(f"\ntargets (issue 71; the batch-1 floor: {FLOOR_MB:.1f} MB of weights a token, the "
          f"fast profile's, at {FLOOR_GB_S:.0f} GB/s: {FLOOR_MS:.2f} ms):")
    for n in names[1:]:
        r = results[n]
        checks = [("8 streams >= 4x llama-server", r["streams_tok_s"] / base["streams_tok_s"],
                   4.0, "x"),
                  ("batch 1 >= 2x llama-server", r["batch1_tok_s"] / base["batch1_tok_s"],
                   2.0, "x"),
                  ("32 mixed >= 3x llama-server", r["mixed_tok_s"] / base["mixed_tok_s"],
                   3.0, "x")]
        text = "; ".join(f"{label}: {v:.2f}{unit} ({'met' if v >= goal else 'not met'})"
                         for label, v, goal, unit in checks)
        floor = r["batch1_ms_token"] / FLOOR_MS
        print(f"  {n}: {text}; batch 1 <= 1.6x the floor: {floor:.2f}x "
              f"({'met' if floor <= 1.6 else 'not met'})")


# The bandwidth floor the issue names: what a batch-1 step of the fast profile reads once a
# token (LlamaModel.weight_bytes: the packed decoder weights and the Q8_0 output matrix, 96.5 MB;
# the issue counted 84 with a 4-bit output matrix) over this machine kind's measured read
# bandwidth with 2 threads (~35 GB/s).
FLOOR_GB_S = 35.0
FLOOR_MB = 96.5
FLOOR_MS = FLOOR_MB * 1e6 / (FLOOR_GB_S * 1e9) * 1e3


def main() -> int:
    from bench.upstream_llamacpp import build_llama_server, build_llama_server_avx2

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-python", default="0.3.36", help="sdist version to build from")
    ap.add_argument("--dtypes", default="default,exact",
                    help="Tailscope runs (comma-separated): default (no flags, as make serve "
                         "runs: the fast profile), exact (the exact profile), or an engine "
                         "dtype, DTYPE+int4 / DTYPE+int8 for packed weights, +out=int4 for a "
                         "packed output matrix, +compile for compiled decode steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3,
                    help="each server measured this many times, in turns; medians printed")
    ap.add_argument("--quick", action="store_true", help="8 mixed requests of 32 tokens")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--no-avx2", action="store_true",
                    help="skip the second table (llama.cpp built for AVX2 against our AVX2 "
                         "path)")
    ap.add_argument("--fidelity", action="store_true",
                    help="also compare fidelity: our fast profile against exact, llama.cpp's "
                         "4-bit path against its float baseline (llama-perplexity "
                         "--kl-divergence)")
    args = ap.parse_args()
    results: dict[str, dict] = {}
    if args.dtypes:  # --dtypes "" --no-avx2 --fidelity: the fidelity comparison alone
        exe = build_llama_server(args.llama_cpp_python)
        results = compare(exe, args.dtypes.split(","), args)
        print(f"# vs_llamacpp  llama-server {exe.parent.parent.parent.name}/"
              f"{exe.parent.parent.name}, threads={args.threads}, bundled Q4_1 GGUF; "
              f"{_shape(args.quick)}")
        report(results)
    if not args.no_avx2:
        avx2_exe = build_llama_server_avx2(args.llama_cpp_python)
        avx2 = compare(avx2_exe, ["avx2"], args)
        print(f"\n# vs_llamacpp AVX2  llama-server {avx2_exe.parent.parent.name} (GGML_NATIVE=OFF, "
              f"AVX2, no AVX-512) against Tailscope's AVX2 path ({' '.join(serve_args('avx2'))}"
              f"; {' '.join(f'{k}={v}' for k, v in AVX2_ENV.items())}), threads={args.threads}")
        report(avx2, avx2=True)
        results["avx2"] = avx2
    if args.fidelity:
        results["fidelity"] = fidelity(args.llama_cpp_python, args.threads)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def llama_kl(bindir: Path, text: Path, threads: int, ctx: int = 512) -> dict:
    """llama.cpp's 4-bit path (the bundled Q4_1 GGUF) against its own float baseline."""
    import re
    import subprocess

    from engine.loader.paths import default_model_path

    env = {"LD_LIBRARY_PATH": str(bindir)}
    common = ["-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    with tempfile.TemporaryDirectory() as tmp:
        f32, base = f"{tmp}/f32.gguf", f"{tmp}/base.kld"
        for cmd in ([bindir / "llama-quantize", "--allow-requantize", default_model_path(), f32,
                     "F32"],
                    [bindir / "llama-perplexity", "-m", f32, *common,
                     "--kl-divergence-base", base]):
            subprocess.run([str(c) for c in cmd], env=env, check=True, capture_output=True)
        out = subprocess.run([str(bindir / "llama-perplexity"), "-m", str(default_model_path()),
                              *common, "--kl-divergence-base", base, "--kl-divergence"],
                             env=env, check=True, capture_output=True, text=True)
    log = out.stdout + out.stderr

    def value(label: str) -> float:
        m = re.search(rf"{re.escape(label)}\s*:\s*(-?[0-9.]+)", log)
        if m is None:
            raise RuntimeError(f"llama-perplexity printed no {label!r}")
        return float(m.group(1))

    return {"ppl_increase": value("Mean PPL(Q)/PPL(base)") - 1, "kl_mean": value("Mean    KLD"),
            "kl_p99": value("99.0%   KLD"), "top1": value("Same top p") / 100}


def fidelity(version: str, threads: int) -> dict:
    """Both 4-bit paths against their float references; the issue's gates."""
    import torch

    from bench.upstream_llamacpp import build_llama_tools
    from evals.fidelity import MAX_PPL_INCREASE, TEXT, run

    torch.set_num_threads(threads)
    ours = run("fast", "exact").as_dict()
    theirs = llama_kl(build_llama_tools(version), TEXT, threads)
    print(f"\n# fidelity on {TEXT.name}, windows of 512 ({ours['tokens']} positions for ours; "
          "llama.cpp scores each window's second half)")
    print("| | perplexity vs reference | KL mean / p99 (nats) | top-1 agreement |")
    print("|---|---|---|---|")
    for name, f in (("Tailscope fast vs exact", ours), ("llama.cpp Q4_1 vs its F32", theirs)):
        print(f"| {name} | {f['ppl_increase'] * 100:+.3f} % | {f['kl_mean']:.6f} / "
              f"{f['kl_p99']:.6f} | {f['top1'] * 100:.2f} % |")
    print(f"targets: fast within {MAX_PPL_INCREASE * 100:g} % of exact's perplexity "
          f"({'met' if ours['ppl_increase'] <= MAX_PPL_INCREASE else 'NOT met'}); its mean KL "
          f"no worse than llama.cpp's "
          f"({'met' if ours['kl_mean'] <= theirs['kl_mean'] else 'NOT met'})")
    return {"tailscope": ours, "llama_cpp": theirs}


def _shape(quick: bool) -> str:
    from bench.engine_throughput import workload

    w = workload(quick)
    return f"{len(w['mixed'])} mixed requests, {w['mixed_tokens']} output tokens each"


def compare(exe: Path, specs: list[str], args) -> dict[str, dict]:
    """llama-server (``exe``) and a Tailscope server per spec, measured in turns round after
    round; each one's medians."""
    from bench.engine_throughput import workload

    w = workload(args.quick)
    servers: list[Server] = []
    try:
        servers.append(start_llama(exe, args.threads, w))
        for spec in specs:
            servers.append(start_tailscope(spec, args.threads))
        for i in range(args.rounds):
            w = workload(args.quick, seed=1234 + i)  # fresh prompts: no prefix-cache hits
            for srv in servers:
                srv.rounds.append(measure(srv.url, srv.model, w, srv.extra))
                r = srv.rounds[-1]
                print(f"round {i + 1} {srv.name}: batch-1 {r['batch1_ms_token']:.1f} ms/token, "
                      f"8 streams {r['streams_tok_s']:.1f} tok/s, 32 mixed "
                      f"{r['mixed_tok_s']:.1f} tok/s", flush=True)
    finally:
        for srv in servers:
            srv.stop()
    return {srv.name: summarise(srv) for srv in servers}


if __name__ == "__main__":
    sys.exit(main())
