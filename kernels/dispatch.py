"""Kernel dispatch: the engine calls these names and never an implementation directly.

``TAILSCOPE_KERNELS`` selects the backend: ``auto`` (default: Triton on CUDA tensors once the
Triton kernels land, the torch reference otherwise) or ``torch``. Until the Triton kernels exist,
``triton`` is refused with a clear error rather than silently running something else.
"""

from __future__ import annotations

import os

from kernels import reference

_BACKENDS = ("auto", "torch")


def kernel_backend() -> str:
    choice = os.environ.get("TAILSCOPE_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        raise ValueError(
            f"TAILSCOPE_KERNELS={choice!r} is not available; choose one of {', '.join(_BACKENDS)}"
        )
    return "torch"


write_kv = reference.write_kv
paged_decode_attention = reference.paged_decode_attention
paged_prefill_attention = reference.paged_prefill_attention
causal_attention = reference.causal_attention
