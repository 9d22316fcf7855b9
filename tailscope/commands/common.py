"""Helpers the commands share: the engine settings as flags, the store or gateway a
read-side command talks to."""

from __future__ import annotations

import argparse
import json

from engine.config import EngineConfig
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


def _iso(us: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(us / 1e6, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _gateway_up(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


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


def _query_limits(s: Settings):
    """The ``TAILSCOPE_QUERY_*`` limits of every store read (the gateway's and a store
    process's)."""
    from tracing.store import QueryLimits

    return QueryLimits(max_execution_s=s.query_max_execution_s,
                       max_result_rows=s.query_max_result_rows,
                       max_rows_to_read=s.query_max_rows_to_read,
                       max_memory_mb=s.query_max_memory_mb)
