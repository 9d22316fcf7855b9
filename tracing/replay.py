"""Replay a recorded request and say whether it came out the same.

A record holds what the engine was given: the prompt's token ids (``input_token_ids``, after
the chat template and tools were rendered), the sampling parameters as sent to the engine
(``sampling_params``: penalties, logit bias, stop strings and token ids, the response format's
schema, logprobs settings, ``n``, the seed), and its ``config_id`` (the store's ``configs``
table holds that config). A replay sends those token ids with those parameters to a gateway as
a ``/v1/completions`` request, so it runs through the same scheduler, engine and sampler as any
request and gets a trace record of its own; the chat template is not rendered again.

The replay asks for ``logprobs`` (to show both tokens' log-probabilities where the outputs part)
and ``return_token_ids``; neither changes what is sampled. It compares choice 0's token ids
(the ones the record keeps) with the record's.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

STAGES = ("ttft_ms", "tpot_ms", "e2e_ms", "engine_queue_ms", "prefill_ms", "decode_ms",
          "preempted_ms", "cached_tokens", "replica")
REPLAY_LOGPROBS = 5


class ReplayRefused(ValueError):
    """The record cannot be replayed; the message says why."""


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, str):  # a JSON array (e.g. read back through a JSON export)
        value = json.loads(value)
    return [int(t) for t in value]


def replay_params(record: dict) -> dict:
    """The record's sampling parameters, or ``ReplayRefused`` saying what is missing."""
    trace = record.get("trace_id", "?")
    status = int(record.get("http_status") or 0)
    if status >= 400 and not record.get("generated_tokens"):
        raise ReplayRefused(
            f"trace {trace} was answered {status} ({record.get('error_type') or 'error'}: "
            f"{(record.get('error_message') or '')[:200]}) before the engine ran it: "
            "there is nothing to replay")
    if record.get("timing_source") in ("upstream", "gateway"):
        raise ReplayRefused(f"trace {trace} ran on the external backend {record.get('replica')!r}"
                            ": replay runs recorded requests on the bundled engine")
    if not _ids(record.get("input_token_ids")):
        if record.get("detail_kept") is False or record.get("detail_reason") == "dropped":
            raise ReplayRefused(
                f"trace {trace} cannot be replayed: tail-based retention dropped its token ids "
                f"(detail_reason {record.get('detail_reason')!r}; TAILSCOPE_DETAIL_SAMPLE=1 "
                "keeps every request's)")
        raise ReplayRefused(
            f"trace {trace} cannot be replayed: its record holds token counts but no token ids "
            "(its tenant's capture = \"counts\", or the gateway ran with "
            "TAILSCOPE_RECORD_TOKEN_IDS=false), so the prompt it sent is not known")
    raw = record.get("sampling_params") or ""
    if not raw:
        raise ReplayRefused(f"trace {trace} was recorded before records kept their sampling "
                            "parameters (sampling_params is empty): it cannot be rebuilt")
    params = json.loads(raw) if isinstance(raw, str) else dict(raw)
    if params.get("scoring"):
        raise ReplayRefused(f"trace {trace} scored its prompt (echo with max_tokens 0): it "
                            "generated nothing to compare")
    return params


def completion_body(record: dict, model: str) -> dict:
    """The ``/v1/completions`` body that sends the recorded request again."""
    p = replay_params(record)
    e = p["engine"]
    body: dict[str, Any] = {
        "model": model, "prompt": _ids(record["input_token_ids"]),
        "max_tokens": e["max_tokens"], "temperature": e["temperature"], "top_p": e["top_p"],
        "top_k": e["top_k"], "min_p": e["min_p"], "typical_p": e["typical_p"],
        "repetition_penalty": e["repetition_penalty"],
        "frequency_penalty": e["frequency_penalty"], "presence_penalty": e["presence_penalty"],
        "logit_bias": {str(k): v for k, v in (e.get("logit_bias") or {}).items()},
        "seed": e.get("seed"), "ignore_eos": e["ignore_eos"],
        "stop_token_ids": list(e.get("stop_token_ids") or []),
        "n": p.get("n", 1), "stop": list(p.get("stop") or []),
        "include_stop_str_in_output": bool(p.get("include_stop_str_in_output")),
        "skip_special_tokens": p.get("skip_special_tokens", True),
        "logprobs": max(REPLAY_LOGPROBS, e.get("top_logprobs") or 0),
        "return_token_ids": True,
    }
    if e.get("prompt_logprobs") is not None:
        body["prompt_logprobs"] = e["prompt_logprobs"]
    if e.get("priority"):
        body["priority"] = e["priority"]
    if e.get("min_tokens"):  # older records have none: 0
        body["min_tokens"] = e["min_tokens"]
    if e.get("allowed_token_ids") is not None:
        body["allowed_token_ids"] = list(e["allowed_token_ids"])
    s = e.get("structured")
    if s and s["kind"] in ("regex", "choice", "grammar"):  # sent as vLLM's structured_outputs
        body["structured_outputs"] = {s["kind"]: json.loads(s["schema"])
                                      if s["kind"] == "choice" else s["schema"]}
    elif s:
        body["response_format"] = {"type": "json_object"} if s["kind"] == "json_object" else {
            "type": "json_schema", "json_schema": {"name": "replay",
                                                   "schema": json.loads(s["schema"])}}
    return body


@dataclass
class Divergence:
    position: int  # index into choice 0's generated tokens
    recorded_token: int | None  # None: the record ended here
    replay_token: int | None  # None: the replay ended here
    recorded_text: str = ""
    replay_text: str = ""
    # the replay's log-probabilities (of its own token, and of the recorded one when it was
    # among the top alternatives; None otherwise)
    replay_logprob: float | None = None
    recorded_token_logprob_in_replay: float | None = None


@dataclass
class ReplayResult:
    trace_id: str  # the replay's own trace
    status: int
    identical: bool = False
    token_ids: list[int] = field(default_factory=list)
    divergence: Divergence | None = None
    text: str = ""
    error: str = ""
    stages: dict = field(default_factory=dict)  # the replay's record's stage timings


def first_divergence(recorded: list[int], replayed: list[int], prefix_only: bool = False
                     ) -> int | None:
    """The first position where the two differ (one ending early counts), or None.
    ``prefix_only``: a stop string ended the request, and the tokens sampled after it while
    the stop travelled to the engine depend on timing: only the common length is compared."""
    for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
        if a != b:
            return i
    if prefix_only or len(recorded) == len(replayed):
        return None
    return min(len(recorded), len(replayed))


def _logprob_entries(choice: dict) -> list[tuple[float | None, dict[str, float]]]:
    """The completions ``logprobs`` object -> per token (its logprob, {alt text: logprob})."""
    lp = choice.get("logprobs") or {}
    tops = lp.get("top_logprobs") or []
    return [(value, dict(tops[i] or {}) if i < len(tops) else {})
            for i, value in enumerate(lp.get("token_logprobs") or [])]


async def _send(client: httpx.AsyncClient, body: dict, headers: dict) -> httpx.Response:
    return await client.post("/v1/completions", json=body, headers=headers)


async def _background(client: httpx.AsyncClient, model: str, headers: dict, stop: asyncio.Event,
                      seed: int) -> int:
    """Other traffic while the replays run: prompts of assorted lengths, sampled, so the
    replays share their steps with requests unlike them."""
    rng = random.Random(seed)
    sent = 0
    while not stop.is_set():
        n = rng.choice((3, 17, 60, 140))
        body = {"model": model, "prompt": [rng.randrange(100, 30000) for _ in range(n)],
                "max_tokens": rng.choice((4, 12, 24)), "temperature": 0.9,
                "seed": rng.randrange(1 << 30), "ignore_eos": True}
        await client.post("/v1/completions", json=body, headers=headers)
        sent += 1
    return sent


async def run_replays(url: str, record: dict, model: str, copies: int = 1,
                      background: int = 0, api_key: str | None = None,
                      admin_key: str | None = None, timeout_s: float = 300.0
                      ) -> list[ReplayResult]:
    """Send the recorded request ``copies`` times at once to the gateway at ``url`` (with
    ``background`` streams of other traffic alongside), and compare each with the record."""
    body = completion_body(record, model)
    recorded = _ids(record.get("output_token_ids"))
    by_stop = record.get("finish_reason") == "stop_string"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    admin = {"Authorization": f"Bearer {admin_key}"} if admin_key else headers
    limits = httpx.Limits(max_connections=copies + background + 4)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s,
                                 limits=limits) as client:
        stop = asyncio.Event()
        others = [asyncio.ensure_future(_background(client, model, headers, stop, i))
                  for i in range(background)]
        if others:
            await asyncio.sleep(0.05)  # they are in the engine when the replays arrive
        try:
            responses = await asyncio.gather(*(_send(client, body, headers)
                                               for _ in range(copies)))
        finally:
            stop.set()
            if others:
                await asyncio.gather(*others, return_exceptions=True)
        results = []
        for r in responses:
            results.append(await _result(client, r, recorded, by_stop, headers, admin))
    return results


async def _result(client: httpx.AsyncClient, r: httpx.Response, recorded: list[int],
                  by_stop: bool, headers: dict, admin: dict) -> ReplayResult:
    res = ReplayResult(trace_id=r.headers.get("x-tailscope-trace-id", ""), status=r.status_code)
    if r.status_code != 200:
        try:
            res.error = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            res.error = r.text[:300]
        return res
    choice = sorted(r.json()["choices"], key=lambda c: c.get("index", 0))[0]
    res.token_ids, res.text = list(choice.get("token_ids") or []), choice.get("text") or ""
    at = first_divergence(recorded, res.token_ids,
                          prefix_only=by_stop and choice.get("finish_reason") == "stop")
    res.identical = at is None
    if at is not None:
        entries = _logprob_entries(choice)
        d = Divergence(at, recorded[at] if at < len(recorded) else None,
                       res.token_ids[at] if at < len(res.token_ids) else None)
        d.recorded_text = await detokenize(client, [d.recorded_token], headers) \
            if d.recorded_token is not None else ""
        d.replay_text = await detokenize(client, [d.replay_token], headers) \
            if d.replay_token is not None else ""
        if at < len(entries):
            d.replay_logprob, alts = entries[at]
            if d.recorded_token is not None:
                d.recorded_token_logprob_in_replay = alts.get(d.recorded_text)
        res.divergence = d
    detail = await client.get(f"/debug/requests/{res.trace_id}", headers=admin)
    if detail.status_code == 200:
        rec = detail.json().get("record") or {}
        res.stages = {k: rec.get(k) for k in STAGES}
    return res


async def detokenize(client: httpx.AsyncClient, ids: list[int], headers: dict) -> str:
    if not ids:
        return ""
    r = await client.post("/detokenize", json={"tokens": ids}, headers=headers)
    return r.json().get("prompt", "") if r.status_code == 200 else ""


def report(record: dict, results: list[ReplayResult], texts: dict[str, str] | None = None
           ) -> dict:
    """A JSON-able report: identical or not, where the first replay parted from the record
    (both tokens and the replay's logprobs), the texts, stage timings side by side."""
    texts = texts or {}
    first = results[0] if results else None
    return {
        "trace_id": record.get("trace_id"), "config_id": record.get("config_id"),
        "identical": bool(results) and all(r.identical for r in results),
        "replays": len(results), "identical_replays": sum(r.identical for r in results),
        "first_divergence": asdict(first.divergence) if first and first.divergence else None,
        "recorded_text": texts.get("recorded", ""), "replay_text": first.text if first else "",
        "stages": {"recorded": {k: record.get(k) for k in STAGES},
                   "replay": first.stages if first else {}},
        "replay_trace_ids": [r.trace_id for r in results],
        "errors": [r.error for r in results if r.error],
    }


def render(rep: dict) -> str:
    """The report as text (``tailscope replay``)."""
    lines = [f"trace {rep['trace_id']} (config {rep['config_id']}): "
             + ("IDENTICAL" if rep["identical"] else "DIFFERENT")
             + f" - {rep['identical_replays']}/{rep['replays']} replays identical"]
    d = rep.get("first_divergence")
    if d:
        def lp(v):
            return "not in the replay's top alternatives" if v is None else f"{v:.4f}"
        lines.append(f"first divergence at generated token {d['position']}: recorded "
                     f"{d['recorded_token']} {d['recorded_text']!r} (replay logprob "
                     f"{lp(d['recorded_token_logprob_in_replay'])}), replay "
                     f"{d['replay_token']} {d['replay_text']!r} (logprob "
                     f"{lp(d['replay_logprob'])})")
    lines.append(f"recorded: {rep['recorded_text']!r}")
    lines.append(f"replay:   {rep['replay_text']!r}")
    rec, rep_st = rep["stages"]["recorded"], rep["stages"]["replay"] or {}
    lines.append(f"{'stage':<18}{'recorded':>14}{'replay':>14}")
    for k in STAGES:
        a, b = rec.get(k), rep_st.get(k)
        fa = f"{a:.1f}" if isinstance(a, float) else str(a if a is not None else "-")
        fb = f"{b:.1f}" if isinstance(b, float) else str(b if b is not None else "-")
        lines.append(f"{k:<18}{fa:>14}{fb:>14}")
    lines.append("replay trace ids: " + ", ".join(rep["replay_trace_ids"]))
    lines.extend(f"error: {e}" for e in rep["errors"])
    return "\n".join(lines)


async def replay(url: str, record: dict, model: str, copies: int = 1, background: int = 0,
                 api_key: str | None = None, admin_key: str | None = None) -> dict:
    """Replay ``record`` on the gateway at ``url`` and return ``report``'s dict."""
    results = await run_replays(url, record, model, copies, background, api_key, admin_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=60) as client:
        text = await detokenize(client, _ids(record.get("output_token_ids")), headers)
    return report(record, results, {"recorded": text})


# ---- where a record and its config come from ----------------------------------------------
def fetch_record(source, trace_id: str, admin_key: str | None = None) -> dict:
    """The record of ``trace_id`` from a gateway URL (its memory or store:
    ``GET /debug/requests/ID``) or a ``tracing.store.Store``; ``LookupError`` if none."""
    from tracing import queries as Q

    trace_id = trace_id.strip().lower()
    if isinstance(source, str):
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        r = httpx.get(f"{source.rstrip('/')}/debug/requests/{trace_id}", headers=headers,
                      timeout=60)
        if r.status_code == 404:
            raise LookupError(f"no record for trace {trace_id} at {source}")
        if r.status_code != 200:
            raise LookupError(f"{source}/debug/requests/{trace_id} answered {r.status_code}: "
                              f"{r.text[:300]}")
        return r.json()["record"]
    cols, rows = source.select(Q.TRACE_RECORD, {"t": trace_id})
    if not rows:
        raise LookupError(f"no record for trace {trace_id} in the store")
    return dict(zip(cols, rows[0], strict=True))


def fetch_config(source, config_id: str, admin_key: str | None = None) -> dict | None:
    """The resolved config a ``config_id`` stands for (the ``configs`` table), or None."""
    from tracing import queries as Q

    reader = Q.GatewaySource(source, admin_key) if isinstance(source, str) else source
    _, rows = reader.select(Q.CONFIG_OF, {"c": config_id})
    if not rows:
        return None
    name, config = rows[0]
    return {"name": name, **json.loads(config)}


def config_file_text(config: dict) -> str:
    """An engine config file (``tailscope serve --engine-config``) for a stored config: the
    model, engine settings and sampling policy (external backends are left out: replay runs
    on the bundled engine)."""
    import yaml

    data = {"name": f"replay-of-{config.get('name') or 'recorded'}"}
    for key in ("model", "served_model_name", "replicas", "engine", "sampling"):
        if config.get(key) is not None:
            data[key] = config[key]
    if isinstance(data.get("engine"), dict):  # a stored config names no profile when exact
        data["engine"] = {"profile": "exact", **data["engine"]}
    return yaml.safe_dump(data, sort_keys=False)
