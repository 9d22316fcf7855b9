"""Weight matrices prepared once for the fastest CPU matmul available.

For bfloat16 on CPU, oneDNN with the weight reordered ahead of time ("prepacked") uses AMX/AVX512
and is 2-5x faster than ``F.linear``, which reorders the weight on every call. Measured here
(3072x576, 2 threads): 167 vs 412 us at M=1, 1.0 vs 3.5 ms at M=512. For float32 the plain MKL
path of ``F.linear`` is kept: prepacking made batch-1 decode slower. Results are the same values
``F.linear`` gives (checked in tests/kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _can_prepack(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """``y = x @ weight.T`` with ``weight`` ``[out, in]``; holds only the prepared form."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.prepacked = _can_prepack(weight)
        if self.prepacked:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight = weight.contiguous()

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


# Rows up to which a step runs on the packed 4-bit weights; past it, on the dense copy.
# torch's int4 kernel costs about the same per row as a whole GEMV (it is one, per row), while
# a prepacked bf16 GEMM costs little more for 8 rows than for one once the weight is in cache.
# Measured here (3072x576, 2 threads, weights cold as in a real step): int4 87 us vs bf16
# 335 us at 1 row, on par at about 8, 5.7x slower at 64 (README, "Where batch-1 time goes").
INT4_MAX_ROWS = 4


class Int4Linear:
    """``y = x @ w.T`` for ``w = (code - 8) * scale + zero`` per group of ``group`` inputs
    (``engine.quant.Int4Weight``, the kernel's own form): steps of up to ``max_rows`` rows
    (batch-1 and small-batch decode, where reading the weights is the cost) run torch's
    weight-only int4 kernel on the packed codes; larger ones (prefill, many streams) a dense
    copy of the same values in ``dtype``, where the matmul is the cost and the int4 kernel is
    slower."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 dense: torch.Tensor, group: int, max_rows: int = INT4_MAX_ROWS) -> None:
        """``codes`` [N, K] (0..15), ``scale`` / ``zero`` [N, K / group]; ``dense`` the same
        values in the model's dtype (``Int4Weight.dequantize``), for steps past ``max_rows``."""
        self.shape = tuple(codes.shape)
        self.dtype = dense.dtype
        self.group = group
        self.max_rows = max_rows
        # [N, K / 2] bytes in the kernel's own layout; [K / group, N, 2] scales and zeros in
        # bfloat16: the kernel's float32 path is a slow reference one (2.97 ms against 89 us
        # at one row here), so float32 activations go through it as bfloat16
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1)
        self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(
            torch.bfloat16)
        self.dense = Linear(dense)

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """What a small step reads: the packed codes and the scales and zeros."""
        return self.packed.numel() * self.packed.element_size() + \
            self.scales_zeros.numel() * self.scales_zeros.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.packed, self.group, self.scales_zeros).to(x.dtype)
        return self.dense(x)
