"""The p99 drill-down (Streamlit): ``tailscope drill`` or ``streamlit run dashboards/drill.py``.

Pages: Overview (percentiles over time by replica, request rate by finish reason, SLO
attainment), Regression (baseline vs suspect window, or two config ids: what moved, ranked, and
one sentence naming the top cause), Requests (the slowest, filterable; choosing one opens its
Trace view: stage timeline, inter-token gaps against the replica's batch size and KV usage,
token ids with their text (decoded with the record's own tokenizer, matched by revision, or
shown as ids only), versions and sampling parameters), Evals (stored eval runs, a
comparison of two with the verdict ``tailscope eval compare`` gives, and failing cases linked to
their Trace view; ``?page=Evals&a=RUN&b=RUN`` opens a comparison), What-if (stored
``tailscope whatif`` and ``tailscope size`` runs: the step-cost model and its error, predicted
against recorded percentiles, the TTFT frontier over rate scales, the replica counts checked).

The data source comes from ``TAILSCOPE_DRILL_SOURCE`` and is shown on every page:
``gateway:http://host:8000`` reads through a gateway's ``/debug/query`` (the embedded store
belongs to the gateway while it runs; ``TAILSCOPE_ADMIN_KEY`` is sent when set), a
``chdb:///path`` or ``http(s)://`` DSN is opened directly. Every number comes from
``tracing.queries``.
"""

from __future__ import annotations

import datetime as dt

import pandas as pd
import streamlit as st

from tailscope import env
from tracing import queries as Q

PAGES = ("Overview", "Regression", "Requests", "Evals", "What-if")
# dimensions the Regression page does not offer to explain a shift by (the model is one per
# window; a request's end state is an outcome, not a cause)
_NOT_A_CAUSE = ("model", "final_state", "finish_reason")


def source_spec() -> str:
    return env.drill_source()


@st.cache_resource
def open_source(spec: str):
    if spec.startswith("gateway:"):
        return Q.GatewaySource(spec[len("gateway:"):], env.setting("admin_key"))
    from tracing.store import connect

    store = connect(spec, key=env.setting("store_key") or None)
    try:
        store.migrate()
    except Exception as exc:  # a read-only user (the compose stack's viewer): the gateway migrates
        st.caption(f"schema not checked ({type(exc).__name__}): reading as a read-only user")
    return store


def parse_time(text: str, default: dt.datetime) -> dt.datetime:
    try:
        t = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        st.warning(f"could not read {text!r} as a time (ISO 8601); using {default:%F %T}")
        return default
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def window(label: str, start: dt.datetime, end: dt.datetime, key: str
           ) -> tuple[dt.datetime, dt.datetime]:
    c1, c2 = st.columns(2)
    a = c1.text_input(f"{label} from (UTC)", start.strftime("%Y-%m-%d %H:%M:%S"), key=f"{key}_a")
    b = c2.text_input(f"{label} to (UTC)", end.strftime("%Y-%m-%d %H:%M:%S"), key=f"{key}_b")
    return parse_time(a, start), parse_time(b, end)


def overview(src, now: dt.datetime) -> None:
    start, end = window("Window", now - dt.timedelta(hours=1), now, "ov")
    metric = st.selectbox("Metric", ["ttft_ms", "e2e_ms", "tpot_ms", "itl_ms",
                                     "engine_queue_ms", "prefill_ms", "decode_ms"], key="ov_m")
    span_s = max((end - start).total_seconds(), 1)
    bucket = max(10, int(span_s // 60))
    pct = Q.percentiles(src, start, end, metric=metric, by="replica", bucket_s=bucket)
    st.subheader(f"{metric}: p50 / p95 / p99 by replica")
    if pct.empty:
        st.info("no requests in this window")
    else:
        wide = pct.pivot_table(index="t", columns="replica", values=["p50", "p95", "p99"])
        wide.columns = [f"{q} {r}" for q, r in wide.columns]
        st.line_chart(wide)
        st.dataframe(Q.percentiles(src, start, end, metric=metric, by="replica"),
                     hide_index=True)
    st.subheader("Requests per second by finish reason")
    fr = Q.by_finish_reason(src, start, end, bucket_s=bucket)
    if not fr.empty:
        st.bar_chart(fr.pivot_table(index="t", columns="finish_reason", values="rps"))
    st.subheader("SLO attainment")
    c1, c2 = st.columns(2)
    ttft = c1.number_input("TTFT SLO (ms)", value=500.0, key="ov_ttft")
    tpot = c2.number_input("TPOT SLO (ms)", value=50.0, key="ov_tpot")
    slo = Q.slo(src, start, end, ttft_ms=ttft, tpot_ms=tpot, by="replica")
    st.dataframe(slo, hide_index=True)


def regression(src, now: dt.datetime) -> None:
    mode = st.radio("Compare", ["two windows", "two configs"], horizontal=True, key="rg_mode")
    metric = st.selectbox("Metric", ["ttft_ms", "e2e_ms"], key="rg_m")
    by = st.selectbox("By", [d for d in Q.DIMENSIONS if d not in _NOT_A_CAUSE], key="rg_by")
    base_f = suspect_f = None
    if mode == "two windows":
        base = window("Baseline", now - dt.timedelta(hours=2), now - dt.timedelta(hours=1),
                      "rg_base")
        suspect = window("Suspect", now - dt.timedelta(hours=1), now, "rg_sus")
    else:
        base = suspect = window("Window", now - dt.timedelta(hours=6), now, "rg_cfg")
        c1, c2 = st.columns(2)
        base_f = {"config_id": c1.text_input("Baseline config_id", key="rg_cfg_a")}
        suspect_f = {"config_id": c2.text_input("Suspect config_id", key="rg_cfg_b")}
    cmp = Q.compare_windows(src, base, suspect, metric=metric, by=by, base_filters=base_f,
                            suspect_filters=suspect_f)
    if cmp.empty:
        st.info("nothing to compare: one of the sides has no requests")
        return
    st.success(Q.explain(cmp))
    top = cmp.head(12).copy()
    top["what"] = top[by].astype(str) + " · " + top["stage"]
    st.bar_chart(top.set_index("what")["weighted_ms"], horizontal=True)
    st.dataframe(cmp[[by, "stage", "base_ms", "suspect_ms", "delta_ms", "share"]],
                 hide_index=True)


def requests_page(src, now: dt.datetime) -> None:
    start, end = window("Window", now - dt.timedelta(hours=1), now, "rq")
    c1, c2, c3, c4 = st.columns(4)
    metric = c1.selectbox("Slowest by", ["e2e_ms", "ttft_ms", "tpot_ms", "itl_ms"], key="rq_m")
    instance = c2.text_input("Gateway instance (blank: all)", key="rq_i")
    replica = c3.text_input("Replica (blank: all)", key="rq_r")
    tenant = c4.text_input("Tenant (blank: all)", key="rq_t")
    c5, c6 = st.columns(2)
    end_user = c5.text_input("End user (the request's user / safety_identifier)", key="rq_u")
    tagged = c6.text_input("Metadata key=value (blank: all)", key="rq_md")
    filters = {k: v for k, v in (("instance", instance), ("replica", replica),
                                 ("tenant", tenant), ("end_user", end_user)) if v}
    if "=" in tagged:
        key, _, value = tagged.partition("=")
        filters[Q.METADATA + key.strip()] = value.strip()
    slow = Q.slowest(src, start, end, metric=metric, limit=50, filters=filters)
    st.dataframe(slow, hide_index=True)
    options = list(slow["trace_id"]) if not slow.empty else []
    typed = st.text_input("Trace id", key="rq_trace")
    chosen = typed.strip() or (st.selectbox("or pick one of the slowest", options, key="rq_pick")
                               if options else "")
    if chosen:
        trace_view(src, chosen)


def trace_view(src, trace_id: str) -> None:
    t = Q.trace(src, trace_id)
    rec = t["record"]
    st.header(f"Trace {trace_id}")
    if rec is None:
        st.error("no record for that trace")
        st.text(trace_id)
        return
    st.caption(f"{rec['final_state']} · {rec['finish_reason']} · HTTP {rec['http_status']} · "
               f"replica {rec['replica'] or '-'} · tenant {rec['tenant']} · priority "
               f"{rec.get('priority', 0)} · lane {rec.get('lane') or 'standard'}")
    # what the client wrote is shown as plain text: as Markdown, a link or an image there
    # would be live in the operator's view (a tracking pixel, a phishing link)
    for label in ("end_user", "metadata"):
        if rec.get(label):
            st.text(f"{label.replace('_', ' ')}: {rec[label]}")
    if rec.get("degraded"):
        st.warning(f"admitted DEGRADED: {rec['degraded']}")
    stages = pd.DataFrame([{"stage": Q.STAGE_NAMES[c], "ms": float(rec[c] or 0.0)}
                           for c in Q.STAGES["e2e_ms"]])
    other = float(rec["e2e_ms"]) - stages["ms"].sum()
    stages.loc[len(stages)] = {"stage": "streaming", "ms": other}
    st.subheader("Stages")
    st.bar_chart(stages.set_index("stage")["ms"], horizontal=True)
    st.dataframe(stages, hide_index=True)
    st.subheader("Waterfall")
    fall = Q.waterfall(t)
    st.vega_lite_chart(fall, {
        "mark": {"type": "bar", "tooltip": True},
        "encoding": {"y": {"field": "lane", "type": "nominal", "sort": ["request", "engine",
                                                                         "client"]},
                     "x": {"field": "start_ms", "type": "quantitative",
                           "title": "ms since arrival"},
                     "x2": {"field": "end_ms"},
                     "color": {"field": "segment", "type": "nominal"}}})
    st.dataframe(fall, hide_index=True)
    _neighbours(t["steps"], trace_id)
    st.subheader("Inter-token gaps and the replica's batch")
    gaps = _gaps(rec, t["steps"])
    if gaps is not None:
        st.line_chart(gaps.set_index("ts")[[c for c in ("gap_ms", "num_seqs")
                                            if c in gaps]])
        st.dataframe(gaps, hide_index=True)
    else:
        st.info("no inter-token gaps (fewer than two content flushes)")
    st.subheader("Timeline")
    st.dataframe(t["events"], hide_index=True)
    st.subheader("Tokens")
    ids = list(rec.get("output_token_ids") or [])
    st.write(f"prompt {rec['prompt_tokens']} tokens, generated {rec['generated_tokens']}, "
             f"emitted {rec['emitted_tokens']}")
    if ids:
        st.code(str(ids[:200]), language=None)
        text = decode(tuple(ids), str(rec.get("tokenizer_revision") or ""))
        if text is not None:
            st.text(text)
        else:
            st.caption(f"no tokenizer with revision {rec.get('tokenizer_revision')!r} here "
                       "(the ids above are what the model produced; set "
                       "TAILSCOPE_DRILL_TOKENIZERS to its tokenizer's path to see text)")
    st.subheader("Versions and sampling")
    keys = ("model", "model_revision", "engine_version", "tokenizer_revision",
            "gateway_version", "config_id", "temperature", "top_p", "top_k", "min_p", "seed",
            "max_tokens", "stream")
    st.dataframe(pd.DataFrame([{"field": k, "value": str(rec.get(k))} for k in keys]),
                 hide_index=True)


def _neighbours(steps, trace_id: str) -> None:
    """Links to the requests whose prefill shared this one's steps."""
    if steps.empty or "member_traces" not in steps:
        return
    others = sorted({m for s in steps.itertuples(index=False)
                     if trace_id in list(s.member_traces)
                     for m, p in zip(s.member_traces, s.member_prefill, strict=False)
                     if m != trace_id and int(p) > 0})
    if others:
        st.markdown("Neighbours whose prefill shared its steps: " + ", ".join(
            f"[{m[:12]}…]({trace_link(m)})" for m in others[:20]))


def _gaps(rec: dict, steps):
    """Each inter-token gap with the replica's batch at its flush (its last step at or before
    it); None without gaps."""
    itl = list(rec.get("itl_ms") or [])
    if not itl:
        return None
    arrival_us = Q.ts_us(rec["arrival_ts"])
    first_us = arrival_us + float(rec["ttft_ms"] or 0) * 1000
    gaps = pd.DataFrame({"t_us": (first_us + pd.Series(itl).cumsum() * 1000).astype(
        "int64"), "gap_ms": itl})
    if not steps.empty:
        keys = pd.to_datetime(steps["ts"], utc=True)
        steps = steps.assign(t_us=[int(k.timestamp() * 1e6) for k in keys])
        gaps = pd.merge_asof(gaps, steps.sort_values("t_us")[
            ["t_us", "num_seqs", "kv_blocks_used", "kv_blocks_total"]], on="t_us",
            direction="backward")
    gaps.insert(0, "ts", pd.to_datetime(gaps.pop("t_us"), unit="us", utc=True))
    return gaps


def trace_link(trace_id: str) -> str:
    return f"/?page=Requests&trace={trace_id}" if trace_id else ""


def evals_page(src, now: dt.datetime) -> None:
    from evals import compare as C

    runs = C.list_runs(src, 200)
    if runs.empty:
        st.info("no eval runs stored yet: `tailscope eval run --suite smoke-qa`")
        return
    runs = runs.assign(pass_rate=runs["passed"] / runs["cases"].clip(lower=1))
    st.subheader("Runs")
    st.dataframe(runs, hide_index=True, column_config={
        "pass_rate": st.column_config.ProgressColumn("pass rate", min_value=0, max_value=1)})
    ids = list(runs["run_id"])
    for key in ("ev_a", "ev_b"):  # a run id from the URL that is not stored: ignore it
        if st.session_state.get(key) not in (None, *ids):
            del st.session_state[key]
    c1, c2 = st.columns(2)
    a = c1.selectbox("Baseline run (A)", ids, index=min(1, len(ids) - 1), key="ev_a")
    b = c2.selectbox("Candidate run (B)", ids, index=0, key="ev_b")
    run_a, res_a = C.load_run(src, a)
    run_b, res_b = C.load_run(src, b)
    cmp = C.compare(run_a, res_a, run_b, res_b)
    m1, m2, m3, m4 = st.columns(4)
    m1.metric("Verdict", cmp.verdict.upper())
    m2.metric("Pass rate B", f"{cmp.pass_rate_b:.1%}",
              f"{(cmp.pass_rate_b - cmp.pass_rate_a) * 100:+.1f} points")
    m3.metric("Newly failing / passing", f"{len(cmp.regressed)} / {len(cmp.fixed)}")
    m4.metric("McNemar p (one-sided)", f"{cmp.mcnemar_p:.4f}")
    st.caption(f"A: {a} (config {run_a['config_id']}) · B: {b} (config {run_b['config_id']}) · "
               "thresholds: the defaults of `tailscope eval compare`")
    st.subheader("Latency from the joined request records")
    st.dataframe(cmp.latency, hide_index=True)
    link = st.column_config.LinkColumn("trace (Trace view)", display_text=r"trace=(\w+)")
    changed = cmp.cases[cmp.cases["case_id"].isin(cmp.regressed + cmp.fixed)]
    st.subheader("Cases whose verdict changed")
    if changed.empty:
        st.info("no case changed between the runs")
    else:
        st.dataframe(pd.DataFrame({
            "case_id": changed["case_id"], "A": changed["passed_a"], "B": changed["passed_b"],
            "detail B": changed["detail_b"], "output B": changed["output_b"],
            "trace": changed["trace_id_b"].map(trace_link)}), hide_index=True,
            column_config={"trace": link})
    st.subheader("Reproducibility, case by case")
    st.caption("consistent: the run's own attempts of the case agreed (batch mixes, prefix-"
               "cache hits); same output: B gave A's text, else where it first parted")
    st.dataframe(C.reproducibility(res_a, res_b), hide_index=True)
    failing = res_b[~res_b["passed"]]
    st.subheader(f"Failing cases in B ({len(failing)} of {len(res_b)})")
    if not failing.empty:
        st.dataframe(pd.DataFrame({
            "case_id": failing["case_id"], "detail": failing["detail"],
            "output": failing["output"], "finish_reason": failing["finish_reason"],
            "e2e_ms": failing["e2e_ms"], "trace": failing["trace_id"].map(trace_link)}),
            hide_index=True, column_config={"trace": link})


def whatif_page(src, now: dt.datetime) -> None:
    runs = Q.whatif_runs(src, 200)
    if runs.empty:
        st.info("no what-if runs stored yet: `tailscope whatif --window FROM..TO --set "
                "max_num_seqs=32` or `tailscope size --slo ttft_ms=500 --peak-rate 10`")
        return
    st.subheader("Runs")
    st.dataframe(runs[["run_id", "ts", "kind", "window_start", "window_end", "replicas",
                       "config_id"]], hide_index=True)
    ids = list(runs["run_id"])
    if st.session_state.get("wi_run") not in (None, *ids):
        del st.session_state["wi_run"]
    run = runs.iloc[ids.index(st.selectbox("Run", ids, key="wi_run"))]
    params, cost, results = run["params"], run["step_cost"], run["results"]
    err = cost.get("error") or {}
    st.caption(f"window {run['window_start']} .. {run['window_end']} · replica(s) "
               f"{run['replicas']} · recorded config {run['config_id']} · step cost (ms) = "
               + " + ".join(f"{c:.4g}×{f}" for c, f in zip(cost.get("coef", []),
                                                          cost.get("features", []),
                                                          strict=False))
               + (" + an offset for steps of " + ", ".join(
                   f"{k} ({v:+.1f} ms)" for k, v in offsets.items()) + " tokens"
                  if (offsets := cost.get("offsets")) else "")
               + (f" · held-out error median {err['median_rel']:.1%}, p95 "
                  f"{err['p95_rel']:.1%}" if err else "")
               + (f" · replicas on one host: a step beside b others costs 1 + "
                  f"{cont['beta']:.3f}×b ({cont['source']})"
                  if (cont := results.get("contention")) and cont.get("beta") else ""))
    st.json(params, expanded=False)
    if run["kind"] == "size":
        m1, m2, m3 = st.columns(3)
        formula = results.get("formula_replicas", results["replicas"])
        m1.metric("Replicas", results["replicas"], help=None if formula == results["replicas"]
                  else f"ceil(peak / (c x rho)) = {formula}; raised until the what-if at N "
                       "meets the SLO (replicas on one host slow each other)")
        m2.metric("Per-replica goodput c", f"{results['per_replica_goodput_rps']:.2f} req/s")
        m3.metric("Peak rate", f"{results['peak_rate_rps']:g} req/s")
        st.dataframe(pd.DataFrame(results["checks"]).drop(columns=["ttft_ms"]),
                     hide_index=True)
        return
    table = Q.whatif_table(results)
    st.subheader("Predicted and recorded (ms)")
    st.dataframe(table, hide_index=True)
    warn = results.get("extrapolated_warn", 0.25)
    far = table[table["extrapolated"].fillna(0) > warn].drop_duplicates(["rate_scale", "column"])
    for _, row in far.iterrows():
        st.warning(f"{row['column']} at rate scale {row['rate_scale']:g}: "
                   f"{row['extrapolated']:.0%} of its simulated busy time is in step batch "
                   "sizes the window barely recorded, so their cost is extrapolated; a window "
                   "with quieter stretches as well as bursts pins it down")
    if table["rate_scale"].nunique() > 1:
        st.subheader("TTFT p99 over the offered rate")
        ttft = table[(table["metric"] == "ttft_ms") & (table["column"] != "recorded")]
        st.line_chart(ttft.pivot_table(index="offered_rps", columns="column", values="p99"))


def tokenizer_text(ids: list[int], revision: str, paths: list[str]) -> str | None:
    """The ids' text from the first tokenizer at ``paths`` whose revision is the record's;
    None when none is (another model's ids must never be shown as bundled-tokenizer text)."""
    from engine.text import load_tokenizer

    for path in paths:
        try:
            tok = load_tokenizer(path)
        except (FileNotFoundError, ImportError, ValueError, OSError):
            continue
        if revision and tok.revision == revision:
            return tok.decode(list(ids))
    return None


@st.cache_data
def decode(ids: tuple[int, ...], revision: str) -> str | None:
    """Text of a record's ids with its own tokenizer: those listed in
    ``TAILSCOPE_DRILL_TOKENIZERS`` (paths, ``os.pathsep``-separated), then the bundled one."""
    paths = env.drill_tokenizers()
    try:
        from engine.loader.paths import default_model_path

        paths.append(str(default_model_path()))
    except (FileNotFoundError, ImportError):
        pass
    return tokenizer_text(list(ids), revision, paths)


def main() -> None:
    st.set_page_config(page_title="Tailscope drill-down", layout="wide")
    spec = source_spec()
    params = st.query_params  # links in (e.g. from Grafana): ?page=Requests&trace=<trace id>
    if "page" not in st.session_state and params.get("page") in PAGES:
        st.session_state["page"] = params["page"]
    if "rq_trace" not in st.session_state and params.get("trace"):
        st.session_state["rq_trace"] = params["trace"]
    for key in ("a", "b"):  # ?page=Evals&a=RUN&b=RUN
        if f"ev_{key}" not in st.session_state and params.get(key):
            st.session_state[f"ev_{key}"] = params[key]
    page = st.sidebar.radio("Page", PAGES, key="page")
    st.sidebar.caption(f"Data source: `{spec}`")
    st.title(f"Tailscope · {page}")
    st.caption(f"Data source: {spec}")
    try:
        src = open_source(spec)
    except Exception as exc:  # a wrong DSN or a locked chDB directory: say so on the page
        st.error(f"cannot open the data source {spec}: {exc}")
        return
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    try:
        {"Overview": overview, "Regression": regression, "Requests": requests_page,
         "Evals": evals_page, "What-if": whatif_page}[page](src, now)
    except Q.QueryError as exc:
        st.error(str(exc))


main()
