"""Compare two eval runs: per-case changes, quality with a paired test, latency from the joined
request records, and a verdict that can gate a rollout.

Quality. The runs are paired by case id. ``b`` cases passed in A and fail in B, ``c`` failed in A
and pass in B; McNemar's exact test (one-sided: "B is worse") gives
``p = P(X >= b)`` for ``X ~ Binomial(b + c, 1/2)``. Quality regresses when B's weighted pass
rate is more than ``max_pass_drop`` below A's **and** ``p <= alpha``. Greedy suites are
deterministic, so their flips are real: ``alpha=1`` (``--strict``) gates on any net loss.

More: docs/design/gateway-notes.md#evalscompare."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from tracing import queries as Q

LATENCY_METRICS = ("ttft_ms", "e2e_ms")


@dataclass(frozen=True)
class Thresholds:
    max_pass_drop: float = 0.0  # fraction of weighted pass rate
    alpha: float = 0.05  # McNemar one-sided p-value needed to call a quality regression
    max_p50_increase: float = 0.5  # latency ratio above 1 + this (lower bound) regresses
    max_p99_increase: float = 1.0
    confidence: float = 0.95
    resamples: int = 2000


@dataclass
class Comparison:
    run_a: dict
    run_b: dict
    cases: pd.DataFrame  # one row per case in both runs
    only_a: list[str]
    only_b: list[str]
    pass_rate_a: float
    pass_rate_b: float
    regressed: list[str]  # passed in A, fail in B
    fixed: list[str]
    changed_output: list[str]
    mcnemar_p: float
    quality_regressed: bool
    latency: pd.DataFrame  # metric, quantile, a, b, ratio, ratio_low, limit, regressed
    thresholds: Thresholds = field(default_factory=Thresholds)

    @property
    def latency_regressed(self) -> bool:
        return bool(self.latency["regressed"].any()) if not self.latency.empty else False

    @property
    def verdict(self) -> str:
        return "regressed" if self.quality_regressed or self.latency_regressed else "ok"


def list_runs(source, limit: int = 100) -> pd.DataFrame:
    return Q.eval_runs(source, limit)


def load_run(source, run_id: str) -> tuple[dict, pd.DataFrame]:
    """The run's row and its results, each joined with its request record's latency."""
    runs, results, records = Q.eval_run(source, run_id)
    if runs.empty:
        raise KeyError(f"no eval run {run_id!r}")
    run = runs.iloc[0].to_dict()
    try:
        run["config"] = json.loads(run.get("config") or "{}")
    except json.JSONDecodeError:
        run["config"] = {}
    if records.empty:
        records = pd.DataFrame(columns=["trace_id", "ttft_ms", "e2e_ms", "record_config_id",
                                        "final_state"])
    if results.empty:
        results = pd.DataFrame(columns=["case_id", "trace_id", "score", "passed", "detail",
                                        "output", "finish_reason", "weight", "tags"])
    results = results.merge(records, on="trace_id", how="left")
    results["passed"] = results["passed"].astype(bool)
    return run, results


def reproducibility(res_a: pd.DataFrame, res_b: pd.DataFrame) -> pd.DataFrame:
    """Case by case: whether each run's own attempts agreed (the ``consistent`` check: batch
    mixes, prefix-cache hits), whether B gave A's output, and where it first parted."""
    from evals.cases import VARIES, divergence

    b = res_b.set_index("case_id")
    rows = []
    for _, ra in res_a.iterrows():
        rb = b.loc[ra["case_id"]] if ra["case_id"] in b.index else None
        same = rb is not None and rb["output"] == ra["output"]
        rows.append({
            "case_id": ra["case_id"],
            "consistent A": VARIES not in ra["detail"],
            "consistent B": None if rb is None else VARIES not in rb["detail"],
            "same output": same,
            "first divergence": "" if same or rb is None else divergence(
                [ra["output"]], [rb["output"]]).replace("in choice 0 ", "")})
    return pd.DataFrame(rows)


def mcnemar_one_sided(b: int, c: int) -> float:
    """P(X >= b), X ~ Binomial(b + c, 1/2): the chance of at least ``b`` losses among the
    ``b + c`` discordant pairs if neither run were better."""
    n = b + c
    if n == 0 or b == 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(b, n + 1)) / 2 ** n


def _weighted_rate(df: pd.DataFrame, col: str) -> float:
    w = df["weight"].astype(float)
    return float((df[col].astype(float) * w).sum() / w.sum()) if w.sum() > 0 else 0.0


def latency_table(cases: pd.DataFrame, th: Thresholds, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for metric in LATENCY_METRICS:
        pair = cases[[f"{metric}_a", f"{metric}_b"]].astype(float).dropna()
        pair = pair[(pair > 0).all(axis=1)]
        a, b = pair[f"{metric}_a"].to_numpy(), pair[f"{metric}_b"].to_numpy()
        for q, limit in ((50, th.max_p50_increase), (99, th.max_p99_increase)):
            if len(a) < 2:
                rows.append(dict(metric=metric, quantile=f"p{q}", n=len(a), a=np.nan,
                                 b=np.nan, ratio=np.nan, ratio_low=np.nan, limit=1 + limit,
                                 regressed=False))
                continue
            qa, qb = np.percentile(a, q), np.percentile(b, q)
            idx = rng.integers(0, len(a), size=(th.resamples, len(a)))
            ratios = np.percentile(b[idx], q, axis=1) / np.maximum(
                np.percentile(a[idx], q, axis=1), 1e-9)
            low = float(np.quantile(ratios, 1 - th.confidence))
            rows.append(dict(metric=metric, quantile=f"p{q}", n=len(a), a=qa, b=qb,
                             ratio=qb / max(qa, 1e-9), ratio_low=low, limit=1 + limit,
                             regressed=bool(low > 1 + limit)))
    return pd.DataFrame(rows)


def compare(run_a: dict, res_a: pd.DataFrame, run_b: dict, res_b: pd.DataFrame,
            th: Thresholds = Thresholds()) -> Comparison:
    cases = res_a.merge(res_b, on="case_id", suffixes=("_a", "_b"))
    only_a = sorted(set(res_a["case_id"]) - set(res_b["case_id"]))
    only_b = sorted(set(res_b["case_id"]) - set(res_a["case_id"]))
    cases["weight"] = cases["weight_a"]
    regressed = cases.loc[cases["passed_a"] & ~cases["passed_b"], "case_id"].tolist()
    fixed = cases.loc[~cases["passed_a"] & cases["passed_b"], "case_id"].tolist()
    changed = cases.loc[cases["output_a"] != cases["output_b"], "case_id"].tolist()
    rate_a = _weighted_rate(cases, "passed_a") if len(cases) else 0.0
    rate_b = _weighted_rate(cases, "passed_b") if len(cases) else 0.0
    p = mcnemar_one_sided(len(regressed), len(fixed))
    quality = rate_b < rate_a - th.max_pass_drop - 1e-12 and p <= th.alpha
    return Comparison(run_a, run_b, cases, only_a, only_b, rate_a, rate_b, regressed, fixed,
                      changed, p, bool(quality), latency_table(cases, th), th)


def render(c: Comparison) -> str:
    a, b = c.run_a, c.run_b
    lines = [f"A: {a['run_id']}  suite {a['suite']}  config {a['config_id']}",
             f"B: {b['run_id']}  suite {b['suite']}  config {b['config_id']}"]
    if a["suite"] != b["suite"]:
        lines.append(f"note: different suites; comparing the {len(c.cases)} cases in both")
    if c.only_a or c.only_b:
        lines.append(f"note: {len(c.only_a)} cases only in A, {len(c.only_b)} only in B")
    lines += ["", f"quality: pass rate {c.pass_rate_a:.1%} -> {c.pass_rate_b:.1%} "
              f"({(c.pass_rate_b - c.pass_rate_a) * 100:+.1f} points); {len(c.regressed)} "
              f"newly failing, {len(c.fixed)} newly passing, {len(c.changed_output)} outputs "
              f"changed; McNemar one-sided p = {c.mcnemar_p:.4f} "
              f"(alpha {c.thresholds.alpha}, max drop {c.thresholds.max_pass_drop:.1%})"
              f" -> {'REGRESSED' if c.quality_regressed else 'ok'}"]
    by_id = c.cases.set_index("case_id")
    for cid in c.regressed:
        r = by_id.loc[cid]
        lines.append(f"  - {cid}: now fails ({r['detail_b']}); trace {r['trace_id_b']}; "
                     f"output {str(r['output_b'])[:80]!r}")
    for cid in c.fixed:
        lines.append(f"  + {cid}: now passes; trace {by_id.loc[cid]['trace_id_b']}")
    lines.append("")
    lines.append("latency (ms; ratio B/A, its one-sided lower bound, the limit):")
    for _, r in c.latency.iterrows():
        if r["n"] < 2:
            lines.append(f"  {r['metric']} {r['quantile']}: too few joined records ({r['n']})")
            continue
        lines.append(f"  {r['metric']:>8} {r['quantile']}: {r['a']:8.1f} -> {r['b']:8.1f}  "
                     f"x{r['ratio']:.2f} (low {r['ratio_low']:.2f}, limit {r['limit']:.2f})"
                     f"{'  REGRESSED' if r['regressed'] else ''}  n={r['n']}")
    lines += ["", f"verdict: {c.verdict.upper()}"]
    return "\n".join(lines)
