"""``tailscope eval``: run suites, compare runs, list them, measure fidelity."""

from __future__ import annotations

import argparse
import json
import sys

from tailscope import env
from tailscope.commands.common import (
    _gateway_up,
    _store_target,
)
from tailscope.settings import Settings


def cmd_eval(args: argparse.Namespace) -> int:
    """Run a suite against a config (or a running gateway), compare two runs, list runs."""
    from evals import compare as C
    from evals import runner as R
    from tracing.queries import GatewaySource

    s = Settings.from_env()
    admin = s.admin_key or None
    if args.eval_command == "fidelity":
        from evals import fidelity as F

        try:
            got = F.run(args.config, args.reference, args.text or F.TEXT, args.window,
                        args.max_tokens, s.model)
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(got.as_dict()) if args.json else got.text(args.config,
                                                                     args.reference))
        return 0 if got.ppl_increase <= F.MAX_PPL_INCREASE else 1
    if args.eval_command == "run":
        try:
            suite, cases = R.load_suite(args.suite)
        except (R.EvalError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.url and args.config:
            print("error: give --config (start a gateway with it) or --url (use that gateway "
                  "and its own config), not both", file=sys.stderr)
            return 2
        kwargs = dict(concurrency=args.concurrency, api_key=args.api_key, admin_key=admin)
        try:
            if args.url:
                summary = R.run(args.url, suite, cases, model=args.model, **kwargs)
            else:
                from tracing.store import is_embedded, normalise_dsn

                configs = args.config or [str(R.CONFIGS_DIR / "bundled.yaml")]
                if is_embedded(normalise_dsn(s.store_dsn)) and _gateway_up(s.gateway_url):
                    print(f"error: a gateway at {s.gateway_url} holds the embedded store; stop "
                          "it, or run against it with --url", file=sys.stderr)
                    return 2
                child_env = {"TAILSCOPE_STORE_FLUSH_S": env.setting("store_flush_s") or "1"}
                summaries = []
                for config in configs:  # one after the other: the embedded store is theirs
                    with R.GatewayProcess(config, env=child_env, log_path=args.gateway_log) as gw:
                        print(f"gateway for {config} on {gw.url}", file=sys.stderr)
                        summaries.append(R.run(gw.url, suite, cases, **kwargs))
                if len(summaries) > 1:
                    for one in summaries:
                        print(one.text(), end="\n\n")
                    print(R.across_configs(summaries))
                    print(" ".join(x.run_id for x in summaries))
                    return 0
                summary = summaries[0]
        except R.EvalError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(summary.text())
        print(summary.run_id)
        return 0
    kind, target = _store_target(args, s)
    source = GatewaySource(target, admin) if kind == "gateway" else target
    if args.eval_command == "list":
        runs = C.list_runs(source, args.limit)
        print(runs.to_string(index=False) if not runs.empty else "no eval runs stored")
        return 0
    th = C.Thresholds(max_pass_drop=args.max_pass_drop, alpha=1.0 if args.strict else args.alpha,
                      max_p50_increase=args.max_p50_increase,
                      max_p99_increase=args.max_p99_increase)
    try:
        run_a, res_a = C.load_run(source, args.run_a)
        run_b, res_b = C.load_run(source, args.run_b)
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    comparison = C.compare(run_a, res_a, run_b, res_b, th)
    print(C.render(comparison))
    return 1 if comparison.verdict == "regressed" else 0


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="eval suites: run, compare two runs (a CI gate), list")
    es = ev.add_subparsers(dest="eval_command", required=True)
    r = es.add_parser("run", help="run a suite against a config file or a running gateway")
    r.add_argument("--suite", required=True,
                   help="protocol | smoke-qa | determinism, or a YAML/JSONL file of cases")
    r.add_argument("--config", action="append",
                   help="engine config YAML to start a gateway with (default "
                        "evals/configs/bundled.yaml); repeat it to run the suite on each "
                        "config and report, per case, whether they all gave the first "
                        "config's output and where not")
    r.add_argument("--url", help="run against this gateway instead (its own config is used)")
    r.add_argument("--model", help="with --url: which of its served models (default its "
                   "bundled model), e.g. an external backend's")
    r.add_argument("--concurrency", type=int, default=8,
                   help="cases in flight at once")
    r.add_argument("--api-key", help="tenant key for the requests")
    r.add_argument("--gateway-log", metavar="FILE", help="the started gateway's output")
    fi = es.add_parser("fidelity", help="how far a config's next-token distributions are "
                       "from a reference's on a fixed text: perplexity, KL divergence, top-1 "
                       "agreement (exit 1 past the perplexity gate)")
    fi.add_argument("--config", default="fast", help="a profile (fast, exact) or an engine "
                    "config YAML file (default fast)")
    fi.add_argument("--reference", default="exact", help="the same, compared against "
                    "(default exact)")
    fi.add_argument("--text", help="the text (default: evals/data/shakespeare.txt, a "
                    "public-domain one of ~23k tokens)")
    fi.add_argument("--window", type=int, default=512, help="tokens run from scratch at once")
    fi.add_argument("--max-tokens", type=int, help="only the text's first N tokens")
    fi.add_argument("--json", action="store_true", help="print the report as JSON")
    for name, help_ in (("compare", "compare run B against baseline run A; exit 1 on a "
                         "regression"), ("list", "the latest stored runs")):
        c = es.add_parser(name, help=help_)
        c.add_argument("--url", help="a gateway to read through (default: the running one, "
                       "if any)")
        c.add_argument("--dsn", help="store DSN (default TAILSCOPE_STORE_DSN)")
        if name == "list":
            c.add_argument("--limit", type=int, default=20, help="most runs listed")
            continue
        c.add_argument("run_a", help="baseline run id")
        c.add_argument("run_b", help="candidate run id")
        c.add_argument("--max-pass-drop", type=float, default=0.0,
                       help="tolerated drop of the weighted pass rate (fraction, default 0)")
        c.add_argument("--alpha", type=float, default=0.05,
                       help="McNemar one-sided p-value needed to call a quality regression")
        c.add_argument("--strict", action="store_true",
                       help="any net loss of passing cases regresses (no significance test)")
        c.add_argument("--max-p50-increase", type=float, default=0.5,
                       help="p50 TTFT/E2E ratio limit, minus 1 (default 0.5)")
        c.add_argument("--max-p99-increase", type=float, default=1.0,
                       help="p99 TTFT/E2E ratio limit, minus 1 (default 1.0)")
    ev.set_defaults(func=cmd_eval)
