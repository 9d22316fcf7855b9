"""``make screenshots``: the drill-down's pages on a seeded store, saved as PNGs by headless
Chromium (Debian's ``chromium``) into ``docs/screenshots/``.

The store gets two hours of synthetic traffic in which, during the last hour, 6% of replica
r1's requests queue 200 ms longer, so the Regression page (its default windows are the hour
before and the last hour) has something to find. Each page is loaded once before its
screenshot: Streamlit renders only skeletons on a first visit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tracing.client import free_port

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "screenshots"


def seed(dsn: str) -> str:
    """Seed in a child process: chDB locks the directory, and Streamlit opens it next."""
    code = f"""
import datetime as dt, sys
sys.path.insert(0, {str(ROOT)!r})
from tracing.arrow import records_to_arrow
from tracing.store import Store
from tracing.seed import synthetic_records, synthetic_steps
s = Store({dsn!r}); s.migrate()
now = dt.datetime.now(dt.UTC)
us = lambda t: int(t.timestamp() * 1e6)
base = synthetic_records(3000, us(now - dt.timedelta(hours=2)), us(now - dt.timedelta(hours=1)),
                         seed=5, token_ids=True)
sus = synthetic_records(3000, us(now - dt.timedelta(hours=1)), us(now), seed=5, token_ids=True,
                        slow_replica="r1", slow_fraction=0.06, slow_queue_ms=200.0)
s.insert_rows("requests", base + sus)
top = max(sus, key=lambda r: r.e2e_ms)
s.insert("request_events", records_to_arrow([top])[1])  # its timeline: the waterfall
steps = synthetic_steps(us(now - dt.timedelta(hours=2)), us(now))
decode_from = top.arrival_ts_us + (top.e2e_ms - top.decode_ms - top.tail_ms) * 1000
for st in steps:  # the steps it decoded in, a neighbour's prefill in some of them
    if st.replica == top.replica and decode_from <= st.ts_us <= decode_from + top.decode_ms * 1000:
        st.member_traces = [top.trace_id, base[st.step % 50].trace_id]
        st.member_prefill = [0, st.prefill_tokens]
        st.member_decode = [1, 0]
s.insert_rows("engine_steps", steps)
print(top.trace_id)
s.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().splitlines()[-1]


def shoot(chromium: str, url: str, png: Path, height: int = 1600) -> None:
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", f"--user-data-dir={tempfile.mkdtemp()}",
            f"--window-size=1400,{height}", "--virtual-time-budget=20000"]
    subprocess.run([*args, "--dump-dom", url], capture_output=True, timeout=120)  # warm-up
    subprocess.run([*args, f"--screenshot={png}", url], capture_output=True, timeout=120,
                   check=True)


def main() -> int:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 1
    dsn = f"chdb://{tempfile.mkdtemp(prefix='tailscope-shots-')}/store"
    trace_id = seed(dsn)
    port = free_port()
    env = {**os.environ, "TAILSCOPE_DRILL_SOURCE": dsn}
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run",
                             str(ROOT / "dashboards" / "drill.py"), "--server.port", str(port),
                             "--server.headless", "true", "--browser.gatherUsageStats", "false"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx

        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/_stcore/health", timeout=2).text == "ok":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        OUT.mkdir(parents=True, exist_ok=True)
        shoot(chromium, f"{base}/?page=Overview", OUT / "warm-up.png")  # the first session
        (OUT / "warm-up.png").unlink(missing_ok=True)  # is slow: imports, caches, the store
        for name, query, height in (
                ("overview", "page=Overview", 1600), ("regression", "page=Regression", 1600),
                ("trace", f"page=Requests&trace={trace_id}", 3000)):  # with its waterfall
            png = OUT / f"{name}.png"
            for _ in range(4):  # a page caught while still rendering is a tiny, blank PNG
                shoot(chromium, f"{base}/?{query}", png, height)
                if png.stat().st_size > 40_000:
                    break
            print(f"wrote {png.relative_to(ROOT)} ({png.stat().st_size // 1024} KB)")
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
