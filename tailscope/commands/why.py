"""``tailscope why``: why one request was slow."""

from __future__ import annotations

import argparse
import sys

from tailscope.commands.common import (
    _store_target,
)
from tailscope.settings import Settings


def cmd_why(args: argparse.Namespace) -> int:
    """Why a request was slow: its slowest gaps and the steps and neighbours inside them."""
    from tracing import queries as Q
    from tracing.why import why

    s = Settings.from_env()
    kind, target = _store_target(args, s)
    source = Q.GatewaySource(target, s.admin_key or None) if kind == "gateway" else target
    try:
        gaps, sentence = why(source, args.trace_id, top=args.top)
    except Q.QueryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(sentence)
    if not gaps.empty:
        shown = gaps.assign(neighbours=[", ".join(f"{t[:12]}…:{p}" for t, p in n.items())
                                        for n in gaps["neighbours"]])
        print(shown.to_string(index=False, float_format=lambda x: f"{x:.1f}"))
    return 0


def add_parser(sub) -> None:
    w = sub.add_parser("why", help="why a request was slow: its slowest gaps, the engine steps "
                                   "and the other requests (and tenants) inside them")
    w.add_argument("trace_id", help="the slow request's trace id")
    w.add_argument("--top", type=int, default=5, help="how many of its slowest gaps")
    w.add_argument("--url", help="a gateway to go through (default: the running one, if any)")
    w.add_argument("--dsn", help="store DSN (default TAILSCOPE_STORE_DSN)")
    w.set_defaults(func=cmd_why)
