"""The generated Grafana dashboard: committed JSON is what the generator makes now, and every
panel's SQL (plugin macros and variables expanded) runs on chDB and returns what its panel
type needs."""

from __future__ import annotations

import datetime as dt
import re
import urllib.parse

import pytest

from dashboards import grafana
from tracing.seed import synthetic_records, synthetic_steps

NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)
FROM, TO = NOW - dt.timedelta(hours=4, minutes=30), NOW - dt.timedelta(hours=3, minutes=30)


def us(t: dt.datetime) -> int:
    return int(t.timestamp() * 1e6)


@pytest.fixture(scope="module")
def seeded(store):
    recs = synthetic_records(400, us(FROM), us(TO), seed=11, config_id="cfg-g")
    for i, r in enumerate(recs[::10]):  # some name their end user (characters to escape too)
        r.end_user = "ann@example.com" if i % 2 else "bo'b \\ ü"
    store.insert_rows("requests", recs)
    store.insert_rows("engine_steps", synthetic_steps(us(FROM), us(TO), replicas=("g0", "g1")))
    return store, recs


def expand(sql: str, values: dict[str, list[str]], interval_s: int = 60,
           slo: tuple[str, str] = ("500", "50"), end_user: str = "") -> str:
    """What the ClickHouse plugin sends for a time range, an interval and the variables."""
    frm, to = FROM.strftime("%Y-%m-%d %H:%M:%S"), TO.strftime("%Y-%m-%d %H:%M:%S")
    sql = re.sub(r"\$__timeFilter\((\w+)\)",
                 lambda m: f"{m[1]} >= toDateTime('{frm}', 'UTC') AND "
                           f"{m[1]} <= toDateTime('{to}', 'UTC')", sql)
    sql = re.sub(r"\$__timeInterval\((\w+)\)",
                 lambda m: f"toStartOfInterval({m[1]}, INTERVAL {interval_s} second)", sql)
    sql = sql.replace("$__interval_s", str(interval_s))
    sql = re.sub(r"\$\{(\w+):singlequote\}",
                 lambda m: ",".join(f"'{v}'" for v in values[m[1]]), sql)
    for name, typed in zip(("ttft_slo", "tpot_slo"), slo, strict=True):  # Grafana's encoding
        sql = sql.replace(f"${{{name}:percentencode}}", urllib.parse.quote(typed, safe=""))
    sql = sql.replace("${end_user:percentencode}", urllib.parse.quote(end_user, safe=""))
    assert "$" not in sql, sql
    return sql


def test_committed_files_are_what_the_generator_makes():
    for path, text in grafana.render().items():
        assert path.exists(), f"{path} is missing: run python -m dashboards.grafana"
        assert path.read_text() == text, f"{path} is stale: run python -m dashboards.grafana"


def test_dashboard_has_the_variables_and_a_trace_link():
    d = grafana.build()
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["ds", "instance", "replica", "model", "config_id", "tenant", "end_user",
                     "ttft_slo", "tpot_slo"]
    assert all(t["datasource"]["type"] == grafana.PLUGIN for p in d["panels"]
               for t in p["targets"])
    links = [lk for p in d["panels"] for lk in p["fieldConfig"]["defaults"].get("links", [])]
    assert any("trace=${__data.fields.trace_id}" in lk["url"] for lk in links)


@pytest.mark.parametrize("panel", grafana.PANELS, ids=lambda p: p.title[:40])
def test_every_panel_query_runs_and_fits_its_panel(seeded, panel):
    store, recs = seeded
    values = {"instance": [""], "replica": ["r0", "r1", "g0", "g1"],
              "model": ["SmolLM2-135M-Instruct"], "config_id": ["cfg-g"],
              "tenant": ["acme", "globex"]}
    cols, rows = store.select(expand(panel.sql, values))
    assert rows, f"{panel.title}: no rows on the seeded store"
    if panel.kind == "timeseries":
        assert cols[0] == "time"
        assert all(isinstance(r[0], dt.datetime) for r in rows)
        numeric = [i for i, c in enumerate(cols[1:], 1)
                   if all(isinstance(r[i], int | float) for r in rows)]
        assert numeric, f"{panel.title}: no numeric column in {cols}"
    else:
        assert len(cols) >= 2
    if panel.link_trace:
        assert cols[0] == "trace_id" and rows[0][0] in {r.trace_id for r in recs}


def test_slo_text_boxes_cannot_inject_sql(seeded):
    store, _ = seeded
    panel = next(p for p in grafana.PANELS if p.title.startswith("SLO attainment"))
    values = {"instance": [""], "replica": ["g0", "g1"], "model": ["SmolLM2-135M-Instruct"],
              "config_id": ["cfg-g"], "tenant": ["acme", "globex"]}
    honest = store.select(expand(panel.sql, values, slo=("0", "0")))[1]
    for evil in ("0') OR 1=1 OR ('", "0\\') OR 1=1 --", "1e9 OR 1=1"):
        # the typed text stays one string literal: not a number, so the SLO reads as 0
        assert store.select(expand(panel.sql, values, slo=(evil, evil)))[1] == honest


def test_the_end_user_box_filters_every_request_panel_and_cannot_inject_sql(seeded):
    """Typed text is compared whole with the record's end_user (special characters too);
    blank is every request; text built to break out of the literal matches nothing."""
    store, recs = seeded
    panel = next(p for p in grafana.PANELS if p.title.startswith("Slowest requests"))
    values = {"instance": [""], "replica": ["r0", "r1", "g0", "g1"],
              "model": ["SmolLM2-135M-Instruct"], "config_id": ["cfg-g"],
              "tenant": ["acme", "globex"]}

    def traces(end_user: str) -> set[str]:
        sql = expand(panel.sql, values, end_user=end_user).replace("LIMIT 50", "LIMIT 1000")
        return {r[0] for r in store.select(sql)[1]}

    for who in ("ann@example.com", "bo'b \\ ü"):
        want = {r.trace_id for r in recs if r.end_user == who}
        assert want and traces(who) == want, who
    assert len(traces("")) == len(recs)
    for evil in ("' OR 1=1 OR '", "\\' OR 1=1 --", "ann@example.com' OR '1'='1"):
        assert traces(evil) == set()
