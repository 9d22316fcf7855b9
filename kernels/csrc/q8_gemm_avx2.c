/* The Q8_0 matmul of q8_gemm.c for CPUs without AVX-512 BF16 (AVX2 + FMA + F16C), on float32
 * activations: the output matrix of the fast profile's float32 path on such CPUs.
 *
 * Why our own: torch has no Q8_0 matmul; a dense float32 copy of the bundled model's output
 * matrix reads 113 MB a token against these 30, and a 4-bit copy with rescored top logits cost
 * 1.2 % perplexity. Each code widened to float32 (exact) times its input, float32 sums, each
 * block's scale once: the model's values, as a float32 dequantized copy gives them up to
 * summation order.
 *
 * Layout: q8_gemm.c's (kernels/native.py's pack_q8). In pair p of group g, byte 2o + j holds
 * output o's code for input 2p + j: eight bytes widened are four outputs' pairs, multiplied by
 * the pair (x[2p], x[2p + 1]) broadcast, and each output's two lanes added at the group's end
 * (hadd, then the four 64-bit lanes put in order).
 *
 * Threads: OpenMP, torch's runtime (as q4_gemm.c).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Rows per pass: four pair-lane accumulators a row; two rows' eight plus a widened code
 * vector and the rows' broadcast pairs fit the 16 ymm registers. */
#define MAXR 2

static inline __m256 in_order(__m256 a, __m256 b) {
    /* hadd: [o0, o1, o4, o5 | o2, o3, o6, o7] of a's outputs 0-3 and b's 4-7 */
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(a, b)), 0xD8));
}

/* One tile of 16 outputs for mr (<= MAXR) rows; the same sums in the same order at every mr. */
static inline __attribute__((always_inline)) void tile(
        const float *x, int K, int G, const int8_t *codes, const uint16_t *scale, int mr,
        float *out, int N, int valid) {
    __m256 tot[MAXR][2];
    for (int r = 0; r < mr; r++) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const int8_t *cg = codes + (size_t)g * 512;
        for (int i = 0; i < 8; i++) _mm_prefetch((const char *)(cg + 2048 + 64 * i), _MM_HINT_T0);
        __m256 acc[MAXR][4];
        for (int r = 0; r < mr; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
        for (int p = 0; p < 16; p++) {
            __m256 xv[MAXR];
            for (int r = 0; r < mr; r++) {
                double pair;
                memcpy(&pair, x + (size_t)r * K + g * 32 + 2 * p, 8);
                xv[r] = _mm256_castpd_ps(_mm256_set1_pd(pair));
            }
            for (int i = 0; i < 4; i++) {
                const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(cg + p * 32 + 8 * i))));
                for (int r = 0; r < mr; r++) acc[r][i] = _mm256_fmadd_ps(w, xv[r], acc[r][i]);
            }
        }
        const __m256 S0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g * 16)));
        const __m256 S1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g * 16 + 8)));
        for (int r = 0; r < mr; r++) {
            tot[r][0] = _mm256_fmadd_ps(in_order(acc[r][0], acc[r][1]), S0, tot[r][0]);
            tot[r][1] = _mm256_fmadd_ps(in_order(acc[r][2], acc[r][3]), S1, tot[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        float buf[16];
        _mm256_storeu_ps(buf, tot[r][0]);
        _mm256_storeu_ps(buf + 8, tot[r][1]);
        memcpy(out + (size_t)r * N, buf, sizeof(float) * (size_t)valid);
    }
}

/* out[M, N] float32 = x[M, K] (float32, rows K apart) @ W.T for W packed by pack_q8. Returns 1
 * for a shape the layout cannot hold (K not a multiple of 32), else 0. */
int q8_gemm_f32(const float *x, int M, int K, int N, const int8_t *codes, const uint16_t *scale,
                float *out, int threads) {
    if (M < 1 || K % 32 || N < 1) return 1;
    const int G = K / 32, T = (N + 15) / 16;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < T; t++) {
        const int8_t *ct = codes + (size_t)t * G * 512;
        const uint16_t *st = scale + (size_t)t * G * 16;
        const int valid = N - 16 * t < 16 ? N - 16 * t : 16;
        for (int r0 = 0; r0 < M; r0 += MAXR) {
            const int mr = M - r0 < MAXR ? M - r0 : MAXR;
            float *o = out + (size_t)r0 * N + (size_t)t * 16;
            if (mr == 2) tile(x + (size_t)r0 * K, K, G, ct, st, 2, o, N, valid);
            else tile(x + (size_t)r0 * K, K, G, ct, st, 1, o, N, valid);
        }
    }
    return 0;
}
