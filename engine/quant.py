"""Low-bit weights for ``weights: int4 | int8``. 4-bit: codes, scales and zeros, read from
GGUF's Q4 blocks without going through float, or quantized from float weights. 8-bit
(``quantize_int8``): one symmetric scale per output row, the form torch's ``_weight_int8pack_mm``
takes; GGUF's Q8_0 has a scale per 32 inputs, which that kernel cannot take, so every int8
weight is quantized from float (a Q8_0 tensor's dequantized values included).

4-bit, one form for every source: ``w = (code - 8) * scale + zero`` per group of 32 along the
input dimension, the form torch's CPU weight-only int4 kernel (``_weight_int4pack_mm_for_cpu``)
takes. GGUF's 4-bit types map onto it exactly (per llama.cpp's block layouts, as the ``gguf``
package decodes them in ``gguf.quants``):

- Q4_0: ``w = d * (q - 8)``: scale ``d``, zero 0;
- Q4_1: ``w = d * q + m``: scale ``d``, zero ``m + 8d``;
- Q4_K: super-blocks of 256 in eight groups of 32, ``w = d * sc * q - dmin * mn``: scale
  ``d * sc``, zero ``8 * d * sc - dmin * mn``.

Float weights (an HF directory, an F16 / Q8_0 / K-quant GGUF tensor) are quantized with the
``gguf`` package's own Q4_1 quantizer (per-group min / max) and decoded by the same path, so
there is one decoder. The block decoding is written here rather than taken from ``gguf``
because ``gguf.quants`` only returns floats: it has no call that hands back the codes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K, quantize

GROUP = 32  # values per (scale, zero) group along the input dimension


@dataclass
class Int4Weight:
    """A ``[N, K]`` matrix as 4-bit codes with a scale and zero per group of ``GROUP``."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    scale: torch.Tensor  # float32 [N, K // GROUP]
    zero: torch.Tensor  # float32 [N, K // GROUP]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        c = self.codes.view(n, k // GROUP, GROUP).to(torch.float32) - 8
        return (c * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).view(n, k)

    def map_rows(self, f: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
        """The same row operation (a slice, a permutation) on codes, scales and zeros."""
        return Int4Weight(f(self.codes), f(self.scale), f(self.zero))

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stacked along the output rows (Q/K/V, gate/up fused into one matrix)."""
        return Int4Weight(*(torch.cat([getattr(p, a) for p in parts])
                            for a in ("codes", "scale", "zero")))


def _nibbles(qs: np.ndarray, n_blocks: int, run: int) -> np.ndarray:
    """Codes from packed bytes: each run of ``run`` bytes holds ``run`` values in its low
    nibbles, then the next ``run`` in its high nibbles (llama.cpp's order)."""
    qs = qs.reshape(n_blocks, -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(n_blocks, -1)


def from_gguf(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> Int4Weight | None:
    """``data`` (a GGUF tensor's raw blocks, one row of blocks per output row) as codes, scales
    and zeros, exactly; None for a type that is not 4-bit."""
    n, k = shape
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n * k // _block_values(qtype), -1)
    nb = blocks.shape[0]
    if qtype in (Q.Q4_0, Q.Q4_1):
        d = blocks[:, 0:2].view(np.float16).astype(np.float32)
        if qtype == Q.Q4_0:
            zero, qs = np.zeros_like(d), blocks[:, 2:]
        else:
            zero, qs = blocks[:, 2:4].view(np.float16).astype(np.float32) + 8 * d, blocks[:, 4:]
        codes, scale = _nibbles(qs, nb, 16), d
    elif qtype == Q.Q4_K:
        d = blocks[:, 0:2].view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = d * sc.astype(np.float32)  # [nb, 8]
        zero = 8 * scale - dmin * mn.astype(np.float32)
        codes = _nibbles(blocks[:, 16:], nb, 32)
    else:
        return None
    groups = k // GROUP
    return Int4Weight(torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k)),
                      torch.from_numpy(np.ascontiguousarray(scale).reshape(n, groups)),
                      torch.from_numpy(np.ascontiguousarray(zero).reshape(n, groups)))


def q8_0_from_gguf(data: np.ndarray, qtype: Q, shape: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A GGUF Q8_0 tensor's raw blocks (a float16 scale, then 32 int8 codes) as its codes
    ``[rows, cols]`` int8 and scales ``[rows, cols / 32]`` float16, exactly
    (``kernels.linear.Int8Rows``); None for another type."""
    if qtype != Q.Q8_0:
        return None
    n, k = shape
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // 32, 34)
    scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(n, k // 32)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
    return torch.from_numpy(codes), torch.from_numpy(scale)


def _block_values(qtype: Q) -> int:
    return 256 if qtype == Q.Q4_K else 32


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """A float ``[N, K]`` matrix quantized per group of 32 by ``gguf``'s Q4_1 rule (min / max)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"weights: int4 needs input dimensions divisible by {GROUP}; a "
                         f"{n}x{k} matrix is not")
    blocks = quantize(w.detach().to(torch.float32).numpy(), Q.Q4_1)
    out = from_gguf(blocks, Q.Q4_1, (n, k))
    assert out is not None
    return out


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[N, K]`` matrix as GGUF's Q8_0 blocks (``gguf``'s rule: a float16 scale
    ``max |w| / 127`` per 32 inputs), as ``q8_0_from_gguf`` returns a stored one."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"output_weights: q8_0 needs input dimensions divisible by 32; a "
                         f"{n}x{k} matrix is not")
    out = q8_0_from_gguf(quantize(w.detach().to(torch.float32).numpy(), Q.Q8_0), Q.Q8_0, (n, k))
    assert out is not None
    return out


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[N, K]`` matrix as int8 ``q`` and a float32 scale per row, ``w ~ q * scale``
    (symmetric, round to nearest: error at most half a step, ``scale / 2``)."""
    w = w.detach().to(torch.float32)
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale
