"""Torch dtypes by name (``EngineConfig.dtype`` holds the name; only engine code needs torch)."""

from __future__ import annotations

import torch

from engine.config import DTYPE_BYTES

_DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None
