"""How long ``make serve`` takes to answer: from a cold cache (a fresh clone's: our CPU kernels,
the compiled decode step and inductor's cache all built anew) and again with the caches warm.

    python bench/startup.py [--threads 2] [--cache-dir DIR]

Runs ``tailscope serve`` with no engine flags (the product's default profile, whatever this
shell's ``TAILSCOPE_PROFILE`` says) twice against one empty cache directory (a temporary one
unless ``--cache-dir``), and prints for each start the seconds from spawning the process to:
``/ready`` (every replica up), the first answer (a 16-token completion), and the compiled step
in use (``/debug/replicas``: ``compile`` leaves ``compiling``; ``off`` where the profile does not
compile). The issue's targets: the first answer within 60 s cold, ready within 5 s warm.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def one_start(cache: Path, threads: int, compile_timeout_s: float) -> dict:
    import httpx

    from tracing.client import GatewayProcess

    gw = GatewayProcess([], cwd=ROOT, quiet=True, ready_timeout_s=600, env={
        "TAILSCOPE_THREADS": str(threads), "TAILSCOPE_PROFILE": "fast",
        "TAILSCOPE_CACHE_DIR": str(cache), "TAILSCOPE_AOT_CACHE_DIR": str(cache / "aot"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TAILSCOPE_STORE_DSN": f"chdb://{tempfile.mkdtemp(prefix='tailscope-startup-')}/s"})
    t0 = time.monotonic()
    out: dict = {}
    try:
        gw.start()  # every replica ready
        out["ready_s"] = time.monotonic() - t0
        model = httpx.get(f"{gw.url}/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(f"{gw.url}/v1/completions", timeout=300, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 16,
            "temperature": 0})
        r.raise_for_status()
        out["first_answer_s"] = time.monotonic() - t0
        states = gw.wait_compiled(compile_timeout_s)
        if "compiling" in states:
            out["compile"] = "still compiling"
        else:
            out["compile"] = ",".join(sorted(states))
            out["compiled_s"] = time.monotonic() - t0
    finally:
        gw.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", help="an empty directory (default: a temporary one)")
    ap.add_argument("--compile-timeout", type=float, default=900)
    args = ap.parse_args()
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="tailscope-startup-cache-"))
    if cache.exists() and any(cache.iterdir()):
        raise SystemExit(f"--cache-dir {cache} is not empty: the first start must be cold")
    cold = one_start(cache, args.threads, args.compile_timeout)
    warm = one_start(cache, args.threads, args.compile_timeout)
    print(f"# startup  make serve defaults, threads={args.threads}, cache {cache}")
    print(f"{'start':6}{'ready s':>10}{'first answer s':>16}{'compiled s':>12}  compile")
    for name, r in (("cold", cold), ("warm", warm)):
        print(f"{name:6}{r['ready_s']:10.1f}{r['first_answer_s']:16.1f}"
              f"{r.get('compiled_s', float('nan')):12.1f}  {r['compile']}")
    print(f"targets (issue 71): first answer cold <= 60 s: {cold['first_answer_s']:.1f} "
          f"({'met' if cold['first_answer_s'] <= 60 else 'not met'}); ready warm <= 5 s: "
          f"{warm['ready_s']:.1f} ({'met' if warm['ready_s'] <= 5 else 'not met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
