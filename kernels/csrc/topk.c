/* The indices of each row's k largest bfloat16 values, AVX-512 BW (the candidates that
 * kernels.linear.RescoredOutput rescores from the exact output matrix, every decode step), and
 * the merge of the rescored values into the step's float32 logits.
 *
 * Why our own: torch's CPU topk on bfloat16 took ~290 us for 8 rows of a 49,152-token
 * vocabulary here (its max alone 170 us), 2-3% of a compiled 8-row decode step. This one reads
 * each value once as a 16-bit integer key in the values' order (a bfloat16's bits, negatives
 * with their magnitude bits flipped), compares 32 keys an instruction against the smallest key
 * kept so far, and only the rare value above it goes into a min-heap of k: ~40 us for 8 rows
 * on 2 threads.
 *
 * Order: the k largest by value; of equal values the lower index first (a later equal value
 * does not displace a kept one); the result sorted by value, largest first, as torch.topk
 * gives it. A NaN counts as larger than +inf, as in torch.topk; -0.0 counts as just below
 * +0.0. Rows ld apart. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

static inline int16_t key_of(uint16_t bits) {
    if ((bits & 0x7FFF) > 0x7F80) return 0x7FFF; /* NaN, either sign */
    int16_t k = (int16_t)bits;
    return k < 0 ? (int16_t)(k ^ 0x7FFF) : k;
}

/* (key, index) a beats b: larger key, or equal key and lower index */
static inline int beats(int16_t ka, int64_t ia, int16_t kb, int64_t ib) {
    return ka > kb || (ka == kb && ia < ib);
}

/* restore the min-heap (the root is the entry every other beats) below position i */
static void sift_down(int16_t *key, int64_t *idx, int k, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < k && beats(key[m], idx[m], key[l], idx[l])) m = l;
        if (r < k && beats(key[m], idx[m], key[r], idx[r])) m = r;
        if (m == i) return;
        int16_t tk = key[i]; key[i] = key[m]; key[m] = tk;
        int64_t ti = idx[i]; idx[i] = idx[m]; idx[m] = ti;
        i = m;
    }
}

/* out[r * k + j], j < k <= n: row r's k largest, largest first. Returns 1 when out of memory. */
int topk_rows(const uint16_t *x, int64_t rows, int64_t n, int64_t ld, int64_t k, int64_t *out,
              int threads) {
    int rc = 0;
    #pragma omp parallel num_threads(threads)
    {
        int16_t *key = (int16_t *)malloc(sizeof(int16_t) * (size_t)k);
        int64_t *idx = (int64_t *)malloc(sizeof(int64_t) * (size_t)k);
        if (!key || !idx) {
            #pragma omp atomic write
            rc = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!key || !idx) continue;
            const uint16_t *p = x + r * ld;
            for (int64_t j = 0; j < k; j++) {
                key[j] = key_of(p[j]);
                idx[j] = j;
            }
            for (int64_t j = k / 2 - 1; j >= 0; j--) sift_down(key, idx, (int)k, (int)j);
            const __m512i flip = _mm512_set1_epi16(0x7FFF), inf = _mm512_set1_epi16(0x7F80);
            /* 32 keys an instruction from the first value past the heap's (unaligned loads,
               the row's tail masked) */
            for (int64_t i = k; i < n; i += 32) {
                const __mmask32 m = n - i >= 32 ? (__mmask32)0xFFFFFFFFu
                                                : (__mmask32)((1u << (n - i)) - 1);
                const __m512i v = _mm512_maskz_loadu_epi16(m, p + i);
                /* negative values (sign set): magnitude bits flipped, so keys order as values */
                __m512i kv = _mm512_xor_si512(
                    v, _mm512_and_si512(_mm512_srai_epi16(v, 15), flip));
                const __mmask32 nan = _mm512_cmpgt_epi16_mask(_mm512_and_si512(v, flip), inf);
                kv = _mm512_mask_mov_epi16(kv, nan, flip);
                __mmask32 gt = _mm512_mask_cmpgt_epi16_mask(m, kv, _mm512_set1_epi16(key[0]));
                while (gt) {
                    const int b = __builtin_ctz(gt);
                    gt &= gt - 1;
                    const int16_t kb = key_of(p[i + b]);
                    if (kb > key[0]) {
                        key[0] = kb;
                        idx[0] = i + b;
                        sift_down(key, idx, (int)k, 0);
                    }
                }
            }
            /* largest first: pop the heap from its smallest into the end of the row */
            int64_t *o = out + r * k;
            for (int64_t left = k; left > 0; left--) {
                o[left - 1] = idx[0];
                key[0] = key[left - 1];
                idx[0] = idx[left - 1];
                sift_down(key, idx, (int)(left - 1), 0);
            }
        }
        free(key);
        free(idx);
    }
    return rc;
}

/* out[r, :] = y[r, :] widened to float32 (exactly), then out[r, idx[r, j]] = top[r, j] (also
 * bfloat16, widened): the logits of a rescored step, the rescored values over the packed
 * matrix's, in one pass (torch.compile's graph for y.scatter(...).float() took ~220 us beyond
 * the conversion). Rows of y ld apart, out and idx/top contiguous. Returns 1 for an index
 * outside 0 .. n - 1 (out is then incomplete). */
int merge_rows(const uint16_t *y, int64_t rows, int64_t n, int64_t ld, const int64_t *idx,
               const uint16_t *top, int64_t k, float *out, int threads) {
    int rc = 0;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *p = y + r * ld;
        float *o = out + r * n;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(o + i, bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(p + i))));
        for (; i < n; i++) o[i] = bf16_to_f32(p[i]);
        for (int64_t j = 0; j < k; j++) {
            const int64_t at = idx[r * k + j];
            if (at < 0 || at >= n) {
                #pragma omp atomic write
                rc = 1;
                continue;
            }
            o[at] = bf16_to_f32(top[r * k + j]);
        }
    }
    return rc;
}
