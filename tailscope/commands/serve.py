"""``tailscope serve``: the gateway and its replicas."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from tailscope import env
from tailscope.commands.common import (
    add_engine_flags,
    engine_config,
)
from tailscope.settings import Settings


def cors_origins(setting: str) -> tuple[str, ...]:
    """TAILSCOPE_CORS_ORIGINS as origins: "*", or each a scheme and host (and port), as a
    browser sends its ``Origin`` header; anything else (a path, no scheme) is refused, since
    it would never match and CORS would silently stay off."""
    out = tuple(o.strip().rstrip("/") for o in setting.split(",") if o.strip())
    for o in out:
        scheme, sep, rest = o.partition("://")
        if o != "*" and (not sep or scheme not in ("http", "https") or not rest
                         or "/" in rest):
            raise ValueError(f"TAILSCOPE_CORS_ORIGINS: {o!r} is not an origin (\"*\" or "
                             "scheme://host[:port], e.g. http://localhost:3000)")
    return out


def instance_id(setting: str, port: int) -> str:
    """``TAILSCOPE_INSTANCE_ID``: "auto" is this host's name and the gateway's port, unique
    among gateways on one network; anything else is taken as given."""
    if setting.strip().lower() == "auto":
        import socket

        return f"{socket.gethostname()}:{port}"
    return setting.strip()


def remote_replicas(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``ID=tcp://HOST:PORT`` items (``--remote-replica``, ``TAILSCOPE_REMOTE_REPLICAS``)."""
    out = []
    for item in items:
        rid, sep, addr = item.strip().partition("=")
        if not sep or not rid or not addr.startswith("tcp://"):
            raise ValueError(f"remote replica {item!r}: expected ID=tcp://HOST:PORT")
        out.append((rid, addr))
    if len({rid for rid, _ in out}) != len(out):
        raise ValueError("remote replica ids must be unique")
    return tuple(out)




def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from gateway.app import GatewayConfig, create_app, prepare_replicas
    from tracing.store_server import uvicorn_server

    os.umask(0o077)  # the store, spool, records and key-id secret are readable by us alone
    s = Settings.from_env()
    file = None
    if args.engine_config:
        from tailscope.engine_config import ConfigFileError, load

        try:
            file = load(args.engine_config)
        except ConfigFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        s = replace(s, model=file.model or s.model)
    s = replace(s, model=args.model or s.model)
    # precedence: command-line flag > config file > environment > default
    engine = engine_config(args, file.engine if file else {})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    served = args.served_model_name or (file and file.served_model_name) \
        or "SmolLM2-135M-Instruct"
    from gateway.upstream_config import UpstreamConfig

    try:
        backends = (*(file.backends if file else ()),
                    *(UpstreamConfig.parse_flag(b) for b in args.backend or []))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        remote = remote_replicas([*filter(None, s.remote_replicas.split(",")),
                                  *(args.remote_replica or [])])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:  # a config the gateway refuses (e.g. one model name served twice) is an error
        config = GatewayConfig.from_settings(
            s, tokenizer=args.tokenizer, served_model_name=served,
            replicas=args.replicas if args.replicas is not None
            else (file and file.replicas) or (0 if remote else 1),
            engine=engine, tenants_file=args.config or s.config or None,
            max_inflight_per_replica=args.max_inflight,
            queue_timeout_s=(args.queue_timeout if args.queue_timeout is not None
                             else s.queue_timeout_s) or None,
            records_jsonl=args.records_jsonl or s.records_jsonl or None,
            fault_store_down_file=env.fault_store_down_file(),
            sampling_defaults=file.sampling_defaults if file else {},
            sampling_overrides=file.sampling_overrides if file else {},
            config_name=file.name if file else "", backends=backends, freeze_gc=True,
            instance_id=instance_id(s.instance_id, args.port), remote_replicas=remote,
            cors_origins=cors_origins(s.cors_origins))
        if args.prepare_only:
            return prepare_replicas(config)
        app = create_app(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "::1", "localhost") and not (args.config or s.config):
        logging.getLogger("tailscope").warning(
            "open local mode on %s: anyone who reaches port %d can generate (configure "
            "tenants with --config); /debug/* answer %s", args.host, args.port,
            "the admin key" if s.admin_key else "loopback clients only")
    # uvicorn waits for in-flight requests before it stops: on the signal, stop what only waits
    # on the store (a long /debug/query) at once instead of up to its time limit
    try:
        uvicorn_server(app, app.state.on_exit_signal, host=args.host, port=args.port,
                       log_level="info", access_log=args.access_log).run()
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn has shut down gracefully (requests finished, records drained, the
        # replicas and the store child stopped) and raises the signal again once done, which
        # surfaced as a KeyboardInterrupt traceback; exit as an interrupted program does
        return 130
    return 0


def add_parser(sub) -> None:
    sv = sub.add_parser("serve", help="start the OpenAI-compatible gateway and its replicas")
    sv.add_argument("--host", default="127.0.0.1", help="listen address")
    sv.add_argument("--port", type=int, default=8000, help="listen port")
    sv.add_argument("--model", help="'bundled' (default), a .gguf file, an HF dir, or tiny:<vocab>")
    sv.add_argument("--tokenizer", help="tokenizer: an HF directory, a GGUF file or `bundled` "
                    "(defaults to the model's)")
    sv.add_argument("--served-model-name", help="default SmolLM2-135M-Instruct")
    sv.add_argument("--replicas", type=int, help="replica processes (default 1; 0 with remote "
                    "replicas)")
    sv.add_argument("--remote-replica", action="append", metavar="ID=tcp://HOST:PORT",
                    help="a replica on another host, by its inbox (repeatable; needs "
                         "TAILSCOPE_REPLICA_OUTBOX and TAILSCOPE_REPLICA_KEY)")
    sv.add_argument("--engine-config", metavar="FILE",
                    help="YAML: model, engine settings and sampling policy (evals/configs/)")
    add_engine_flags(sv)
    sv.add_argument("--backend", action="append", metavar="NAME=URL[,key=value...]",
                    help="an external OpenAI-compatible server as a recorded replica "
                         "(repeatable); keys: model (default NAME), upstream_model, "
                         "api_key_env, max_concurrency, connect_timeout_s, "
                         "first_byte_timeout_s, idle_timeout_s, eject_after, eject_s, "
                         "probe_interval_s (gateway.upstream_config.UpstreamConfig)")
    sv.add_argument("--config", help="TOML file with [[tenants]] (API keys and limits)")
    sv.add_argument("--max-inflight", type=int,
                    help="in-flight requests per replica before new ones get 503 "
                         "(default 4 x max_num_seqs)")
    sv.add_argument("--queue-timeout", type=float, metavar="S",
                    help="seconds a request may wait in an engine queue before it ends "
                         "TIMED_OUT with 504 (default 60; 0 = no limit)")
    sv.add_argument("--records-jsonl", metavar="FILE",
                    help="append every request's trace record to FILE as JSON lines")
    sv.add_argument("--access-log", action="store_true", help="uvicorn's per-request log")
    sv.add_argument("--prepare-only", action="store_true",
                    help="build what the local replicas need at their start (kernels; with "
                         "compile: true the compiled decode step) into the caches, then exit "
                         "without serving (a deploy step or init container)")
    sv.set_defaults(func=cmd_serve)
