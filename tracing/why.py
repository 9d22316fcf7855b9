"""``why``: a slow request's slowest inter-token gaps explained by the engine steps inside
them (their time, the time between them, the batch, and the prefill other requests and tenants
brought in), and its queue wait by cause with the requests each cause names. Read from the
record's ``token_steps``, the ``engine_steps`` membership and the wait notes; the CLI's ``tailscope
why``, ``/debug/requests/{id}`` and the drill-down show it."""

from __future__ import annotations

from tracing import timing
from tracing.queries import QueryError, frame, pd

WHY_RECORD = ("SELECT replica, toUnixTimestamp64Micro(arrival_ts) AS arrival_us, e2e_ms, "
              "token_steps, engine_queue_ms, preempted_ms, detail_kept, detail_reason, "
              + ", ".join(c.column for c in timing.CAUSES)
              + " FROM tailscope.requests WHERE trace_id = {t:String} LIMIT 1")
WHY_WAITS = ("SELECT detail FROM tailscope.request_events WHERE trace_id = {t:String} AND "
             "state = 'WAIT' ORDER BY ts, seq")
WHY_STEPS = ("SELECT step, toUnixTimestamp64Micro(ts) AS ts_us, duration_ms, num_seqs, "
             "prefill_tokens, member_traces, member_prefill FROM tailscope.engine_steps "
             "WHERE replica = {r:String} AND ts >= fromUnixTimestamp64Micro({a:Int64}, 'UTC') "
             "AND ts <= fromUnixTimestamp64Micro({b:Int64}, 'UTC') ORDER BY ts, step")

TENANTS_OF = ("SELECT trace_id, any(tenant) AS tenant FROM tailscope.requests WHERE "
              "trace_id IN {ids:Array(String)} GROUP BY trace_id")
_WHY_COLUMNS = ["token", "gap_ms", "step_ms", "idle_ms", "steps", "max_batch",
                "neighbour_prefill_tokens", "neighbours", "neighbour_tenants"]


def why(source, trace_id: str, top: int = 5) -> tuple[pd.DataFrame, str]:
    """The request's slowest inter-token gaps, each explained by the engine steps inside it: how
    many steps, their time and the time between them (``idle_ms``: the engine idle, waiting or
    descheduled), the largest batch, and the prefill tokens other requests (its neighbours,
    with their tenants) brought into those steps. From the record's ``token_steps`` (the step that
    produced each token) and ``engine_steps``' membership; returns the table (slowest first)
    and one sentence. A trace id the store has no record of is a ``QueryError``."""
    trace_id = trace_id.lower()
    rec = frame(source, WHY_RECORD, {"t": trace_id})
    if rec.empty:
        raise QueryError(f"no record for trace {trace_id}")
    r = rec.iloc[0]
    waited = _waits_sentence(source, trace_id, r)
    token_steps = [int(x) for x in (r["token_steps"] if r["token_steps"] is not None else [])]
    if not bool(r["detail_kept"]):
        return pd.DataFrame(columns=_WHY_COLUMNS), (
            "its step detail was not kept (tail-based retention: an ordinary request, not "
            "sampled)" + waited)
    if len(token_steps) < 2 or not all(token_steps):
        return pd.DataFrame(columns=_WHY_COLUMNS), (
            "no step detail for this request (fewer than two tokens, token ids not captured, "
            "or a backend that reports no engine steps)" + waited)
    start = int(r["arrival_us"])
    steps = frame(source, WHY_STEPS, {"r": str(r["replica"]), "a": start,
                                      "b": start + int(float(r["e2e_ms"]) * 1000) + 1})
    by_step = {int(s.step): s for s in steps.itertuples(index=False)}

    def end_us(step: int) -> float:
        s = by_step[step]
        return float(s.ts_us) + float(s.duration_ms) * 1000

    rows = []
    for k in range(1, len(token_steps)):
        a, b = token_steps[k - 1], token_steps[k]
        inside = [by_step[n] for n in range(a + 1, b + 1) if n in by_step]
        if a not in by_step or b not in by_step or not inside:
            continue
        neighbours: dict[str, int] = {}
        for s in inside:
            for t, p in zip(s.member_traces, s.member_prefill, strict=False):
                if t != trace_id and int(p) > 0:
                    neighbours[t] = neighbours.get(t, 0) + int(p)
        gap = (end_us(b) - end_us(a)) / 1000
        step_ms = sum(float(s.duration_ms) for s in inside)
        rows.append({"token": k, "gap_ms": gap, "step_ms": step_ms, "idle_ms": gap - step_ms,
                     "steps": len(inside), "max_batch": max(int(s.num_seqs) for s in inside),
                     "neighbour_prefill_tokens": sum(neighbours.values()),
                     "neighbours": neighbours})
    if not rows:
        return pd.DataFrame(columns=_WHY_COLUMNS), "its engine steps are not in the store" + \
            waited
    gaps = pd.DataFrame(rows).sort_values("gap_ms", ascending=False).head(top)
    named = sorted({t for n in gaps["neighbours"] for t in n})
    tenants: dict[str, str] = {}
    if named:
        cols, got = source.select(TENANTS_OF, {"ids": named})
        tenants = {str(row[0]): str(row[1]) for row in got}
    gaps["neighbour_tenants"] = [sorted({tenants.get(t, "?") for t in n}) for n in
                                 gaps["neighbours"]]
    return gaps.reset_index(drop=True)[_WHY_COLUMNS], _why_sentence(gaps, tenants) + waited


_WAIT_PHRASES = {"step": ("for the step in progress", ""),
                 "budget": ("on the token budget", "used by"),
                 "kv": ("for KV blocks", "held by"), "seqs": ("at max_num_seqs", ""),
                 "hol": ("behind the head of the queue", ""),
                 "share": ("for other tenants' fair share", "behind")}


def _waits_sentence(source, trace_id: str, r) -> str:
    """"; it waited N ms to run: A ms for KV blocks (held by ...), ..." from the record's
    wait-cause columns and its wait notes (the requests each cause names, as trace ids)."""
    total = float(r["engine_queue_ms"] or 0) + float(r["preempted_ms"] or 0)
    parts = sorted(((float(r[c.column] or 0), c) for c in timing.CAUSES), key=lambda x: -x[0])
    if total < 1 or not any(ms >= 1 for ms, _ in parts):
        return ""
    held: dict[str, list[str]] = {}
    _, rows = source.select(WHY_WAITS, {"t": trace_id})
    for (detail,) in rows:
        cause, _, rest = str(detail).partition(":")
        if "[" in rest and rest.endswith("]"):
            for who in rest[rest.rindex("[") + 1:-1].split(", "):
                if who and who not in held.setdefault(cause, []):
                    held[cause].append(who)
    said = []
    for ms, c in parts:
        if ms >= 1:
            cause = c.opened_by[0]
            phrase, verb = _WAIT_PHRASES[cause]
            who = held.get(cause, [])
            names = " ".join(filter(None, (verb, ", ".join(who[:3])))) if who else ""
            said.append(f"{ms:.0f} ms {phrase}" + (f" ({names})" if names else ""))
    return f"; it waited {total:.0f} ms to run: " + ", ".join(said)


def _why_sentence(gaps: pd.DataFrame, tenants: dict[str, str]) -> str:
    ms = ", ".join(f"{g:.0f}" for g in gaps["gap_ms"])
    crowded = gaps[gaps["neighbour_prefill_tokens"] > 0]
    idle = gaps["idle_ms"].sum() / max(1e-9, gaps["gap_ms"].sum())
    between = (f"; {idle:.0%} of that time was between engine steps (the engine idle or "
               "descheduled)") if idle >= 0.25 else ""
    if crowded.empty:
        return (f"its {len(gaps)} slowest gaps ({ms} ms) had no other request's prefill in "
                f"them: decode batches of up to {int(gaps['max_batch'].max())}{between}")
    who: dict[str, int] = {}
    for n in crowded["neighbours"]:
        for t, p in n.items():
            who[tenants.get(t, "?")] = who.get(tenants.get(t, "?"), 0) + p
    by_tenant = ", ".join(f"tenant {t}: {p} prompt tokens"
                          for t, p in sorted(who.items(), key=lambda kv: -kv[1]))
    requests = len({t for n in crowded["neighbours"] for t in n})
    return (f"{len(crowded)} of its {len(gaps)} slowest gaps ({ms} ms) were steps carrying "
            f"prefill chunks of {requests} other request{'s' * (requests != 1)} "
            f"({by_tenant}){between}")
