"""``tailscope store``: query the trace store, delete a tenant's rows, create the schema,
serve an embedded store."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tailscope.commands.common import (
    _admin_headers,
    _param,
    _query_limits,
    _store_target,
)
from tailscope.settings import Settings


def _store_init(args: argparse.Namespace, s: Settings) -> int:
    """``tailscope store init [--cluster NAME]``: the tables as DDL (``--print``) or applied."""
    from tracing import cluster as C
    from tracing.store import Store, StoreError, normalise_dsn

    dsn = normalise_dsn(args.dsn or s.store_dsn)
    if args.cluster is None:
        if args.print:
            from tracing.schema import MIGRATIONS

            for _, _, statements in MIGRATIONS:
                for stmt in statements:
                    print(stmt.rstrip() + ";\n")
            return 0
        try:
            store = Store(dsn)
            print(f"applied migrations {store.migrate() or 'none (up to date)'} on {dsn}")
        except StoreError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        statements = C.ddl(args.cluster, args.shard_by)
        if not args.print:
            if not dsn.startswith(("http://", "https://")):
                print("error: --cluster applies to a ClickHouse server (http(s):// DSN); an "
                      "embedded store is one node (--print shows the DDL)", file=sys.stderr)
                return 2
            try:
                statements = C.apply(Store(dsn), args.cluster, args.shard_by)
            except Exception as exc:  # the server's own error (no such cluster, Keeper down)
                print(f"error: {str(exc).strip().splitlines()[0][:500]}", file=sys.stderr)
                return 1
            print(f"applied {len(statements)} statements on cluster {args.cluster} via {dsn}")
            return 0
    except (ValueError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for stmt in statements:
        print(stmt.rstrip() + ";\n")
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    import httpx


    s = Settings.from_env()
    if args.store_command == "serve":
        import logging

        from tracing.store import StoreError, is_embedded, normalise_dsn
        from tracing.store_server import serve

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        os.umask(0o077)
        dsn = normalise_dsn(args.dsn or s.store_dsn)
        if not is_embedded(dsn):
            print(f"error: a store process serves an embedded store (chdb://...), not {dsn}; "
                  "gateways reach a ClickHouse server directly", file=sys.stderr)
            return 2
        if args.host not in ("127.0.0.1", "::1", "localhost") and not s.store_key:
            print("error: set TAILSCOPE_STORE_KEY to serve the store beyond loopback",
                  file=sys.stderr)
            return 2
        try:
            serve(dsn, args.host, args.port, s.store_key or None, args.parent_pid,
                  _query_limits(s), args.inbox)
        except StoreError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.store_command == "init":
        return _store_init(args, s)
    kind, target = _store_target(args, s)
    if args.store_command == "query":
        params = dict(_param(p) for p in args.param or [])
        if kind == "gateway":
            r = httpx.post(f"{target}/debug/query", json={"sql": args.sql, "params": params},
                           headers=_admin_headers(s), timeout=120)
            if r.status_code != 200:
                print(f"error: {r.json().get('error', {}).get('message', r.text)}",
                      file=sys.stderr)
                return 1
            cols, rows = r.json()["columns"], r.json()["rows"]
        else:
            cols, rows = target.select(args.sql, params)
        if args.format == "json":
            for row in rows:
                print(json.dumps(dict(zip(cols, row, strict=True)), default=str))
        else:
            print("\t".join(cols))
            for row in rows:
                print("\t".join(str(v) for v in row))
        return 0
    if args.store_command == "delete":
        if kind == "gateway":
            r = httpx.delete(f"{target}/debug/tenants/{args.tenant}/records",
                             headers=_admin_headers(s), timeout=120)
            if r.status_code != 200:
                print(f"error: {r.text}", file=sys.stderr)
                return 1
            n = r.json()["deleted_requests"]
        else:
            n = target.delete_tenant(args.tenant)
        print(f"deleted {n} request rows of tenant {args.tenant!r} (and their events)")
        return 0
    return 2


def add_parser(sub) -> None:
    st = sub.add_parser("store", help="query the trace store or delete a tenant's rows")
    st.add_argument("--url", help="a gateway to go through (default: the running one, if any)")
    st.add_argument("--dsn", help="store DSN (default TAILSCOPE_STORE_DSN)")
    sst = st.add_subparsers(dest="store_command", required=True)
    q = sst.add_parser("query", help="run one read-only SELECT")
    q.add_argument("sql", help="one SELECT; {name:Type} placeholders bound by --param")
    q.add_argument("--param", action="append", metavar="NAME=VALUE",
                   help="bind {NAME:Type} in the SQL (repeatable)")
    q.add_argument("--format", choices=["table", "json"], default="table", help="output form")
    d = sst.add_parser("delete", help="delete every stored row of a tenant")
    d.add_argument("--tenant", required=True, help="whose rows and events to delete")
    si = sst.add_parser("init", help="create or upgrade the store's tables (--cluster: on a "
                                     "ClickHouse cluster, ReplicatedMergeTree + Distributed)")
    si.add_argument("--cluster", metavar="NAME", help="the cluster in the servers' "
                    "remote_servers config; ON CLUSTER DDL")
    si.add_argument("--shard-by", choices=["instance", "trace"], default="instance",
                    help="the sharding key of requests, events and steps "
                         "(docs/guides/scaling-out.md)")
    si.add_argument("--print", action="store_true", help="print the DDL; apply nothing")
    ss = sst.add_parser("serve", help="own an embedded (chDB) store and serve it to several "
                                      "gateways (their TAILSCOPE_STORE_DSN=tailscope://HOST:PORT)")
    ss.add_argument("--host", default="127.0.0.1", help="listen address")
    ss.add_argument("--port", type=int, default=8124, help="listen port")
    ss.add_argument("--parent-pid", type=int, help="exit when this process is gone (a gateway "
                    "running its store as a child passes its own pid)")
    ss.add_argument("--inbox", help="a directory from which it inserts Arrow files that clients "
                    "on this host hand over by name instead of sending them (a gateway "
                    "running its store as a child passes a private one)")
    st.set_defaults(func=cmd_store)
