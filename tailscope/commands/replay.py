"""``tailscope replay``: run a recorded request again and say whether it came out the same."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tailscope.commands.common import (
    _store_target,
)
from tailscope.settings import Settings


def cmd_replay(args: argparse.Namespace) -> int:
    """Run a recorded request again and report whether it came out the same (tracing.replay).

    The record comes from ``--source`` (a gateway), else ``--url`` when that gateway has it,
    else the running gateway, else the store.
    It runs on ``--url``, or on a gateway started with ``--engine-config FILE``, or (neither)
    on the source gateway when it runs the recorded config_id, else on one started with the
    recorded config (the store's ``configs`` table)."""
    import asyncio

    import httpx

    from tracing import replay as R

    if not 1 <= args.n <= 64 or not 0 <= args.background <= 16:
        print("error: --n must be in [1, 64] and --background in [0, 16]", file=sys.stderr)
        return 2
    s = Settings.from_env()
    try:
        record, kind, source = _record(args, s)
        R.replay_params(record)  # refuse now, before starting anything
        url, gateway, workdir = _target(args, s, record, kind, source)
    except (LookupError, R.ReplayRefused, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        target = httpx.get(f"{url}/debug/config", timeout=30).json()
        model = target["config"]["served_model_name"]
        rep = asyncio.run(R.replay(url, record, model, args.n, args.background,
                                   args.api_key or None, s.admin_key or None))
    finally:
        if gateway is not None:
            gateway.stop()
        if workdir is not None:
            workdir.cleanup()
    rep["replayed_on_config_id"] = target.get("config_id")
    print(json.dumps(rep, indent=2) if args.json else R.render(rep))
    if rep["errors"]:
        return 2
    return 0 if rep["identical"] else 1


def _record(args: argparse.Namespace, s: Settings) -> tuple[dict, str, str]:
    """(the record, the kind of its source, the source): ``--source``, else ``--url`` when
    that gateway holds it, else the running gateway or the store."""
    import httpx

    from tracing import replay as R

    record = None
    if args.source:
        kind, source = "gateway", args.source.rstrip("/")
    elif args.url:  # the gateway it is to run on most often holds the record too
        kind, source = "gateway", args.url.rstrip("/")
        try:
            record = R.fetch_record(source, args.trace_id, s.admin_key or None)
        except (LookupError, httpx.HTTPError):
            record = None
    if record is None and not args.source:
        kind, source = _store_target(argparse.Namespace(url=None, dsn=args.dsn), s)
    if record is None:
        record = R.fetch_record(source, args.trace_id, s.admin_key or None)
    return record, kind, source


def _target(args: argparse.Namespace, s: Settings, record: dict, kind: str, source: str):
    """(the gateway URL to replay on, the gateway started for it or None, its directory or
    None); a ``RuntimeError`` says why none can be had."""
    import tempfile

    import httpx

    from tracing import replay as R
    from tracing.client import GatewayProcess, GatewayStartError

    if args.url is not None:
        return args.url, None, None
    if args.engine_config is None and kind == "gateway":
        cfg = httpx.get(f"{source}/debug/config", timeout=30).json()
        if cfg.get("config_id") == record.get("config_id"):
            return source, None, None
    config_file = args.engine_config
    workdir = tempfile.TemporaryDirectory(prefix="tailscope-replay-")
    if config_file is None:
        config = R.fetch_config(source, record.get("config_id", ""), s.admin_key or None)
        if config is None:
            workdir.cleanup()
            raise RuntimeError(f"config {record.get('config_id')!r} is not in the configs "
                               "table; pass --url (a gateway running it) or --engine-config "
                               "FILE")
        config_file = os.path.join(workdir.name, "recorded.yaml")
        with open(config_file, "w") as f:
            f.write(R.config_file_text(config))
    # a gateway of its own: its own store, open local mode, no engine settings from the env
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TAILSCOPE_") or k == "TAILSCOPE_THREADS"}
    env["TAILSCOPE_STORE_DSN"] = f"chdb://{os.path.join(workdir.name, 'store')}"
    print(f"starting a gateway with {config_file} ...", file=sys.stderr)
    gateway = GatewayProcess(["--engine-config", config_file], env, quiet=True)
    try:
        gateway.start()
    except GatewayStartError as exc:
        workdir.cleanup()
        raise RuntimeError(str(exc)) from None
    return gateway.url, gateway, workdir


def add_parser(sub) -> None:
    rp = sub.add_parser("replay", help="run a recorded request again (same tokens, sampling "
                                       "and config) and report whether it came out the same")
    rp.add_argument("trace_id", help="the recorded request to run again")
    rp.add_argument("--url", help="run it on this gateway")
    rp.add_argument("--engine-config", metavar="FILE",
                    help="run it on a gateway started with this config (try another config)")
    rp.add_argument("--source", metavar="URL",
                    help="the gateway holding the record (default: --url when it holds it, else "
                         "the running one, else the store)")
    rp.add_argument("--dsn", help="store DSN to read the record from (default "
                                  "TAILSCOPE_STORE_DSN)")
    rp.add_argument("--n", type=int, default=1,
                    help="replay it this many times at once (batch invariance)")
    rp.add_argument("--background", type=int, default=0, metavar="K",
                    help="K streams of other traffic alongside the replays")
    rp.add_argument("--api-key", help="the target gateway's API key, when it has tenants")
    rp.add_argument("--json", action="store_true", help="the report as JSON")
    rp.set_defaults(func=cmd_replay)
