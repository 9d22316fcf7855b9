"""The cluster DDL (``tailscope store init --cluster``), as far as one machine allows: every
statement parses in ClickHouse's own parser (chDB's ``formatQuery``), the local tables with the
replication taken out are column for column the single-node tables the writer and the query
library run on, and a later migration has a cluster form for both tables. What cannot run
here (``ON CLUSTER``, ``ReplicatedMergeTree``, ``Distributed``: chDB has no cluster) is listed
in docs/guides/scaling-out.md."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.tracing.test_store import engine_settings
from tracing import cluster as C
from tracing.schema import MIGRATIONS, TABLES


def parses(store, sql: str) -> str:
    return store.client.query("SELECT formatQuery({q:String})",
                              parameters={"q": sql}).result_rows[0][0]


@pytest.mark.parametrize("shard_by", sorted(C.SHARD_BY))
def test_every_cluster_statement_parses(store, shard_by):
    statements = C.ddl("prod-eu", shard_by)
    assert len(statements) == 3 + 2 * len(TABLES) + 1
    for sql in statements:
        canonical = parses(store, sql)
        assert "ON CLUSTER `prod-eu`" in canonical or canonical.startswith("INSERT"), canonical
    dist = {re.search(r"tailscope\.(\w+) ON CLUSTER", s)[1]: s for s in statements
            if "Distributed(" in s}
    assert set(dist) == {*TABLES, "schema_migrations"}
    # a request's record and events always shard together
    key = {n: re.search(r", (cityHash64\(\w+\))\)$", dist[n])[1] for n in TABLES}
    assert key["requests"] == key["request_events"]
    if shard_by == "instance":  # ... and with them its replica's steps
        assert key["engine_steps"] == key["requests"] == "cityHash64(instance)"
    with pytest.raises(ValueError):
        C.ddl("prod; DROP TABLE x")


def _single_node(sql: str) -> str | None:
    """The statement with replication and the cluster taken out; None for the distributed
    layer and the migration marks."""
    if "Distributed(" in sql or sql.startswith("INSERT"):
        return None
    sql = re.sub(r" ON CLUSTER \S+", "", sql)
    sql = re.sub(r"Replicated(\w*)MergeTree\('[^']*', '[^']*'\)", r"\1MergeTree", sql)
    sql = sql.replace("replicated_deduplication_window", "non_replicated_deduplication_window")
    return sql.replace("tailscope.", "single_node.")


def test_the_local_tables_are_the_single_node_tables(store):
    store.command("CREATE DATABASE IF NOT EXISTS single_node")
    for sql in C.ddl("prod"):
        local = _single_node(sql)
        if local and not local.startswith("CREATE DATABASE"):
            store.command(local)

    def describe(db: str, table: str) -> dict[str, str]:  # (the writer names its columns)
        return {r[0]: (r[1], r[5]) for r in store.client.query(  # type, codec
            f"DESCRIBE TABLE {db}.{table}").result_rows}

    def settings(db: str, table: str) -> set[str]:
        return engine_settings(store, db, table)[1]

    for name in TABLES:
        assert describe("single_node", f"{name}_local") == describe("tailscope", name), name
        # the same MergeTree settings too (the merge selector's base on the writer's tables)
        assert settings("single_node", f"{name}_local") == settings("tailscope", name), name


def test_a_later_migration_has_a_cluster_form_for_both_tables(store):
    # 17 adds a column: on the local and the distributed table alike
    last = 17
    statements = C.migrations("prod", {v for v, _, _ in MIGRATIONS} - {last})
    alters = [s for s in statements if s.startswith("ALTER")]
    assert alters and len(alters) == 2 * len(MIGRATIONS[last - 1][2])
    altered = {re.search(r"tailscope\.(\w+) ADD", s)[1] for s in MIGRATIONS[last - 1][2]}
    assert {re.search(r"tailscope\.(\w+) ON", s)[1] for s in alters} == altered | {
        f"{t}_local" for t in altered}
    assert statements[-1].startswith("INSERT INTO tailscope.schema_migrations") \
        and f"({last}," in statements[-1]
    for sql in statements:
        parses(store, sql)
    # 18 changes codecs: only the local tables store data
    statements = C.migrations("prod", {v for v, _, _ in MIGRATIONS} - {18})
    alters = [s for s in statements if s.startswith("ALTER")]
    assert len(alters) == len(MIGRATIONS[17][2]) == 8
    assert all(re.match(r"ALTER TABLE tailscope\.\w+_local ON CLUSTER prod MODIFY COLUMN \w+ "
                        r"CODEC\(", s) for s in alters), alters
    for sql in statements:
        parses(store, sql)
    # 19 sets a MergeTree setting: the local tables' too
    statements = C.migrations("prod", {v for v, _, _ in MIGRATIONS} - {19})
    alters = [s for s in statements if s.startswith("ALTER")]
    assert [re.match(r"ALTER TABLE tailscope\.(\w+)_local ON CLUSTER prod MODIFY SETTING "
                     r"merge_selector_base = 50$", s)[1] for s in alters] == [
        "requests", "request_events", "engine_steps"], alters
    for sql in statements:
        parses(store, sql)
    assert C.migrations("prod", {v for v, _, _ in MIGRATIONS}) == []  # up to date: nothing
    # a migration that created a table becomes that table's pair
    created = C.migrations("prod", {v for v, _, _ in MIGRATIONS} - {14})
    assert any("whatif_runs_local" in s and "ReplicatedMergeTree" in s for s in created)


def test_store_init_prints_the_cluster_ddl():
    out = subprocess.run([sys.executable, "-m", "tailscope.cli", "store", "init", "--cluster",
                          "prod", "--print"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ENGINE = Distributed(prod, tailscope,") == len(TABLES) + 1
