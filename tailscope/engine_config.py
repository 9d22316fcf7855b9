"""Engine config files: one YAML file names a deployment's model, engine settings and sampling
policy, so an eval run (or a rollout) is reproducible from the file alone::

    name: bundled-default            # a label, not part of config_id
    model: bundled                   # 'bundled', 'tiny', a .gguf file or an HF directory
    served_model_name: SmolLM2-135M-Instruct
    replicas: 1
    engine:                          # any field of engine.config.EngineConfig; the rest keep
      dtype: float32                 # their defaults (unknown keys and wrong types are errors)
      kv_cache_mb: 512
      max_num_seqs: 64
      preemption: recompute          # recompute | swap | auto | off
    sampling:
      defaults: {}                   # request fields filled in when a request leaves them out
      overrides: {}                  # request fields forced on every request (null removes)
    backends:                        # external OpenAI-compatible servers (gateway.upstream)
      - name: vllm-a                 # the replica name in records
        url: http://gpu-1:8000       # with or without /v1
        model: llama-3-8b            # the model name clients send
        upstream_model: meta-llama/Meta-Llama-3-8B-Instruct
        api_key_env: VLLM_KEY        # optional; timeouts, max_concurrency, eject_*,
                                     # probe_interval_s too (gateway.upstream_config.UpstreamConfig)

``tailscope serve --engine-config FILE`` starts a gateway with it; the gateway's ``config_id``
(on every request record and in ``GET /debug/config``) is a hash of the resolved config.
Unknown keys are errors: a typo must not silently fall back to a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig

TOP_KEYS = {"name", "model", "served_model_name", "replicas", "engine", "sampling", "backends"}


class ConfigFileError(ValueError):
    pass


@dataclass(frozen=True)
class EngineConfigFile:
    path: str
    name: str = ""
    model: str | None = None
    served_model_name: str | None = None
    replicas: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # the settings the file gives
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    backends: tuple = ()  # of gateway.upstream_config.UpstreamConfig


def load(path: str | Path) -> EngineConfigFile:
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: expected a mapping at the top level")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise ConfigFileError(f"{path}: unknown keys {sorted(unknown)}; known: "
                              f"{', '.join(sorted(TOP_KEYS))}")
    engine = data.get("engine") or {}
    if not isinstance(engine, dict):
        raise ConfigFileError(f"{path}: engine must be a mapping")
    try:
        EngineConfig.from_mapping(engine, str(path))  # validated now; merged by the caller
    except ValueError as exc:
        raise ConfigFileError(str(exc)) from None
    sampling = data.get("sampling") or {}
    bad = set(sampling) - {"defaults", "overrides"}
    if bad:
        raise ConfigFileError(f"{path}: unknown sampling keys {sorted(bad)}; "
                              "known: defaults, overrides")
    for key in ("defaults", "overrides"):
        if not isinstance(sampling.get(key) or {}, dict):
            raise ConfigFileError(f"{path}: sampling.{key} must be a mapping")
    replicas = data.get("replicas")
    if replicas is not None and (not isinstance(replicas, int) or replicas < 1):
        raise ConfigFileError(f"{path}: replicas must be a positive integer")
    backends = data.get("backends") or []
    if not isinstance(backends, list) or not all(isinstance(b, dict) for b in backends):
        raise ConfigFileError(f"{path}: backends must be a list of mappings")
    from gateway.upstream_config import UpstreamConfig

    try:
        parsed = tuple(UpstreamConfig.from_mapping(b, f"{path}: backends[{i}]")
                       for i, b in enumerate(backends))
    except (ValueError, TypeError) as exc:
        raise ConfigFileError(str(exc)) from None
    return EngineConfigFile(path=str(path), name=str(data.get("name") or path.stem),
                            backends=parsed,
                            model=data.get("model"),
                            served_model_name=data.get("served_model_name"),
                            replicas=replicas, engine=dict(engine),
                            sampling_defaults=dict(sampling.get("defaults") or {}),
                            sampling_overrides=dict(sampling.get("overrides") or {}))
