/* The AMX path of bf16_gemm.c (its header comment says what it computes), included by it alone: with
 * BM_AMX 1 the tile instructions, with BM_AMX 2 each one done in C (the amx_emulated variant).
 *
 * Eight tiles of 16 rows × 64 bytes: C00, C01, C10 and C11 accumulate two row blocks (16 rows each)
 * against the two panels of a work item, A0 and A1 hold the row blocks' 32 k, B0 and B1 the panels'
 * 16 k-pairs. The epilogue (bias, rounding to bf16, storing the columns below N) is plain C: it runs
 * once per output, against 16 × 32 products per output in the tiles. */
#ifndef BM_BF16_AMX_H
#define BM_BF16_AMX_H

#include <stdint.h>
#include <string.h>

#define AMX_ROWS 16  /* rows of a tile */
#define AMX_PAIRS 16 /* k-pairs of a tile step: 32 k */
#define AMX_NR 16    /* columns of a panel */

/* Tile numbers as literals: GCC's tile intrinsics paste their argument's spelling into the instruction. */
#define C00 0
#define C01 1
#define C10 2
#define C11 3
#define A0 4
#define A1 5
#define B0 6
#define B1 7

#if BM_AMX == 1
#include <immintrin.h>

/* Palette 1, every tile 16 rows of 64 bytes; loaded by each thread before its tiles (the configuration
 * is per thread), released after. */
struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static inline void amx_begin(void)
{
    struct amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = AMX_ROWS;
    }
    _tile_loadconfig(&cfg);
}

static inline void amx_end(void) { _tile_release(); }

#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)

#else /* BM_AMX == 2: the tiles in memory, each instruction in C */

static __thread uint8_t emulated_tiles[8][AMX_ROWS * 64];

static inline void amx_begin(void) {}
static inline void amx_end(void) {}

static void tile_zero(int t) { memset(emulated_tiles[t], 0, sizeof emulated_tiles[t]); }

static void tile_load(int t, const void *base, int64_t stride)
{
    for (int r = 0; r < AMX_ROWS; r++) memcpy(emulated_tiles[t] + r * 64, (const uint8_t *)base + r * stride, 64);
}

static void tile_store(int t, void *base, int64_t stride)
{
    for (int r = 0; r < AMX_ROWS; r++) memcpy((uint8_t *)base + r * stride, emulated_tiles[t] + r * 64, 64);
}

/* A value below float32's normal range as zero of its sign: AMX-BF16 takes denormal inputs as zero and
 * flushes denormal results, whatever MXCSR says. */
static inline float flush(float f)
{
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7f800000u) == 0) v.u &= 0x80000000u;
    return v.f;
}

/* tdpbf16ps: C[m][n] += A[m][2k] * B[k][2n], then += A[m][2k + 1] * B[k][2n + 1], for k = 0 .. 15 in
 * order; each product of two bf16 values is exact in float32, so each step rounds once. */
static void tile_dp(int c, int a, int b)
{
    float *C = (float *)(void *)emulated_tiles[c];
    const uint16_t *A = (const uint16_t *)(const void *)emulated_tiles[a];
    const uint16_t *B = (const uint16_t *)(const void *)emulated_tiles[b];
    for (int m = 0; m < AMX_ROWS; m++)
        for (int n = 0; n < AMX_NR; n++) {
            float acc = C[m * AMX_NR + n];
            for (int k = 0; k < AMX_PAIRS; k++)
                for (int e = 0; e < 2; e++) {
                    const float p = flush(bf16_to_f32(A[m * 32 + 2 * k + e])) * flush(bf16_to_f32(B[k * 32 + 2 * n + e]));
                    acc = flush(acc + p);
                }
            C[m * AMX_NR + n] = acc;
        }
}

#define TILE_ZERO(t) tile_zero(t)
#define TILE_LOAD(t, base, stride) tile_load(t, base, stride)
#define TILE_STORE(t, base, stride) tile_store(t, base, stride)
#define TILE_DP(c, a, b) tile_dp(c, a, b)

#endif

/* The A operand of a row block (`rows` of x from `x`, 1-16) at k block kb: straight from x where the
 * block is whole, else copied into `scratch` (16 × 32 bf16) with zeros past the rows and past K. */
static inline const uint16_t *a_operand(const uint16_t *x, int64_t ldx, int64_t rows, int64_t K, int64_t kb,
                                        uint16_t *scratch, int64_t *stride)
{
    const int64_t k0 = kb * 2 * AMX_PAIRS, width = K - k0 < 2 * AMX_PAIRS ? K - k0 : 2 * AMX_PAIRS;
    if (rows == AMX_ROWS && width == 2 * AMX_PAIRS) {
        *stride = ldx * (int64_t)sizeof(uint16_t);
        return x + k0;
    }
    memset(scratch, 0, AMX_ROWS * 2 * AMX_PAIRS * sizeof(uint16_t));
    for (int64_t r = 0; r < rows; r++) memcpy(scratch + r * 2 * AMX_PAIRS, x + r * ldx + k0, width * sizeof(uint16_t));
    *stride = 2 * AMX_PAIRS * (int64_t)sizeof(uint16_t);
    return scratch;
}

/* The B operand of a panel (kh k-pairs, packed [kh][16][2]) at k block kb: straight from the panel where
 * the block's 16 pairs exist, else its last pairs copied into `scratch` with zero pairs after them. */
static inline const uint16_t *b_operand(const uint16_t *panel, int64_t kh, int64_t kb, uint16_t *scratch)
{
    const int64_t p0 = kb * AMX_PAIRS, pairs = kh - p0 < AMX_PAIRS ? kh - p0 : AMX_PAIRS;
    if (pairs == AMX_PAIRS) return panel + p0 * 2 * AMX_NR;
    memset(scratch, 0, AMX_PAIRS * 2 * AMX_NR * sizeof(uint16_t));
    memcpy(scratch, panel + p0 * 2 * AMX_NR, pairs * 2 * AMX_NR * sizeof(uint16_t));
    return scratch;
}

/* An accumulator tile's first `rows` rows and `cols` columns, plus bias, rounded to bf16, into y. */
static inline void amx_finish(const float *c, int64_t rows, int cols, const uint16_t *bias, uint16_t *y,
                              int64_t ldy)
{
    for (int64_t r = 0; r < rows; r++)
        for (int n = 0; n < cols; n++) {
            const float v = c[r * AMX_NR + n];
            y[r * ldy + n] = f32_to_bf16(bias ? v + bf16_to_f32(bias[n]) : v);
        }
}

/* Work item it (panels 2it and 2it + 1, or the one N leaves) against rows [0, M), two row blocks of 16
 * at a time, each k block in order for every tile. */
static void amx_item(int64_t it, const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *wp, int64_t K,
                     uint16_t *y, int64_t ldy, const uint16_t *bias, int64_t N)
{
    const int64_t kh = (K + 1) / 2, blocks = (kh + AMX_PAIRS - 1) / AMX_PAIRS, p = 2 * it, n0 = p * AMX_NR;
    const uint16_t *panel0 = wp + p * kh * 2 * AMX_NR, *panel1 = panel0 + kh * 2 * AMX_NR;
    int cols0, cols1;
    const int np = bm_pair_columns(N, n0, &cols0, &cols1);
    uint16_t a0s[AMX_ROWS * 2 * AMX_PAIRS], a1s[AMX_ROWS * 2 * AMX_PAIRS];
    uint16_t b0s[AMX_PAIRS * 2 * AMX_NR], b1s[AMX_PAIRS * 2 * AMX_NR];
    float c[AMX_ROWS * AMX_NR];
    amx_begin();
    for (int64_t m0 = 0; m0 < M; m0 += 2 * AMX_ROWS) {
        const int64_t rows0 = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
        const int64_t rows1 = M - m0 - AMX_ROWS < AMX_ROWS ? M - m0 - AMX_ROWS : AMX_ROWS; /* <= 0: none */
        const uint16_t *x0 = x + m0 * ldx, *x1 = x0 + AMX_ROWS * ldx;
        TILE_ZERO(C00);
        TILE_ZERO(C01);
        TILE_ZERO(C10);
        TILE_ZERO(C11);
        for (int64_t kb = 0; kb < blocks; kb++) {
            int64_t sa0, sa1;
            const uint16_t *a0 = a_operand(x0, ldx, rows0, K, kb, a0s, &sa0);
            TILE_LOAD(A0, a0, sa0);
            TILE_LOAD(B0, b_operand(panel0, kh, kb, b0s), 2 * AMX_NR * (int64_t)sizeof(uint16_t));
            TILE_DP(C00, A0, B0);
            if (np == 2) {
                TILE_LOAD(B1, b_operand(panel1, kh, kb, b1s), 2 * AMX_NR * (int64_t)sizeof(uint16_t));
                TILE_DP(C01, A0, B1);
            }
            if (rows1 > 0) {
                const uint16_t *a1 = a_operand(x1, ldx, rows1, K, kb, a1s, &sa1);
                TILE_LOAD(A1, a1, sa1);
                TILE_DP(C10, A1, B0);
                if (np == 2) TILE_DP(C11, A1, B1);
            }
        }
        const uint16_t *bias0 = bias ? bias + n0 : NULL, *bias1 = bias ? bias + n0 + AMX_NR : NULL;
        uint16_t *y0 = y + m0 * ldy + n0;
        TILE_STORE(C00, c, AMX_NR * (int64_t)sizeof(float));
        amx_finish(c, rows0, cols0, bias0, y0, ldy);
        if (np == 2) {
            TILE_STORE(C01, c, AMX_NR * (int64_t)sizeof(float));
            amx_finish(c, rows0, cols1, bias1, y0 + AMX_NR, ldy);
        }
        if (rows1 > 0) {
            TILE_STORE(C10, c, AMX_NR * (int64_t)sizeof(float));
            amx_finish(c, rows1, cols0, bias0, y0 + AMX_ROWS * ldy, ldy);
            if (np == 2) {
                TILE_STORE(C11, c, AMX_NR * (int64_t)sizeof(float));
                amx_finish(c, rows1, cols1, bias1, y0 + AMX_ROWS * ldy + AMX_NR, ldy);
            }
        }
    }
    amx_end();
}

#endif
