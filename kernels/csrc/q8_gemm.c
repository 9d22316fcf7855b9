/* A matmul with a matrix kept as GGUF's Q8_0 blocks (w = d * c over each block of 32 inputs: a
 * float16 scale d, int8 codes c) for bfloat16 activations, AVX-512 BF16: the output matrix of a
 * model whose output matrix or tied embedding is stored so (the bundled model's), run as stored.
 *
 * Why our own: torch has no Q8_0 matmul. A bfloat16 copy reads twice the bytes a step (57 MB
 * against 29 for the bundled model) and rounds every d * c to 8 significant bits; a 4-bit copy
 * reads half but moves the logits' tail enough to cost ~1 % perplexity even with its top logits
 * rescored (kernels.linear.RescoredOutput). Here every code is exact in bfloat16 (|c| <= 128:
 * 8 significant bits), so vdpbf16ps multiplies codes and inputs exactly and sums them in
 * float32, and each block's scale multiplies its block's sum once: the model's own values.
 *
 * Layout (kernels/native.py's pack_q8): outputs in tiles of 16 (one zmm of float32
 * accumulators), codes [T][G][16][32]: in pair p of group g, byte 2o + j holds output
 * 16t + o's code for input 32g + 2p + j, so the pair's 32 codes widened to float32 in two
 * halves and packed to bfloat16 (vcvtne2ps2bf16, exact here) are one vdpbf16ps operand, input
 * pairs per output. Scales [T][G][16] float16. N need not be a multiple of 16: the last tile's
 * codes are zero past N and its stores masked.
 *
 * Steps of more than MAXR rows run the same tile MAXR rows at a time (its codes L1 / L2-resident
 * after the first block). Threads: OpenMP on torch's own runtime, as q4_gemm.c.
 */
#include <immintrin.h>
#include <stdint.h>

#define MAXR 8

/* One tile of 16 outputs for mr (<= MAXR) rows; mr is a constant where this is inlined. Each
 * row's sums run in the same order at every mr, so a row's result does not depend on how many
 * rows share its step. (Two chains a row, against vdpbf16ps's latency, bought nothing at one
 * row and cost 2x at eight: sixteen accumulators spill.) */
static inline __attribute__((always_inline)) void tile(
        const uint16_t *x, int K, int G, const int8_t *codes, const uint16_t *scale, int mr,
        __m512 *tot) {
    __m512 acc[MAXR];
    for (int r = 0; r < mr; r++) tot[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const int8_t *cg = codes + (size_t)g * 512;
        for (int i = 0; i < 8; i++) _mm_prefetch((const char *)(cg + 2048 + 64 * i), _MM_HINT_T0);
        for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
        for (int p = 0; p < 16; p++) {
            const __m512 a = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(cg + p * 32))));
            const __m512 b = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(cg + p * 32 + 16))));
            const __m512bh w = _mm512_cvtne2ps_pbh(b, a);
            const uint16_t *xp = x + g * 32 + 2 * p;
            for (int r = 0; r < mr; r++) {
                /* the row's input pair broadcast from memory inside the instruction, as
                   q4_gemm.c does */
                const int32_t *pair = (const int32_t *)(xp + (size_t)r * K);
                __asm__("vdpbf16ps %2%{1to16%}, %1, %0"
                        : "+v"(acc[r]) : "v"(w), "m"(pair[0]));
            }
        }
        const __m512 S = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + g * 16)));
        for (int r = 0; r < mr; r++)
            tot[r] = _mm512_fmadd_ps(acc[r], S, tot[r]);
    }
}

/* out[M, N] float32 = x[M, K] (bfloat16, rows K apart) @ W.T for W packed as above. Returns 1
 * for a shape the layout cannot hold (K not a multiple of 32), else 0. */
int q8_gemm(const uint16_t *x, int M, int K, int N, const int8_t *codes, const uint16_t *scale,
            float *out, int threads) {
    if (M < 1 || K % 32 || N < 1) return 1;
    const int G = K / 32, T = (N + 15) / 16;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < T; t++) {
        const int8_t *ct = codes + (size_t)t * G * 512;
        const uint16_t *st = scale + (size_t)t * G * 16;
        const int valid = N - 16 * t < 16 ? N - 16 * t : 16;
        const __mmask16 keep = (__mmask16)((1u << valid) - 1);
        for (int r0 = 0; r0 < M; r0 += MAXR) {
            const int mr = M - r0 < MAXR ? M - r0 : MAXR;
            const uint16_t *xr = x + (size_t)r0 * K;
            __m512 tot[MAXR];
            switch (mr) {
#define ROWS(R) case R: tile(xr, K, G, ct, st, R, tot); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
            }
            for (int r = 0; r < mr; r++)
                _mm512_mask_storeu_ps(out + (size_t)(r0 + r) * N + (size_t)t * 16, keep, tot[r]);
        }
    }
    return 0;
}
