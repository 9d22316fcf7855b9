"""Token-in/token-out inference engine: the public protocol the gateway imports.

The names below are imported lazily (PEP 562), so that the gateway process, which needs only
``engine.text``, ``engine.protocol`` and ``engine.sampling_params``, never loads torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "EngineConfig": "engine.config", "ModelConfig": "engine.config",
    "Engine": "engine.llm_engine", "RequestOutput": "engine.llm_engine",
    "UnsupportedModelError": "engine.loader", "default_model_path": "engine.loader",
    "load_model": "engine.loader", "load_configured": "engine.loader",
    "OutputObserver": "engine.observer", "RequestStats": "engine.observer",
    "TimelineEvent": "engine.observer", "StepStats": "engine.observer",
    "IllegalTransition": "engine.request", "Request": "engine.request",
    "RequestState": "engine.request",
    "SamplingParams": "engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
