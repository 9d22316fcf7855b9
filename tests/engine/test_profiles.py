"""Engine profiles (``engine.profiles``): ``fast`` is chosen per CPU and is what the product's
entry points run unless told otherwise; ``exact`` is ``EngineConfig()``'s; every individual
setting overrides the profile; the choice and why are in /debug/config and config_id."""

from __future__ import annotations

import argparse

import httpx
import pytest

from engine.config import EngineConfig
from engine.profiles import choose, explain

BF16 = {"avx2", "fma", "avx512f", "avx512_bf16"}
AVX2 = {"avx2", "fma", "f16c"}


def test_fast_is_chosen_per_cpu_and_exact_is_the_float32_path():
    fast, why = choose("fast", BF16)
    assert fast == {"dtype": "bfloat16", "weights": "int4", "output_weights": "int4"}
    assert "avx512_bf16" in why
    assert choose("fast", {"amx_bf16", "amx_tile"})[0]["dtype"] == "bfloat16"
    plain, why = choose("fast", AVX2)
    assert plain == {"dtype": "float32", "weights": "native", "output_weights": "native"}
    assert "no native bf16" in why
    assert choose("exact", BF16)[0] == plain
    with pytest.raises(ValueError, match="profile must be one of"):
        choose("fastest", BF16)
    with pytest.raises(ValueError, match="profile must be one of"):
        EngineConfig(profile="fastest")


def test_a_profile_fills_in_only_what_is_not_given():
    here = choose("fast")[0]
    fast = EngineConfig(profile="fast")
    assert {k: getattr(fast, k) for k in here} == here
    exact = EngineConfig()
    assert (exact.profile, exact.dtype, exact.weights, exact.output_weights) == (
        "exact", "float32", "native", "native")
    mixed = EngineConfig(profile="fast", dtype="float32")
    assert mixed.dtype == "float32" and mixed.weights == here["weights"]
    if here["dtype"] != "float32":
        assert "set over it: dtype=float32" in explain(mixed)
    # a resolved config written out and read back is the same config (replicas, config ids)
    assert EngineConfig(**fast.as_dict()) == fast


def _parse(argv: list[str]) -> argparse.Namespace:
    from tailscope.cli import add_engine_flags

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return p.parse_args(argv)


def test_the_products_entry_points_default_to_fast(monkeypatch):
    from tailscope.cli import engine_config

    monkeypatch.delenv("TAILSCOPE_PROFILE", raising=False)
    assert engine_config(_parse([])).profile == "fast"
    assert engine_config(_parse([]), {"profile": "exact"}).profile == "exact"  # a file
    monkeypatch.setenv("TAILSCOPE_PROFILE", "exact")
    assert engine_config(_parse([])).profile == "exact"
    assert engine_config(_parse(["--profile", "fast"])).profile == "fast"
    got = engine_config(_parse(["--profile", "fast", "--weights", "native"]))
    assert got.weights == "native" and got.dtype == choose("fast")[0]["dtype"]


def test_make_serve_runs_the_fast_profile_and_says_why(bundled_path, monkeypatch):
    from gateway.app import GatewayConfig, config_id
    from tests.gateway.conftest import start_server, stop_server

    monkeypatch.delenv("TAILSCOPE_PROFILE")  # the tests' pin (tests/conftest.py): none here
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path))
    try:
        body = httpx.get(f"{server.url}/debug/config", timeout=30).json()
        chosen, why = choose("fast")
        assert body["profile"] == {"name": "fast", "because": why}
        engine = body["config"]["engine"]
        assert engine["profile"] == "fast"
        assert {k: engine[k] for k in chosen} == chosen  # what the replica was given
        r = httpx.post(f"{server.url}/v1/completions", json={
            "model": server.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        def cid(**engine) -> str:  # start_server's KV budget, as the gateway's own
            return config_id(GatewayConfig(model="tiny:49152",
                                           engine=EngineConfig(kv_cache_mb=64, **engine)))
        assert body["config_id"] == cid(profile="fast") != cid(profile="exact")
    finally:
        stop_server(server)
