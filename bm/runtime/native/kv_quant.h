/* Quantized KV cache rows (bm/runtime/kv_quant.py), one definition for every kernel that reads them.
 *
 * int8: a row is d int8 values, then its float32 scale; fp8: d float8 e4m3fn values, the layer's key or
 * value scale given apart. Widening either to float32 is exact; the value a kernel reads is that times
 * its scale, one float32 product, as torch's dequantization computes it. */
#ifndef BM_KV_QUANT_H
#define BM_KV_QUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* A float8 e4m3fn value (bias 7, no infinities, S.1111.111 NaN) as float32: exact. A normal one's
   exponent and mantissa bits move into float32's with the bias raised by 120; a subnormal one is its
   mantissa times 2^-9. The same value torch's .to(torch.float32) gives. */
static inline float fp8_to_f32(uint8_t b) {
    const uint32_t em = b & 0x7fu;
    union { uint32_t u; float f; } v = { .u = (em << 20) + (120u << 23) };
    float x = em == 0x7fu ? NAN : em < 8u ? (float)em * 0x1p-9f : v.f;
    return b & 0x80u ? -x : x;
}

/* The float32 scale stored after an int8 row's d values. */
static inline float int8_row_scale(const void *row, int64_t d) {
    float s;
    memcpy(&s, (const char *)row + d, sizeof s);
    return s;
}

#endif
