/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) in float32, W held as GGUF stores it: small integers in
 * groups along k, each group with its own float32 step d and offset m per output column,
 *     W[n, k] = u[n, k] * d[n, k / G] + m[n, k / G]            (one rounding: u * d is exact)
 * (bm/runtime/group_linears.py). Q4_0 (u in 0..15, m = -8 d), Q4_1 (u in 0..15, its own m) and Q8_0
 * (u in -128..127, m = 0) are all this form, and each W[n, k] so computed is bit for bit the float32
 * value gguf's own dequantize gives (which transformers loads), since u * d fits float32's 24 bits; so
 * are GPTQ and AWQ int4 (u = q, d = s, m = -z s: s (q - z) exactly). FP8 checkpoints store u as a
 * float8 e4m3 byte (the `kind` 3, m = 0): W = u * d rounded once, as torch expands it in float32.
 *
 * Packed once, in 16-column panels as the float32 panel GEMM packs its weight (small_gemm.c):
 *   kind 4: byte [p][k / 2][c] holds u[16p + c, k] (low nibble) and u[16p + c, k + 1] (high nibble);
 *   kind 8: byte [p][k][c] holds u[16p + c, k] (signed); kind 3: the same bytes, each a float8 e4m3;
 *   d and m: float32 [p][k / G][c].
 * Columns past N are zero. Each weight is expanded in registers, once per tile of up to twelve rows.
 *
 * Each output is the float32 panel GEMM's own chain over the expanded weight: acc = 0; for k in order:
 * acc = fma(x[k], W[n, k], acc); then + bias. So a layer run here is bit for bit the same layer run on
 * its expanded float32 weight by small_gemm.c's AVX-512 and AVX2 builds, whatever M is and whichever
 * tile computes it (batch invariance). The plain C build runs the same chains with fmaf, the same bits.
 * No split of K: threads own whole panel pairs.
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>

#include "ordered_fp.h" /* each chain in order; the bias added apart */
#include "isa.h"
#include "panel_gemm.h"

#define NR 16
#define MR 12
#ifndef BM_GROUP_GEMM_XBLOCK_BYTES
#define BM_GROUP_GEMM_XBLOCK_BYTES (256 * 1024)
#endif
#ifndef BM_GROUP_GEMM_ONE_BLOCK_ROWS
#define BM_GROUP_GEMM_ONE_BLOCK_ROWS 128
#endif

/* Bytes of one panel's values (kind 4: two k steps a byte; kinds 8 and 3: a byte a step). */
#define PANEL_BYTES(bits, K) ((bits) == 4 ? (K) / 2 * NR : (K) * NR)

/* A float8 e4m3 (e4m3fn: no infinities, 0x7f and 0xff NaN) byte as float32, exactly. */
static inline float e4m3_f32(uint8_t b)
{
    const uint32_t mag = b & 0x7fu;
    float v;
    if (mag == 0x7fu) {
        v = NAN;
    } else if (mag < 8u) {
        v = (float)mag / 512.0f; /* subnormal: m * 2^-9 */
    } else {
        union { uint32_t u; float f; } bits = {.u = (mag << 20) + (120u << 23)}; /* exponent bias 7 -> 127 */
        v = bits.f;
    }
    return (b & 0x80u) ? -v : v;
}

#if BM_HAVE_AVX512

/* u of 16 columns at step k of a panel, widened to float32, then u * d + m. */
static inline __m512 expand(const int bits, const uint8_t *panel, int64_t k, __m512 d, __m512 m)
{
    __m512i u;
    if (bits == 3) { /* e4m3 bytes, rebuilt as float32 bits: the value then d * u, rounded once (m = 0) */
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(panel + k * NR)));
        const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
        __m512 v = _mm512_castsi512_ps(
            _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
        v = _mm512_mask_mul_ps(v, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), _mm512_cvtepi32_ps(mag),
                               _mm512_set1_ps(1.0f / 512.0f));
        v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), _mm512_set1_ps(NAN));
        const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
        v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
        return _mm512_fmadd_ps(v, d, m);
    }
    if (bits == 4) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(panel + (k >> 1) * NR));
        const __m128i nib = (k & 1) ? _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f))
                                    : _mm_and_si128(v, _mm_set1_epi8(0x0f));
        u = _mm512_cvtepu8_epi32(nib);
    } else {
        u = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(panel + k * NR)));
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), d, m);
}

/* np (1 or 2) panels against mr <= 12 rows; cols0 and cols1 (0-16) columns of each panel are stored.
 * d0/m0 (d1/m1) are the panels' group parameters, [K / G][16] each. */
static inline __attribute__((always_inline)) void tile(
    const int mr, const int np, const int bits, const float *x, int64_t ldx, const uint8_t *panel,
    const uint8_t *panel1, const float *d0, const float *m0, const float *d1, const float *m1, int64_t K,
    int64_t G, float *y, int64_t ldy, const float *bias, int cols0, int cols1)
{
    __m512 acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g * G < K; g++) {
        const __m512 sd0 = _mm512_loadu_ps(d0 + g * NR), sm0 = _mm512_loadu_ps(m0 + g * NR);
        const __m512 sd1 = np == 2 ? _mm512_loadu_ps(d1 + g * NR) : sd0;
        const __m512 sm1 = np == 2 ? _mm512_loadu_ps(m1 + g * NR) : sm0;
        for (int64_t k = g * G; k < (g + 1) * G; k++) {
            const __m512 b0 = expand(bits, panel, k, sd0, sm0);
            const __m512 b1 = np == 2 ? expand(bits, panel1, k, sd1, sm1) : b0;
            for (int i = 0; i < mr; i++) {
                const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
                acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
                if (np == 2) acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
            }
        }
    }
    for (int j = 0; j < np; j++) {
        const int cols = j ? cols1 : cols0;
        const __mmask16 keep = (__mmask16)((1u << cols) - 1u);
        const __m512 c = bias ? _mm512_maskz_loadu_ps(keep, bias + j * NR) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m512 v = bias ? _mm512_add_ps(acc[i][j], c) : acc[i][j];
            _mm512_mask_storeu_ps(y + i * ldy + j * NR, keep, v);
        }
    }
}

#define TILE4(h, np, ...) tile(h, np, 4, __VA_ARGS__)
#define TILE8(h, np, ...) tile(h, np, 8, __VA_ARGS__)
#define TILE3(h, np, ...) tile(h, np, 3, __VA_ARGS__)

/* Panels 2it and 2it + 1 (or the one N leaves) against rows [0, M), in tiles of at most twelve rows with
 * heights as equal as possible. */
static void item(int64_t it, int bits, const float *x, int64_t ldx, int64_t M, const uint8_t *wp,
                 const float *d, const float *m, int64_t K, int64_t G, float *y, int64_t ldy,
                 const float *bias, int64_t N)
{
    const int64_t p = 2 * it, n0 = p * NR, groups = K / G;
    const uint8_t *panel = wp + p * PANEL_BYTES(bits, K), *panel1 = panel + PANEL_BYTES(bits, K);
    const float *d0 = d + p * groups * NR, *m0 = m + p * groups * NR;
    const float *d1 = d0 + groups * NR, *m1 = m0 + groups * NR;
    int cols0, cols1;
    const int np = bm_pair_columns(N, n0, &cols0, &cols1);
    const float *b = bias ? bias + n0 : NULL;
    const int64_t tiles = (M + MR - 1) / MR;
    int64_t row = 0;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t h = bm_tile_height(M, row, tiles, t);
        const float *xm = x + row * ldx;
        float *ym = y + row * ldy + n0;
        if (bits == 4 && np == 2) {
            BM_TILE_BY_ROWS(TILE4, 2, h, xm, ldx, panel, panel1, d0, m0, d1, m1, K, G, ym, ldy, b, cols0, cols1)
        } else if (bits == 4) {
            BM_TILE_BY_ROWS(TILE4, 1, h, xm, ldx, panel, panel, d0, m0, d0, m0, K, G, ym, ldy, b, cols0, 0)
        } else if (bits == 8 && np == 2) {
            BM_TILE_BY_ROWS(TILE8, 2, h, xm, ldx, panel, panel1, d0, m0, d1, m1, K, G, ym, ldy, b, cols0, cols1)
        } else if (bits == 8) {
            BM_TILE_BY_ROWS(TILE8, 1, h, xm, ldx, panel, panel, d0, m0, d0, m0, K, G, ym, ldy, b, cols0, 0)
        } else if (np == 2) {
            BM_TILE_BY_ROWS(TILE3, 2, h, xm, ldx, panel, panel1, d0, m0, d1, m1, K, G, ym, ldy, b, cols0, cols1)
        } else {
            BM_TILE_BY_ROWS(TILE3, 1, h, xm, ldx, panel, panel, d0, m0, d0, m0, K, G, ym, ldy, b, cols0, 0)
        }
        row += h;
    }
}

#elif BM_HAVE_AVX2

/* The AVX2 build: the same chains, eight outputs per FMA. A tile is one panel (two 8-column halves)
 * against up to six rows: 12 accumulators, as small_gemm.c's AVX2 tile, so its weights are expanded once
 * per six rows. */
#define MR2 6

/* u of the 8 columns of half `half` of a panel at step k, widened to float32, then u * d + m. */
static inline __m256 expand8(const int bits, const uint8_t *panel, int64_t k, int half, __m256 d, __m256 m)
{
    __m256i u;
    if (bits == 3) { /* as the AVX-512 build: the e4m3 value rebuilt as float32 bits, then d * u */
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(panel + k * NR + half * 8)));
        const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
        __m256 v = _mm256_castsi256_ps(
            _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
        const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
        v = _mm256_blendv_ps(v, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
        v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN),
                             _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f))));
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
        v = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
        return _mm256_fmadd_ps(v, d, m);
    }
    if (bits == 4) {
        const __m128i v = _mm_loadl_epi64((const __m128i *)(panel + (k >> 1) * NR + half * 8));
        const __m128i nib = (k & 1) ? _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f))
                                    : _mm_and_si128(v, _mm_set1_epi8(0x0f));
        u = _mm256_cvtepu8_epi32(nib);
    } else {
        u = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(panel + k * NR + half * 8)));
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(u), d, m);
}

/* One panel against mr <= 6 rows; `cols` (1-16) of its columns are stored. With bits 4, 8 or 3 the panel
 * is the packed values and dp/mp its group parameters ([K / G][16]), expanded in registers; with bits 0
 * it is already expanded, float32 [K][16] (expand_panel), and dp, mp and G are unused. */
static inline __attribute__((always_inline)) void tile(
    const int mr, const int bits, const float *x, int64_t ldx, const void *panel, const float *dp,
    const float *mp, int64_t K, int64_t G, float *y, int64_t ldy, const float *bias, int cols)
{
    __m256 acc[MR2][2];
    for (int i = 0; i < MR2; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    if (bits == 0) {
        const float *w = (const float *)panel;
        for (int64_t k = 0; k < K; k++) {
            const __m256 b0 = _mm256_loadu_ps(w + k * NR), b1 = _mm256_loadu_ps(w + k * NR + 8);
            for (int i = 0; i < mr; i++) {
                const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
                acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
            }
        }
    } else {
        for (int64_t g = 0; g * G < K; g++) {
            const __m256 d0 = _mm256_loadu_ps(dp + g * NR), d1 = _mm256_loadu_ps(dp + g * NR + 8);
            const __m256 m0 = _mm256_loadu_ps(mp + g * NR), m1 = _mm256_loadu_ps(mp + g * NR + 8);
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                const __m256 b0 = expand8(bits, (const uint8_t *)panel, k, 0, d0, m0);
                const __m256 b1 = expand8(bits, (const uint8_t *)panel, k, 1, d1, m1);
                for (int i = 0; i < mr; i++) {
                    const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
                    acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
                }
            }
        }
    }
    float c[16];
    if (bias) bm_pad16(bias, cols, c);
    for (int i = 0; i < mr; i++) bm_store_row16(y + i * ldy, acc[i][0], acc[i][1], NULL, bias ? c : NULL, cols);
}

/* A panel's weights expanded once into out, float32 [K][16]: the values the tiles would expand in
 * registers, for a call of more rows than one tile, where every tile then reads them from cache
 * instead of expanding them again (two widenings and an FMA per eight weights, per tile). */
static void expand_panel(int bits, const uint8_t *panel, const float *dp, const float *mp, int64_t K, int64_t G,
                         float *out)
{
    for (int64_t g = 0; g * G < K; g++) {
        const __m256 d0 = _mm256_loadu_ps(dp + g * NR), d1 = _mm256_loadu_ps(dp + g * NR + 8);
        const __m256 m0 = _mm256_loadu_ps(mp + g * NR), m1 = _mm256_loadu_ps(mp + g * NR + 8);
        for (int64_t k = g * G; k < (g + 1) * G; k++) {
            _mm256_storeu_ps(out + k * NR, expand8(bits, panel, k, 0, d0, m0));
            _mm256_storeu_ps(out + k * NR + 8, expand8(bits, panel, k, 1, d1, m1));
        }
    }
}

/* Each thread's buffer for one expanded panel, kept for the thread's life and grown as K needs. */
static float *expanded_buffer(int64_t K)
{
    static __thread float *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (K > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)K * NR * sizeof(float));
        capacity = buffer ? K : 0;
    }
    return buffer;
}

#define TILE4(h, np, ...) tile(h, 4, __VA_ARGS__)
#define TILE8(h, np, ...) tile(h, 8, __VA_ARGS__)
#define TILE3(h, np, ...) tile(h, 3, __VA_ARGS__)
#define TILE0(h, np, ...) tile(h, 0, __VA_ARGS__)

/* u of the 16 columns of a 4-bit panel at steps k (even) and k + 1, from one 16-byte load: the low
 * nibbles are step k, the high ones k + 1; each half widened to float32, then u * d + m. */
static inline __attribute__((always_inline)) void expand4_pair(const uint8_t *panel, int64_t k, __m256 d0,
                                                               __m256 m0, __m256 d1, __m256 m1, __m256 out[4])
{
    const __m128i v = _mm_loadu_si128((const __m128i *)(panel + (k >> 1) * NR));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    out[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d0, m0);
    out[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d1, m1);
    out[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d0, m0);
    out[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d1, m1);
}

/* One row against both panels of a pair: four accumulators (a tile of one row over one panel has two,
 * one FMA latency apart), so a decode step of one request keeps the FMA units busy while the weights
 * are widened. Each output is the same chain as in tile(), so the same bits: acc = fma(x[k], W[n, k],
 * acc) for k in order, W[n, k] = fma(u, d, m), then + bias. */
static inline __attribute__((always_inline)) void row_pair(
    const int bits, const float *x, const uint8_t *p0, const uint8_t *p1, const float *d0p,
    const float *m0p, const float *d1p, const float *m1p, int64_t K, int64_t G, float *y,
    const float *bias, int cols0, int cols1)
{
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g * G < K; g++) {
        const __m256 d00 = _mm256_loadu_ps(d0p + g * NR), d01 = _mm256_loadu_ps(d0p + g * NR + 8);
        const __m256 m00 = _mm256_loadu_ps(m0p + g * NR), m01 = _mm256_loadu_ps(m0p + g * NR + 8);
        const __m256 d10 = _mm256_loadu_ps(d1p + g * NR), d11 = _mm256_loadu_ps(d1p + g * NR + 8);
        const __m256 m10 = _mm256_loadu_ps(m1p + g * NR), m11 = _mm256_loadu_ps(m1p + g * NR + 8);
        if (bits == 4) { /* two steps a load (G is even) */
            for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
                __m256 b0[4], b1[4];
                expand4_pair(p0, k, d00, m00, d01, m01, b0);
                expand4_pair(p1, k, d10, m10, d11, m11, b1);
                const __m256 a = _mm256_broadcast_ss(x + k), a1 = _mm256_broadcast_ss(x + k + 1);
                acc[0] = _mm256_fmadd_ps(a, b0[0], acc[0]);
                acc[1] = _mm256_fmadd_ps(a, b0[1], acc[1]);
                acc[2] = _mm256_fmadd_ps(a, b1[0], acc[2]);
                acc[3] = _mm256_fmadd_ps(a, b1[1], acc[3]);
                acc[0] = _mm256_fmadd_ps(a1, b0[2], acc[0]);
                acc[1] = _mm256_fmadd_ps(a1, b0[3], acc[1]);
                acc[2] = _mm256_fmadd_ps(a1, b1[2], acc[2]);
                acc[3] = _mm256_fmadd_ps(a1, b1[3], acc[3]);
            }
        } else {
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                const __m256 a = _mm256_broadcast_ss(x + k);
                acc[0] = _mm256_fmadd_ps(a, expand8(bits, p0, k, 0, d00, m00), acc[0]);
                acc[1] = _mm256_fmadd_ps(a, expand8(bits, p0, k, 1, d01, m01), acc[1]);
                acc[2] = _mm256_fmadd_ps(a, expand8(bits, p1, k, 0, d10, m10), acc[2]);
                acc[3] = _mm256_fmadd_ps(a, expand8(bits, p1, k, 1, d11, m11), acc[3]);
            }
        }
    }
    float c[16];
    if (bias) bm_pad16(bias, cols0, c);
    bm_store_row16(y, acc[0], acc[1], NULL, bias ? c : NULL, cols0);
    if (bias) bm_pad16(bias + NR, cols1, c);
    bm_store_row16(y + NR, acc[2], acc[3], NULL, bias ? c : NULL, cols1);
}

/* Panels 2it and 2it + 1 (or the one N leaves), each against rows [0, M) in tiles of at most six rows
 * with heights as equal as possible; a panel meeting more than one tile is expanded once first. */
static void item(int64_t it, int bits, const float *x, int64_t ldx, int64_t M, const uint8_t *wp,
                 const float *d, const float *m, int64_t K, int64_t G, float *y, int64_t ldy,
                 const float *bias, int64_t N)
{
    const int64_t groups = K / G, tiles = (M + MR2 - 1) / MR2;
    int cols[2];
    const int np = bm_pair_columns(N, 2 * it * NR, &cols[0], &cols[1]);
    if (M == 1 && np == 2) { /* one row: both panels at once (row_pair) */
        const int64_t p = 2 * it;
        const uint8_t *panel = wp + p * PANEL_BYTES(bits, K);
        const float *dp = d + p * groups * NR, *mp = m + p * groups * NR;
        const float *b = bias ? bias + p * NR : NULL;
        /* each kind a call with a constant `bits`, so row_pair's branches fold away */
#define ROW_PAIR(kind)                                                                                     \
    row_pair(kind, x, panel, panel + PANEL_BYTES(kind, K), dp, mp, dp + groups * NR, mp + groups * NR, K, G, \
             y + p * NR, b, cols[0], cols[1])
        if (bits == 4) {
            ROW_PAIR(4);
        } else if (bits == 8) {
            ROW_PAIR(8);
        } else {
            ROW_PAIR(3);
        }
#undef ROW_PAIR
        return;
    }
    float *expanded = tiles > 1 ? expanded_buffer(K) : NULL;
    for (int j = 0; j < np; j++) {
        const int64_t p = 2 * it + j, n0 = p * NR;
        const uint8_t *panel = wp + p * PANEL_BYTES(bits, K);
        const float *dp = d + p * groups * NR, *mp = m + p * groups * NR;
        const float *b = bias ? bias + n0 : NULL;
        if (expanded) expand_panel(bits, panel, dp, mp, K, G, expanded);
        int64_t row = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t h = bm_tile_height(M, row, tiles, t);
            const float *xm = x + row * ldx;
            float *ym = y + row * ldy + n0;
            if (expanded) {
                BM_TILE_BY_ROWS6(TILE0, 1, h, xm, ldx, expanded, dp, mp, K, G, ym, ldy, b, cols[j])
            } else if (bits == 4) {
                BM_TILE_BY_ROWS6(TILE4, 1, h, xm, ldx, panel, dp, mp, K, G, ym, ldy, b, cols[j])
            } else if (bits == 8) {
                BM_TILE_BY_ROWS6(TILE8, 1, h, xm, ldx, panel, dp, mp, K, G, ym, ldy, b, cols[j])
            } else {
                BM_TILE_BY_ROWS6(TILE3, 1, h, xm, ldx, panel, dp, mp, K, G, ym, ldy, b, cols[j])
            }
            row += h;
        }
    }
}

#else

/* The same chains in C, one output at a time. */
static void item(int64_t it, int bits, const float *x, int64_t ldx, int64_t M, const uint8_t *wp,
                 const float *d, const float *m, int64_t K, int64_t G, float *y, int64_t ldy,
                 const float *bias, int64_t N)
{
    const int64_t groups = K / G;
    for (int64_t n = 2 * it * NR; n < (2 * it + 2) * NR && n < N; n++) {
        const int64_t p = n / NR, c = n % NR;
        const uint8_t *panel = wp + p * PANEL_BYTES(bits, K);
        const float *dp = d + p * groups * NR + c, *mp = m + p * groups * NR + c;
        for (int64_t r = 0; r < M; r++) {
            const float *xr = x + r * ldx;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                float u;
                if (bits == 4) {
                    const uint8_t byte = panel[(k >> 1) * NR + c];
                    u = (float)((k & 1) ? byte >> 4 : byte & 0x0f);
                } else if (bits == 3) {
                    u = e4m3_f32(panel[k * NR + c]);
                } else {
                    u = (float)(int8_t)panel[k * NR + c];
                }
                const float w = fmaf(u, dp[(k / G) * NR], mp[(k / G) * NR]);
                acc = fmaf(xr[k], w, acc);
            }
            y[r * ldy + n] = bias ? acc + bias[n] : acc;
        }
    }
}

#endif

/* x [M, K] float32 with row stride ldx; wp packed as above (ceil(N / 16) panels of `bits` 4, 8 or 3: the
 * kind, e4m3 bytes for 3); d and m
 * float32 [ceil(N / 16)][K / G][16]; bias [N] or NULL; y [M, N] float32 with row stride ldy. K must be a
 * multiple of G, and G of 2. Each thread owns a contiguous run of panel pairs for every row. Returns 0,
 * or -1 for a shape it does not take. */
int bm_group_gemm(const float *x, int64_t ldx, const uint8_t *wp, int64_t bits, const float *d, const float *m,
                  int64_t G, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                  int64_t num_threads)
{
    if ((bits != 4 && bits != 8 && bits != 3) || G <= 0 || G % 2 || K % G) return -1;
    BM_PANEL_GEMM_DRIVE(M, N, K, (int64_t)sizeof(float), MR, BM_GROUP_GEMM_XBLOCK_BYTES, BM_GROUP_GEMM_ONE_BLOCK_ROWS,
                        num_threads,
                        item(it, (int)bits, x + m0 * ldx, ldx, rows, wp, d, m, K, G, y + m0 * ldy, ldy, bias, N));
    return 0;
}
