"""Hot-path kernels: torch reference implementations, Triton versions (later), and dispatch."""

from kernels.dispatch import (
    causal_attention,
    kernel_backend,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

__all__ = [
    "causal_attention",
    "kernel_backend",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
]
