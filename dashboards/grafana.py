"""Grafana dashboards as code (grafana-foundation-sdk) over the ClickHouse trace store.

    python -m dashboards.grafana            # writes dashboards/grafana/dashboards/*.json

Every panel is a raw-SQL query for the ``grafana-clickhouse-datasource`` plugin, with its
macros (``$__timeFilter``, ``$__timeInterval``) and the dashboard variables (data source,
replica, model, config_id, tenant, SLO thresholds). The SDK has no ClickHouse query type, so
``ClickHouseQuery`` below is the plugin's query model (``rawSql``, ``editorType``,
``queryType``, ``format``). ``PANELS`` is the single list the generator and the tests read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import table, timeseries
from grafana_foundation_sdk.builders.common import StackingConfig
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardLinkType,
    DataSourceRef,
    VariableRefresh,
)

from tracing import timing

PLUGIN = "grafana-clickhouse-datasource"
DS = DataSourceRef(type_val=PLUGIN, uid="${ds}")
OUT = Path(__file__).resolve().parent / "grafana"
DRILL_URL = "http://localhost:8501"

# Filters every request panel applies: the time range and the variables ('All' = every value).
REQ_FILTER = ("$__timeFilter(arrival_ts) AND instance IN (${instance:singlequote}) AND replica "
              "IN (${replica:singlequote}) AND model IN (${model:singlequote}) AND config_id IN "
              "(${config_id:singlequote}) AND tenant IN (${tenant:singlequote}) AND "
              "('${end_user:percentencode}' = '' OR "
              "encodeURLComponent(end_user) = '${end_user:percentencode}')")
STEP_FILTER = ("$__timeFilter(ts) AND instance IN (${instance:singlequote}) AND replica IN "
               "(${replica:singlequote})")
# The SLO and end-user text boxes take anything a viewer types. Grafana's ``sqlstring`` format
# doubles quotes but leaves backslashes, which ClickHouse reads as escapes, so it cannot fence a
# value in;
# ``percentencode`` leaves nothing but [A-Za-z0-9._~%-] inside the quotes, and the number is
# parsed from there (text that is not a number reads as 0); the end user typed is compared
# with the column encoded the same way (ClickHouse's encodeURLComponent: the same bytes).
TTFT_SLO = "toFloat64OrZero('${ttft_slo:percentencode}')"
TPOT_SLO = "toFloat64OrZero('${tpot_slo:percentencode}')"


class ClickHouseQuery(cogvariants.Dataquery):
    """The plugin's query model (v4): raw SQL, as a time series or a table."""

    def __init__(self, ref_id: str, sql: str, kind: str) -> None:
        self.ref_id, self.sql, self.kind = ref_id, sql, kind

    def to_json(self) -> dict:
        return {"refId": self.ref_id, "datasource": DS.to_json(), "editorType": "sql",
                "queryType": self.kind, "format": 0 if self.kind == "timeseries" else 1,
                "rawSql": self.sql}


class ClickHouseQueryBuilder(cogbuilder.Builder[ClickHouseQuery]):
    def __init__(self, ref_id: str, sql: str, kind: str = "timeseries") -> None:
        self._internal = ClickHouseQuery(ref_id, sql, kind)

    def build(self) -> ClickHouseQuery:
        return self._internal


@dataclass(frozen=True)
class Panel:
    title: str
    sql: str
    kind: str = "timeseries"  # or "table"
    unit: str = "ms"
    stacked: bool = False
    link_trace: bool = False  # a data link from trace_id to the Streamlit trace view
    shows: str = ""  # its description: Grafana's info tooltip and the docs' panel reference


def _pct(metric: str, value: str) -> str:
    return (f"SELECT $__timeInterval(arrival_ts) AS time, replica, "
            f"quantile(0.5)({value}) AS p50, quantile(0.95)({value}) AS p95, "
            f"quantile(0.99)({value}) AS p99 FROM tailscope.requests "
            f"WHERE {REQ_FILTER} AND {metric} IS NOT NULL GROUP BY time, replica ORDER BY time")


PANELS: list[Panel] = [
    Panel("TTFT percentiles by replica", _pct("ttft_ms", "ttft_ms"),
          shows="p50/p95/p99 time to first token per replica"),
    Panel("TPOT percentiles by replica", _pct("tpot_ms", "tpot_ms"),
          shows="p50/p95/p99 time per output token per replica"),
    Panel("ITL percentiles by replica",
          "SELECT $__timeInterval(arrival_ts) AS time, replica, quantile(0.5)(gap) AS p50, "
          "quantile(0.95)(gap) AS p95, quantile(0.99)(gap) AS p99 FROM tailscope.requests "
          f"ARRAY JOIN itl_ms AS gap WHERE {REQ_FILTER} GROUP BY time, replica ORDER BY time",
          shows="p50/p95/p99 gap between content flushes per replica"),
    Panel("E2E percentiles by replica", _pct("e2e_ms", "e2e_ms"),
          shows="p50/p95/p99 end-to-end latency per replica"),
    Panel("Where the time goes (mean per request, stacked)",
          "SELECT $__timeInterval(arrival_ts) AS time, "
          + "".join(f"avg({s.column}) AS `{s.label}`, " for s in timing.STAGES)
          + f"avg(greatest(0, e2e_ms - {' - '.join(timing.E2E_STAGES)})) AS "
          f"`{timing.STREAMING.label}` FROM tailscope.requests WHERE {REQ_FILTER} "
          "GROUP BY time ORDER BY time", stacked=True,
          shows="mean stage durations per request"),
    Panel("Requests by finish reason (req/s)",
          "SELECT $__timeInterval(arrival_ts) AS time, finish_reason, count() / $__interval_s "
          f"AS rps FROM tailscope.requests WHERE {REQ_FILTER} GROUP BY time, finish_reason "
          "ORDER BY time", unit="reqps",
          shows="request rate by how requests ended"),
    Panel("Responses by HTTP status (req/s)",
          "SELECT $__timeInterval(arrival_ts) AS time, toString(http_status) AS status, "
          f"count() / $__interval_s AS rps FROM tailscope.requests WHERE {REQ_FILTER} "
          "GROUP BY time, status ORDER BY time", unit="reqps",
          shows="response rate by HTTP status"),
    Panel("Engine queue depth and running batch",
          "SELECT $__timeInterval(ts) AS time, replica, avg(waiting) AS waiting, "
          f"avg(running) AS running FROM tailscope.engine_steps WHERE {STEP_FILTER} "
          "GROUP BY time, replica ORDER BY time", unit="short",
          shows="waiting and running sequences per replica"),
    Panel("KV cache usage",
          "SELECT $__timeInterval(ts) AS time, replica, avg(kv_blocks_used / "
          f"kv_blocks_total) AS kv_usage FROM tailscope.engine_steps WHERE {STEP_FILTER} "
          "GROUP BY time, replica ORDER BY time", unit="percentunit",
          shows="share of KV blocks in use per replica"),
    Panel("Prefix-cache hit rate",
          "SELECT $__timeInterval(arrival_ts) AS time, if(sum(prompt_tokens) = 0, 0, "
          "sum(cached_tokens) / sum(prompt_tokens)) AS hit_rate FROM tailscope.requests "
          f"WHERE {REQ_FILTER} GROUP BY time ORDER BY time", unit="percentunit",
          shows="share of prompt tokens served from the prefix cache"),
    Panel("SLO attainment (TTFT <= $ttft_slo ms, TPOT <= $tpot_slo ms)",
          "SELECT $__timeInterval(arrival_ts) AS time, "
          f"countIf({timing.slo_sql(TTFT_SLO, TPOT_SLO)}) / count() AS attainment FROM "
          f"tailscope.requests WHERE {REQ_FILTER} GROUP BY time ORDER BY time",
          unit="percentunit",
          shows="share of requests within both targets"),
    Panel("Goodput (req/s within the SLO)",
          "SELECT $__timeInterval(arrival_ts) AS time, "
          f"countIf({timing.slo_sql(TTFT_SLO, TPOT_SLO)}) / $__interval_s AS goodput FROM "
          f"tailscope.requests WHERE {REQ_FILTER} GROUP BY time ORDER BY time", unit="reqps",
          shows="rate of requests within both targets"),
    Panel("TTFT p99 by tenant (one tenant's burst in another's tail?)",
          "SELECT $__timeInterval(arrival_ts) AS time, tenant, quantile(0.99)(ttft_ms) AS p99 "
          f"FROM tailscope.requests WHERE {REQ_FILTER} AND ttft_ms IS NOT NULL "
          "GROUP BY time, tenant ORDER BY time",
          shows="p99 TTFT per tenant"),
    Panel("Tail by priority and lane (scheduling policy; degraded admission)",
          "SELECT priority, lane, count() AS requests, quantile(0.5)(ttft_ms) AS ttft_p50, "
          "quantile(0.99)(ttft_ms) AS ttft_p99, quantile(0.99)(e2e_ms) AS e2e_p99, "
          "avg(engine_queue_ms) AS queue_ms, avg(wait_share_ms) AS fair_share_wait_ms, "
          f"countIf(degraded != '') AS degraded FROM tailscope.requests WHERE {REQ_FILTER} "
          "GROUP BY priority, lane ORDER BY priority, lane", kind="table",
          shows="latency and waits per priority and lane"),
    Panel("Errors and rejections by tenant",
          "SELECT tenant, countIf(final_state = 'REJECTED') AS rejected, countIf(final_state "
          "IN ('FAILED', 'TIMED_OUT')) AS errors, countIf(final_state = 'CANCELLED') AS "
          f"cancelled, count() AS requests FROM tailscope.requests WHERE {REQ_FILTER} "
          "GROUP BY tenant ORDER BY errors + rejected DESC", kind="table", unit="short",
          shows="rejected, failed and cancelled requests per tenant"),
    Panel("Slowest requests (click a trace id for its trace view)",
          "SELECT trace_id, arrival_ts, replica, tenant, final_state, ttft_ms, e2e_ms, "
          f"engine_queue_ms, prefill_ms, decode_ms FROM tailscope.requests WHERE {REQ_FILTER} "
          "ORDER BY e2e_ms DESC LIMIT 50", kind="table", link_trace=True,
          shows="the 50 slowest, linked to the drill-down"),
]


def _variable(name: str, column: str, table_: str = "requests", time_col: str = "arrival_ts"):
    return (dash.QueryVariable(name).label(name).datasource(DS)
            .query(f"SELECT DISTINCT {column} FROM tailscope.{table_} WHERE "
                   f"$__timeFilter({time_col}) ORDER BY {column}")
            .multi(True).include_all(True).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED))


def _slo(name: str, label: str, default: str):
    return dash.TextBoxVariable(name).label(label).default_value(default)


def build() -> dict:
    d = (dash.Dashboard("Tailscope: latency, stages and capacity").uid("tailscope-overview")
         .tags(["tailscope", "llm"]).time("now-1h", "now").refresh("30s").timezone("utc")
         .with_variable(dash.DatasourceVariable("ds").label("ClickHouse").type(PLUGIN))
         .with_variable(_variable("instance", "instance"))
         .with_variable(_variable("replica", "replica"))
         .with_variable(_variable("model", "model"))
         .with_variable(_variable("config_id", "config_id"))
         .with_variable(_variable("tenant", "tenant"))
         # end users are too many to list: typed (the request's user / safety_identifier)
         .with_variable(dash.TextBoxVariable("end_user").label("End user (blank: all)")
                        .default_value(""))
         .with_variable(_slo("ttft_slo", "TTFT SLO (ms)", "500"))
         .with_variable(_slo("tpot_slo", "TPOT SLO (ms)", "50")))
    for p in PANELS:
        ref = "A"
        if p.kind == "table":
            panel = (table.Panel().title(p.title).description(p.shows).datasource(DS)
                     .unit(p.unit).span(24).height(9))
            if p.link_trace:
                panel = panel.data_links([
                    dash.DashboardLink("Trace view").type(DashboardLinkType.LINK)
                    .url(f"{DRILL_URL}/?page=Requests&trace=${{__data.fields.trace_id}}")
                    .target_blank(True)])
        else:
            panel = (timeseries.Panel().title(p.title).description(p.shows).datasource(DS)
                     .unit(p.unit).span(12).height(8))
            if p.stacked:
                panel = panel.stacking(StackingConfig().mode(StackingMode.NORMAL))
        d = d.with_panel(panel.with_target(ClickHouseQueryBuilder(ref, p.sql, p.kind)))
    return json.loads(json.dumps(d.build(), cls=JSONEncoder, sort_keys=True))


def datasource_provisioning() -> str:
    return """# Grafana provisioning: the Tailscope ClickHouse data source (docker compose stack).
# It signs in as `viewer`, a read-only ClickHouse user (deploy/clickhouse/users.d/viewer.xml)
# whose password Grafana takes from its environment.
apiVersion: 1
datasources:
  - name: ClickHouse
    uid: tailscope-clickhouse
    type: grafana-clickhouse-datasource
    isDefault: true
    jsonData:
      host: clickhouse
      port: 9000
      protocol: native
      defaultDatabase: tailscope
      username: viewer
    secureJsonData:
      password: $CLICKHOUSE_VIEWER_PASSWORD
"""


def dashboard_provisioning() -> str:
    return """# Grafana provisioning: load the generated dashboards from this directory
apiVersion: 1
providers:
  - name: tailscope
    folder: Tailscope
    type: file
    options:
      path: /etc/grafana/provisioning/dashboards/json
"""


def render() -> dict[Path, str]:
    """Every generated file and its content (the tests compare these with the committed ones)."""
    return {
        OUT / "dashboards" / "json" / "tailscope-overview.json":
            json.dumps(build(), indent=2, sort_keys=True) + "\n",
        OUT / "datasources" / "clickhouse.yaml": datasource_provisioning(),
        OUT / "dashboards" / "tailscope.yaml": dashboard_provisioning(),
    }


def main() -> int:
    for path, text in render().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(OUT.parent.parent)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
