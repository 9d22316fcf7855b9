"""Hot-path kernels: torch reference implementations, Triton versions, and dispatch."""

from kernels.dispatch import (
    add_rms_norm,
    causal_attention,
    implementation,
    kernel_backend,
    paged_decode_attention,
    paged_prefill_attention,
    paged_prefill_attention_varlen,
    rms_norm,
    rotary,
    silu_and_mul,
    use_triton,
    write_kv,
)

__all__ = [
    "add_rms_norm",
    "causal_attention",
    "implementation",
    "kernel_backend",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_prefill_attention_varlen",
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "use_triton",
    "write_kv",
]
