/* bfloat16 -> float32, exact (a bfloat16 is a float32's high 16 bits): one value, or 16 at a
 * time (each 16-bit value into the high half of a 32-bit lane). Shared by the kernels here. */
#ifndef TAILSCOPE_BF16_H
#define TAILSCOPE_BF16_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#endif
