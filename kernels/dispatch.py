"""Kernel dispatch: the engine calls these names and never an implementation directly.

``TAILSCOPE_KERNELS`` selects the backend:

- ``auto`` (default): the Triton kernels (``kernels.triton_kernels``) on CUDA tensors when
  ``triton`` is installed, the torch reference (``kernels.reference``) otherwise;
- ``torch``: always the reference;
- ``triton``: always Triton. On CPU tensors that needs Triton's interpreter
  (``TRITON_INTERPRET=1`` set before anything imports triton): how the tests check every kernel
  against its reference on a machine without a GPU. Slow; never a serving setting on CPU.

``causal_attention`` (a whole uncached prompt) has no Triton kernel of its own on the paged
path: under Triton it runs as paged prefill attention over the cache the prompt was just
written to, so the engine's prefill takes the Triton path too.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels import reference
from tailscope import env

_BACKENDS = ("auto", "torch", "triton")


def kernel_backend() -> str:
    choice = env.kernel_backend()
    if choice not in _BACKENDS:
        raise ValueError(
            f"TAILSCOPE_KERNELS={choice!r} is not available; choose one of {', '.join(_BACKENDS)}"
        )
    if choice == "triton":
        _triton()  # a clear error now rather than at the first forward
    return choice


@functools.cache
def _triton():
    try:
        from kernels import triton_kernels
    except ImportError as exc:
        raise ValueError(f"TAILSCOPE_KERNELS=triton needs the triton package ({exc}); "
                         "pip install 'tailscope[gpu]'") from None
    return triton_kernels


@functools.cache
def _triton_available() -> bool:
    try:
        _triton()
        return True
    except ValueError:
        return False


def use_triton(t: torch.Tensor) -> bool:
    choice = kernel_backend()
    if choice == "triton":
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("TAILSCOPE_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 "
                             "(set before triton is imported)")
        return True
    return choice == "auto" and t.is_cuda and _triton_available()


def implementation(t: torch.Tensor):
    """The module of kernels a step on ``t``'s device runs (``triton_kernels`` or
    ``reference``): the model decides once per step, where each dispatched call below decides
    again (reading the environment: ~0.6 ms of a batch-1 step of the bundled model)."""
    return _triton() if use_triton(t) else reference


def _pick(name: str):
    ref = getattr(reference, name)

    def call(*args, **kwargs):
        impl = getattr(_triton(), name) if use_triton(args[0]) else ref
        return impl(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = ref.__doc__
    return call


write_kv = _pick("write_kv")
paged_decode_attention = _pick("paged_decode_attention")
paged_prefill_attention = _pick("paged_prefill_attention")
paged_prefill_attention_varlen = _pick("paged_prefill_attention_varlen")
rms_norm = _pick("rms_norm")
add_rms_norm = _pick("add_rms_norm")
rotary = _pick("rotary")
silu_and_mul = _pick("silu_and_mul")
causal_attention = reference.causal_attention
