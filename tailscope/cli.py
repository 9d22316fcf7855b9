"""``tailscope`` command line. Thin: parses arguments and calls into the packages.

The commands live in ``tailscope.commands``, one module each: ``add_parser`` declares its
arguments and ``cmd_*`` runs it.
"""

from __future__ import annotations

import argparse
import sys

from tailscope import __version__
from tailscope.commands import (
    bench,
    drill,
    generate,
    replay,
    replica_key,
    serve,
    store,
    whatif,
    why,
)
from tailscope.commands import eval as eval_suites
from tailscope.commands.common import add_engine_flags, engine_config  # noqa: F401 (re-exported)
from tailscope.commands.serve import cors_origins  # noqa: F401 (re-exported)

COMMANDS = (generate, serve, store, why, whatif, replay, replica_key, drill, bench, eval_suites)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tailscope", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"tailscope {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
