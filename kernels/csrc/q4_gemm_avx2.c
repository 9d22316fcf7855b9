/* The 4-bit matmul of q4_gemm.c for CPUs without AVX-512 BF16 (AVX2 + FMA + F16C: every x86
 * server since 2013), on float32 activations: the fast profile's path on such CPUs, where bf16
 * is emulated and slower than float32 (engine.profiles).
 *
 * Why our own: torch's int4 kernel takes bf16 activations only (emulated here) and runs one GEMV
 * per row; without a kernel the weights would be read as a dense float32 copy (8 bytes per
 * weight pair instead of 1). This one reads the packed codes once for up to MAXR rows, widens
 * each code to float32 once for all of them, and sums in float32, per group of 32 inputs:
 *
 *   sum_k x_k w_k = S * sum_k x_k c_k + Z * sx,   sx = sum_k x_k,   (w = c * S + Z)
 *
 * exact products of the inputs with the codes, one float32 rounding per term: the values a
 * float32 dequantized copy gives, up to summation order.
 *
 * Layout: q4_gemm.c's (kernels/native.py packs it, one packing for both kernels). In block b of
 * group g, the 16-bit lane o of the 32 bytes holds output o's codes for inputs 4b (bits 0-3),
 * 4b+2 (4-7), 4b+1 (8-11) and 4b+3 (12-15). Scales and zeros [T][G][16], float16 or float32.
 *
 * N must be a multiple of 16, K of 32. Threads: OpenMP, torch's runtime (as q4_gemm.c).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* Rows per pass: two 8-lane accumulators a row (a tile of 16 outputs), four rows' eight plus
 * the tile's widened codes and a broadcast input fit the 16 ymm registers. */
#define MAXR 4

static inline __m256 load8(const char *p, int f32) {
    if (f32) return _mm256_loadu_ps((const float *)p);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* One tile of 16 outputs for mr (<= MAXR) rows; mr is a constant where this is inlined. */
static inline __attribute__((always_inline)) void tile(
        const float *x, int K, int G, const uint8_t *codes, const char *scale, const char *zero,
        int f32, const float *sx, int mr, float *out, int N) {
    const __m256i low = _mm256_set1_epi32(0x0F);
    const int ssz = f32 ? 64 : 32, half = f32 ? 32 : 16;
    __m256 tot[MAXR][2];
    for (int r = 0; r < mr; r++) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *cg = codes + (size_t)g * 256;
        _mm_prefetch((const char *)(cg + 1024), _MM_HINT_T0);
        _mm_prefetch((const char *)(cg + 1088), _MM_HINT_T0);
        _mm_prefetch((const char *)(cg + 1152), _MM_HINT_T0);
        _mm_prefetch((const char *)(cg + 1216), _MM_HINT_T0);
        __m256 acc[MAXR][2];
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int b = 0; b < 8; b++) {
            /* outputs 0-7 and 8-15, each lane one output's four codes */
            const __m256i d0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(cg + b * 32)));
            const __m256i d1 =
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(cg + b * 32 + 16)));
            static const int shift[4] = {0, 8, 4, 12}; /* inputs 4b, 4b+1, 4b+2, 4b+3 */
            for (int i = 0; i < 4; i++) {
                const __m256 w0 = _mm256_cvtepi32_ps(
                    _mm256_and_si256(_mm256_srli_epi32(d0, shift[i]), low));
                const __m256 w1 = _mm256_cvtepi32_ps(
                    _mm256_and_si256(_mm256_srli_epi32(d1, shift[i]), low));
                for (int r = 0; r < mr; r++) {
                    const __m256 xv = _mm256_broadcast_ss(x + (size_t)r * K + g * 32 + 4 * b + i);
                    acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
                }
            }
        }
        const char *sg = scale + (size_t)g * ssz, *zg = zero + (size_t)g * ssz;
        const __m256 S0 = load8(sg, f32), S1 = load8(sg + half, f32);
        const __m256 Z0 = load8(zg, f32), Z1 = load8(zg + half, f32);
        for (int r = 0; r < mr; r++) {
            const __m256 s = _mm256_set1_ps(sx[r * G + g]);
            tot[r][0] = _mm256_fmadd_ps(Z0, s, _mm256_fmadd_ps(acc[r][0], S0, tot[r][0]));
            tot[r][1] = _mm256_fmadd_ps(Z1, s, _mm256_fmadd_ps(acc[r][1], S1, tot[r][1]));
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(out + (size_t)r * N, tot[r][0]);
        _mm256_storeu_ps(out + (size_t)r * N + 8, tot[r][1]);
    }
}

/* out[M, N] (float32) = x[M, K] (float32, rows K apart) @ W.T; any M (rows MAXR at a time, each
 * tile's codes read from memory once and from cache for the further passes). */
int q4_gemm_f32(const float *x, int M, int K, int N, const uint8_t *codes, const void *scale,
                const void *zero, int scale_f32, float *out, int threads) {
    if (M < 1 || K % 32 || N % 16) return 1;
    const int G = K / 32, T = N / 16, ssz = scale_f32 ? 4 : 2;
    float *sx = (float *)malloc(sizeof(float) * (size_t)M * G);
    if (!sx) return 2;
    for (int r = 0; r < M; r++)
        for (int g = 0; g < G; g++) {
            float s = 0;
            for (int j = 0; j < 32; j++) s += x[(size_t)r * K + g * 32 + j];
            sx[r * G + g] = s;
        }
    #pragma omp parallel for schedule(guided) num_threads(threads)
    for (int t = 0; t < T; t++) {
        const uint8_t *ct = codes + (size_t)t * G * 256;
        const char *st = (const char *)scale + (size_t)t * G * 16 * ssz;
        const char *zt = (const char *)zero + (size_t)t * G * 16 * ssz;
        for (int r0 = 0; r0 < M; r0 += MAXR) {
            const int mr = M - r0 < MAXR ? M - r0 : MAXR;
            const float *xr = x + (size_t)r0 * K, *sr = sx + r0 * G;
            float *o = out + (size_t)r0 * N + (size_t)t * 16;
            switch (mr) {
#define ROWS(R) case R: tile(xr, K, G, ct, st, zt, scale_f32, sr, R, o, N); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#undef ROWS
            }
        }
    }
    free(sx);
    return 0;
}
