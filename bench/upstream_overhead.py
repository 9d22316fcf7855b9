"""``bench/gateway_overhead.py --upstream``: what a proxy adds in front of an instant
OpenAI-compatible upstream, Tailscope and the LiteLLM proxy side by side in one run.

The upstream (``InstantUpstream``, written for this bench: a bare asyncio HTTP/1.1 server in its
own process) answers every ``POST`` at once with a canned stream of four content chunks, a
finish chunk, a ``usage`` chunk and ``[DONE]``, so the figures are the proxies' own cost. The
same open-loop schedule (evenly spaced sends; latency from the scheduled time) runs against:

* direct: the upstream itself;
* tailscope: ``tailscope serve --backend bench=UPSTREAM`` with full capture into a fresh
  embedded chDB store (the bundled replica is the tiny model and sits idle);
* litellm: the LiteLLM proxy (``litellm --config ... --num_workers 1``), installed by this script
  into its own venv under ``~/.cache/tailscope-bench/litellm`` (``--litellm-version``, default
  1.108.7; ``--no-litellm`` skips it).

For each rate: TTFT and E2E p50/p99, errors, each proxy's CPU time per request, and what each
adds over direct; the proxies' peak RSS (each with its child processes: Tailscope's store
child, where its embedded store runs by default; not its idle replica). No pass/fail here;
docs/benchmarks/serving.md has a run's table.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tailscope-bench"
KEY = "sk-" + secrets.token_hex(24)  # LiteLLM's master key for the run (sent on every path)

# The canned stream: a completion of four content chunks (about what a short answer is).
_CHUNKS = [f'{{"id":"cmpl-bench","object":"text_completion","model":"bench","choices":'
           f'[{{"index":0,"text":"{t}","finish_reason":{f}}}]}}'
           for t, f in (("Hello", "null"), (" there", "null"), (",", "null"), (" friend", "null"),
                        ("", '"length"'))]
_CHUNKS.append('{"id":"cmpl-bench","object":"text_completion","model":"bench","choices":[],'
               '"usage":{"prompt_tokens":8,"completion_tokens":4,"total_tokens":12}}')
_BODY = "".join(f"data: {c}\n\n" for c in _CHUNKS) + "data: [DONE]\n\n"
UPSTREAM_SERVER = textwrap.dedent(f'''
    import asyncio, sys
    BODY = {_BODY.encode()!r}
    HEAD = (b"HTTP/1.1 200 OK\\r\\ncontent-type: text/event-stream\\r\\n"
            b"content-length: " + str(len(BODY)).encode() + b"\\r\\n\\r\\n")
    MODELS = b'{{"object":"list","data":[{{"id":"bench","object":"model"}}]}}'
    async def serve(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\\r\\n\\r\\n")
                length = 0
                for line in head.split(b"\\r\\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\n"
                                 b"content-length: " + str(len(MODELS)).encode() +
                                 b"\\r\\n\\r\\n" + MODELS)
                else:
                    writer.write(HEAD + BODY)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]), backlog=4096)
        async with server:
            await server.serve_forever()
    asyncio.run(main())
''')


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not come up in {timeout_s:.0f} s")


def proxy_gateway(backend: str):
    """``tailscope serve --backend BACKEND`` (its bundled replica is the tiny model, idle) with
    full capture into a fresh embedded chDB store; started and ready."""
    from engine.loader.paths import resolve_model_path
    from tracing.client import GatewayProcess

    store = f"chdb://{tempfile.mkdtemp(prefix='tailscope-bench-')}/store"
    return GatewayProcess(["--model", "tiny:49152", "--tokenizer",
                           str(resolve_model_path("bundled")), "--backend", backend],
                          cwd=ROOT, quiet=True,
                          env={"TAILSCOPE_KV_CACHE_MB": "64", "TAILSCOPE_STORE_DSN": store,
                               "TAILSCOPE_THREADS": "1"}).start()


def litellm_venv(version: str) -> Path:
    """The LiteLLM proxy's own venv (created and installed once, outside the repository)."""
    venv = CACHE / f"litellm-{version}"
    exe = venv / "bin" / "litellm"
    if not exe.exists():
        print(f"installing litellm[proxy]=={version} into {venv} (once) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                        f"litellm[proxy]=={version}"], check=True)
    return exe


async def _drive(url: str, model: str, rates: list[float], duration: float, pid: int | None,
                 open_loop, Result) -> dict[float, dict]:
    import httpx

    from bench.gateway_overhead import cpu_ms, timed_stream

    out = {}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(
            max_connections=1000, max_keepalive_connections=1000)) as http:
        for rate in rates:
            async def one(i: int, at: int, res) -> None:
                body = {"model": model, "prompt": "Say hello", "max_tokens": 4,
                        "stream": True}
                await timed_stream(http, f"{url}/v1/completions", body, at, res,
                                   lambda line: line.startswith("data: {") and '"Hello"' in line,
                                   headers={"Authorization": f"Bearer {KEY}"},
                                   need_content=True)

            await open_loop(rate, min(duration, 2.0), one)  # warm-up
            cpu0 = cpu_ms(pid) if pid else 0.0
            res = (await open_loop(rate, duration, one)).summary()
            if pid:
                res["cpu_ms_per_request"] = (cpu_ms(pid) - cpu0) / max(1, res["n"] + res["errors"])
            out[rate] = res
    return out


def run(rates: list[float], duration: float, litellm: str | None) -> dict:
    from bench.gateway_overhead import Result, open_loop, peak_rss_sampler
    from tracing.client import free_port

    up_port = free_port()
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM_SERVER, str(up_port)])
    up_url = f"http://127.0.0.1:{up_port}"
    procs: list[subprocess.Popen] = [upstream]
    results: dict = {"rates": rates, "duration_s": duration, "paths": {}, "peak_rss_mb": {}}
    try:
        _wait_http(f"{up_url}/v1/models", 30, upstream)
        targets: list[tuple[str, str, str, subprocess.Popen | None]] = [
            ("direct", up_url, "bench", None)]
        gw = proxy_gateway(f"bench={up_url},max_concurrency=1024")
        procs.append(gw.proc)
        targets.append(("tailscope", gw.url, "bench", gw.proc))
        if litellm:
            exe = litellm_venv(litellm)
            cfg = Path(tempfile.mkdtemp(prefix="tailscope-bench-litellm-")) / "config.yaml"
            cfg.write_text(textwrap.dedent(f"""\
                model_list:
                  - model_name: bench
                    litellm_params:
                      model: text-completion-openai/bench
                      api_base: {up_url}/v1
                      api_key: sk-upstream
                general_settings:
                  master_key: {KEY}
            """))
            port = free_port()
            proc = subprocess.Popen([str(exe), "--config", str(cfg), "--port", str(port),
                                     "--num_workers", "1"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            procs.append(proc)
            _wait_http(f"http://127.0.0.1:{port}/health/liveliness", 240, proc)
            targets.append(("litellm", f"http://127.0.0.1:{port}", "bench", proc))
        for name, url, model, proc in targets:
            stop, peak = threading.Event(), []
            sampler = None
            if proc is not None:
                sampler = threading.Thread(target=peak_rss_sampler, args=(proc.pid, stop, peak))
                sampler.start()
            try:
                results["paths"][name] = asyncio.run(_drive(
                    url, model, rates, duration, proc.pid if proc else None, open_loop, Result))
            finally:
                stop.set()
                if sampler is not None:
                    sampler.join()
            if peak:
                results["peak_rss_mb"][name] = peak[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
    return results


def report(results: dict) -> str:
    paths = results["paths"]
    lines = [f"proxy overhead: instant upstream, 4 content chunks, streamed, open loop, "
             f"{results['duration_s']:g} s per rate (ms, from the scheduled send time)",
             f"{'rate/s':>7} {'path':>10} {'n':>5} {'err':>5} {'ttft p50':>9} {'ttft p99':>9} "
             f"{'e2e p50':>9} {'e2e p99':>9} {'cpu/req':>8}"]
    direct = paths["direct"]
    for rate in results["rates"]:
        for name, per in paths.items():
            r = per[rate]
            cpu = r.get("cpu_ms_per_request")
            lines.append(f"{rate:7.0f} {name:>10} {r['n']:5d} {r['errors']:5d} "
                         f"{r['ttft_p50']:9.2f} {r['ttft_p99']:9.2f} {r['e2e_p50']:9.2f} "
                         f"{r['e2e_p99']:9.2f} {'' if cpu is None else f'{cpu:8.2f}'}")
        for name, per in paths.items():
            if name == "direct":
                continue
            r, d = per[rate], direct[rate]
            lines.append(f"{'':7} {'+' + name:>10} {'':5} {'':5} "
                         f"{r['ttft_p50'] - d['ttft_p50']:9.2f} "
                         f"{r['ttft_p99'] - d['ttft_p99']:9.2f} "
                         f"{r['e2e_p50'] - d['e2e_p50']:9.2f} {r['e2e_p99'] - d['e2e_p99']:9.2f}")
        if "litellm" in paths and "tailscope" in paths:
            t, m, d = paths["tailscope"][rate], paths["litellm"][rate], direct[rate]
            added = [(t[k] - d[k], m[k] - d[k]) for k in ("e2e_p50", "e2e_p99")]
            ratio = " ".join(f"{k}: {a / b:.3f}" if b > 0 else f"{k}: n/a"
                             for k, (a, b) in zip(("p50", "p99"), added, strict=True))
            lines.append(f"{'':7} {'ratio':>10}  tailscope added / litellm added, {ratio}")
    for name, mb in results["peak_rss_mb"].items():
        lines.append(f"peak RSS {name}: {mb:.0f} MB")
    return "\n".join(lines)
