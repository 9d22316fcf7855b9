"""The store's tables on a ClickHouse cluster: ``tailscope store init --cluster NAME``.

Each table of ``tracing.schema.TABLES`` becomes two, both created ``ON CLUSTER``:

- ``<table>_local``, a ``ReplicatedMergeTree`` on every node (ClickHouse Keeper keeps each
  shard's replicas in step), with the single-node table's columns, partitioning, order, TTL and
  insert deduplication (``replicated_deduplication_window``: a spooled batch replayed with its
  token is still a no-op);
- ``<table>``, a ``Distributed`` table over them. The writer inserts into it and the query
  library reads from it under the same names as on one node, so neither changes.

More: docs/design/gateway-notes.md#tracingcluster."""

from __future__ import annotations

import re

from tracing.schema import DATABASE, MIGRATIONS, TABLES

SHARD_BY = {
    "instance": {"requests": "cityHash64(instance)", "request_events": "cityHash64(instance)",
                 "engine_steps": "cityHash64(instance)"},
    "trace": {"requests": "cityHash64(trace_id)", "request_events": "cityHash64(trace_id)",
              "engine_steps": "cityHash64(replica)"},
}
OTHER_KEYS = {"eval_runs": "cityHash64(run_id)", "eval_results": "cityHash64(run_id)",
              "bench_runs": "cityHash64(run_id)", "configs": "cityHash64(config_id)",
              "whatif_runs": "cityHash64(run_id)"}
_ALTER = re.compile(rf"^ALTER TABLE {DATABASE}\.(\w+) (.*)$", re.S)
# how a column is compressed and how parts are merged concern the tables that store them, not
# the Distributed table over them
_LOCAL_ONLY = re.compile(r"^(MODIFY COLUMN \w+ CODEC\(.*\)|MODIFY SETTING [\w =,]+)$", re.S)
_CREATE = re.compile(rf"^CREATE TABLE IF NOT EXISTS {DATABASE}\.(\w+) ", re.S)


def _ident(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", name):
        raise ValueError(f"cluster name {name!r}: letters, digits, '_' and '-' only")
    return f"`{name}`" if "-" in name else name


def table_pair(name: str, cluster: str, shard_by: str = "instance") -> list[str]:
    """The local replicated table and the distributed table over it."""
    t, c = TABLES[name], _ident(cluster)
    key = {**SHARD_BY[shard_by], **OTHER_KEYS}[name]
    cols = t.column_defs()
    local = (f"CREATE TABLE IF NOT EXISTS {DATABASE}.{name}_local ON CLUSTER {c} (\n"
             f"    {cols}\n)\n"
             f"ENGINE = ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{DATABASE}/"
             f"{name}_local', '{{replica}}')\n"
             f"PARTITION BY toDate({t.time_column})\nORDER BY ({t.order_by})\n"
             f"TTL toDateTime({t.time_column}) + toIntervalDay(ttl_days)\n"
             f"SETTINGS {t.settings('replicated_deduplication_window')}")
    dist = (f"CREATE TABLE IF NOT EXISTS {DATABASE}.{name} ON CLUSTER {c} "
            f"AS {DATABASE}.{name}_local\n"
            f"ENGINE = Distributed({c}, {DATABASE}, {name}_local, {key})")
    return [local, dist]


def _migrations_pair(cluster: str) -> list[str]:
    c = _ident(cluster)
    return [
        f"CREATE TABLE IF NOT EXISTS {DATABASE}.schema_migrations_local ON CLUSTER {c} "
        "(version UInt32, name String, applied_at DateTime64(6, 'UTC') DEFAULT now64(6)) "
        f"ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{{shard}}/{DATABASE}/"
        "schema_migrations_local', '{replica}') ORDER BY version",
        f"CREATE TABLE IF NOT EXISTS {DATABASE}.schema_migrations ON CLUSTER {c} AS "
        f"{DATABASE}.schema_migrations_local ENGINE = Distributed({c}, {DATABASE}, "
        "schema_migrations_local, version)"]


def _mark(versions: list[tuple[int, str]]) -> list[str]:
    if not versions:
        return []
    rows = ", ".join(f"({int(v)}, '{n.replace(chr(92), '').replace(chr(39), '')}')"
                     for v, n in versions)
    return [f"INSERT INTO {DATABASE}.schema_migrations (version, name) VALUES {rows}"]


def ddl(cluster: str, shard_by: str = "instance") -> list[str]:
    """A new cluster at today's schema: the database, every table pair, and every migration
    marked applied (the tables are created as declared now)."""
    if shard_by not in SHARD_BY:
        raise ValueError(f"shard_by {shard_by!r}: one of {', '.join(SHARD_BY)}")
    out = [f"CREATE DATABASE IF NOT EXISTS {DATABASE} ON CLUSTER {_ident(cluster)}",
           *_migrations_pair(cluster)]
    for name in TABLES:
        out += table_pair(name, cluster, shard_by)
    return out + _mark([(v, n) for v, n, _ in MIGRATIONS])


def migrations(cluster: str, applied: set[int], shard_by: str = "instance") -> list[str]:
    """The migrations not in ``applied``, in their cluster form, then their marks."""
    c, out, done = _ident(cluster), [], []
    for version, name, statements in MIGRATIONS:
        if version in applied:
            continue
        for stmt in statements:
            if m := _CREATE.match(stmt):
                out += table_pair(m[1], cluster, shard_by)
            elif (m := _ALTER.match(stmt)) and _LOCAL_ONLY.match(m[2]):
                out += [f"ALTER TABLE {DATABASE}.{m[1]}_local ON CLUSTER {c} {m[2]}"]
            elif m:
                out += [f"ALTER TABLE {DATABASE}.{m[1]}_local ON CLUSTER {c} {m[2]}",
                        f"ALTER TABLE {DATABASE}.{m[1]} ON CLUSTER {c} {m[2]}"]
            else:
                raise ValueError(f"migration {version} has a statement with no cluster form: "
                                 f"{stmt[:80]}")
        done.append((version, name))
    return out + _mark(done)


def apply(store, cluster: str, shard_by: str = "instance") -> list[str]:
    """Create the cluster's tables, or upgrade them: the statements run, in order. ``store``
    is a ``tracing.store.Store`` on one of the cluster's servers."""
    client = store.client
    have = client.query("SELECT count() FROM system.tables WHERE database = {d:String} AND "
                        "name = 'schema_migrations'", parameters={"d": DATABASE}
                        ).result_rows[0][0]
    if have:
        applied = {r[0] for r in client.query(
            f"SELECT version FROM {DATABASE}.schema_migrations").result_rows}
        statements = migrations(cluster, applied, shard_by)
    else:
        statements = ddl(cluster, shard_by)
    for stmt in statements:
        client.command(stmt)
    return statements
