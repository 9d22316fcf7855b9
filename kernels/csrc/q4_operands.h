// The checks both 4-bit matmul operators (ops.cpp, ops_avx2.cpp) make of their packed matrix
// (kernels/native.py's pack_int4 layout) against an input of k columns.
#ifndef TAILSCOPE_Q4_OPERANDS_H
#define TAILSCOPE_Q4_OPERANDS_H

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

inline void check_q4_operands(const at::Tensor &packed, const at::Tensor &scale,
                              const at::Tensor &zero, int64_t out_features, int64_t k) {
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: uint8");
    TORCH_CHECK(scale.scalar_type() == zero.scalar_type() && scale.is_contiguous() &&
                    zero.is_contiguous() &&
                    (scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat),
                "scale / zero: float16 or float32");
    TORCH_CHECK(packed.numel() == out_features * k / 2 && k % 32 == 0 && out_features % 16 == 0,
                "packed does not hold [", out_features, ", ", k, "] 4-bit codes");
    TORCH_CHECK(scale.numel() == out_features * (k / 32) && zero.numel() == scale.numel(),
                "scale / zero do not hold [", out_features, ", ", k / 32, "] groups");
}

#endif
