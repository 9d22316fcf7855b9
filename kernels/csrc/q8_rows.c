/* Dot products of chosen rows of a matrix kept as GGUF's Q8_0 blocks with bfloat16 vectors:
 * the rescoring of a low-bit output matrix's top logits (kernels.linear.RescoredOutput) from
 * the exact output matrix, where that matrix is a tied embedding stored as Q8_0 (the bundled
 * model's) and kept so (kernels.linear.Int8Rows: half the memory of a bfloat16 copy, 27 MB of
 * the bundled model's). torch has no kernel for it: gathering the rows, dequantizing them and
 * a bmm cost 13x the bf16 gather at 32 rows of 64 (float32 temporaries), this reads each
 * chosen row's 32-byte blocks once. AVX-512. */
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

/* out[b * k + j] = sum_i w(r, i) * x[b * H + i] for r = idx[b * k + j], where w(r, i) =
 * bfloat16(scale[r][i / 32] * codes[r][i]): the value a bfloat16 copy of the matrix holds
 * (the product in float32, exact for a float16 scale and an int8 code, rounded to nearest
 * even), so the sums are that copy's to float32 rounding. codes [V, H] int8, scale [V, H / 32]
 * float16, x [B, H] bfloat16, H a multiple of 32. Returns 1 where an index is outside 0 .. V-1
 * (its output 0), else 0. */
int q8_rows_dot(const uint16_t *x, int64_t B, int64_t H, const int8_t *codes,
                const uint16_t *scale, int64_t V, const int64_t *idx, int64_t k, float *out,
                int threads) {
    int bad = 0;
    const int64_t groups = H / 32;
    #pragma omp parallel for schedule(static) num_threads(threads) reduction(|:bad)
    for (int64_t t = 0; t < B * k; t++) {
        const int64_t r = idx[t];
        if (r < 0 || r >= V) {
            out[t] = 0.0f;
            bad = 1;
            continue;
        }
        const int8_t *q = codes + r * H;
        const uint16_t *s = scale + r * groups, *xb = x + (t / k) * H;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(s[g]));
            for (int h = 0; h < 32; h += 16) {
                const __m128i c = _mm_loadu_si128((const __m128i *)(q + g * 32 + h));
                const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), d);
                const __m512 wb = bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(w));
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xb + g * 32 + h));
                acc = _mm512_fmadd_ps(wb, bf16x16_to_f32(xv), acc);
            }
        }
        out[t] = _mm512_reduce_add_ps(acc);
    }
    return bad;
}
