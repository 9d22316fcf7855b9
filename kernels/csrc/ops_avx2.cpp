// Registers csrc/q4_gemm_avx2.c and csrc/q8_gemm_avx2.c as the torch operators
// tailscope_avx2::int4_mm_f32 and ::q8_mm_f32 (a library of its own, built with AVX2 flags only:
// it must load on CPUs the AVX-512 library cannot run on). Their fake (shape) functions are
// registered from Python (kernels/native.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "q4_operands.h"

extern "C" int q4_gemm_f32(const float *x, int M, int K, int N, const uint8_t *codes,
                           const void *scale, const void *zero, int scale_f32, float *out,
                           int threads);

extern "C" int q8_gemm_f32(const float *x, int M, int K, int N, const int8_t *codes,
                           const uint16_t *scale, float *out, int threads);

namespace {

at::Tensor int4_mm_f32(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scale,
                       const at::Tensor &zero, int64_t out_features) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: 2-D float32");
    const int64_t m = x.size(0), k = x.size(1);
    check_q4_operands(packed, scale, zero, out_features, k);
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty({m, out_features}, x.options());
    if (m == 0) return out;
    const int rc = q4_gemm_f32(xc.data_ptr<float>(), (int)m, (int)k, (int)out_features,
                               packed.data_ptr<uint8_t>(), scale.data_ptr(), zero.data_ptr(),
                               scale.scalar_type() == at::kFloat, out.data_ptr<float>(),
                               at::get_num_threads());
    TORCH_CHECK(rc == 0, "q4_gemm_f32 failed (", rc, ")");
    return out;
}

at::Tensor q8_mm_f32(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale,
                     int64_t out_features) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: [M, K] float32");
    const int64_t m = x.size(0), k = x.size(1);
    check_q8_operands("q8_mm_f32", codes, scale, out_features, k);
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty({m, out_features}, x.options());
    if (m == 0) return out;
    const int rc = q8_gemm_f32(xc.data_ptr<float>(), (int)m, (int)k, (int)out_features,
                               codes.data_ptr<int8_t>(),
                               reinterpret_cast<const uint16_t *>(scale.data_ptr()),
                               out.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(rc == 0, "q8_gemm_f32 failed (", rc, ")");
    return out;
}

}  // namespace

TORCH_LIBRARY(tailscope_avx2, m) {
    m.def("int4_mm_f32(Tensor x, Tensor packed, Tensor scale, Tensor zero, int out_features) "
          "-> Tensor");
    m.def("q8_mm_f32(Tensor x, Tensor codes, Tensor scale, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(tailscope_avx2, CPU, m) {
    m.impl("int4_mm_f32", int4_mm_f32);
    m.impl("q8_mm_f32", q8_mm_f32);
}
