/* bfloat16 <-> float32, one definition for every kernel that reads or writes bf16 tensors.
 *
 * Widening a bf16 value to float32 is exact: its 16 bits are the top half of the float32 (a shift).
 * Narrowing rounds to nearest, ties to even, as torch's float -> bfloat16 conversion does, and keeps a
 * NaN a NaN. So a kernel that widens bf16 inputs, computes in float32 and narrows its result gives
 * exactly what torch gives for `kernel_f32(x.float()).to(torch.bfloat16)`.
 *
 * Include after isa.h (the 16-lane forms need BM_HAVE_AVX512). */
#ifndef BM_BF16_H
#define BM_BF16_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}

/* Round to nearest, ties to even, as torch's float -> bfloat16 conversion does (NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f)
{
    union { float f; uint32_t u; } v = { .f = f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if BM_HAVE_AVX2
/* Eight lanes widened: zero-extend each 16-bit value to 32 bits, shift it into the top half. */
static inline __m256 bf16x8_load(const uint16_t *p)
{
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

#if BM_HAVE_AVX512
/* Sixteen lanes of the same conversions. */
static inline __m512 bf16x16_load(const uint16_t *p)
{
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* The bf16 bits of each lane, rounded as f32_to_bf16 rounds, in the low half of each 32-bit lane. */
static inline __m512i bf16x16_bits(__m512 f)
{
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

static inline __m512 bf16x16_round(__m512 f) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_bits(f), 16)); }

static inline void bf16x16_store(uint16_t *p, __m512 f)
{
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16x16_bits(f)));
}
#endif

#endif
