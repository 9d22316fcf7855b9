"""``tailscope`` command line. Thin: parses arguments and calls into the packages."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

from engine.config import EngineConfig
from tailscope import __version__
from tailscope.settings import Settings, engine_env


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One ``--<setting>`` flag per EngineConfig field (its type and help from there)."""
    for name, (kind, _, help_) in EngineConfig.setting_types().items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, dest=f"engine_{name}", action=argparse.BooleanOptionalAction,
                           default=None, help=help_)
        else:
            p.add_argument(flag, dest=f"engine_{name}", type=kind, default=None, help=help_)


def engine_config(args: argparse.Namespace, *layers: dict) -> EngineConfig:
    """The defaults (the product's profile, ``fast``: engine.profiles) < the environment
    (``TAILSCOPE_<SETTING>``) < each of ``layers`` (e.g. a config file) < flags; the profile
    fills in what none of them gives."""
    from engine.profiles import PRODUCT_DEFAULT

    flags = {name: getattr(args, f"engine_{name}") for name in EngineConfig.setting_types()
             if getattr(args, f"engine_{name}", None) is not None}
    merged: dict = {"profile": PRODUCT_DEFAULT}
    for layer in (engine_env(), *layers, flags):
        merged.update(layer)
    try:
        return EngineConfig(**merged)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, SamplingParams, load_model
    from engine.constrained import GrammarCompiler
    from engine.loader.paths import TINY, resolve_model_path
    from engine.sampling_params import StructuredOutput
    from engine.text import generate_text, load_tokenizer

    s = Settings.from_env()
    s = replace(s, model=args.model or s.model)
    config = engine_config(args)
    if s.threads:
        torch.set_num_threads(s.threads)
    path = resolve_model_path(s.model)
    if isinstance(path, str) and path.startswith(TINY):
        print("error: the tiny test model has no tokenizer; pass a GGUF or HF model",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = load_model(path, config.dtype, batch_invariant=config.batch_invariant,
                       weights=config.weights,
                       output_weights=config.output_weights)
    tokenizer = load_tokenizer(path)
    structured = None
    if args.json_schema is not None:
        schema = json.loads(args.json_schema) if args.json_schema else None
        structured = StructuredOutput.from_response_format(
            {"type": "json_schema", "json_schema": {"schema": schema}} if schema
            else {"type": "json_object"})
    grammar = GrammarCompiler.from_tokenizer(tokenizer, model.config.vocab_size) \
        if structured else None
    # a one-shot command takes the compiled step only where a replica already built it: a
    # build takes minutes, longer than the generation it would speed up
    engine = Engine(model, config, grammar=grammar, defer_compile=True)
    engine.runner.start_compile(build=False)
    load_s = time.perf_counter() - t0
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    ids = tokenizer.encode(text)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, structured=structured)
    t1 = time.perf_counter()
    result = generate_text(engine, tokenizer, "cli-0", ids, params, stop=args.stop or (),
                           on_text=lambda t: print(t, end="", flush=True))
    total_s = time.perf_counter() - t1
    print(flush=True)
    if result.error:
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    req = engine.get_request("cli-0")
    n = result.generated_tokens
    ttft_ms = (req.token_times_ns[0] - req.arrival_ns) / 1e6 if n else float("nan")
    decode_s = (req.token_times_ns[-1] - req.token_times_ns[0]) / 1e9 if n else 0.0
    tps = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    stop = f" ({result.stop_reason!r})" if result.stop_reason is not None else ""
    print(f"[load {load_s:.2f} s | prompt {len(ids)} tok | TTFT {ttft_ms:.1f} ms | "
          f"{n} tok in {total_s:.2f} s | decode {tps:.1f} tok/s | "
          f"finish {result.finish_reason}{stop} | compile {engine.runner.compile_state}]",
          file=sys.stderr)
    return 0


def cors_origins(setting: str) -> tuple[str, ...]:
    """TAILSCOPE_CORS_ORIGINS as origins: "*", or each a scheme and host (and port), as a
    browser sends its ``Origin`` header; anything else (a path, no scheme) is refused, since
    it would never match and CORS would silently stay off."""
    out = tuple(o.strip().rstrip("/") for o in setting.split(",") if o.strip())
    for o in out:
        scheme, sep, rest = o.partition("://")
        if o != "*" and (not sep or scheme not in ("http", "https") or not rest
                         or "/" in rest):
            raise ValueError(f"TAILSCOPE_CORS_ORIGINS: {o!r} is not an origin (\"*\" or "
                             "scheme://host[:port], e.g. http://localhost:3000)")
    return out


def instance_id(setting: str, port: int) -> str:
    """``TAILSCOPE_INSTANCE_ID``: "auto" is this host's name and the gateway's port, unique
    among gateways on one network; anything else is taken as given."""
    if setting.strip().lower() == "auto":
        import socket

        return f"{socket.gethostname()}:{port}"
    return setting.strip()


def remote_replicas(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``ID=tcp://HOST:PORT`` items (``--remote-replica``, ``TAILSCOPE_REMOTE_REPLICAS``)."""
    out = []
    for item in items:
        rid, sep, addr = item.strip().partition("=")
        if not sep or not rid or not addr.startswith("tcp://"):
            raise ValueError(f"remote replica {item!r}: expected ID=tcp://HOST:PORT")
        out.append((rid, addr))
    if len({rid for rid, _ in out}) != len(out):
        raise ValueError("remote replica ids must be unique")
    return tuple(out)


def _query_limits(s: Settings):
    """The ``TAILSCOPE_QUERY_*`` limits of every store read (the gateway's and a store
    process's)."""
    from tracing.store import QueryLimits

    return QueryLimits(max_execution_s=s.query_max_execution_s,
                       max_result_rows=s.query_max_result_rows,
                       max_rows_to_read=s.query_max_rows_to_read,
                       max_memory_mb=s.query_max_memory_mb)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from gateway.app import GatewayConfig, create_app, prepare_replicas
    from gateway.limits import RequestLimits
    from tracing.store_server import uvicorn_server

    os.umask(0o077)  # the store, spool, records and key-id secret are readable by us alone
    s = Settings.from_env()
    file = None
    if args.engine_config:
        from tailscope.engine_config import ConfigFileError, load

        try:
            file = load(args.engine_config)
        except ConfigFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        s = replace(s, model=file.model or s.model)
    s = replace(s, model=args.model or s.model)
    # precedence: command-line flag > config file > environment > default
    engine = engine_config(args, file.engine if file else {})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    served = args.served_model_name or (file and file.served_model_name) \
        or "SmolLM2-135M-Instruct"
    from gateway.upstream import UpstreamConfig

    try:
        backends = (*(file.backends if file else ()),
                    *(UpstreamConfig.parse_flag(b) for b in args.backend or []))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        remote = remote_replicas([*filter(None, s.remote_replicas.split(",")),
                                  *(args.remote_replica or [])])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:  # a config the gateway refuses (e.g. one model name served twice) is an error
        config = GatewayConfig(model=s.model, tokenizer=args.tokenizer,
                               served_model_name=served,
                               replicas=args.replicas if args.replicas is not None
                               else (file and file.replicas) or (0 if remote else 1),
                               engine=engine,
                               tenants_file=args.config or s.config,
                               max_inflight_per_replica=args.max_inflight,
                               queue_timeout_s=(args.queue_timeout if args.queue_timeout
                                                is not None else s.queue_timeout_s) or None,
                               max_buffered_deltas=s.max_buffered_deltas,
                               slow_client_timeout_s=s.slow_client_timeout_s,
                               records_jsonl=args.records_jsonl or s.records_jsonl or None,
                               record_token_ids=s.record_token_ids,
                               detail_sample=s.detail_sample,
                               detail_quantile=s.detail_quantile,
                               detail_warmup=s.detail_warmup,
                               store_dsn=None if s.store_dsn.lower() in ("", "none")
                               else s.store_dsn,
                               store_key=s.store_key or None,
                               store_process=s.store_process,
                               spool_dir=s.spool_dir or None,
                               store_ttl_days=s.store_ttl_days,
                               store_flush_s=s.store_flush_s,
                               admin_key=s.admin_key or None,
                               fault_store_down_file=os.environ.get(
                                   "TAILSCOPE_FAULT_STORE_DOWN_FILE") or None,
                               otlp_endpoint=s.otlp_endpoint or None,
                               otlp_protocol=s.otlp_protocol,
                               sampling_defaults=file.sampling_defaults if file else {},
                               sampling_overrides=file.sampling_overrides if file else {},
                               config_name=file.name if file else "",
                               max_body_bytes=s.max_body_bytes,
                               responses_store_mb=s.responses_store_mb,
                               limits=RequestLimits(
                                   max_messages=s.max_messages,
                                   max_stop_strings=s.max_stop_strings,
                                   max_stop_chars=s.max_stop_chars,
                                   max_logit_bias=s.max_logit_bias,
                                   max_stop_token_ids=s.max_stop_token_ids,
                                   max_allowed_token_ids=s.max_allowed_token_ids,
                                   max_json_depth=s.max_json_depth,
                                   max_schema_bytes=s.max_schema_bytes,
                                   max_batch_prompts=s.max_batch_prompts),
                               query_limits=_query_limits(s),
                               request_timeout_s=s.request_timeout_s or None,
                               heartbeat_timeout_s=s.heartbeat_timeout_s,
                               max_queue_mb=s.store_max_queue_mb,
                               key_id_secret=s.key_id_secret or None,
                               backends=backends, freeze_gc=True,
                               gc_threshold=s.gc_threshold,
                               instance_id=instance_id(s.instance_id, args.port),
                               remote_replicas=remote,
                               replica_outbox=s.replica_outbox or None,
                               replica_key=s.replica_key or None,
                               replica_cpus=s.replica_cpus,
                               cors_origins=cors_origins(s.cors_origins))
        if args.prepare_only:
            return prepare_replicas(config)
        app = create_app(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "::1", "localhost") and not (args.config or s.config):
        logging.getLogger("tailscope").warning(
            "open local mode on %s: anyone who reaches port %d can generate (configure "
            "tenants with --config); /debug/* answer %s", args.host, args.port,
            "the admin key" if s.admin_key else "loopback clients only")
    # uvicorn waits for in-flight requests before it stops: on the signal, stop what only waits
    # on the store (a long /debug/query) at once instead of up to its time limit
    try:
        uvicorn_server(app, app.state.on_exit_signal, host=args.host, port=args.port,
                       log_level="info", access_log=args.access_log).run()
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn has shut down gracefully (requests finished, records drained, the
        # replicas and the store child stopped) and raises the signal again once done, which
        # surfaced as a KeyboardInterrupt traceback; exit as an interrupted program does
        return 130
    return 0


def _param(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--param {text!r}: expected NAME=VALUE")
    try:
        return key, json.loads(value)  # numbers and lists as such, anything else a string
    except json.JSONDecodeError:
        return key, value


def _store_target(args: argparse.Namespace, s: Settings):
    """('gateway', url) or ('direct', Store): the gateway owns an embedded store while it runs."""
    import httpx

    from tracing.store import connect, is_embedded, normalise_dsn

    if args.url:
        return "gateway", args.url.rstrip("/")
    dsn = normalise_dsn(args.dsn or s.store_dsn)
    if is_embedded(dsn):
        try:
            httpx.get(f"{s.gateway_url}/health", timeout=1.0).raise_for_status()
            return "gateway", s.gateway_url.rstrip("/")
        except httpx.HTTPError:
            pass
    store = connect(dsn, key=s.store_key or None)
    store.migrate()
    return "direct", store


def _admin_headers(s: Settings) -> dict[str, str]:
    return {"Authorization": f"Bearer {s.admin_key}"} if s.admin_key else {}


def _store_init(args: argparse.Namespace, s: Settings) -> int:
    """``tailscope store init [--cluster NAME]``: the tables as DDL (``--print``) or applied."""
    from tracing import cluster as C
    from tracing.store import Store, StoreError, normalise_dsn

    dsn = normalise_dsn(args.dsn or s.store_dsn)
    if args.cluster is None:
        if args.print:
            from tracing.schema import MIGRATIONS

            for _, _, statements in MIGRATIONS:
                for stmt in statements:
                    print(stmt.rstrip() + ";\n")
            return 0
        try:
            store = Store(dsn)
            print(f"applied migrations {store.migrate() or 'none (up to date)'} on {dsn}")
        except StoreError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        statements = C.ddl(args.cluster, args.shard_by)
        if not args.print:
            if not dsn.startswith(("http://", "https://")):
                print("error: --cluster applies to a ClickHouse server (http(s):// DSN); an "
                      "embedded store is one node (--print shows the DDL)", file=sys.stderr)
                return 2
            try:
                statements = C.apply(Store(dsn), args.cluster, args.shard_by)
            except Exception as exc:  # the server's own error (no such cluster, Keeper down)
                print(f"error: {str(exc).strip().splitlines()[0][:500]}", file=sys.stderr)
                return 1
            print(f"applied {len(statements)} statements on cluster {args.cluster} via {dsn}")
            return 0
    except (ValueError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for stmt in statements:
        print(stmt.rstrip() + ";\n")
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    import httpx


    s = Settings.from_env()
    if args.store_command == "serve":
        import logging

        from tracing.store import StoreError, is_embedded, normalise_dsn
        from tracing.store_server import serve

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        os.umask(0o077)
        dsn = normalise_dsn(args.dsn or s.store_dsn)
        if not is_embedded(dsn):
            print(f"error: a store process serves an embedded store (chdb://...), not {dsn}; "
                  "gateways reach a ClickHouse server directly", file=sys.stderr)
            return 2
        if args.host not in ("127.0.0.1", "::1", "localhost") and not s.store_key:
            print("error: set TAILSCOPE_STORE_KEY to serve the store beyond loopback",
                  file=sys.stderr)
            return 2
        try:
            serve(dsn, args.host, args.port, s.store_key or None, args.parent_pid,
                  _query_limits(s), args.inbox)
        except StoreError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.store_command == "init":
        return _store_init(args, s)
    kind, target = _store_target(args, s)
    if args.store_command == "query":
        params = dict(_param(p) for p in args.param or [])
        if kind == "gateway":
            r = httpx.post(f"{target}/debug/query", json={"sql": args.sql, "params": params},
                           headers=_admin_headers(s), timeout=120)
            if r.status_code != 200:
                print(f"error: {r.json().get('error', {}).get('message', r.text)}",
                      file=sys.stderr)
                return 1
            cols, rows = r.json()["columns"], r.json()["rows"]
        else:
            cols, rows = target.select(args.sql, params)
        if args.format == "json":
            for row in rows:
                print(json.dumps(dict(zip(cols, row, strict=True)), default=str))
        else:
            print("\t".join(cols))
            for row in rows:
                print("\t".join(str(v) for v in row))
        return 0
    if args.store_command == "delete":
        if kind == "gateway":
            r = httpx.delete(f"{target}/debug/tenants/{args.tenant}/records",
                             headers=_admin_headers(s), timeout=120)
            if r.status_code != 200:
                print(f"error: {r.text}", file=sys.stderr)
                return 1
            n = r.json()["deleted_requests"]
        else:
            n = target.delete_tenant(args.tenant)
        print(f"deleted {n} request rows of tenant {args.tenant!r} (and their events)")
        return 0
    return 2


def cmd_why(args: argparse.Namespace) -> int:
    """Why a request was slow: its slowest gaps and the steps and neighbours inside them."""
    from tracing import queries as Q

    s = Settings.from_env()
    kind, target = _store_target(args, s)
    source = Q.GatewaySource(target, s.admin_key or None) if kind == "gateway" else target
    try:
        gaps, sentence = Q.why(source, args.trace_id, top=args.top)
    except Q.QueryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(sentence)
    if not gaps.empty:
        shown = gaps.assign(neighbours=[", ".join(f"{t[:12]}…:{p}" for t, p in n.items())
                                        for n in gaps["neighbours"]])
        print(shown.to_string(index=False, float_format=lambda x: f"{x:.1f}"))
    return 0


def _window(spec: str | None) -> tuple[int, int]:
    """``FROM..TO`` (ISO 8601 times, UTC unless they say otherwise, or unix seconds) as µs;
    none: the last hour."""
    import datetime as dt

    def at(x: str) -> int:
        x = x.strip()
        try:
            return int(float(x) * 1e6)
        except ValueError:
            t = dt.datetime.fromisoformat(x)
            return int((t if t.tzinfo else t.replace(tzinfo=dt.UTC)).timestamp() * 1e6)

    if not spec:
        now = int(time.time() * 1e6)
        return now - 3_600_000_000, now
    start, sep, end = spec.partition("..")
    if not sep:
        raise ValueError(f"--window {spec!r}: expected FROM..TO")
    a, b = at(start), at(end)
    if b <= a:
        raise ValueError(f"--window {spec!r}: TO must be after FROM")
    return a, b


def _parse_slo(text: str | None) -> dict[str, float]:
    """``ttft_ms=N,tpot_ms=N`` (either may be left out)."""
    slo = {}
    for part in (text or "").split(","):
        if part.strip():
            key, _, value = part.partition("=")
            if key.strip() not in ("ttft_ms", "tpot_ms") or not value:
                raise ValueError(f"--slo {text!r}: use ttft_ms=N,tpot_ms=N")
            slo[key.strip()] = float(value)
    return slo


def _whatif_window(args: argparse.Namespace, s: Settings):
    """(store target, the ``tailscope.whatif.Window`` of ``--window`` / ``--bench-run``, the
    candidate: the recorded config with ``--engine-config``, ``--set`` and ``--policy``)."""
    from tailscope import engine_config as ECF
    from tailscope import whatif as W
    from tracing import queries as Q

    if not args.step_speed > 0:  # before the store is read
        raise ValueError("--step-speed must be > 0")
    kind, target = _store_target(args, s)
    source = Q.GatewaySource(target, s.admin_key or None) if kind == "gateway" else target
    if args.bench_run:
        if args.window:
            raise ValueError("give --window or --bench-run, not both")
        start, end = W.window_of_bench_run(source, args.bench_run)
    else:
        start, end = _window(args.window)
    w = W.load(source, start, end, args.replica)
    if args.contention is not None:
        if not args.contention >= 0:
            raise ValueError("--contention must be >= 0")
        w.contention, w.contention_source = args.contention, "flag"
    cand = W.candidate(w.base, ECF.load(args.engine_config).engine if args.engine_config
                       else None, args.set, args.policy)
    return target, w, cand


def _offsets(offsets) -> str:
    """``{1: -0.3, 2: 2.2}`` as ``1 (-0.3 ms), 2 (+2.2 ms)``."""
    return ", ".join(f"{k} ({v:+.1f} ms)" for k, v in sorted(offsets.items()))


def _print_window(w) -> None:
    e = w.cost.error
    print(f"window {_iso(w.start_us)}..{_iso(w.end_us)}: replica(s) {', '.join(w.replicas)}, "
          f"{len(w.requests)} requests ({len(w.arrivals)} sequences) at {w.rate_rps:.2f} req/s, "
          f"{w.steps} steps; config {w.config_id}"
          + ("" if w.config_known else " (not in the configs table: engine defaults)"))
    print("step cost (ms) = " + " + ".join(f"{c:.4g}*{f}" for c, f in
                                          zip(w.cost.coef, w.cost.as_dict()["features"],
                                              strict=True))
          + (f", + an offset for steps of {_offsets(w.cost.offsets)} tokens"
             if w.cost.offsets else "")
          + f"; held-out error median {e.median_rel:.1%}, p95 {e.p95_rel:.1%} "
          f"({e.n_test} steps; a constant cost per step: median {e.baseline_median_rel:.1%})")
    print(f"gateway share of TTFT (recorded median): {w.overhead_ms:.1f} ms, added to the "
          "predicted TTFT and E2E")
    if w.contention_source != "none":
        print(f"replicas on one host: a step beside b others mid-step costs "
              f"1 + {w.contention:.3f}*b times its model cost ({w.contention_source})")
    elif len(w.replicas) == 1:
        print("replicas on one host: not measured (a window of one replica cannot show how "
              "replicas slow each other; --contention BETA, e.g. from a window of several)")
    if w.stand_ins:
        print(f"note: {w.stand_ins} requests kept counts, not token ids: stand-in prompts, no "
              "prefix-cache hits for them")
    if w.estimated:
        print(f"note: {w.estimated} requests timed out before their first token: their output "
              "lengths are estimated (their tenant's median, capped at their max_tokens)")


def _iso(us: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(us / 1e6, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _print_columns(title: str, cols: dict[str, dict | None]) -> None:
    """One row per metric (each cell p50/p90/p99 ms), then preemptions, shed, timed out and
    the SLO."""
    from tailscope.whatif import LABELS, METRICS

    names = list(cols)
    print(f"{title:<14}" + "".join(f"{n:>28}" for n in names))
    for m in METRICS:
        cells = ("/".join(f"{c['table'][m][q]:.0f}" for q in ("p50", "p90", "p99"))
                 if c else "" for c in cols.values())
        print(f"{LABELS[m]:<14}" + "".join(f"{x:>28}" for x in cells))
    for key in ("preemptions", "shed", "timed_out"):
        print(f"{key:<14}" + "".join(f"{c.get(key, '') if c else '':>28}"
                                     for c in cols.values()))
    print(f"{'extrapolated':<14}" + "".join(  # tailscope.whatif.extrapolated
        f"{c['extrapolated']:.0%}".rjust(28) if c and "extrapolated" in c else f"{'':>28}"
        for c in cols.values()))
    if any(c and "slo" in c for c in cols.values()):
        print(f"{'SLO met':<14}" + "".join(
            f"{c['slo']['attainment']:.1%} ({c['slo']['goodput_rps']:.2f}/s)".rjust(28)
            if c else f"{'':>28}" for c in cols.values()))


def _warn_extrapolated(points: list[dict]) -> None:
    """A warning for each prediction that spends much of its time in step shapes the window
    barely recorded (``tailscope.whatif.extrapolated``)."""
    from tailscope.whatif import EXTRAPOLATED_WARN, SEEN_MIN

    for p in points:
        for key in ("recorded_config", "candidate"):
            share = p[key].get("extrapolated", 0.0)
            if share > EXTRAPOLATED_WARN:
                print(f"warning: {share:.0%} of the {key.replace('_', ' ')}'s predicted busy "
                      f"time (x{p['rate_scale']:g}) is in steps of batch sizes outside the "
                      f"range the window pins down (fewer than {SEEN_MIN} recorded steps at or "
                      "below, or at or above, the size): their cost is extrapolated; a window "
                      "with stretches at those batch sizes pins it down",
                      file=sys.stderr)


def _keep_run(args: argparse.Namespace, s: Settings, target, kind: str, w, params: dict,
              results: dict) -> str | None:
    """The run's id in ``whatif_runs`` (None with ``--no-store``, or when storing failed:
    then a warning says why and the figures are printed all the same)."""
    from tailscope import whatif as W

    if args.no_store:
        return None
    try:
        return W.store_run(target, kind, w, params, results, s.admin_key or None)
    except (W.WhatIfError, OSError) as exc:
        print(f"warning: {exc}", file=sys.stderr)
        return None


def cmd_whatif(args: argparse.Namespace) -> int:
    """Recorded traffic through the engine's own scheduler on a virtual clock
    (tailscope.whatif), under its recorded config and a candidate, side by side."""
    from tailscope import whatif as W
    from tracing.timing import Slo

    s = Settings.from_env()
    try:
        scales = [float(x) for x in args.rate_scale.split(",") if x.strip()]
        if not scales or not all(x > 0 for x in scales):
            raise ValueError("--rate-scale: positive numbers, comma-separated")
        slo = Slo(**_parse_slo(args.slo)) if args.slo else None
        if args.replicas is not None and args.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        target, w, cand = _whatif_window(args, s)
    except W.WhatIfError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # the recorded gateway's queue timeout unless --queue-timeout says otherwise (0: none)
    queue_timeout = (args.queue_timeout if args.queue_timeout is not None
                     else w.queue_timeout_s) or None
    params, results = W.compare(w, cand, args.replicas, scales, slo, args.max_inflight,
                                queue_timeout, args.step_speed)
    changed, points = params["candidate_changes"], results["points"]
    n_rec, n_cand = params["replicas_recorded"], params["replicas_candidate"]
    stored = _keep_run(args, s, target, "whatif", w, params, results)
    if args.plot:
        W.plot_frontier(points, args.plot, f"what-if: {changed or 'recorded config'}, "
                        f"{n_cand} replica(s)")
    _warn_extrapolated(points)
    if args.json:
        print(json.dumps({"run_id": stored, "replicas": w.replicas, "window_us":
                          [w.start_us, w.end_us], "config_id": w.config_id,
                          "step_cost": w.cost.as_dict(), **params, **results},
                         indent=2, default=float))
        return 0
    _print_window(w)
    print(f"candidate: {changed or 'the recorded config'}"
          + (f"; replicas {n_rec} -> {n_cand}" if n_cand != n_rec else "")
          + (f"; steps {args.step_speed:g}x as fast" if args.step_speed != 1.0 else "")
          + f"; engine queue timeout {f'{queue_timeout:g} s' if queue_timeout else 'none'}"
          + (" (the recorded gateway's)" if args.queue_timeout is None and queue_timeout
             else ""))
    for p in points:
        title = "ms" if p["rate_scale"] == 1.0 else \
            f"x{p['rate_scale']:g} ({p['offered_rps']:.2f}/s)"
        print()
        _print_columns(title, {"recorded": p.get("recorded"),
                               "predicted (recorded cfg)": p["recorded_config"],
                               "predicted (candidate)": p["candidate"]})
    print("\n(each cell p50/p90/p99 ms; TTFT and E2E as the client sees them, the rest the "
          "engine's; 'queue' runs from arrival to the first step that ran the request; "
          "'extrapolated': the share of busy time in step batch sizes beyond the window's)")
    if args.plot:
        print(f"frontier plot: {args.plot}")
    if stored:
        print(f"stored in whatif_runs as {stored}")
    return 0


def cmd_size(args: argparse.Namespace) -> int:
    """Replicas for a peak rate: N = ceil(peak / (c * rho)) from one replica's predicted goodput
    c on the window's traffic, confirmed by what-if runs at N - 1, N and N + 1."""
    from tailscope import whatif as W
    from tracing.timing import Slo

    s = Settings.from_env()
    try:
        slo = _parse_slo(args.slo)
        if not slo:
            raise ValueError("--slo is required: ttft_ms=N,tpot_ms=N")
        target, w, cand = _whatif_window(args, s)
        out = W.size(W.faster(w, args.step_speed), cand, Slo(**slo), args.peak_rate,
                     args.utilisation, args.attainment, args.max_inflight)
    except W.WhatIfError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    changed = W.changes(w.base, cand)
    params = {"slo": slo, "peak_rate_rps": args.peak_rate, "utilisation": args.utilisation,
              "target_attainment": args.attainment, "candidate_changes": changed,
              "max_inflight": args.max_inflight, "step_speed": args.step_speed}
    stored = _keep_run(args, s, target, "size", w, params, out)
    if args.json:
        print(json.dumps({"run_id": stored, "step_speed": args.step_speed, **out}, indent=2,
                         default=float))
        return 0
    _print_window(w)
    c = out["per_replica_goodput_rps"]
    print(f"per-replica goodput c = {c:.2f} req/s (the highest rate of this traffic at which "
          f"one replica{' of the candidate' if changed else ''}"
          + (f" with steps {args.step_speed:g}x as fast" if args.step_speed != 1.0 else "")
          + " meets the SLO for "
          f"{args.attainment:.0%} of requests, by what-if)")
    print(f"N = ceil({args.peak_rate:g} / ({c:.2f} x {args.utilisation:g})) = "
          f"{out['formula_replicas']} replicas"
          + ("" if out["replicas"] == out["formula_replicas"] else
             f"; raised to {out['replicas']}, the fewest whose what-if meets the SLO "
             "(replicas on one host slow each other)"))
    print(f"confirmed with the window scaled to {args.peak_rate:g} req/s "
          f"(x{out['rate_scale']:.2f}):")
    for chk in out["checks"]:
        mark = "  <- N" if chk["replicas"] == out["replicas"] else ""
        print(f"  {chk['replicas']} replica(s): SLO met {chk['attainment']:.1%}, goodput "
              f"{chk['goodput_rps']:.2f}/s, TTFT p99 {chk['ttft_ms']['p99']:.0f} ms, "
              f"shed {chk['shed']}{mark}")
    if stored:
        print(f"stored in whatif_runs as {stored}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Run a recorded request again and report whether it came out the same (tracing.replay).

    The record comes from ``--source`` (a gateway), else ``--url`` when that gateway has it,
    else the running gateway, else the store.
    It runs on ``--url``, or on a gateway started with ``--engine-config FILE``, or (neither)
    on the source gateway when it runs the recorded config_id, else on one started with the
    recorded config (the store's ``configs`` table)."""
    import asyncio
    import tempfile

    import httpx

    from tracing import replay as R
    from tracing.client import GatewayProcess, GatewayStartError

    if not 1 <= args.n <= 64 or not 0 <= args.background <= 16:
        print("error: --n must be in [1, 64] and --background in [0, 16]", file=sys.stderr)
        return 2
    s = Settings.from_env()
    record = None
    if args.source:
        kind, source = "gateway", args.source.rstrip("/")
    elif args.url:  # the gateway it is to run on most often holds the record too
        kind, source = "gateway", args.url.rstrip("/")
        try:
            record = R.fetch_record(source, args.trace_id, s.admin_key or None)
        except (LookupError, httpx.HTTPError):
            record = None
    if record is None and not args.source:
        kind, source = _store_target(argparse.Namespace(url=None, dsn=args.dsn), s)
    try:
        if record is None:
            record = R.fetch_record(source, args.trace_id, s.admin_key or None)
        R.replay_params(record)  # refuse now, before starting anything
    except (LookupError, R.ReplayRefused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    url, gateway, workdir = args.url, None, None
    if url is None and args.engine_config is None and kind == "gateway":
        cfg = httpx.get(f"{source}/debug/config", timeout=30).json()
        if cfg.get("config_id") == record.get("config_id"):
            url = source
    if url is None:
        config_file = args.engine_config
        workdir = tempfile.TemporaryDirectory(prefix="tailscope-replay-")
        if config_file is None:
            config = R.fetch_config(source, record.get("config_id", ""), s.admin_key or None)
            if config is None:
                print(f"error: config {record.get('config_id')!r} is not in the configs table; "
                      "pass --url (a gateway running it) or --engine-config FILE", file=sys.stderr)
                return 2
            config_file = os.path.join(workdir.name, "recorded.yaml")
            with open(config_file, "w") as f:
                f.write(R.config_file_text(config))
        # a gateway of its own: its own store, open local mode, no engine settings from the env
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("TAILSCOPE_") or k == "TAILSCOPE_THREADS"}
        env["TAILSCOPE_STORE_DSN"] = f"chdb://{os.path.join(workdir.name, 'store')}"
        print(f"starting a gateway with {config_file} ...", file=sys.stderr)
        gateway = GatewayProcess(["--engine-config", config_file], env, quiet=True)
        try:
            gateway.start()
        except GatewayStartError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        url = gateway.url
    try:
        target = httpx.get(f"{url}/debug/config", timeout=30).json()
        model = target["config"]["served_model_name"]
        rep = asyncio.run(R.replay(url, record, model, args.n, args.background,
                                   args.api_key or None, s.admin_key or None))
    finally:
        if gateway is not None:
            gateway.stop()
        if workdir is not None:
            workdir.cleanup()
    rep["replayed_on_config_id"] = target.get("config_id")
    print(json.dumps(rep, indent=2) if args.json else R.render(rep))
    if rep["errors"]:
        return 2
    return 0 if rep["identical"] else 1


def cmd_replica_key(args: argparse.Namespace) -> int:
    """A replica's own link key, from the fleet key (``engine.link``): give that replica only
    this, so it cannot speak for another."""
    from engine.link import link_key
    from tailscope.keys import check_key

    fleet = os.environ.get("TAILSCOPE_REPLICA_KEY", "")
    try:
        if not fleet:
            raise ValueError("TAILSCOPE_REPLICA_KEY (the gateway's fleet key) is not set")
        check_key("TAILSCOPE_REPLICA_KEY", fleet)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(link_key(fleet.encode(), args.id).decode())
    return 0


def cmd_drill(args: argparse.Namespace) -> int:
    """Serve the Streamlit drill-down on a data source (default: the running gateway)."""
    from pathlib import Path

    s = Settings.from_env()
    source = args.source or (f"gateway:{args.url or s.gateway_url}")
    app = Path(__file__).resolve().parent.parent / "dashboards" / "drill.py"
    env = {**os.environ, "TAILSCOPE_DRILL_SOURCE": source}
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.port", str(args.port),
           "--server.address", args.host, "--server.headless", "true",
           "--browser.gatherUsageStats", "false"]
    print(f"drill-down on {source}: http://{args.host}:{args.port}", file=sys.stderr)
    sys.stderr.flush()
    # this process becomes Streamlit: a signal that stops `tailscope drill` stops the server,
    # with no child left behind
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def cmd_bench(args: argparse.Namespace) -> int:
    """Load-test any OpenAI-compatible endpoint (bench/loadgen.py)."""
    from pathlib import Path

    from bench import loadgen as L

    slo = _parse_slo(args.slo)
    target = L.Target(args.url, model=args.model, api_key=args.api_key)
    keys = [k for k in (args.tenant_keys or "").split(",") if k]
    if keys and not L.open_run(target, Settings.from_env().admin_key or None):
        print("no bench-run token from the target (not a Tailscope gateway, or no admin key): "
              "requests of the first tenant only are tagged into the run", file=sys.stderr)

    def items_for(n: int, seed: int) -> list:
        if args.trace:
            return L.load_trace(args.trace)[:n]
        return L.workload(n, L.Dist.parse(args.prompt_len), L.Dist.parse(args.output_len),
                          seed=seed, shared_prefix=args.shared_prefix, api_keys=keys or None)

    if args.mode == "sweep":
        result = L.sweep(target, items_for, args.steps, seed=args.seed, slo=slo or None,
                         point_s=args.duration or 10.0)
    else:
        n = args.requests or (int(args.rate * args.duration) if args.rate and args.duration
                              else 100)
        result = L.run(target, args.mode, items_for(n + args.warmup, args.seed),
                       rate=args.rate, burstiness=args.burstiness,
                       concurrency=args.concurrency, seed=args.seed, warmup=args.warmup,
                       slo=slo or None)
    result["run_id"] = target.run_id
    print(L.summary_md(result))
    if not args.no_record:
        params = {k: v for k, v in vars(args).items() if k not in ("func", "api_key",
                                                                    "tenant_keys")}
        print(L.record_run(target, result, params, Settings.from_env().admin_key or None),
              file=sys.stderr)
    if args.out:
        for path in L.write_outputs(result, Path(args.out)):
            print(f"wrote {path}", file=sys.stderr)
    return 0


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
                env = {"TAILSCOPE_STORE_FLUSH_S": os.environ.get("TAILSCOPE_STORE_FLUSH_S",
                                                                 "1")}
                summaries = []
                for config in configs:  # one after the other: the embedded store is theirs
                    with R.GatewayProcess(config, env=env, log_path=args.gateway_log) as gw:
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


def _gateway_up(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tailscope", description=__doc__)
    p.add_argument("--version", action="version", version=f"tailscope {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt with the engine")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--model", help="'bundled' (default), a .gguf file or an HF directory")
    add_engine_flags(g)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="-1: all tokens")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this share of the top one's probability")
    g.add_argument("--seed", type=int, help="sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json-schema", nargs="?", const="", metavar="SCHEMA",
                   help="constrain output to JSON (optionally to this JSON schema)")
    g.set_defaults(func=cmd_generate)
    sv = sub.add_parser("serve", help="start the OpenAI-compatible gateway and its replicas")
    sv.add_argument("--host", default="127.0.0.1", help="listen address")
    sv.add_argument("--port", type=int, default=8000, help="listen port")
    sv.add_argument("--model", help="'bundled' (default), a .gguf file, an HF dir, or tiny:<vocab>")
    sv.add_argument("--tokenizer", help="tokenizer: an HF directory, a GGUF file or `bundled` "
                    "(defaults to the model's)")
    sv.add_argument("--served-model-name", help="default SmolLM2-135M-Instruct")
    sv.add_argument("--replicas", type=int, help="replica processes (default 1; 0 with remote "
                    "replicas)")
    sv.add_argument("--remote-replica", action="append", metavar="ID=tcp://HOST:PORT",
                    help="a replica on another host, by its inbox (repeatable; needs "
                         "TAILSCOPE_REPLICA_OUTBOX and TAILSCOPE_REPLICA_KEY)")
    sv.add_argument("--engine-config", metavar="FILE",
                    help="YAML: model, engine settings and sampling policy (evals/configs/)")
    add_engine_flags(sv)
    sv.add_argument("--backend", action="append", metavar="NAME=URL[,key=value...]",
                    help="an external OpenAI-compatible server as a recorded replica "
                         "(repeatable); keys: model (default NAME), upstream_model, "
                         "api_key_env, max_concurrency, connect_timeout_s, "
                         "first_byte_timeout_s, idle_timeout_s, eject_after, eject_s, "
                         "probe_interval_s (gateway.upstream.UpstreamConfig)")
    sv.add_argument("--config", help="TOML file with [[tenants]] (API keys and limits)")
    sv.add_argument("--max-inflight", type=int,
                    help="in-flight requests per replica before new ones get 503 "
                         "(default 4 x max_num_seqs)")
    sv.add_argument("--queue-timeout", type=float, metavar="S",
                    help="seconds a request may wait in an engine queue before it ends "
                         "TIMED_OUT with 504 (default 60; 0 = no limit)")
    sv.add_argument("--records-jsonl", metavar="FILE",
                    help="append every request's trace record to FILE as JSON lines")
    sv.add_argument("--access-log", action="store_true", help="uvicorn's per-request log")
    sv.add_argument("--prepare-only", action="store_true",
                    help="build what the local replicas need at their start (kernels; with "
                         "compile: true the compiled decode step) into the caches, then exit "
                         "without serving (a deploy step or init container)")
    sv.set_defaults(func=cmd_serve)
    st = sub.add_parser("store", help="query the trace store or delete a tenant's rows")
    st.add_argument("--url", help="a gateway to go through (default: the running one, if any)")
    st.add_argument("--dsn", help="store DSN (default TAILSCOPE_STORE_DSN)")
    sst = st.add_subparsers(dest="store_command", required=True)
    q = sst.add_parser("query", help="run one read-only SELECT")
    q.add_argument("sql", help="one SELECT; {name:Type} placeholders bound by --param")
    q.add_argument("--param", action="append", metavar="NAME=VALUE",
                   help="bind {NAME:Type} in the SQL (repeatable)")
    q.add_argument("--format", choices=["table", "json"], default="table", help="output form")
    d = sst.add_parser("delete", help="delete every stored row of a tenant")
    d.add_argument("--tenant", required=True, help="whose rows and events to delete")
    si = sst.add_parser("init", help="create or upgrade the store's tables (--cluster: on a "
                                     "ClickHouse cluster, ReplicatedMergeTree + Distributed)")
    si.add_argument("--cluster", metavar="NAME", help="the cluster in the servers' "
                    "remote_servers config; ON CLUSTER DDL")
    si.add_argument("--shard-by", choices=["instance", "trace"], default="instance",
                    help="the sharding key of requests, events and steps "
                         "(docs/guides/scaling-out.md)")
    si.add_argument("--print", action="store_true", help="print the DDL; apply nothing")
    ss = sst.add_parser("serve", help="own an embedded (chDB) store and serve it to several "
                                      "gateways (their TAILSCOPE_STORE_DSN=tailscope://HOST:PORT)")
    ss.add_argument("--host", default="127.0.0.1", help="listen address")
    ss.add_argument("--port", type=int, default=8124, help="listen port")
    ss.add_argument("--parent-pid", type=int, help="exit when this process is gone (a gateway "
                    "running its store as a child passes its own pid)")
    ss.add_argument("--inbox", help="a directory from which it inserts Arrow files that clients "
                    "on this host hand over by name instead of sending them (a gateway "
                    "running its store as a child passes a private one)")
    st.set_defaults(func=cmd_store)
    w = sub.add_parser("why", help="why a request was slow: its slowest gaps, the engine steps "
                                   "and the other requests (and tenants) inside them")
    w.add_argument("trace_id", help="the slow request's trace id")
    w.add_argument("--top", type=int, default=5, help="how many of its slowest gaps")
    w.add_argument("--url", help="a gateway to go through (default: the running one, if any)")
    w.add_argument("--dsn", help="store DSN (default TAILSCOPE_STORE_DSN)")
    w.set_defaults(func=cmd_why)
    def window_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--window", metavar="FROM..TO", help="ISO 8601 times (UTC) or unix "
                       "seconds (default: the last hour)")
        p.add_argument("--bench-run", metavar="ID", help="the window of a 'tailscope bench' run")
        p.add_argument("--replica", help="only this replica's traffic (default: every "
                       "replica's in the window)")
        p.add_argument("--engine-config", metavar="FILE", help="the candidate's engine settings")
        p.add_argument("--set", action="append", metavar="NAME=VALUE",
                       help="a candidate engine setting (repeatable), e.g. max_num_seqs=32")
        p.add_argument("--policy", help="the candidate's scheduling_policy")
        p.add_argument("--max-inflight", type=int, help="the gateway's per-replica load "
                       "shedding limit (default 4 x max_num_seqs, the gateway's)")
        p.add_argument("--url", help="a gateway to read through (default: the running one, if "
                       "any)")
        p.add_argument("--dsn", help="store DSN (default TAILSCOPE_STORE_DSN)")
        p.add_argument("--no-store", action="store_true", help="do not keep the run in "
                       "whatif_runs")
        p.add_argument("--contention", type=float, metavar="BETA", help="replicas on one "
                       "host: a step that starts while b others are mid-step costs 1 + BETA*b "
                       "times its model cost (default: fitted from the window when it has "
                       "several replicas, else 0; 0 for replicas on separate hosts)")
        p.add_argument("--step-speed", type=float, default=1.0, metavar="X",
                       help="the candidate's engine steps X times as fast as the window's: "
                       "other hardware, a faster dtype or kernel (measure X on both, e.g. with "
                       "bench/engine_throughput.py); default 1")
        p.add_argument("--json", action="store_true", help="the figures as JSON")

    wi = sub.add_parser("whatif", help="recorded traffic through the engine's own scheduler and "
                        "the gateway's router on a virtual clock: the recorded config and a "
                        "candidate")
    window_args(wi)
    wi.add_argument("--replicas", type=int, help="the candidate's replica count (default: as "
                    "recorded)")
    wi.add_argument("--queue-timeout", type=float, metavar="S",
                    help="end a request still queued after S seconds (TIMED_OUT), as the "
                         "gateway's TAILSCOPE_QUEUE_TIMEOUT_S does (default: the recorded "
                         "gateway's, from the configs table; 0: no limit)")
    wi.add_argument("--rate-scale", default="1", metavar="X[,X...]",
                    help="arrivals this many times as fast; several: a sweep (see --plot)")
    wi.add_argument("--slo", metavar="ttft_ms=N,tpot_ms=N", help="also report SLO attainment "
                    "and goodput")
    wi.add_argument("--plot", metavar="PNG", help="write the TTFT frontier over the rate scales")
    wi.set_defaults(func=cmd_whatif)
    sz = sub.add_parser("size", help="replicas for a peak rate under an SLO, from one replica's "
                        "goodput on recorded traffic, confirmed by what-if runs")
    window_args(sz)
    sz.add_argument("--slo", required=True, metavar="ttft_ms=N,tpot_ms=N",
                    help="the latency targets a request must meet")
    sz.add_argument("--peak-rate", type=float, required=True, metavar="REQ/S",
                    help="the arrival rate to size for")
    sz.add_argument("--utilisation", type=float, default=0.8, metavar="RHO",
                    help="the share of a replica's goodput to plan for (default 0.8)")
    sz.add_argument("--attainment", type=float, default=0.99,
                    help="the share of requests that must meet the SLO (default 0.99)")
    sz.set_defaults(func=cmd_size)

    rp = sub.add_parser("replay", help="run a recorded request again (same tokens, sampling "
                                       "and config) and report whether it came out the same")
    rp.add_argument("trace_id", help="the recorded request to run again")
    rp.add_argument("--url", help="run it on this gateway")
    rp.add_argument("--engine-config", metavar="FILE",
                    help="run it on a gateway started with this config (try another config)")
    rp.add_argument("--source", metavar="URL",
                    help="the gateway holding the record (default: --url when it holds it, else "
                         "the running one, else the store)")
    rp.add_argument("--dsn", help="store DSN to read the record from (default "
                                  "TAILSCOPE_STORE_DSN)")
    rp.add_argument("--n", type=int, default=1,
                    help="replay it this many times at once (batch invariance)")
    rp.add_argument("--background", type=int, default=0, metavar="K",
                    help="K streams of other traffic alongside the replays")
    rp.add_argument("--api-key", help="the target gateway's API key, when it has tenants")
    rp.add_argument("--json", action="store_true", help="the report as JSON")
    rp.set_defaults(func=cmd_replay)
    rk = sub.add_parser("replica-key", help="print a replica's own link key (set it as that "
                        "replica's TAILSCOPE_REPLICA_LINK_KEY) from TAILSCOPE_REPLICA_KEY")
    rk.add_argument("id", help="the replica's id, as the gateway names it (--remote-replica)")
    rk.set_defaults(func=cmd_replica_key)
    dr = sub.add_parser("drill", help="serve the Streamlit p99 drill-down")
    dr.add_argument("--source", help="chdb:///path or http(s)://host:8123 DSN, or "
                                     "gateway:URL (default: the gateway at TAILSCOPE_GATEWAY_URL)")
    dr.add_argument("--url", help="the gateway to read through (shorthand for gateway:URL)")
    dr.add_argument("--host", default="127.0.0.1", help="listen address")
    dr.add_argument("--port", type=int, default=8501, help="listen port")
    dr.set_defaults(func=cmd_drill)
    b = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="base URL, with or without /v1")
    b.add_argument("--api-key", help="Bearer key for the gateway (a tenant's)")
    b.add_argument("--model", default="SmolLM2-135M-Instruct", help="the model to ask")
    b.add_argument("--mode", choices=["serial", "burst", "rate", "sweep", "closed"],
                   default="rate", help="one at a time, all at once, an open-loop rate, a "
                   "sweep of rates, or a fixed number of streams")
    b.add_argument("--rate", type=float, help="requests/s (mode rate)")
    b.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier")
    b.add_argument("--concurrency", type=int, default=8, help="streams (mode closed)")
    b.add_argument("--requests", type=int, help="requests to send (default rate x duration)")
    b.add_argument("--duration", type=float,
                   help="seconds of schedule (mode rate; per rate in a sweep, default 10)")
    b.add_argument("--steps", type=int, default=5, help="rates in a sweep")
    b.add_argument("--prompt-len", default="lognormal:128:0.6",
                   help="fixed:N | uniform:A:B | lognormal:MEDIAN:SIGMA (tokens)")
    b.add_argument("--output-len", default="uniform:16:64",
                   help="max_tokens distribution, as --prompt-len")
    b.add_argument("--shared-prefix", type=float, default=0.0,
                   help="fraction of prompts starting with the same 64 tokens")
    b.add_argument("--tenant-keys", help="comma-separated API keys, used round-robin")
    b.add_argument("--trace", help="JSONL trace to replay (timestamp, prompt, max_tokens)")
    b.add_argument("--warmup", type=int, default=2, help="serial requests reported apart")
    b.add_argument("--slo", help="ttft_ms=N,tpot_ms=N: report attainment and goodput")
    b.add_argument("--out", help="directory for results.json, summary.md and plots")
    b.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    b.add_argument("--no-record", action="store_true",
                   help="do not store the run in the gateway's bench_runs table")
    b.set_defaults(func=cmd_bench)
    _eval_parser(sub)
    return p


def _eval_parser(sub) -> None:
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
