/* Decode attention straight from the paged KV cache, bfloat16, AVX-512 BF16.
 *
 * Why our own: on the CPU torch has no paged attention. The torch path gathers every sequence's
 * blocks into a padded [B, Hk, keys, D] copy (keys and values) and runs
 * scaled_dot_product_attention on it with a length mask: at 8 sequences of ~100 keys that is
 * ~130 us a layer of the bundled model (4 of a decode step's ~15 ms; torch.profiler), for a few
 * hundred kilobytes of keys and values. This reads each key and value row once, where it lies,
 * for all the query heads that share it (grouped-query attention), with no copy and no padding.
 *
 *   q        [B, H, D]            bf16, the step's one query token per sequence; sequences
 *                                 q_sb and heads q_sh elements apart (a view of the QKV output)
 *   k_cache  [NB, BS, Hk, D]      bf16, v_cache the same
 *   tables   [B, M] int64         block ids (rows padded past the context with any valid id)
 *   lens     [B] int64            keys each query sees (1 .. M * BS)
 *   out      [B, H, D]            bf16
 *
 * One task per (sequence, KV head), dynamically scheduled over the OpenMP threads (a thread
 * preempted by another process on a shared core delays only its own tasks). Per task: scores
 * q . k with vdpbf16ps (products of bf16 exact, float32 sums) for the H / Hk query heads, a
 * float32 softmax (max subtracted; exp by range reduction and a degree-7 polynomial, relative
 * error < 1e-7), then the probabilities times the value rows in float32, rounded to bf16 once.
 * D must be a multiple of 32 up to 256, H / Hk at most 8. A block id outside the cache or a
 * length outside 1 .. M * BS fails the call (return code) rather than reading out of bounds.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define MAXG 8
#define MAXC 8 /* D / 32 */

static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* x - n ln 2, ln 2 in two parts (Cody-Waite): |r| <= ln2 / 2 with no loss in n ln 2 */
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n); /* p * 2^n */
}

static inline __mmask16 tail(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* the sums of 16 vectors, one per lane, in their order: a transpose and add in four levels
   (45 instructions for 16 sums, against ~8 each for a horizontal add per vector) */
static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], d[4], e[2];
    for (int i = 0; i < 8; i++) /* lanes of 128 bits: a0 + a2, a1 + a3 for vectors 2i, 2i+1 */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* each 128-bit lane: the sums of vectors 4i .. 4i+3 there */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* 128-bit lanes 0 + 1 and 2 + 3 of two such */
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(d[2 * i], d[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(d[2 * i], d[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88),
                         _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

/* softmax of s[0..L) in place; returns 1 / sum of the exponentials */
static float softmax_unnormalised(float *s, int64_t L) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < L; t += 16)
        m = _mm512_mask_max_ps(m, tail(L - t), m, _mm512_maskz_loadu_ps(tail(L - t), s + t));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += 16) {
        const __mmask16 k = tail(L - t);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), mx));
        _mm512_mask_storeu_ps(s + t, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

int paged_decode_attention(const uint16_t *q, int64_t q_sb, int64_t q_sh,
                           const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *tables, int64_t M, const int64_t *lens, int B, int H,
                           int HK, int D, int BS, int64_t NB, float scale, uint16_t *out,
                           int threads) {
    if (B < 0 || HK < 1 || H % HK || H / HK > MAXG || D % 32 || D / 32 > MAXC || BS < 1)
        return 1;
    const int G = H / HK, C = D / 32;
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : failed)
    for (int task = 0; task < B * HK; task++) {
        const int b = task / HK, kh = task % HK;
        const int64_t L = lens[b];
        const int64_t *tab = tables + (int64_t)b * M;
        if (L < 1 || L > M * BS) {
            failed |= 2;
            continue;
        }
        int bad = 0;
        for (int64_t i = 0; i < (L + BS - 1) / BS; i++) bad |= tab[i] < 0 || tab[i] >= NB;
        if (bad) {
            failed |= 4;
            continue;
        }
        const int64_t stride = (L + 15) / 16 * 16; /* one head's scores */
        /* the scores, then the key rows' offsets; C11's aligned_alloc wants a whole number of
           64-byte lines */
        float *s =
            (float *)aligned_alloc(64, (size_t)(G * stride) * 4 + (size_t)(L + 7) / 8 * 64);
        if (!s) {
            failed |= 8;
            continue;
        }
        /* each key's row in the caches, walked block by block (a division per key costs more
           than the key's arithmetic) */
        int64_t *row = (int64_t *)(s + G * stride);
        for (int64_t t = 0, i = 0; t < L; i++)
            for (int o = 0; o < BS && t < L; o++, t++) row[t] = ((tab[i] * BS + o) * HK + kh) * D;
        const uint16_t *qb = q + (int64_t)b * q_sb + (int64_t)kh * G * q_sh;
        __m512bh qv[MAXG][MAXC];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++)
                qv[g][c] = (__m512bh)_mm512_loadu_si512(qb + g * q_sh + 32 * c);
        for (int64_t t0 = 0; t0 < L; t0 += 16) { /* 16 keys at a time, one score per lane */
            const int n = L - t0 < 16 ? (int)(L - t0) : 16;
            const uint16_t *kr[16];
            for (int j = 0; j < 16; j++) { /* past the context: a valid row, its lane unused */
                kr[j] = k_cache + row[t0 + (j < n ? j : 0)];
            }
            for (int g = 0; g < G; g++) {
                __m512 acc[16];
                for (int j = 0; j < 16; j++) {
                    acc[j] = _mm512_setzero_ps();
                    for (int c = 0; c < C; c++)
                        acc[j] = _mm512_dpbf16_ps(
                            acc[j], qv[g][c], (__m512bh)_mm512_loadu_si512(kr[j] + 32 * c));
                }
                _mm512_mask_storeu_ps(s + g * stride + t0, tail(n),
                                      _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
            }
        }
        float inv[MAXG];
        for (int g = 0; g < G; g++) inv[g] = softmax_unnormalised(s + g * stride, L);
        uint16_t *ob = out + ((int64_t)b * H + (int64_t)kh * G) * D;
        for (int c = 0; c < C; c++) { /* 32 outputs of every head: one 64-byte line a row */
            __m512 lo[MAXG], hi[MAXG];
            for (int g = 0; g < G; g++) lo[g] = hi[g] = _mm512_setzero_ps();
            for (int64_t t = 0; t < L; t++) {
                const __m512i v = _mm512_loadu_si512(v_cache + row[t] + 32 * c);
                const __m512 v0 = bf16x16_to_f32(_mm512_castsi512_si256(v));
                const __m512 v1 = bf16x16_to_f32(_mm512_extracti64x4_epi64(v, 1));
                for (int g = 0; g < G; g++) {
                    const __m512 p = _mm512_set1_ps(s[g * stride + t]);
                    lo[g] = _mm512_fmadd_ps(p, v0, lo[g]);
                    hi[g] = _mm512_fmadd_ps(p, v1, hi[g]);
                }
            }
            for (int g = 0; g < G; g++) {
                const __m512 k = _mm512_set1_ps(inv[g]);
                _mm512_storeu_si512(ob + g * D + 32 * c,
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi[g], k),
                                                                 _mm512_mul_ps(lo[g], k)));
            }
        }
        free(s);
    }
    return failed;
}
