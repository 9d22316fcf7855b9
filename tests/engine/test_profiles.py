"""Engine profiles (``engine.profiles``): ``fast`` is chosen per CPU and is what the product's
entry points run unless told otherwise; ``exact`` is ``EngineConfig()``'s; every individual
setting overrides the profile; the choice and why are in /debug/config and config_id."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest

from engine.config import EngineConfig
from engine.profiles import choose, explain

BF16 = {"avx2", "fma", "avx512f", "avx512_bf16"}
AVX2 = {"avx2", "fma", "f16c"}


def test_fast_is_chosen_per_cpu_and_exact_is_the_float32_path():
    fast, why = choose("fast", BF16)
    assert fast == {"dtype": "bfloat16", "weights": "int4", "output_weights": "q8_0",
                    "compile": True, "compile_mode": "aot"}
    assert "avx512_bf16" in why
    assert choose("fast", {"amx_bf16", "amx_tile"})[0]["dtype"] == "bfloat16"
    avx2, why = choose("fast", AVX2)
    assert avx2 == {"dtype": "float32", "weights": "int4", "output_weights": "q8_0",
                    "compile": False, "compile_mode": "jit"}
    assert "no native bf16" in why and "AVX2 kernels" in why
    assert choose("fast", AVX2 | {"avx512f", "avx512bw"})[0] == avx2  # AVX-512 without BF16
    plain = {"dtype": "float32", "weights": "native", "output_weights": "native",
             "compile": False, "compile_mode": "jit"}
    assert choose("fast", {"sse4_2", "avx"}) == (plain, choose("fast", {"avx"})[1])
    assert "nor AVX2" in choose("fast", {"avx"})[1]
    assert choose("exact", BF16)[0] == plain
    with pytest.raises(ValueError, match="profile must be one of"):
        choose("fastest", BF16)
    with pytest.raises(ValueError, match="profile must be one of"):
        EngineConfig(profile="fastest")


def test_fast_on_avx2_needs_a_kernel_it_can_build(monkeypatch):
    """Without our AVX2 kernel the 4-bit weights would run on torch's, which takes bf16 inputs
    (emulated there): the profile then stays on the exact path, and says why."""
    monkeypatch.setenv("TAILSCOPE_NATIVE_KERNELS", "0")
    settings, why = choose("fast", AVX2)
    assert settings["weights"] == "native" and "cannot be built" in why
    monkeypatch.setenv("TAILSCOPE_NATIVE_KERNELS", "1")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CC", "no-such-cc")
    assert choose("fast", AVX2)[0]["weights"] == "native"


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
    # batch_invariant's kernels cannot run packed weights: the profile yields to it
    invariant = EngineConfig(profile="fast", batch_invariant=True)
    assert (invariant.weights, invariant.output_weights) == ("native", "native")
    assert invariant.dtype == here["dtype"] and "set over it" not in explain(invariant)


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


def test_make_serve_runs_the_fast_profile_and_says_why(bundled_path, monkeypatch, tmp_path):
    """... and on a CPU whose fast profile compiles, the replica is ready before its compiled
    step is: it serves eagerly while the step builds (an empty cache here), then on it."""
    from gateway.app import GatewayConfig, config_id
    from tests.gateway.conftest import start_server, stop_server

    monkeypatch.delenv("TAILSCOPE_PROFILE")  # the tests' pin (tests/conftest.py): none here
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          env={"TAILSCOPE_AOT_CACHE_DIR": str(tmp_path / "aot")})
    try:
        def compile_state() -> str:
            return httpx.get(f"{server.url}/debug/replicas", timeout=30).json()["r0"]["compile"]
        compiles = choose("fast")[0]["compile"]
        first = compile_state()
        assert first in (("compiling", "compiled") if compiles else ("off",))
        seen = [first]
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
        if compiles:
            deadline = time.monotonic() + 600
            while seen[-1] == "compiling" and time.monotonic() < deadline:
                time.sleep(0.5)
                seen.append(compile_state())
            assert seen[-1] == "compiled" and set(seen) <= {"compiling", "compiled"}, seen
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


@pytest.mark.parametrize("profile", ["exact", "fast"])
def test_a_stored_config_replays_as_the_same_config(profile, tmp_path, monkeypatch):
    """The configs table leaves ``profile`` out when it is exact (earlier config ids stay):
    the config file replay rebuilds from it must still say exact, or a product default of
    fast would make the replay another config."""
    from gateway.app import GatewayConfig, config_id, resolved_config
    from tailscope.cli import engine_config
    from tailscope.engine_config import load
    from tracing.replay import config_file_text

    monkeypatch.delenv("TAILSCOPE_PROFILE", raising=False)
    original = GatewayConfig(engine=EngineConfig(profile=profile, kv_cache_mb=64))
    f = tmp_path / "recorded.yaml"
    f.write_text(config_file_text(resolved_config(original)))
    file = load(f)
    rebuilt = GatewayConfig(model=file.model, served_model_name=file.served_model_name,
                            engine=engine_config(_parse([]), file.engine))
    assert config_id(rebuilt) == config_id(original)


def test_the_fast_profiles_compiled_step_needs_its_own_dtype_and_weights():
    """AOT runs bfloat16 with packed 4-bit weights: given others, the profile's compile stays
    off (or jit where compile is asked for), never a start that fails on its own default."""
    fast = choose("fast", BF16)[0]
    if fast != choose("fast")[0]:
        pytest.skip("this CPU's fast profile does not compile")
    assert (EngineConfig(profile="fast").compile, EngineConfig(profile="fast").compile_mode) \
        == (True, "aot")
    native = EngineConfig(profile="fast", weights="native")
    assert (native.compile, native.compile_mode) == (False, "jit")
    assert EngineConfig(profile="fast", dtype="float32").compile is False
    asked = EngineConfig(profile="fast", weights="int8", compile=True)
    assert (asked.compile, asked.compile_mode) == (True, "jit")
    assert EngineConfig(profile="fast", weights="int4a8").compile_mode == "aot"
    assert EngineConfig(profile="fast", compile=False).compile is False
    invariant = EngineConfig(profile="fast", batch_invariant=True)
    assert (invariant.compile, invariant.weights) == (False, "native")
