"""The eval runner: sends a suite's cases to a gateway over HTTP, scores the answers, and stores
the run through the gateway (``POST /debug/eval-runs``) so every result joins its request record
by trace id.

Order of sending: every case's first attempt goes out concurrently (``concurrency`` at a time,
so the engine batches them together); the later attempts of cases with ``repeat`` go one at a
time afterwards, so each repeat runs in a different batch mix from its first attempt (what the
``determinism`` suite checks). Each request carries ``x-tailscope-bench-run: <run id>`` (stored
as ``requests.bench_run``), and the trace id comes back in ``x-tailscope-trace-id``.

``GatewayProcess`` starts ``tailscope serve --engine-config FILE`` on a free port for a run and
stops it with SIGTERM (the gateway then drains its record writer), so a run against a config
file needs nothing running beforehand.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from evals.cases import VARIES, Case, divergence, load_cases, score
from tracing import queries as Q
from tracing.client import GatewayProcess as _Gateway
from tracing.client import GatewayStartError, sse_json

SUITES_DIR = Path(__file__).resolve().parent / "suites"
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


class EvalError(RuntimeError):
    pass


def builtin_suites() -> list[str]:
    return sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))


def load_suite(name_or_path: str) -> tuple[str, list[Case]]:
    """A built-in suite by name (``evals/suites/NAME.yaml``) or a YAML/JSONL file."""
    path = Path(name_or_path)
    if not path.exists():
        path = SUITES_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise EvalError(f"no suite {name_or_path!r}: not a file, and the built-in suites "
                            f"are {', '.join(builtin_suites())}")
    return path.stem, load_cases(path)


@dataclass
class Attempt:
    trace_id: str = ""
    status: int = 0
    choices: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    error: str = ""


@dataclass
class CaseResult:
    case_id: str
    trace_id: str
    score: float
    passed: bool
    detail: str
    tags: list[str]
    output: str
    finish_reason: str
    weight: float


def _body(case: Case, model: str) -> tuple[str, dict]:
    body = {"model": model, **case.params}
    if case.messages is not None:
        body["messages"] = case.messages
        return "/v1/chat/completions", body
    body["prompt"] = case.prompt
    return "/v1/completions", body


def _text(choice: dict, chat: bool, stream: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    part = choice.get("delta" if stream else "message") or {}
    return part.get("content") or ""


async def send(client: httpx.AsyncClient, case: Case, model: str, run_id: str) -> Attempt:
    path, body = _body(case, model)
    chat = path.endswith("chat/completions")
    headers = {"x-tailscope-bench-run": run_id}
    att = Attempt()
    try:
        if body.get("stream"):
            body.setdefault("stream_options", {"include_usage": True})
            texts: dict[int, str] = {}
            finish: dict[int, str] = {}
            async with client.stream("POST", path, json=body, headers=headers) as r:
                att.trace_id, att.status = r.headers.get("x-tailscope-trace-id", ""), r.status_code
                if r.status_code != 200:
                    await r.aread()
                    att.error = f"HTTP {r.status_code}: {_message(r)}"
                    return att
                async for line in r.aiter_lines():
                    chunk = sse_json(line)
                    if chunk is None:
                        continue
                    if chunk.get("error"):
                        att.error = f"stream error: {chunk['error'].get('message')}"
                    if chunk.get("usage"):
                        att.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    for c in chunk.get("choices") or []:
                        i = c.get("index", 0)
                        texts[i] = texts.get(i, "") + _text(c, chat, True)
                        if c.get("finish_reason"):
                            finish[i] = c["finish_reason"]
            att.choices = [texts[i] for i in sorted(texts)]
            att.finish_reason = finish.get(0)
            return att
        r = await client.post(path, json=body, headers=headers)
        att.trace_id, att.status = r.headers.get("x-tailscope-trace-id", ""), r.status_code
        if r.status_code != 200:
            att.error = f"HTTP {r.status_code}: {_message(r)}"
            return att
        data = r.json()
        choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
        att.choices = [_text(c, chat, False) for c in choices]
        att.finish_reason = choices[0].get("finish_reason") if choices else None
        att.prompt_tokens = (data.get("usage") or {}).get("prompt_tokens")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        att.error = f"request failed: {exc!r}"
    return att


def _message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def judge(case: Case, attempts: list[Attempt]) -> CaseResult:
    first = attempts[0]
    output = first.choices[0] if first.choices else ""
    failed = [a.error for a in attempts if a.error]
    if failed:  # an HTTP or stream error fails the case whatever the text says
        return CaseResult(case.id, first.trace_id, 0.0, False, "; ".join(failed[:2]),
                          list(case.tags), output, first.finish_reason or "", case.weight)
    s = score(case, output, first.finish_reason, choices=first.choices,
              repeats=[a.choices for a in attempts[1:]], prompt_tokens=first.prompt_tokens)
    return CaseResult(case.id, first.trace_id, s.score, s.passed, s.detail, list(case.tags),
                      output, first.finish_reason or "", case.weight)


async def run_cases(url: str, cases: list[Case], run_id: str, model: str,
                    concurrency: int = 8, api_key: str | None = None,
                    timeout_s: float = 300.0) -> list[CaseResult]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=timeout_s) as client:
        gate = asyncio.Semaphore(concurrency)

        async def first(case: Case) -> Attempt:
            async with gate:
                return await send(client, case, model, run_id)

        firsts = await asyncio.gather(*(first(c) for c in cases))
        attempts = {c.id: [a] for c, a in zip(cases, firsts, strict=True)}
        for case in cases:  # repeats one at a time: a different batch mix from the first
            for _ in range(case.repeat - 1):
                attempts[case.id].append(await send(client, case, model, run_id))
    return [judge(c, attempts[c.id]) for c in cases]


def new_run_id(suite: str) -> str:
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    return f"eval-{suite}-{stamp}-{secrets.token_hex(3)}"[:64]


# ---- talking to the gateway ---------------------------------------------------------------
def _admin(admin_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {admin_key}"} if admin_key else {}


def gateway_config(url: str) -> dict:
    r = httpx.get(f"{url.rstrip('/')}/debug/config", timeout=30)
    if r.status_code != 200:
        raise EvalError(f"{url}/debug/config answered {r.status_code}: is it a Tailscope "
                        "gateway?")
    return r.json()


def store_run(url: str, run: dict, results: list[CaseResult], admin_key: str | None) -> dict:
    r = httpx.post(f"{url.rstrip('/')}/debug/eval-runs", headers=_admin(admin_key),
                   json={"run": run, "results": [asdict(x) for x in results]}, timeout=60)
    if r.status_code != 200:
        raise EvalError(f"storing the run failed: HTTP {r.status_code}: {_message(r)}")
    return r.json()


def wait_for_records(url: str, trace_ids: list[str], admin_key: str | None,
                     timeout_s: float = 30.0) -> int:
    """The gateway writes records in batches: wait until the run's requests are queryable."""
    want = len({t for t in trace_ids if t})
    deadline, found = time.monotonic() + timeout_s, 0
    source = Q.GatewaySource(url, admin_key, timeout_s=30)
    while True:
        with contextlib.suppress(Q.QueryError, httpx.HTTPError):
            found = Q.records_found(source, trace_ids)
        if found >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


class GatewayProcess(_Gateway):
    """``tailscope serve --engine-config FILE`` in a child process, for the length of a run."""

    def __init__(self, config_path: str | Path, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 300.0, log_path: str | Path | None = None) -> None:
        self.config_path = str(config_path)
        super().__init__(["--engine-config", self.config_path], env, ready_timeout_s,
                         log=log_path, quiet=True)

    def __enter__(self) -> GatewayProcess:
        try:
            return self.start()
        except GatewayStartError as exc:
            raise EvalError(f"the gateway for {self.config_path}: {exc}") from None


@dataclass
class RunSummary:
    run_id: str
    suite: str
    config_id: str
    config_name: str
    results: list[CaseResult]
    records_found: int

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    def text(self) -> str:
        n = len(self.results)
        weight = sum(r.weight for r in self.results) or 1.0
        wscore = sum(r.score * r.weight for r in self.results) / weight
        lines = [f"run {self.run_id}: suite {self.suite}, config {self.config_name or '-'} "
                 f"({self.config_id})",
                 f"passed {self.passed}/{n} ({self.passed / max(n, 1):.1%}), weighted score "
                 f"{wscore:.3f}; {self.records_found}/{n} request records joined"]
        tags: dict[str, list[bool]] = {}
        for r in self.results:
            for t in r.tags:
                tags.setdefault(t, []).append(r.passed)
        if tags:
            lines.append("by tag: " + ", ".join(f"{t} {sum(v)}/{len(v)}"
                                                for t, v in sorted(tags.items())))
        for r in self.results:
            if not r.passed:
                lines.append(f"  FAIL {r.case_id} (trace {r.trace_id or '-'}): {r.detail}")
        return "\n".join(lines)


def run(url: str, suite: str, cases: list[Case], *, concurrency: int = 8,
        api_key: str | None = None, admin_key: str | None = None,
        run_id: str | None = None, model: str | None = None) -> RunSummary:
    """Run a suite against the gateway at ``url`` and store it there; the run's config is the
    gateway's own (``GET /debug/config``). ``model``: one of its served models (default its
    bundled replicas'), e.g. an external backend's: the run's config notes which."""
    cfg = gateway_config(url)
    model = model or cfg["config"]["served_model_name"]
    run_id = run_id or new_run_id(suite)
    results = asyncio.run(run_cases(url, cases, run_id, model, concurrency, api_key))
    store_run(url, {"run_id": run_id, "suite": suite, "config_id": cfg["config_id"],
                    "config": {"name": cfg.get("name", ""), **cfg["config"], "eval_model": model,
                               "versions": cfg.get("versions", {})}, "url": url},
              results, admin_key)
    found = wait_for_records(url, [r.trace_id for r in results], admin_key)
    return RunSummary(run_id, suite, cfg["config_id"], cfg.get("name", ""), results, found)


def across_configs(summaries: list[RunSummary]) -> str:
    """The reproducibility report of one suite run on several configs: per case, whether each
    run's own attempts agreed (batch mixes, prefix-cache hits: the ``consistent`` check) and
    whether each config gave the first config's output, and where it first parted."""
    base = summaries[0]
    label = base.config_name or base.config_id
    lines = [f"reproducibility across {len(summaries)} configs (baseline {label}, "
             f"run {base.run_id}):"]
    names = [s.config_name or s.config_id for s in summaries]
    lines.append(f"{'case':<28}" + "".join(f"{n[:24]:>26}" for n in names))
    by_run = [{r.case_id: r for r in s.results} for s in summaries]
    parted: list[str] = []
    for r0 in base.results:
        cells = []
        for name, results in zip(names, by_run, strict=True):
            r = results.get(r0.case_id)
            if r is None:
                cells.append("-")
                continue
            within = "consistent" if VARIES not in r.detail else "varies"
            same = r.output == r0.output
            cells.append(f"{within}, {'same' if same else 'DIFFERS'}")
            if not same:
                parted.append(f"  {r0.case_id} on {name}: "
                              + divergence([r0.output], [r.output]).replace("in choice 0 ", ""))
        lines.append(f"{r0.case_id:<28}" + "".join(f"{c:>26}" for c in cells))
    identical = sum(all(res.get(r.case_id) is not None and res[r.case_id].output == r.output
                        for res in by_run) for r in base.results)
    lines.append(f"{identical}/{len(base.results)} cases gave the same output on every config")
    return "\n".join(lines + parted)
