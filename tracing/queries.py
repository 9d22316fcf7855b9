"""The drill-down query library: named, parameterised queries shared by every surface (the
Streamlit app, the CLI, benchmarks, evals).

Each function takes a *source* (anything with ``select(sql, params) -> (columns, rows)``: a
``tracing.store.Store`` opened directly, or ``GatewaySource`` reading through a gateway's
``/debug/query``) and returns a pandas DataFrame. User input only ever reaches ClickHouse as a
bound parameter (``{name:Type}``); the few identifiers that vary (a metric, a dimension) are
checked against the fixed lists below before they are written into the SQL.

The seed lecture's rule is built in: ``tail_breakdown`` and ``compare_windows`` split queueing
from service time stage by stage (ingress, tokenize, route, engine queue, prefill, decode,
preempted, streaming) and per dimension value, never only aggregates.
"""

from __future__ import annotations

import datetime as dt
import importlib
from dataclasses import dataclass

from tracing import timing
from tracing.record import RecordEvent


class _Pandas:
    """pandas, imported on first use: the gateway reads the SQL below (``TRACE_RECORD``, ...)
    without paying for pandas (about 40 MB of memory) in its process."""

    def __getattr__(self, name: str):
        return getattr(importlib.import_module("pandas"), name)


pd = _Pandas()

# Latency columns of tailscope.requests; "itl_ms" is an array (one value per gap).
METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms", "tail_ms", "ingress_ms", "tokenize_ms",
           "route_ms", "engine_queue_ms", "prefill_ms", "decode_ms", "preempted_ms")
DIMENSIONS = ("replica", "instance", "model", "model_revision", "engine_version", "config_id",
              "tenant", "final_state", "finish_reason", "endpoint", "prompt_bucket",
              "neighbour_tenant", "priority", "lane", "end_user")
# a filter on "metadata.<key>" matches the requests whose OpenAI metadata has that value there
METADATA = "metadata."

# The stages that add up to each end-to-end metric, in path order (from the timing owner).
# "streaming" is the rest: for e2e, the time between the engine's tokens and the client's
# flushes (and the tail).
STAGES = {"e2e_ms": timing.E2E_STAGES, "ttft_ms": timing.TTFT_STAGES}
STAGE_NAMES = {**timing.LABELS, "other_ms": timing.STREAMING.label}
_DIM_SQL = {d: d for d in DIMENSIONS} | {
    "prompt_bucket": "multiIf(prompt_tokens < 128, '<128', prompt_tokens < 512, '128-511', "
                     "prompt_tokens < 2048, '512-2047', '>=2048')",
    # the tenant whose prefill chunks shared most of the request's steps
    "neighbour_tenant": "if(neighbour_tenant = '', '(none)', neighbour_tenant)",
    "priority": "toString(priority)"}
_WINDOW = ("arrival_ts >= fromUnixTimestamp64Micro({start:Int64}, 'UTC') AND "
           "arrival_ts < fromUnixTimestamp64Micro({end:Int64}, 'UTC')")


class QueryError(ValueError):
    pass


def _us(t: dt.datetime | float | int) -> int:
    """A window bound as µs since the epoch (datetimes without tzinfo are UTC)."""
    if isinstance(t, dt.datetime):
        if t.tzinfo is None:
            t = t.replace(tzinfo=dt.UTC)
        return int(t.timestamp() * 1_000_000)
    return int(float(t) * 1_000_000)  # seconds since the epoch


def _metric(metric: str) -> str:
    if metric not in METRICS:
        raise QueryError(f"unknown metric {metric!r}; one of {', '.join(METRICS)}")
    return metric


def _dim(dim: str | None) -> str | None:
    if dim is None:
        return None
    if dim not in DIMENSIONS:
        raise QueryError(f"unknown dimension {dim!r}; one of {', '.join(DIMENSIONS)}")
    return _DIM_SQL[dim]


def _filters(filters: dict[str, str] | None, params: dict) -> str:
    """Equality filters on dimensions, bound as parameters: ' AND dim = {f_dim:String}'; a
    ``metadata.<key>`` filter compares that key of the request's metadata (its key bound too)."""
    out = ""
    for i, (dim, value) in enumerate(sorted((filters or {}).items())):
        if dim.startswith(METADATA) and len(dim) > len(METADATA):
            out += f" AND JSONExtractString(metadata, {{fk{i}:String}}) = {{f{i}:String}}"
            params[f"fk{i}"] = dim[len(METADATA):]
        else:
            out += f" AND {_dim(dim)} = {{f{i}:String}}"
        params[f"f{i}"] = str(value)
    return out


def frame(source, sql: str, params: dict) -> pd.DataFrame:
    cols, rows = source.select(sql, params)
    return pd.DataFrame([list(r) for r in rows], columns=cols)


@dataclass
class GatewaySource:
    """Reads through a gateway's ``POST /debug/query`` (the embedded store belongs to it)."""

    url: str
    admin_key: str | None = None
    timeout_s: float = 60.0

    def select(self, sql: str, params: dict | None = None) -> tuple[list[str], list[list]]:
        import httpx

        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        r = httpx.post(f"{self.url.rstrip('/')}/debug/query", headers=headers,
                       json={"sql": sql, "params": params or {}}, timeout=self.timeout_s)
        if r.status_code != 200:
            raise QueryError(r.json().get("error", {}).get("message", r.text))
        body = r.json()
        return body["columns"], body["rows"]


# ---- percentiles ------------------------------------------------------------------------------
def percentiles(source, start, end, metric: str = "e2e_ms", by: str | None = None,
                bucket_s: int | None = None, filters: dict[str, str] | None = None
                ) -> pd.DataFrame:
    """p50/p90/p95/p99/max (and the count) of a metric, by time bucket and/or a dimension."""
    m = _metric(metric)
    params = {"start": _us(start), "end": _us(end)}
    value = "arrayJoin(itl_ms)" if m == "itl_ms" else m
    keys, names = [], []
    if bucket_s:
        keys.append("toStartOfInterval(arrival_ts, toIntervalSecond({bucket:UInt32})) AS t")
        names.append("t")
        params["bucket"] = int(bucket_s)
    if by:
        keys.append(f"{_dim(by)} AS {by}")
        names.append(by)
    select = ", ".join(keys + [
        "count() AS n",
        "quantilesExact(0.5, 0.9, 0.95, 0.99)(v) AS q", "max(v) AS max"])
    group = f" GROUP BY {', '.join(names)} ORDER BY {', '.join(names)}" if names else ""
    sql = (f"SELECT {select} FROM (SELECT *, {value} AS v FROM tailscope.requests WHERE "
           f"{_WINDOW}{_filters(filters, params)} AND v IS NOT NULL){group}")
    df = frame(source, sql, params)
    columns = [*names, "n", "p50", "p90", "p95", "p99", "max"]
    if df.empty:  # an empty result may come back without column names
        return pd.DataFrame(columns=columns)
    q = pd.DataFrame(df.pop("q").tolist(), columns=["p50", "p90", "p95", "p99"])
    return pd.concat([df, q], axis=1)[columns]


# ---- the tail, stage by stage -------------------------------------------------------------
def _stage_exprs(metric: str) -> list[tuple[str, str]]:
    stages = STAGES.get(metric)
    if stages is None:
        raise QueryError(f"stage breakdowns exist for {', '.join(STAGES)}, not {metric!r}")
    other = f"{metric} - ({' + '.join(stages)})"
    return [(s, s) for s in stages] + [("other_ms", other)]


def _cut(source, m: str, where: str, params: dict) -> float | None:
    """The ``{q:Float64}`` quantile of ``m`` over ``where`` (None when nothing matches)."""
    df = frame(source, f"SELECT quantileExact({{q:Float64}})({m}) AS cut FROM "
                       f"tailscope.requests WHERE {where}", params)
    if df.empty or df.iloc[0]["cut"] is None:
        return None
    return float(df.iloc[0]["cut"])


_TAIL_COLUMNS = ["stage", "column", "tail_ms", "median_ms", "delta_ms", "share"]


def tail_breakdown(source, start, end, metric: str = "e2e_ms", quantile: float = 0.99,
                   filters: dict[str, str] | None = None) -> pd.DataFrame:
    """For requests above the window's ``quantile`` of ``metric``: each stage's mean, against
    the median request's (the median of each stage), and its share of the gap."""
    m = _metric(metric)
    stages = _stage_exprs(m)
    params = {"start": _us(start), "end": _us(end), "q": float(quantile)}
    where = f"{_WINDOW}{_filters(filters, params)} AND {m} IS NOT NULL"
    cut = _cut(source, m, where, params)
    if cut is None:
        return pd.DataFrame(columns=_TAIL_COLUMNS)
    params["cut"] = cut
    cols = ", ".join(f"avgIf({e}, {m} >= {{cut:Float64}}) AS tail_{s}, median({e}) AS med_{s}"
                     for s, e in stages)
    sql = (f"SELECT countIf({m} >= {{cut:Float64}}) AS tail_n, count() AS n, {cols} "
           f"FROM tailscope.requests WHERE {where}")
    row = frame(source, sql, params)
    if row.empty or not row.at[0, "n"]:
        return pd.DataFrame(columns=_TAIL_COLUMNS)
    r = row.iloc[0]
    out = pd.DataFrame([{"stage": STAGE_NAMES[s], "column": s, "tail_ms": r[f"tail_{s}"],
                         "median_ms": r[f"med_{s}"]} for s, _ in stages])
    out["delta_ms"] = out["tail_ms"] - out["median_ms"]
    gap = out["delta_ms"].sum()
    out["share"] = out["delta_ms"] / gap if gap else 0.0
    out.attrs.update(cut_ms=params["cut"], tail_n=int(r["tail_n"]), n=int(r["n"]))
    return out.sort_values("delta_ms", ascending=False, ignore_index=True)


def compare_windows(source, base: tuple, suspect: tuple, metric: str = "e2e_ms",
                    by: str = "replica", quantile: float = 0.99,
                    filters: dict[str, str] | None = None,
                    base_filters: dict[str, str] | None = None,
                    suspect_filters: dict[str, str] | None = None) -> pd.DataFrame:
    """What moved the tail between two windows (or two configs, with per-side filters such as
    ``{"config_id": ...}``), per value of ``by`` and per stage, ranked by how much of the
    regression it explains.

    Attribution (stated): within each value ``d`` of ``by``, its tail is its requests at or above
    its own ``quantile`` of ``metric``; the stages add up to the metric, so the change of the tail
    mean splits exactly into the changes of each stage's mean over that tail. Each (d, stage)
    change is weighted by d's share of the requests (so a small tenant cannot dominate), and
    ``share`` is its fraction of the positive weighted changes. Taking each value's own tail
    keeps a shift of traffic between values from posing as a stage change. The overall change
    of the ``quantile`` of ``metric`` is in ``attrs``.

    ``by="neighbour_tenant"`` (the tenant whose prefill shared most of a request's steps) is a
    property of the suspect window's load, not a population present in both: each of its
    values is compared with the base window as a whole, so the neighbour that came with the
    regression ranks first.
    """
    m = _metric(metric)
    dim = _dim(by)
    whole_base = by == "neighbour_tenant"
    stages = _stage_exprs(m)
    sides, cuts = {}, {}
    for side, (start, end), extra in (("base", base, base_filters),
                                      ("suspect", suspect, suspect_filters)):
        params = {"start": _us(start), "end": _us(end), "q": float(quantile)}
        where = (f"{_WINDOW}{_filters({**(filters or {}), **(extra or {})}, params)} "
                 f"AND {m} IS NOT NULL")
        cut = _cut(source, m, where, params)
        cuts[side] = float("nan") if cut is None else cut
        inner = ", ".join(f"{e} AS x_{s}" for s, e in stages)  # never shadow a column
        means = ", ".join(f"avg(x_{s}) AS mean_{s}" for s, _ in stages)
        d_sql = "'(all)'" if whole_base and side == "base" else dim
        sql = (f"SELECT dim, any(nd) AS nd, count() AS k, {means} FROM (SELECT {d_sql} AS dim, "
               f"{m} AS v, {inner}, quantileExact({{q:Float64}})(v) OVER (PARTITION BY dim) "
               f"AS cut_d, count() OVER (PARTITION BY dim) AS nd FROM tailscope.requests "
               f"WHERE {where}) WHERE v >= cut_d GROUP BY dim")
        df = frame(source, sql, params)
        if df.empty:  # an empty result may come back without column names
            df = pd.DataFrame(columns=["dim", "nd", "k", *(f"mean_{s}" for s, _ in stages)])
        df["n_total"] = df["nd"].sum() if len(df) else 0
        sides[side] = df
    rows = []
    dims = sorted(set(sides["suspect"].get("dim", [])) | (
        set() if whole_base else set(sides["base"].get("dim", []))))
    for d in dims:
        hit = {side: df if whole_base and side == "base" else df[df["dim"] == d]
               for side, df in sides.items()}
        if any(h.empty for h in hit.values()):
            continue  # a value seen in one window only: nothing to compare it with
        weight = float(hit["suspect"]["nd"].iloc[0]) / float(sides["suspect"]["n_total"].iloc[0])
        for s, _ in stages:
            b = float(hit["base"][f"mean_{s}"].iloc[0])
            a = float(hit["suspect"][f"mean_{s}"].iloc[0])
            rows.append({by: d, "stage": STAGE_NAMES[s], "column": s, "base_ms": b,
                         "suspect_ms": a, "delta_ms": a - b, "weight": weight,
                         "weighted_ms": (a - b) * weight})
    out = pd.DataFrame(rows, columns=[by, "stage", "column", "base_ms", "suspect_ms",
                                      "delta_ms", "weight", "weighted_ms"])
    positive = out.loc[out["weighted_ms"] > 0, "weighted_ms"].sum() if len(out) else 0.0
    out["share"] = out["weighted_ms"].clip(lower=0) / positive if positive else 0.0
    out = out.sort_values("weighted_ms", ascending=False, ignore_index=True)
    out.attrs.update(metric=m, by=by, quantile=quantile, base_cut_ms=cuts["base"],
                     suspect_cut_ms=cuts["suspect"], weighted_delta_ms=float(
                         out["weighted_ms"].sum()) if len(out) else 0.0)
    return out


def explain(comparison: pd.DataFrame) -> str:
    """One plain sentence naming the top cause, e.g.
    "p99 E2E +180 ms; 85% of it is engine queue time on r1"."""
    a = comparison.attrs
    label = a["metric"].removesuffix("_ms").upper()
    q = f"p{round(a['quantile'] * 100):d}"
    delta = a["suspect_cut_ms"] - a["base_cut_ms"]
    if comparison.empty or comparison.iloc[0]["weighted_ms"] <= 0:
        return f"{q} {label} {delta:+.0f} ms; no stage moved"
    top = comparison.iloc[0]
    where = f"on {top[a['by']]}" if a["by"] == "replica" else f"for {a['by']} {top[a['by']]}"
    return (f"{q} {label} {delta:+.0f} ms; {top['share'] * 100:.0f}% of it is "
            f"{top['stage']} {where}")


# ---- requests, traces, SLOs, rates ------------------------------------------------------------
def slowest(source, start, end, metric: str = "e2e_ms", limit: int = 50,
            filters: dict[str, str] | None = None) -> pd.DataFrame:
    m = _metric(metric)
    params = {"start": _us(start), "end": _us(end), "limit": int(limit)}
    order = "arrayMax(itl_ms)" if m == "itl_ms" else m
    sql = (f"SELECT trace_id, arrival_ts, instance, replica, tenant, end_user, final_state, "
           f"finish_reason, prompt_tokens, emitted_tokens, ttft_ms, tpot_ms, e2e_ms, "
           f"engine_queue_ms, prefill_ms, decode_ms FROM tailscope.requests WHERE {_WINDOW}"
           f"{_filters(filters, params)} ORDER BY {order} DESC LIMIT {{limit:UInt32}}")
    return frame(source, sql, params)


# One trace's rows (the drill-down's Trace view and the gateway's /debug/requests/{trace_id}).
TRACE_RECORD = "SELECT * FROM tailscope.requests WHERE trace_id = {t:String} LIMIT 1"
# the configs table (one row per config_id a gateway ran)
CONFIG_EXISTS = "SELECT count() FROM tailscope.configs WHERE config_id = {c:String}"
CONFIG_OF = ("SELECT name, config FROM tailscope.configs WHERE config_id = {c:String} "
             "ORDER BY ts LIMIT 1")
TRACE_EVENTS = ("SELECT ts, state, detail FROM tailscope.request_events WHERE "
                "trace_id = {t:String} ORDER BY ts, seq")
STEPS_BETWEEN = ("SELECT * FROM tailscope.engine_steps WHERE replica = {r:String} AND ts >= "
                 "fromUnixTimestamp64Micro({a:Int64}, 'UTC') AND ts <= "
                 "fromUnixTimestamp64Micro({b:Int64}, 'UTC') ORDER BY ts, step")
# How many of these traces have a stored record (writers batch: wait until all are there).
RECORDS_FOUND = ("SELECT uniqExact(trace_id) FROM tailscope.requests WHERE "
                 "trace_id IN {ids:Array(String)}")
REQUEST_COUNT = "SELECT count() FROM tailscope.requests"
RECORDS_BY_TRACE = "SELECT * FROM tailscope.requests WHERE trace_id IN {ids:Array(String)}"


def records_found(source, trace_ids: list[str]) -> int:
    ids = sorted({t for t in trace_ids if t})
    _, rows = source.select(RECORDS_FOUND, {"ids": ids})
    return int(rows[0][0])


def trace(source, trace_id: str) -> dict:
    """One trace: its record, its events, and its replica's engine steps during it."""
    params = {"t": trace_id.lower()}
    rec = frame(source, TRACE_RECORD, params)
    if rec.empty:
        return {"record": None, "events": pd.DataFrame(), "steps": pd.DataFrame()}
    record = rec.iloc[0].to_dict()
    events = frame(source, TRACE_EVENTS, params)
    steps = frame(source, "SELECT ts, step, duration_ms, num_seqs, prefill_tokens, "
                          "decode_tokens, kv_blocks_used, kv_blocks_total, running, waiting, "
                          "member_traces, member_prefill, member_decode "
                          "FROM tailscope.engine_steps WHERE replica = {r:String} AND ts >= "
                          "(SELECT arrival_ts FROM tailscope.requests WHERE trace_id = "
                          "{t:String} LIMIT 1) AND ts <= (SELECT arrival_ts + toIntervalMicro"
                          "second(toInt64(e2e_ms * 1000)) FROM tailscope.requests WHERE "
                          "trace_id = {t:String} LIMIT 1) ORDER BY ts, step",
                  {**params, "r": str(record.get("replica") or "")})
    return {"record": record, "events": events, "steps": steps}


def ts_us(value) -> int:
    """A stored timestamp (a DateTime64 as pandas reads it, with or without its UTC zone) as
    µs since the epoch."""
    ts = pd.Timestamp(value)
    return int((ts if ts.tzinfo else ts.tz_localize("UTC")).timestamp() * 1e6)


_WATERFALL = ["lane", "segment", "start_ms", "end_ms", "ms", "detail"]


def waterfall(t: dict) -> pd.DataFrame:
    """A request's life in time order, for ``trace(...)``'s result: lane ``request`` is its
    stages from its timeline (the timing owner's windows; waiting split by cause when the
    bundled engine noted them), adding up to ``e2e_ms`` exactly; lane ``engine`` is each step
    it ran in (its prefill chunk or decode token, with the batch and the other requests'
    prefill tokens in it); lane ``client`` is each inter-token gap at the client. Times are ms
    since the request arrived."""
    rec, events, steps = t["record"], t["events"], t["steps"]
    if rec is None:
        return pd.DataFrame(columns=_WATERFALL)
    arrival = ts_us(rec["arrival_ts"])
    rows: list[tuple] = []

    def add(lane: str, segment: str, a_us: float, b_us: float, detail: str = "") -> None:
        rows.append((lane, segment, (a_us - arrival) / 1000, (b_us - arrival) / 1000,
                     (b_us - a_us) / 1000, detail))

    ev = [] if events is None or events.empty else [
        RecordEvent(ts_us(e.ts), str(e.state), str(e.detail or ""))
        for e in events.itertuples(index=False)]
    if ev:
        causes = timing.cause_windows(ev) if rec.get("timing_source") == "engine" else []
        for w in timing.windows(ev):
            if not (causes and w.stage.column in timing.WAITING):
                add("request", w.stage.label, w.start_us, w.end_us)
        for w in causes:
            add("request", f"waiting: {w.stage.label}", w.start_us, w.end_us)
    else:  # no stored timeline: the stage columns end to end, in path order
        at = float(arrival)
        for column in timing.E2E_STAGES:
            ms = float(rec.get(column) or 0)
            add("request", timing.LABELS[column], at, at + ms * 1000)
            at += ms * 1000
        add("request", timing.STREAMING.label, at, arrival + float(rec["e2e_ms"]) * 1000)
    trace_id = str(rec["trace_id"])
    crowded: list[float] = []  # ends (µs) of its steps that carried others' prefill
    if steps is not None and not steps.empty and "member_traces" in steps:
        for s in steps.itertuples(index=False):
            members = list(s.member_traces if s.member_traces is not None else [])
            if trace_id not in members:
                continue
            i = members.index(trace_id)
            own_prefill = int(s.member_prefill[i])
            others = sum(int(p) for j, p in enumerate(s.member_prefill) if j != i)
            start = ts_us(s.ts)
            end = start + float(s.duration_ms) * 1000
            add("engine", f"prefill {own_prefill}" if own_prefill else "decode", start, end,
                f"step {int(s.step)}: batch {int(s.num_seqs)}, others' prefill {others}")
            if others:
                crowded.append(end)
    ttft = rec.get("ttft_ms")
    if ttft is not None and not pd.isna(ttft):
        flush = arrival + float(ttft) * 1000
        for k, gap in enumerate(rec.get("itl_ms") if rec.get("itl_ms") is not None else []):
            nxt = flush + float(gap) * 1000  # coloured by whether others' prefill was inside
            shared = any(flush < e <= nxt for e in crowded)
            add("client", "gap with others' prefill" if shared else "gap", flush, nxt,
                f"token {k + 1}")
            flush = nxt
    out = pd.DataFrame(rows, columns=_WATERFALL)
    return out.sort_values(["lane", "start_ms"], kind="stable", ignore_index=True)


# what-if (tailscope.whatif): the requests and engine steps of some replicas in a window
WHATIF_REQUESTS = (
    "SELECT trace_id, replica, toUnixTimestamp64Micro(arrival_ts) AS arrival_us, "
    "input_token_ids, prompt_tokens, generated_tokens, n, tenant, priority, config_id, "
    "final_state, ttft_ms, e2e_ms, tpot_ms, itl_ms, engine_queue_ms, prefill_ms, decode_ms, "
    "preempted_ms, preemptions, max_tokens FROM tailscope.requests WHERE replica IN "
    "{rs:Array(String)} AND " + _WINDOW + " AND (generated_tokens > 0 OR final_state = "
    "'TIMED_OUT') ORDER BY arrival_ts")
WHATIF_STEPS = (
    "SELECT replica, toUnixTimestamp64Micro(ts) AS ts_us, duration_ms, prefill_tokens, "
    "decode_tokens, num_seqs, kv_blocks_used, kv_blocks_total, prefill_context "
    "FROM tailscope.engine_steps WHERE "
    "replica IN {rs:Array(String)} AND "
    "ts >= fromUnixTimestamp64Micro({start:Int64}, 'UTC') AND "
    "ts < fromUnixTimestamp64Micro({end:Int64}, 'UTC') ORDER BY replica, ts, step")
WHATIF_REPLICAS = ("SELECT replica, count() AS c FROM tailscope.requests WHERE " + _WINDOW +
                   " AND replica != '' GROUP BY replica ORDER BY replica")
WHATIF_BENCH_RUN = (
    "SELECT min(toUnixTimestamp64Micro(arrival_ts)), "
    "max(toUnixTimestamp64Micro(arrival_ts) + toInt64(e2e_ms * 1000)), count() "
    "FROM tailscope.requests WHERE bench_run = {b:String}")
def slo(source, start, end, ttft_ms: float, tpot_ms: float, by: str | None = None,
        filters: dict[str, str] | None = None) -> pd.DataFrame:
    """SLO attainment (the fraction of finished requests within both thresholds; a request
    with one token has no TPOT and meets that part) and goodput (such requests per second)."""
    params = {"start": _us(start), "end": _us(end), "ttft": float(ttft_ms),
              "tpot": float(tpot_ms)}
    window_s = max((params["end"] - params["start"]) / 1e6, 1e-9)
    key = f"{_dim(by)} AS {by}, " if by else ""
    group = f" GROUP BY {by} ORDER BY {by}" if by else ""
    ok = timing.slo_sql("{ttft:Float64}", "{tpot:Float64}")
    sql = (f"SELECT {key}count() AS n, countIf({ok}) AS good, good / n AS attainment "
           f"FROM tailscope.requests WHERE {_WINDOW}{_filters(filters, params)}{group}")
    df = frame(source, sql, params)
    df["goodput_rps"] = df["good"] / window_s
    return df


def rates(source, start, end, bucket_s: int = 60, filters: dict[str, str] | None = None
          ) -> pd.DataFrame:
    """Per time bucket: requests/s by final state, rejection, cancellation and error rates,
    and the prefix-cache hit rate (cached / prompt tokens)."""
    params = {"start": _us(start), "end": _us(end), "bucket": int(bucket_s)}
    sql = ("SELECT toStartOfInterval(arrival_ts, toIntervalSecond({bucket:UInt32})) AS t, "
           "count() AS n, count() / {bucket:UInt32} AS rps, "
           "countIf(final_state = 'FINISHED') / n AS finished_rate, "
           "countIf(final_state = 'REJECTED') / n AS rejection_rate, "
           "countIf(final_state = 'CANCELLED') / n AS cancellation_rate, "
           "countIf(final_state IN ('FAILED', 'TIMED_OUT')) / n AS error_rate, "
           "if(sum(prompt_tokens) = 0, 0, sum(cached_tokens) / sum(prompt_tokens)) AS "
           f"prefix_hit_rate FROM tailscope.requests WHERE {_WINDOW}"
           f"{_filters(filters, params)} GROUP BY t ORDER BY t")
    return frame(source, sql, params)


def by_finish_reason(source, start, end, bucket_s: int = 60,
                     filters: dict[str, str] | None = None) -> pd.DataFrame:
    params = {"start": _us(start), "end": _us(end), "bucket": int(bucket_s)}
    sql = ("SELECT toStartOfInterval(arrival_ts, toIntervalSecond({bucket:UInt32})) AS t, "
           "finish_reason, count() / {bucket:UInt32} AS rps FROM tailscope.requests WHERE "
           f"{_WINDOW}{_filters(filters, params)} GROUP BY t, finish_reason ORDER BY t")
    return frame(source, sql, params)


# ---- eval runs ---------------------------------------------------------------------------------
def eval_runs(source, limit: int = 100) -> pd.DataFrame:
    """Stored eval runs, newest first."""
    return frame(source, "SELECT run_id, ts, suite, config_id, cases, passed, url FROM "
                 "tailscope.eval_runs ORDER BY ts DESC LIMIT 1 BY run_id LIMIT {n:UInt32}",
                 {"n": limit})


def eval_run(source, run_id: str) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """One eval run's row, its case results, and its requests' records (latency, config)."""
    p = {"r": run_id}
    run = frame(source, "SELECT run_id, ts, suite, config_id, config, url, cases, passed FROM "
                "tailscope.eval_runs WHERE run_id = {r:String} LIMIT 1", p)
    results = frame(source, "SELECT case_id, trace_id, score, passed, detail, output, "
                    "finish_reason, weight, tags FROM tailscope.eval_results WHERE run_id = "
                    "{r:String} ORDER BY case_id LIMIT 1 BY case_id", p)
    records = frame(source, "SELECT trace_id, ttft_ms, e2e_ms, config_id AS record_config_id, "
                    "final_state FROM tailscope.requests WHERE trace_id IN (SELECT trace_id "
                    "FROM tailscope.eval_results WHERE run_id = {r:String}) LIMIT 1 BY trace_id",
                    p)
    return run, results, records


# ---- what-if runs (tailscope whatif / size) ----------------------------------------------------
def whatif_runs(source, limit: int = 100) -> pd.DataFrame:
    """Stored what-if and sizing runs, newest first (JSON columns parsed)."""
    import json

    runs = frame(source, "SELECT run_id, ts, kind, fromUnixTimestamp64Micro(window_start_us, "
                 "'UTC') AS window_start, fromUnixTimestamp64Micro(window_end_us, 'UTC') AS "
                 "window_end, replicas, config_id, params, step_cost, results FROM "
                 "tailscope.whatif_runs ORDER BY ts DESC LIMIT 1 BY run_id LIMIT {n:UInt32}",
                 {"n": limit})
    for col in ("params", "step_cost", "results"):
        runs[col] = runs[col].map(json.loads)
    return runs


def whatif_table(results: dict) -> pd.DataFrame:
    """A what-if run's predictions, one row per (rate scale, column, metric): p50/p90/p99 in
    ms; the columns are what was recorded (at the window's own rate), the recorded config
    predicted, and the candidate predicted. ``extrapolated``: the prediction's share of
    simulated busy time in step batch sizes the window barely recorded
    (``tailscope.whatif.extrapolated``; None for what was recorded and for runs stored before
    it existed)."""
    rows = []
    for p in results.get("points", []):
        for col in ("recorded", "recorded_config", "candidate"):
            summary = p.get(col)
            if not summary:
                continue
            slo = summary.get("slo") or {}
            for metric, q in summary["table"].items():
                rows.append({"rate_scale": p["rate_scale"], "offered_rps": p["offered_rps"],
                             "column": col.replace("_", " "), "metric": metric,
                             "p50": q["p50"], "p90": q["p90"], "p99": q["p99"],
                             "slo_attainment": slo.get("attainment"),
                             "preemptions": summary.get("preemptions"),
                             "shed": summary.get("shed"),
                             "extrapolated": summary.get("extrapolated")})
    return pd.DataFrame(rows, columns=["rate_scale", "offered_rps", "column", "metric", "p50",
                                       "p90", "p99", "slo_attainment", "preemptions", "shed",
                                       "extrapolated"])
