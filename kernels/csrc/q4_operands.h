// The checks the 4-bit and the Q8_0 matmul operators of both libraries (ops.cpp, ops_avx2.cpp)
// make of their packed matrix (kernels/native.py's pack_int4 / pack_q8 layouts) against an
// input of k columns.
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

inline void check_q8_operands(const char *op, const at::Tensor &codes, const at::Tensor &scale,
                              int64_t out_features, int64_t k) {
    const int64_t tiles = (out_features + 15) / 16;
    TORCH_CHECK(out_features > 0 && k % 32 == 0, op, ": K a multiple of 32, out_features > 0");
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                    codes.numel() == tiles * 16 * k,
                "codes: contiguous int8 holding [", out_features, ", ", k, "] in tiles of 16");
    TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() &&
                    scale.numel() == tiles * 16 * (k / 32),
                "scale: contiguous float16 holding [", out_features, ", ", k / 32, "] blocks");
}

#endif
