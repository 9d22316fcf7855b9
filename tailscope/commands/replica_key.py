"""``tailscope replica-key``: a replica's own link key."""

from __future__ import annotations

import argparse
import sys

from tailscope import env


def cmd_replica_key(args: argparse.Namespace) -> int:
    """A replica's own link key, from the fleet key (``engine.link``): give that replica only
    this, so it cannot speak for another."""
    from engine.link import link_key
    from tailscope.keys import check_key

    _, fleet = env.replica_keys()
    try:
        if not fleet:
            raise ValueError("TAILSCOPE_REPLICA_KEY (the gateway's fleet key) is not set")
        check_key("TAILSCOPE_REPLICA_KEY", fleet)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(link_key(fleet.encode(), args.id).decode())
    return 0


def add_parser(sub) -> None:
    rk = sub.add_parser("replica-key", help="print a replica's own link key (set it as that "
                        "replica's TAILSCOPE_REPLICA_LINK_KEY) from TAILSCOPE_REPLICA_KEY")
    rk.add_argument("id", help="the replica's id, as the gateway names it (--remote-replica)")
    rk.set_defaults(func=cmd_replica_key)
