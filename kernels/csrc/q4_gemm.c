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
 * q4_gemm_a8 (weights: int4a8) runs the few-rows path on inputs rounded to int8 instead, AVX-512
 * VNNI (see its section below; not exact).
 *
 * N must be a multiple of 16, K of 32. Threads: OpenMP, torch's own runtime (libgomp.so.1 is
 * already loaded by torch when this library is), as many as the caller passes (ops.cpp: torch's
 * own thread count).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define MAXR 8

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

/* ---- activations as int8 (AVX-512 VNNI) ---------------------------------------------------
 * The few-rows path with each row's inputs quantized to int8 per group of 32
 * (q = round(x * (127 / max |x|)) in float32, ties to even; d = max |x| / 127 over the
 * group: GGUF's Q8_0 form, what llama.cpp multiplies its 4-bit weights with), so one vpdpbusd
 * multiplies 4 codes by 4 inputs per output (64 products an instruction, twice vdpbf16ps's
 * 32):
 *
 *   sum_k x_k w_k ~= S * d * sum_k q_k c_k + Z * sx,   sx = sum_k x_k (of the exact inputs).
 *
 * In block b of group g, output o's bytes 2o and 2o + 1 hold the codes of inputs
 * 4b, 4b+2 (low, high nibble) and 4b+1, 4b+3: widened to 16-bit lanes and each byte's high
 * nibble moved to the lane's second byte, a 32-bit lane holds the codes of inputs
 * (4b, 4b+2, 4b+1, 4b+3), and the quantized inputs are stored in that order. */

static void quantize_rows(const uint16_t *x, int M, int K, int8_t *q, float *d, float *sx) {
    const int G = K / 32;
    /* within each 4 inputs, the order the codes' lanes hold them: 0, 2, 1, 3 */
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    for (int r = 0; r < M; r++)
        for (int g = 0; g < G; g++) {
            const uint16_t *xg = x + (size_t)r * K + g * 32;
            __m512 v[2];
            for (int h = 0; h < 2; h++)
                v[h] = bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(xg + 16 * h)));
            const float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            const float inv = amax > 0 ? 127.0f / amax : 0.0f;
            d[r * G + g] = amax / 127.0f;
            sx[r * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
            for (int h = 0; h < 2; h++) {
                /* the float32 product rounded to the nearest integer, ties to even (the
                   conversion's default rounding); |t| <= 127 */
                const __m512i t = _mm512_cvtps_epi32(_mm512_mul_ps(
                    _mm512_permutexvar_ps(order, v[h]), _mm512_set1_ps(inv)));
                _mm_storeu_si128((__m128i *)(q + (size_t)r * K + g * 32 + 16 * h),
                                 _mm512_cvtsepi32_epi8(t));
            }
        }
}

static inline __attribute__((always_inline)) void tile_a8(
        const int8_t *xq, int K, int G, const uint8_t *codes, const char *scale,
        const char *zero, int f32, const float *d, const float *sx, int mr, __m512 *tot) {
    const __m512i nibbles = _mm512_set1_epi16(0x0F0F);
    const int ssz = f32 ? 64 : 32;
    __m512i acc[MAXR];
    for (int r = 0; r < mr; r++) tot[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *cg = codes + (size_t)g * 256;
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(cg + 1024 + 64 * i), _MM_HINT_T0);
        for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_si512();
        for (int b = 0; b < 8; b++) {
            const __m512i c =
                _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(cg + b * 32)));
            /* (c | c << 4) & 0x0F0F: the low nibble in the lane's first byte, the high in its
               second */
            const __m512i w = _mm512_ternarylogic_epi32(c, _mm512_slli_epi16(c, 4), nibbles, 0xA8);
            const int8_t *xp = xq + g * 32 + 4 * b;
            for (int r = 0; r < mr; r++) {
                const int32_t *four = (const int32_t *)(xp + (size_t)r * K);
                __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc[r]) : "v"(w), "m"(four[0]));
            }
        }
        const __m512 S = load_scale(scale + (size_t)g * ssz, f32);
        const __m512 Z = load_scale(zero + (size_t)g * ssz, f32);
        for (int r = 0; r < mr; r++) {
            tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]),
                                     _mm512_mul_ps(S, _mm512_set1_ps(d[r * G + g])), tot[r]);
            tot[r] = _mm512_fmadd_ps(Z, _mm512_set1_ps(sx[r * G + g]), tot[r]);
        }
    }
}

/* The few-rows path (M < MANY_ROWS) on bf16 inputs, or with ``a8`` on int8 ones (above). */
static int few_rows(const uint16_t *x, int M, int K, int N, const uint8_t *codes,
                    const void *scale, const void *zero, int scale_f32, void *out, int out_bf16,
                    int threads, int a8) {
    const int G = K / 32, T = N / 16, ssz = scale_f32 ? 4 : 2;
    /* each row's group sums (and with a8 its scales d, then its int8 inputs) */
    float *sx = (float *)malloc(sizeof(float) * (size_t)M * G * (a8 ? 2 : 1) +
                                (a8 ? (size_t)M * K : 0));
    if (!sx) return 2;
    float *d = sx + (size_t)M * G;
    int8_t *xq = (int8_t *)(d + (size_t)M * G);
    if (a8) {
        quantize_rows(x, M, K, xq, d, sx);
    } else {
        for (int r = 0; r < M; r++)
            for (int g = 0; g < G; g++) {
                float s = 0;
                for (int j = 0; j < 32; j++) s += bf16_to_f32(x[(size_t)r * K + g * 32 + j]);
                sx[r * G + g] = s;
            }
    }
    #pragma omp parallel for schedule(guided) num_threads(threads)
    for (int t = 0; t < T; t++) {
        const uint8_t *ct = codes + (size_t)t * G * 256;
        const char *st = (const char *)scale + (size_t)t * G * 16 * ssz;
        const char *zt = (const char *)zero + (size_t)t * G * 16 * ssz;
        for (int r0 = 0; r0 < M; r0 += MAXR) {
            const int mr = M - r0 < MAXR ? M - r0 : MAXR;
            const uint16_t *xr = x + (size_t)r0 * K;
            const int8_t *qr = xq + (size_t)r0 * K;
            const float *sr = sx + r0 * G, *dr = d + r0 * G;
            __m512 tot[MAXR];
            switch (mr) {
#define ROWS(R) case R:                                                                 \
                if (a8) tile_a8(qr, K, G, ct, st, zt, scale_f32, dr, sr, R, tot);       \
                else tile(xr, K, G, ct, st, zt, scale_f32, sr, R, tot);                 \
                break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
            }
            store_rows(tot, mr, (size_t)r0, N, t, out, out_bf16);
        }
    }
    free(sx);
    return 0;
}

static int gemm(const uint16_t *x, int M, int K, int N, const uint8_t *codes, const void *scale,
                const void *zero, int scale_f32, void *out, int out_bf16, int threads, int a8) {
    if (M < 1 || K % 32 || N % 16) return 1;
    if (M >= MANY_ROWS)
        return q4_gemm_many(x, M, K, N, codes, scale, zero, scale_f32, out, out_bf16, threads);
    return few_rows(x, M, K, N, codes, scale, zero, scale_f32, out, out_bf16, threads, a8);
}

/* out[M, N] (bf16 if out_bf16, else float32) = x[M, K] (bf16, rows K apart) @ W.T */
int q4_gemm(const uint16_t *x, int M, int K, int N, const uint8_t *codes, const void *scale,
            const void *zero, int scale_f32, void *out, int out_bf16, int threads) {
    return gemm(x, M, K, N, codes, scale, zero, scale_f32, out, out_bf16, threads, 0);
}

/* q4_gemm with a few-rows step's inputs as int8 (above); many rows as q4_gemm. */
int q4_gemm_a8(const uint16_t *x, int M, int K, int N, const uint8_t *codes, const void *scale,
               const void *zero, int scale_f32, void *out, int out_bf16, int threads) {
    return gemm(x, M, K, N, codes, scale, zero, scale_f32, out, out_bf16, threads, 1);
}
