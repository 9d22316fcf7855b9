"""The one module that reads ``TAILSCOPE_*`` variables from the environment.

Two kinds. The settings (``tailscope.settings.Settings`` and the engine's ``EngineConfig``, one
variable per field, ``TAILSCOPE_<FIELD NAME>``) are read through ``setting`` and parsed by their
types there. The process-level switches below are read where they are used, before any settings
exist (a kernel build, a cache path, a replica's own environment), each through a function
here. Standard library only: the kernels and the engine read it too.
"""

from __future__ import annotations

import os
from pathlib import Path

# The process-level variables and their help (the environment reference lists them).
PROCESS_VARIABLES: dict[str, str] = {
    "TAILSCOPE_NATIVE_KERNELS": "`on` (default): build and use our C kernels where the CPU "
    "runs them; `off`: torch's kernels only; `avx2`: the AVX2 library alone",
    "TAILSCOPE_KERNELS": "the kernel backend: `auto` (default: Triton on CUDA tensors when "
    "installed, else torch), `torch`, or `triton` (on a CPU only under `TRITON_INTERPRET=1`)",
    "TAILSCOPE_CACHE_DIR": "where built kernels and compiled steps are kept (default "
    "`~/.cache/tailscope`)",
    "TAILSCOPE_AOT_CACHE_DIR": "where ahead-of-time compiled decode steps are kept (default "
    "`$TAILSCOPE_CACHE_DIR/aot`)",
    "TAILSCOPE_REPLICA_LINK_KEY": "a replica's own link key, set by the gateway for the "
    "replicas it starts (derived from `TAILSCOPE_REPLICA_KEY`)",
    "TAILSCOPE_DRILL_SOURCE": "the drill-down's data source (`gateway:URL`, `chdb://DIR` or a "
    "ClickHouse DSN), set by `tailscope drill`",
    "TAILSCOPE_DRILL_TOKENIZERS": "tokenizer paths (`os.pathsep`-separated) the drill-down "
    "tries to show a record's text",
    "TAILSCOPE_FAULT_STORE_DOWN_FILE": "tests only: while this file exists the store child "
    "refuses inserts (fault injection)",
}


def setting(name: str) -> str | None:
    """``TAILSCOPE_<NAME>`` (a setting's field name) as set, else None."""
    return os.environ.get(f"TAILSCOPE_{name.upper()}")


def _get(name: str, default: str = "") -> str:
    return os.environ.get(f"TAILSCOPE_{name}", default)


def native_kernels() -> str:
    """``TAILSCOPE_NATIVE_KERNELS``: ``on`` (default: every library of our kernels this CPU
    runs), ``off``, or ``avx2`` (the AVX2 library alone: how its path is run and tested on an
    AVX-512 machine)."""
    value = _get("NATIVE_KERNELS", "1").strip().lower()
    return "off" if value in ("0", "false", "no", "off") else "avx2" if value == "avx2" \
        else "on"


def kernel_backend() -> str:
    """``TAILSCOPE_KERNELS`` as given, lower-cased ("auto" when unset or empty)."""
    return _get("KERNELS", "auto").strip().lower() or "auto"


def cache_dir() -> Path:
    """``$TAILSCOPE_CACHE_DIR``, else ``~/.cache/tailscope``."""
    return Path(_get("CACHE_DIR") or Path.home() / ".cache" / "tailscope")


def aot_cache_dir() -> Path:
    """``$TAILSCOPE_AOT_CACHE_DIR``, else ``aot`` in the cache directory."""
    return Path(_get("AOT_CACHE_DIR") or cache_dir() / "aot")


def threads() -> int:
    """``TAILSCOPE_THREADS`` (0: not set)."""
    return int(_get("THREADS") or 0)


def profile() -> str:
    """``TAILSCOPE_PROFILE`` ("" when unset)."""
    return _get("PROFILE")


def replica_keys() -> tuple[str, str]:
    """(``TAILSCOPE_REPLICA_LINK_KEY``: a replica's own, ``TAILSCOPE_REPLICA_KEY``: the
    fleet's), "" each when unset."""
    return _get("REPLICA_LINK_KEY"), _get("REPLICA_KEY")


def drill_source() -> str:
    return _get("DRILL_SOURCE", "gateway:http://127.0.0.1:8000")


def drill_tokenizers() -> list[str]:
    return [p for p in _get("DRILL_TOKENIZERS").split(os.pathsep) if p]


def fault_store_down_file() -> str | None:
    return _get("FAULT_STORE_DOWN_FILE") or None
