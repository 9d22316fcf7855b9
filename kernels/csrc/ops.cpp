// Registers csrc/q4_gemm.c, csrc/paged_attention.c, csrc/argmax.c, csrc/q8_rows.c,
// csrc/q8_gemm.c and csrc/topk.c as torch operators, tailscope_native::int4_mm,
// ::paged_decode_attention, ::argmax, ::q8_rows_dot, ::q8_mm, ::topk_indices and
// ::rescored_logits, so eager code and
// torch.compile'd graphs call them through the dispatcher like aten ops: ~4.6 us a call here,
// against ~17 for a Python custom op (121 calls in a batch-1 step of the bundled model).
// Their fake (shape) functions are registered from Python (kernels/native.py).
#include <algorithm>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "q4_operands.h"

extern "C" int q4_gemm(const uint16_t *x, int M, int K, int N, const uint8_t *codes,
                       const void *scale, const void *zero, int scale_f32, void *out,
                       int out_bf16, int threads);
extern "C" int q4_gemm_a8(const uint16_t *x, int M, int K, int N, const uint8_t *codes,
                          const void *scale, const void *zero, int scale_f32, void *out,
                          int out_bf16, int threads);
extern "C" int paged_decode_attention(const uint16_t *q, int64_t q_sb, int64_t q_sh,
                                      const uint16_t *k_cache,
                                      const uint16_t *v_cache, const int64_t *tables, int64_t M,
                                      const int64_t *lens, int B, int H, int HK, int D, int BS,
                                      int64_t NB, float scale, uint16_t *out, int threads);
extern "C" void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out,
                            int threads);
extern "C" int q8_rows_dot(const uint16_t *x, int64_t B, int64_t H, const int8_t *codes,
                           const uint16_t *scale, int64_t V, const int64_t *idx, int64_t k,
                           float *out, int threads);
extern "C" int q8_gemm(const uint16_t *x, int M, int K, int N, const int8_t *codes,
                       const uint16_t *scale, float *out, int threads);
extern "C" int topk_rows(const uint16_t *x, int64_t rows, int64_t n, int64_t ld, int64_t k,
                         int64_t *out, int threads);
extern "C" int merge_rows(const uint16_t *y, int64_t rows, int64_t n, int64_t ld,
                          const int64_t *idx, const uint16_t *top, int64_t k, float *out,
                          int threads);

namespace {

at::Tensor int4_mm_impl(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scale,
                        const at::Tensor &zero, int64_t out_features, at::ScalarType out_dtype,
                        bool a8) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: 2-D bfloat16");
    TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat,
                "out_dtype: bfloat16 or float32");
    const int64_t m = x.size(0), k = x.size(1);
    check_q4_operands(packed, scale, zero, out_features, k);
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty({m, out_features}, x.options().dtype(out_dtype));
    if (m == 0) return out;
    const int rc = (a8 ? q4_gemm_a8 : q4_gemm)(
                           reinterpret_cast<const uint16_t *>(xc.data_ptr()), (int)m, (int)k,
                           (int)out_features, packed.data_ptr<uint8_t>(), scale.data_ptr(),
                           zero.data_ptr(), scale.scalar_type() == at::kFloat, out.data_ptr(),
                           out_dtype == at::kBFloat16, at::get_num_threads());
    TORCH_CHECK(rc == 0, "q4_gemm failed (", rc, ")");
    return out;
}

at::Tensor int4_mm(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scale,
                   const at::Tensor &zero, int64_t out_features, at::ScalarType out_dtype) {
    return int4_mm_impl(x, packed, scale, zero, out_features, out_dtype, false);
}

at::Tensor int4_mm_a8(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scale,
                      const at::Tensor &zero, int64_t out_features, at::ScalarType out_dtype) {
    return int4_mm_impl(x, packed, scale, zero, out_features, out_dtype, true);
}

at::Tensor paged_decode(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                        const at::Tensor &block_tables, const at::Tensor &context_lens,
                        double scale) {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16, "q: [B, H, D] bfloat16");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kBFloat16 &&
                    k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                    v_cache.scalar_type() == at::kBFloat16 && v_cache.is_contiguous(),
                "k_cache / v_cache: contiguous [blocks, block_size, kv_heads, D] bfloat16");
    const int64_t b = q.size(0), h = q.size(1), d = q.size(2), hk = k_cache.size(2);
    TORCH_CHECK(k_cache.size(3) == d && hk > 0 && h % hk == 0,
                "q's heads / head size do not match the cache's");
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == b &&
                    block_tables.scalar_type() == at::kLong,
                "block_tables: [B, M] int64");
    TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == b &&
                    context_lens.scalar_type() == at::kLong,
                "context_lens: [B] int64");
    // q may be a view of the step's QKV output: its rows and heads apart, its elements not
    const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous(), tc = block_tables.contiguous(),
                     lc = context_lens.contiguous();
    at::Tensor out = at::empty({b, h, d}, q.options());
    if (b == 0) return out;
    const int rc = paged_decode_attention(
        reinterpret_cast<const uint16_t *>(qc.data_ptr()), qc.stride(0), qc.stride(1),
        reinterpret_cast<const uint16_t *>(k_cache.data_ptr()),
        reinterpret_cast<const uint16_t *>(v_cache.data_ptr()), tc.data_ptr<int64_t>(),
        tc.size(1), lc.data_ptr<int64_t>(), (int)b, (int)h, (int)hk, (int)d,
        (int)k_cache.size(1), k_cache.size(0), (float)scale,
        reinterpret_cast<uint16_t *>(out.data_ptr()), at::get_num_threads());
    TORCH_CHECK(rc != 1, "paged_decode_attention: unsupported shape (head size ", d,
                " must be a multiple of 32 up to 256, at most 8 query heads per KV head)");
    TORCH_CHECK(!(rc & 2), "paged_decode_attention: a context length outside 1 .. ",
                tc.size(1) * k_cache.size(1), " (the block table's keys)");
    TORCH_CHECK(!(rc & 4), "paged_decode_attention: a block id outside the cache's ",
                k_cache.size(0), " blocks");
    TORCH_CHECK(rc == 0, "paged_decode_attention failed (", rc, ")");
    return out;
}

at::Tensor argmax(const at::Tensor &x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0 &&
                    x.size(1) < (int64_t(1) << 31),
                "x: [rows, n] float32, 0 < n < 2^31");
    const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
    at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
    if (x.size(0) == 0) return out;
    argmax_rows(xc.data_ptr<float>(), xc.size(0), xc.size(1), xc.stride(0),
                out.data_ptr<int64_t>(), std::min<int64_t>(at::get_num_threads(), x.size(0)));
    return out;
}

at::Tensor q8_rows_dot_op(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale,
                          const at::Tensor &idx) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [B, H] bfloat16");
    TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
                "codes: contiguous [V, H] int8");
    const int64_t v = codes.size(0), h = codes.size(1);
    TORCH_CHECK(h % 32 == 0 && x.size(1) == h, "x's columns must be codes' (a multiple of 32)");
    TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() &&
                    scale.numel() == v * (h / 32),
                "scale: contiguous [V, H / 32] float16");
    TORCH_CHECK(idx.dim() == 2 && idx.size(0) == x.size(0) && idx.scalar_type() == at::kLong,
                "idx: [B, k] int64");
    const at::Tensor xc = x.contiguous(), ic = idx.contiguous();
    at::Tensor out = at::empty({idx.size(0), idx.size(1)}, x.options().dtype(at::kFloat));
    if (out.numel() == 0) return out;
    const int rc = q8_rows_dot(reinterpret_cast<const uint16_t *>(xc.data_ptr()), x.size(0), h,
                               codes.data_ptr<int8_t>(),
                               reinterpret_cast<const uint16_t *>(scale.data_ptr()), v,
                               ic.data_ptr<int64_t>(), idx.size(1), out.data_ptr<float>(),
                               at::get_num_threads());
    TORCH_CHECK(rc == 0, "q8_rows_dot: a row index outside 0 .. ", v - 1);
    return out;
}

at::Tensor q8_mm(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale,
                 int64_t out_features) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [M, K] bfloat16");
    const int64_t m = x.size(0), k = x.size(1);
    check_q8_operands("q8_mm", codes, scale, out_features, k);
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty({m, out_features}, x.options().dtype(at::kFloat));
    if (m == 0) return out;
    const int rc = q8_gemm(reinterpret_cast<const uint16_t *>(xc.data_ptr()), (int)m, (int)k,
                           (int)out_features, codes.data_ptr<int8_t>(),
                           reinterpret_cast<const uint16_t *>(scale.data_ptr()),
                           out.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(rc == 0, "q8_gemm failed (", rc, ")");
    return out;
}

at::Tensor topk_indices(const at::Tensor &x, int64_t k) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [rows, n] bfloat16");
    TORCH_CHECK(k > 0 && k <= x.size(1), "k must be in 1 .. ", x.size(1), ", not ", k);
    const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
    at::Tensor out = at::empty({x.size(0), k}, x.options().dtype(at::kLong));
    if (x.size(0) == 0) return out;
    const int rc = topk_rows(reinterpret_cast<const uint16_t *>(xc.data_ptr()), xc.size(0),
                             xc.size(1), xc.stride(0), k, out.data_ptr<int64_t>(),
                             std::min<int64_t>(at::get_num_threads(), x.size(0)));
    TORCH_CHECK(rc == 0, "topk_indices: out of memory");
    return out;
}

at::Tensor rescored_logits(const at::Tensor &y, const at::Tensor &idx, const at::Tensor &top) {
    TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kBFloat16, "y: [rows, n] bfloat16");
    TORCH_CHECK(idx.dim() == 2 && idx.size(0) == y.size(0) && idx.scalar_type() == at::kLong,
                "idx: [rows, k] int64");
    TORCH_CHECK(top.sizes() == idx.sizes() && top.scalar_type() == at::kBFloat16,
                "top: bfloat16, idx's shape");
    const at::Tensor yc = y.stride(1) == 1 ? y : y.contiguous();
    const at::Tensor ic = idx.contiguous(), tc = top.contiguous();
    at::Tensor out = at::empty({y.size(0), y.size(1)}, y.options().dtype(at::kFloat));
    if (y.numel() == 0) return out;
    const int rc = merge_rows(reinterpret_cast<const uint16_t *>(yc.data_ptr()), yc.size(0),
                              yc.size(1), yc.stride(0), ic.data_ptr<int64_t>(),
                              reinterpret_cast<const uint16_t *>(tc.data_ptr()), idx.size(1),
                              out.data_ptr<float>(),
                              std::min<int64_t>(at::get_num_threads(), y.size(0)));
    TORCH_CHECK(rc == 0, "rescored_logits: an index outside 0 .. ", y.size(1) - 1);
    return out;
}

}  // namespace

TORCH_LIBRARY(tailscope_native, m) {
    m.def("int4_mm(Tensor x, Tensor packed, Tensor scale, Tensor zero, int out_features, "
          "ScalarType out_dtype) -> Tensor");
    m.def("int4_mm_a8(Tensor x, Tensor packed, Tensor scale, Tensor zero, int out_features, "
          "ScalarType out_dtype) -> Tensor");
    m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor context_lens, float scale) -> Tensor");
    m.def("argmax(Tensor x) -> Tensor");
    m.def("q8_rows_dot(Tensor x, Tensor codes, Tensor scale, Tensor idx) -> Tensor");
    m.def("q8_mm(Tensor x, Tensor codes, Tensor scale, int out_features) -> Tensor");
    m.def("topk_indices(Tensor x, int k) -> Tensor");
    m.def("rescored_logits(Tensor y, Tensor idx, Tensor top) -> Tensor");
}

TORCH_LIBRARY_IMPL(tailscope_native, CPU, m) {
    m.impl("int4_mm", int4_mm);
    m.impl("int4_mm_a8", int4_mm_a8);
    m.impl("paged_decode_attention", paged_decode);
    m.impl("argmax", argmax);
    m.impl("q8_rows_dot", q8_rows_dot_op);
    m.impl("q8_mm", q8_mm);
    m.impl("topk_indices", topk_indices);
    m.impl("rescored_logits", rescored_logits);
}
