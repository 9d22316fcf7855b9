"""``tailscope drill``: the Streamlit drill-down."""

from __future__ import annotations

import argparse
import os
import sys

from tailscope.settings import Settings


def cmd_drill(args: argparse.Namespace) -> int:
    """Serve the Streamlit drill-down on a data source (default: the running gateway)."""
    import importlib.util

    s = Settings.from_env()
    source = args.source or (f"gateway:{args.url or s.gateway_url}")
    # the app's file, found where the package is installed (not imported: Streamlit runs it)
    app = importlib.util.find_spec("dashboards.drill").origin
    env = {**os.environ, "TAILSCOPE_DRILL_SOURCE": source}
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.port", str(args.port),
           "--server.address", args.host, "--server.headless", "true",
           "--browser.gatherUsageStats", "false"]
    print(f"drill-down on {source}: http://{args.host}:{args.port}", file=sys.stderr)
    sys.stderr.flush()
    # this process becomes Streamlit: a signal that stops `tailscope drill` stops the server,
    # with no child left behind
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def add_parser(sub) -> None:
    dr = sub.add_parser("drill", help="serve the Streamlit p99 drill-down")
    dr.add_argument("--source", help="chdb:///path or http(s)://host:8123 DSN, or "
                                     "gateway:URL (default: the gateway at TAILSCOPE_GATEWAY_URL)")
    dr.add_argument("--url", help="the gateway to read through (shorthand for gateway:URL)")
    dr.add_argument("--host", default="127.0.0.1", help="listen address")
    dr.add_argument("--port", type=int, default=8501, help="listen port")
    dr.set_defaults(func=cmd_drill)
