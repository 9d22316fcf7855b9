"""One declaration per engine setting: every field of ``EngineConfig`` is an environment
variable, a command-line flag, a YAML engine key, part of ``config_id``, and reaches the replica
process, with nothing else to edit."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.config import EngineConfig
from gateway.app import GatewayConfig, config_id
from tailscope.cli import add_engine_flags, engine_config
from tailscope.engine_config import ConfigFileError, load
from tailscope.settings import Settings

# a value other than the default for every setting, by type
SAMPLE = {"dtype": "bfloat16", "kv_cache_mb": 64, "num_kv_blocks": 40, "block_size": 8,
          "max_num_seqs": 3, "max_batched_tokens": 128, "max_model_len": 512,
          "prefix_caching": False, "preemption": "swap", "step_detail": False,
          "scheduling_policy": "priority", "priority_aging_s": 2.5, "batch_invariant": True,
          "sjf_token_s": 0.05, "budget_split": "prefill_first", "decode_reserve_tokens": 8,
          "fair_decode_cost": 1.5, "weights": "int4", "compile": True,
          "output_weights": "int4", "compile_mode": "aot", "profile": "fast"}
# settings whose other values need another setting's (sent along with them on every surface)
REQUIRES = {"compile_mode": {"compile": True}}
# settings with one valid value so far (no other value to send through every surface)
SINGLE_CHOICE: dict[str, tuple] = {}


def test_the_sample_covers_every_setting():
    assert all(len(choices) == 1 for choices in SINGLE_CHOICE.values())  # else: into SAMPLE
    assert set(SAMPLE) | set(SINGLE_CHOICE) == set(EngineConfig.setting_types())
    for name, value in SAMPLE.items():
        assert getattr(EngineConfig(), name) != value, name


@pytest.mark.parametrize("name", sorted(SAMPLE))
def test_each_setting_is_an_env_var_a_flag_a_yaml_key_and_part_of_config_id(
        name, monkeypatch, tmp_path):
    value = SAMPLE[name]
    values = {**REQUIRES.get(name, {}), name: value}
    for n, v in values.items():
        monkeypatch.setenv(f"TAILSCOPE_{n.upper()}", "0" if v is False else str(v))
    assert getattr(Settings.from_env().engine, name) == value
    for n in values:
        monkeypatch.delenv(f"TAILSCOPE_{n.upper()}")

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    argv = []
    for n, v in values.items():
        flag = "--" + n.replace("_", "-")
        argv += [f"--no-{flag[2:]}"] if v is False else [flag] if v is True else [flag, str(v)]
    assert getattr(engine_config(p.parse_args(argv)), name) == value

    f = tmp_path / "c.yaml"
    f.write_text("engine: {" + ", ".join(
        f"{n}: {str(v).lower() if isinstance(v, bool) else v}" for n, v in values.items()) + "}")
    assert EngineConfig(**load(f).engine) == EngineConfig(**values)

    base = config_id(GatewayConfig(engine=EngineConfig(**REQUIRES.get(name, {}))))
    assert config_id(GatewayConfig(engine=EngineConfig(**values))) != base


def test_flags_win_over_the_file_and_the_file_over_the_environment(monkeypatch):
    monkeypatch.setenv("TAILSCOPE_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("TAILSCOPE_BLOCK_SIZE", "8")
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    got = engine_config(p.parse_args(["--max-num-seqs", "7"]),
                        {"max_num_seqs": 6, "kv_cache_mb": 32})
    assert (got.max_num_seqs, got.block_size, got.kv_cache_mb) == (7, 8, 32)


def test_bad_values_are_refused_naming_the_setting(tmp_path):
    f = tmp_path / "c.yaml"
    for text, match in (("engine: {max_num_seqs: 0}", "max_num_seqs must be >= 1"),
                        ("engine: {preemption: sometimes}", "preemption must be one of"),
                        ("engine: {prefix_caching: 1}", "prefix_caching must be bool")):
        f.write_text(text)
        with pytest.raises(ConfigFileError, match=match):
            load(f)


def test_the_replica_receives_the_whole_config(bundled_path):
    import httpx

    from engine.config import auto_dtype
    from tests.gateway.conftest import start_server, stop_server

    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--num-kv-blocks", "40", "--max-num-seqs", "3", "--dtype", "auto")
    try:
        info = httpx.get(f"{server.url}/debug/replicas").json()["r0"]
        assert info["kv_blocks_total"] == 40  # only the replica's engine could know this
        body = httpx.get(f"{server.url}/debug/config").json()
        engine = body["config"]["engine"]
        assert engine["max_num_seqs"] == 3 and engine["num_kv_blocks"] == 40
        assert engine["dtype"] == body["dtype_auto"]["chooses"] == auto_dtype()[0]
    finally:
        stop_server(server)


@pytest.mark.parametrize("path", sorted(
    (Path(__file__).resolve().parents[2] / "evals" / "configs").glob("*.yaml")),
    ids=lambda p: p.stem)
def test_the_shipped_eval_configs_load(path):
    file = load(path)
    config = EngineConfig.from_mapping(file.engine, str(path))
    assert file.name.startswith(path.stem) and file.model == "bundled"
    assert config.as_dict().items() >= {
        k: v for k, v in file.engine.items() if k != "dtype"}.items()


@pytest.mark.parametrize("name", ["vllm", "sglang", "llamacpp"])
def test_the_documented_backend_configs_load(name):
    from pathlib import Path

    file = load(Path(__file__).resolve().parents[2] / "deploy" / "backends" / f"{name}.yaml")
    assert file.backends and all(b.url.startswith("http") and b.model for b in file.backends)


def test_a_backend_entry_with_a_typo_is_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("backends:\n  - {name: a, url: 'http://x', model: m, idle_timeout: 3}\n")
    with pytest.raises(ConfigFileError, match="idle_timeout"):
        load(path)


def test_dtype_auto_is_resolved_where_the_config_is_made(tmp_path, monkeypatch):
    """``auto`` is bf16 where the CPU multiplies bf16 natively, else fp32; it becomes the
    concrete dtype when the config is made, so config_id, the replicas and the records see
    the choice, and a config written ``auto`` is the same config as the one it chose."""
    from engine.config import auto_dtype

    assert auto_dtype({"avx2", "avx512f", "avx512_bf16"})[0] == "bfloat16"
    assert auto_dtype({"avx2", "amx_bf16", "amx_tile"})[0] == "bfloat16"
    chosen, why = auto_dtype({"avx2", "avx512f"})
    assert chosen == "float32" and "avx512_bf16" in why
    here = auto_dtype()[0]
    assert EngineConfig(dtype="auto").dtype == here
    assert EngineConfig(dtype="auto") == EngineConfig(dtype=here)
    f = tmp_path / "c.yaml"
    f.write_text("engine: {dtype: auto}")
    assert EngineConfig.from_mapping(load(f).engine, str(f)).dtype == here
    monkeypatch.setenv("TAILSCOPE_DTYPE", "auto")
    assert Settings.from_env().engine.dtype == here
    f.write_text("engine: {dtype: bf8}")
    with pytest.raises(ConfigFileError, match="or auto"):
        load(f)


def _other_value(f):
    """A value of setting ``f`` other than its default, as the environment would give it."""
    default = f.default
    if isinstance(default, bool):
        return "0" if default else "1"
    if isinstance(default, (int, float)):
        return str(default + 7)
    return "tcp://127.0.0.1:1" if f.name == "replica_outbox" else f"x-{f.name}"


def test_every_gateway_setting_reaches_the_gateway_config(monkeypatch):
    """One declaration per gateway setting: its field in ``Settings`` is its environment
    variable, and ``GatewayConfig.from_settings`` carries it (same name, a renamed field, or a
    limits group) with nothing else to edit; a setting the gateway does not hold is listed."""
    import dataclasses

    from gateway.config import NOT_GATEWAY, PARSED, RENAMED

    fields = [f for f in dataclasses.fields(Settings) if f.name != "engine"]
    for f in fields:
        monkeypatch.setenv(f"TAILSCOPE_{f.name.upper()}", _other_value(f))
    s = Settings.from_env()
    config = GatewayConfig.from_settings(s, **{name: () for name in PARSED})
    held = {**dataclasses.asdict(config), **dataclasses.asdict(config.limits),
            **{"query_" + k: v for k, v in dataclasses.asdict(config.query_limits).items()}}
    for f in fields:
        if f.name in PARSED or f.name in NOT_GATEWAY:
            continue
        got = held[RENAMED.get(f.name, f.name)]
        assert got == getattr(s, f.name) != f.default, f.name
    with pytest.raises(TypeError, match="given, parsed"):
        GatewayConfig.from_settings(s)


def test_an_empty_or_zero_setting_is_none_where_the_config_takes_none(monkeypatch):
    monkeypatch.setenv("TAILSCOPE_STORE_DSN", "none")
    monkeypatch.setenv("TAILSCOPE_REQUEST_TIMEOUT_S", "0")
    from gateway.config import PARSED

    config = GatewayConfig.from_settings(Settings.from_env(), **{n: () for n in PARSED})
    assert config.store_dsn is None and config.request_timeout_s is None
    assert config.admin_key is None and config.spool_dir is None  # "" by default
