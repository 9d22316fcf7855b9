/* A weight-only 4-bit matmul for a few rows of bfloat16 activations (decode steps), AVX-512 BF16.
 *
 * Why our own: torch's CPU int4 kernel (aten::_weight_int4pack_mm_for_cpu, torch 2.13) runs one
 * GEMV per activation row, so a step of 8 rows reads every weight 8 times and costs about what
 * the dense bf16 matmul does; no library installable here does better on x86 (torchao's wheel has
 * no x86 kernels, IPEX does not support this torch). This one reads each weight once for up to 8
 * rows: 4-bit codes are widened to bf16 *as integers* (0x4300 | code is the bf16 of 128 + code,
 * exact) and multiplied with vdpbf16ps; the per-group scale and zero and the 128 offset are applied
 * once per group of 32 inputs in float32:
 *
 *   sum_k x_k w_k = S * sum_k x_k (128 + c_k) + (Z - 128 S) * sx,   sx = sum_k x_k,
 *   where w = c * S + Z over the group (Z = zero - 8 * scale in engine.quant's form).
 *
 * Layout (kernels/native.py packs it): outputs in tiles of 16 (one zmm of float32 accumulators),
 * codes [T][G][8][32] bytes: in block b of group g, byte j holds output 16t + j/2's code for input
 * 32g + 4b + j%2 in its low nibble and for input 32g + 4b + 2 + j%2 in its high nibble, so a
 * 32-byte load widened to 16-bit lanes gives two vdpbf16ps operands (input pairs per output)
 * with one AND and one shift. Scales and zeros [T][G][16], float16 or float32.
 * N must be a multiple of 16, K of 32. Threads: OpenMP, torch's own runtime (libgomp.so.1 is
 * already loaded by torch when this library is), as many as the caller passes (ops.cpp: torch's
 * own thread count).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAXR 8

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __m512 load_scale(const void *p, int f32) {
    if (f32) return _mm512_loadu_ps(p);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* One tile of 16 outputs for mr (<= MAXR) rows; mr is a constant where this is inlined. */
static inline __attribute__((always_inline)) void tile(
        const uint16_t *x, int K, int G, const uint8_t *codes, const char *scale,
        const char *zero, int f32, const float *sx, int mr, __m512 *tot) {
    const __m512i low = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
    const int ssz = f32 ? 64 : 32;
    __m512 acc[MAXR];
    for (int r = 0; r < mr; r++) tot[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *cg = codes + (size_t)g * 256;
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(cg + 1024 + 64 * i), _MM_HINT_T0);
        for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
        for (int b = 0; b < 8; b++) {
            __m512i d = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(cg + b * 32)));
            __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(d, low, bias, 0xEA); /* d&low|bias */
            __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(d, 4), bias);
            const uint16_t *xp = x + g * 32 + 4 * b;
            for (int r = 0; r < mr; r++) {
                /* the row's input pair broadcast from memory inside the instruction ({1to16}):
                   gcc emits a separate vpbroadcastd for _mm512_set1_epi32, one more uop per
                   product here; 3-6% of the kernel's time at 1-16 rows, same results */
                const int32_t *pair = (const int32_t *)(xp + (size_t)r * K);
                __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc[r]) : "v"(lo), "m"(pair[0]));
                __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc[r]) : "v"(hi), "m"(pair[1]));
            }
        }
        const __m512 S = load_scale(scale + (size_t)g * ssz, f32);
        /* Z - 128 S: the offset's share, once per group rather than once per row */
        const __m512 Z = _mm512_fnmadd_ps(S, _mm512_set1_ps(128.0f),
                                          load_scale(zero + (size_t)g * ssz, f32));
        for (int r = 0; r < mr; r++) {
            tot[r] = _mm512_fmadd_ps(acc[r], S, tot[r]);
            tot[r] = _mm512_fmadd_ps(Z, _mm512_set1_ps(sx[r * G + g]), tot[r]);
        }
    }
}

/* Rows per block of the many-rows path: 16 float32 accumulators and the weight register. */
#define BIGR 16

/* One tile's 16 x K weights as bf16 input pairs, [K/2][16 outputs][2] (vdpbf16ps's operand
 * order): w = c * S + Z in float32, rounded to nearest even, the values the dense bf16 copy of
 * the same matrix would hold (up to the rounding of Z = zero - 8 * scale, one float32 ulp). */
static void dequant_tile(const uint8_t *codes, const char *scale, const char *zero, int f32,
                         int G, __m512i *buf) {
    const __m512i low = _mm512_set1_epi32(0x0F);
    /* 16-bit lane 2i takes element i, lane 2i + 1 element 16 + i */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    const int ssz = f32 ? 64 : 32;
    for (int g = 0; g < G; g++) {
        const __m512 S = load_scale(scale + (size_t)g * ssz, f32);
        const __m512 Z = load_scale(zero + (size_t)g * ssz, f32);
        for (int b = 0; b < 8; b++) {
            /* 32-bit lane o: output o's bytes 2o (inputs 4b, 4b+2) and 2o+1 (4b+1, 4b+3) */
            __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                (const __m256i *)(codes + (size_t)g * 256 + b * 32)));
            for (int h = 0; h < 2; h++) { /* low nibbles: inputs 4b, 4b+1; high: 4b+2, 4b+3 */
                __m512i e = _mm512_and_si512(_mm512_srli_epi32(d, 4 * h), low);
                __m512i o = _mm512_and_si512(_mm512_srli_epi32(d, 8 + 4 * h), low);
                __m512 we = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), S, Z);
                __m512 wo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(o), S, Z);
                /* [we 0..15, wo 0..15] in bf16, then interleaved to (we_i, wo_i) pairs */
                buf[g * 16 + b * 2 + h] = _mm512_permutexvar_epi16(
                    pairs, (__m512i)_mm512_cvtne2ps_pbh(wo, we));
            }
        }
    }
}

/* Rows [mr] of one tile from its dequantized weights: plain bf16 products, float32 sums. ``xb``
 * holds the row block's input pairs interleaved, [K/2][BIGR] (each row's pair at a constant
 * offset from one pointer: sixteen row pointers would not fit the general registers). */
static inline __attribute__((always_inline)) void tile_bf16(
        const int32_t *xb, int K, const __m512i *buf, int mr, __m512 *tot) {
    __m512 acc[BIGR]; /* local, not the caller's: gcc stored those back every iteration */
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int p = 0; p < K / 2; p++) {
        const __m512bh w = (__m512bh)_mm512_load_si512(buf + p);
        const int32_t *pairs = xb + (size_t)p * BIGR;
        for (int r = 0; r < mr; r++)
            __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc[r]) : "v"(w), "m"(pairs[r]));
    }
    for (int r = 0; r < mr; r++) tot[r] = acc[r];
}

static void store_rows(const __m512 *tot, int mr, size_t row0, int N, int t, void *out,
                       int out_bf16) {
    for (int r = 0; r < mr; r++) {
        size_t o = (row0 + r) * N + (size_t)t * 16;
        if (out_bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + o),
                                (__m256i)_mm512_cvtneps_pbh(tot[r]));
        else
            _mm512_storeu_ps((float *)out + o, tot[r]);
    }
}

/* Many rows (prefill chunks, large batches): each tile of 16 outputs is dequantized once into a
 * bf16 buffer (L1 / L2-resident: K * 32 bytes) and multiplied with every row, 16 rows at a time,
 * so the work per weight is one load for 16 products, as in a dense bf16 GEMM, and the engine
 * keeps no dense copy of its 4-bit matrices (the bundled model's: 212 MB). The values are the
 * dense copy's (bf16-rounded weights), not the few-rows path's exact ones. */
static int q4_gemm_many(const uint16_t *x, int M, int K, int N, const uint8_t *codes,
                        const void *scale, const void *zero, int scale_f32, void *out,
                        int out_bf16, int threads) {
    const int G = K / 32, T = N / 16, ssz = scale_f32 ? 4 : 2, RB = (M + BIGR - 1) / BIGR;
    /* the rows' input pairs, [RB][K/2][BIGR] (zeros past M) */
    int32_t *xp = (int32_t *)aligned_alloc(64, (size_t)RB * K * BIGR * 2);
    if (!xp) return 2;
    int rc = 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int rb = 0; rb < RB; rb++)
            for (int r = 0; r < BIGR; r++) {
                const int row = rb * BIGR + r;
                const int32_t *src = (const int32_t *)(x + (size_t)row * K);
                int32_t *dst = xp + (size_t)rb * (K / 2) * BIGR + r;
                for (int p = 0; p < K / 2; p++) dst[(size_t)p * BIGR] = row < M ? src[p] : 0;
            }
        __m512i *buf = (__m512i *)aligned_alloc(64, (size_t)K * 32);
        if (!buf) {
            #pragma omp atomic write
            rc = 2;
        }
        #pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            if (!buf) continue;
            dequant_tile(codes + (size_t)t * G * 256,
                         (const char *)scale + (size_t)t * G * 16 * ssz,
                         (const char *)zero + (size_t)t * G * 16 * ssz, scale_f32, G, buf);
            for (int r0 = 0; r0 < M; r0 += BIGR) {
                const int mr = M - r0 < BIGR ? M - r0 : BIGR;
                const int32_t *xr = xp + (size_t)(r0 / BIGR) * (K / 2) * BIGR;
                __m512 tot[BIGR];
                switch (mr) {
#define ROWS(R) case R: tile_bf16(xr, K, buf, R, tot); break;
                ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
                ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
                }
                store_rows(tot, mr, (size_t)r0, N, t, out, out_bf16);
            }
        }
        free(buf);
    }
    free(xp);
    return rc;
}

/* Rows from which q4_gemm takes the many-rows path (q4_gemm_many): dequantizing a tile costs
 * about what 16 rows' products of it do, so below this the exact few-rows path is as fast. */
#define MANY_ROWS 32

/* out[M, N] (bf16 if out_bf16, else float32) = x[M, K] (bf16, rows K apart) @ W.T */
int q4_gemm(const uint16_t *x, int M, int K, int N, const uint8_t *codes, const void *scale,
            const void *zero, int scale_f32, void *out, int out_bf16, int threads) {
    if (M < 1 || K % 32 || N % 16) return 1;
    if (M >= MANY_ROWS)
        return q4_gemm_many(x, M, K, N, codes, scale, zero, scale_f32, out, out_bf16, threads);
    const int G = K / 32, T = N / 16, ssz = scale_f32 ? 4 : 2;
    float *sx = (float *)malloc(sizeof(float) * (size_t)M * G);
    if (!sx) return 2;
    for (int r = 0; r < M; r++)
        for (int g = 0; g < G; g++) {
            float s = 0;
            for (int j = 0; j < 32; j++) s += bf16_to_f32(x[(size_t)r * K + g * 32 + j]);
            sx[r * G + g] = s;
        }
    #pragma omp parallel for schedule(guided) num_threads(threads)
    for (int t = 0; t < T; t++) {
        const uint8_t *ct = codes + (size_t)t * G * 256;
        const char *st = (const char *)scale + (size_t)t * G * 16 * ssz;
        const char *zt = (const char *)zero + (size_t)t * G * 16 * ssz;
        for (int r0 = 0; r0 < M; r0 += MAXR) {
            const int mr = M - r0 < MAXR ? M - r0 : MAXR;
            const uint16_t *xr = x + (size_t)r0 * K;
            __m512 tot[MAXR];
            switch (mr) {
#define ROWS(R) case R: tile(xr, K, G, ct, st, zt, scale_f32, sx + r0 * G, R, tot); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
            }
            store_rows(tot, mr, (size_t)r0, N, t, out, out_bf16);
        }
    }
    free(sx);
    return 0;
}
