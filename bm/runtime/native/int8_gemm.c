/* y[M, N] = (x[M, K] @ Q[N, K]^T) * scale[N] (+ bias[N]) in float32 over int8 weights: bm's linears under
 * model.quantization: int8 (bm/runtime/weight_quant.py), weight-only (the activations stay float32).
 *
 * The int8 weight is packed once (Int8GemmKernel.pack, in torch) into panels of 16 output columns,
 * k-major, as bm's float32 panel GEMM packs its weight (small_gemm.c):
 * wp[(n / 16) * K * 16 + k * 16 + (n % 16)], zero past N. The packed panels are the layer's only copy of
 * its weight: a quarter of float32's bytes in memory and in every step's reads.
 *
 * Each output is one float32 chain over k in order, whatever M is and whichever tile computes it
 * (batch invariance): acc = 0; for k = 0 .. K-1: acc = fma(x[k], float(q[n, k]), acc); then
 * acc * scale[n], then + bias[n]. No split of K: threads own whole panel pairs. The AVX-512 build widens
 * 16 weights (one panel's k row) per instruction pair and computes 16 outputs per FMA, the AVX2 build 8;
 * the plain C build runs the same chains with fmaf: the same bits in all three.
 *
 * A tile covers two adjacent panels (32 outputs) of up to twelve rows: 24 float32 accumulators, each k
 * two 16-byte loads and widenings and one broadcast per row. Rows come in blocks whose x stays in L2
 * while the thread's panels pass over them (decode batches are one block: each weight is read from
 * memory once per call).
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>

#include "ordered_fp.h" /* each chain in order; the scale and the bias applied apart */
#include "isa.h"
#include "panel_gemm.h"

#define NR 16
#define MR 12
#ifndef BM_INT8_GEMM_XBLOCK_BYTES
#define BM_INT8_GEMM_XBLOCK_BYTES (256 * 1024)
#endif
#ifndef BM_INT8_GEMM_ONE_BLOCK_ROWS
#define BM_INT8_GEMM_ONE_BLOCK_ROWS 128
#endif

#if BM_HAVE_AVX512

static inline __m512 widen16(const int8_t *q)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

/* np (1 or 2) panels against mr <= 12 rows; cols0 and cols1 (0-16) columns of each panel are stored. */
static inline __attribute__((always_inline)) void tile(
    const int mr, const int np, const float *x, int64_t ldx, const int8_t *panel, const int8_t *panel1,
    int64_t K, float *y, int64_t ldy, const float *scale, const float *bias, int cols0, int cols1)
{
    __m512 acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m512 b0 = widen16(panel + k * NR);
        const __m512 b1 = np == 2 ? widen16(panel1 + k * NR) : b0;
        for (int i = 0; i < mr; i++) {
            const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
            acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
            if (np == 2) acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    for (int j = 0; j < np; j++) {
        const int cols = j ? cols1 : cols0;
        const __mmask16 keep = (__mmask16)((1u << cols) - 1u);
        const __m512 s = _mm512_maskz_loadu_ps(keep, scale + j * NR);
        const __m512 c = bias ? _mm512_maskz_loadu_ps(keep, bias + j * NR) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            __m512 v = _mm512_mul_ps(acc[i][j], s);
            if (bias) v = _mm512_add_ps(v, c);
            _mm512_mask_storeu_ps(y + i * ldy + j * NR, keep, v);
        }
    }
}

#define BY_ROWS(np, h, ...) BM_TILE_BY_ROWS(tile, np, h, __VA_ARGS__)

/* Panels 2it and 2it + 1 (or the one N leaves) against rows [0, M), in tiles of at most twelve rows with
 * heights as equal as possible. */
static void item(int64_t it, const float *x, int64_t ldx, int64_t M, const int8_t *wp, int64_t K, float *y,
                 int64_t ldy, const float *scale, const float *bias, int64_t N)
{
    const int64_t p = 2 * it, n0 = p * NR;
    const int8_t *panel = wp + p * K * NR, *panel1 = panel + K * NR;
    int cols0, cols1;
    const int np = bm_pair_columns(N, n0, &cols0, &cols1);
    const float *b = bias ? bias + n0 : NULL;
    const int64_t tiles = (M + MR - 1) / MR;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t h = bm_tile_height(M, m, tiles, t);
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy + n0;
        if (np == 2) {
            BY_ROWS(2, h, xm, ldx, panel, panel1, K, ym, ldy, scale + n0, b, cols0, cols1)
        } else {
            BY_ROWS(1, h, xm, ldx, panel, panel, K, ym, ldy, scale + n0, b, cols0, 0)
        }
        m += h;
    }
}

#elif BM_HAVE_AVX2

/* The AVX2 build: the same chains, eight outputs per FMA, in tiles of one panel against up to six rows
 * (12 accumulators, as small_gemm.c's AVX2 tile). */
#define MR2 6

static inline __m256 widen8(const int8_t *q)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* One panel against mr <= 6 rows; `cols` (1-16) of its columns are stored. */
static inline __attribute__((always_inline)) void tile(
    const int mr, const int np, const float *x, int64_t ldx, const int8_t *panel, int64_t K, float *y,
    int64_t ldy, const float *scale, const float *bias, int cols)
{
    (void)np;
    __m256 acc[MR2][2];
    for (int i = 0; i < MR2; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = widen8(panel + k * NR), b1 = widen8(panel + k * NR + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    float s[16], c[16];
    bm_pad16(scale, cols, s);
    if (bias) bm_pad16(bias, cols, c);
    for (int i = 0; i < mr; i++) bm_store_row16(y + i * ldy, acc[i][0], acc[i][1], s, bias ? c : NULL, cols);
}

/* Panels 2it and 2it + 1 (or the one N leaves), each against rows [0, M) in tiles of at most six rows
 * with heights as equal as possible. */
static void item(int64_t it, const float *x, int64_t ldx, int64_t M, const int8_t *wp, int64_t K, float *y,
                 int64_t ldy, const float *scale, const float *bias, int64_t N)
{
    int cols[2];
    const int np = bm_pair_columns(N, 2 * it * NR, &cols[0], &cols[1]);
    for (int j = 0; j < np; j++) {
        const int64_t p = 2 * it + j, n0 = p * NR;
        const int8_t *panel = wp + p * K * NR;
        const float *b = bias ? bias + n0 : NULL;
        const int64_t tiles = (M + MR2 - 1) / MR2;
        int64_t row = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t h = bm_tile_height(M, row, tiles, t);
            BM_TILE_BY_ROWS6(tile, 1, h, x + row * ldx, ldx, panel, K, y + row * ldy + n0, ldy, scale + n0, b,
                             cols[j])
            row += h;
        }
    }
}

#else

/* The same chains in C, one output at a time. */
static void item(int64_t it, const float *x, int64_t ldx, int64_t M, const int8_t *wp, int64_t K, float *y,
                 int64_t ldy, const float *scale, const float *bias, int64_t N)
{
    for (int64_t n = 2 * it * NR; n < (2 * it + 2) * NR && n < N; n++) {
        const int8_t *panel = wp + (n / NR) * K * NR + n % NR;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * ldx;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(xm[k], (float)panel[k * NR], acc);
            float v = acc * scale[n];
            if (bias) v = v + bias[n];
            y[m * ldy + n] = v;
        }
    }
}

#endif

/* x [M, K] float32 with row stride ldx; wp packed as above (ceil(N / 16) panels); scale [N] and bias [N]
 * (or NULL) float32; y [M, N] float32 with row stride ldy. Each thread owns a contiguous run of panel
 * pairs for every row. Returns 0. */
int bm_int8_gemm(const float *x, int64_t ldx, const int8_t *wp, const float *scale, const float *bias,
                 float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t num_threads)
{
    BM_PANEL_GEMM_DRIVE(M, N, K, (int64_t)sizeof(float), MR, BM_INT8_GEMM_XBLOCK_BYTES, BM_INT8_GEMM_ONE_BLOCK_ROWS,
                        num_threads, item(it, x + m0 * ldx, ldx, rows, wp, K, y + m0 * ldy, ldy, scale, bias, N));
    return 0;
}
