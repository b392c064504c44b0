/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) in bfloat16, batch invariant: bm's bf16 CPU linears when
 * model.cpu_bf16_gemm is invariant (bm/runtime/prepack.py).
 *
 * oneDNN's bf16 GEMM picks its blocking (and so each output's order of summation) by M, so a row's bits
 * depend on how many rows share the call (tests/test_batch_invariance.py measures it). Here every
 * output element is one float32 chain over k in a fixed order, whatever M is and whichever tile or tail
 * computes it:
 *   acc = 0; for each k-pair p = 0, 1, ... in order: acc = vdpbf16ps(acc, x[2p..2p+1], w[2p..2p+1]);
 *   (odd K: the last pair is (x[K-1], 0) against (w[K-1], 0));
 *   then acc + bias (float32, where given), rounded to bf16 to nearest, ties to even (bf16.h), as
 *   `.to(torch.bfloat16)` rounds. No split-K: threads own whole column panels.
 * A row of a 12-row tile, of a shorter tile, and a row alone run the same instructions on the same
 * values, so they give the same bits.
 *
 * The weight is packed once (Bf16GemmKernel.pack, in torch) into panels of 16 output columns with
 * k-pairs interleaved, the layout vdpbf16ps reads: wp[(n / 16) * Kh * 32 + (k / 2) * 32 + (n % 16) * 2
 * + k % 2] with Kh = ceil(K / 2), zero-padded past N and K. A tile covers two adjacent panels (32
 * columns) of up to twelve rows: 24 float32 accumulators, each k-pair one 64-byte load per panel and
 * one broadcast per row. The columns past N in the last panel are computed (the padding is zero) and
 * not stored.
 *
 * Built for AVX-512 with AVX512_BF16 (bm.cpu_isa's avx512_bf16 variant, -mavx512bf16), and for AMX
 * (amx_bf16: the same packed weight read as AMX tiles, below); any other build has no code and
 * bm_bf16_gemm_available returns 0.
 *
 * The AMX build. The packed panel is already an AMX B operand: a k-pair's 16 columns × 2 values are one
 * 64-byte tile row, so 16 pairs (32 k) are one B tile. Each output tile (16 rows × 16 columns) is
 *   C = 0; for each block b = 0, 1, ... of 32 k in order: C = tdpbf16ps(C, x[rows, 32b .. 32b + 31],
 *   panel[pairs 16b .. 16b + 15]); then C + bias, rounded to bf16 as above.
 * The k blocks run in order and never split; the tile instruction's own order within a block is the
 * hardware's and does not depend on the other rows of the tile, so each row's bits are those it gets
 * alone (a row block past M, or a k block past K, is copied into a zero-padded scratch tile: its zero
 * products change no sum). Its values are not vdpbf16ps's bit for bit (another order), so a model is
 * batch invariant on either build, each against itself.
 *
 * BM_AMX_EMULATE builds the same AMX path with each tile instruction done in C, as Intel's pseudocode
 * defines it (bf16 products exact in float32, summed pair by pair in k order, inputs and results past
 * float32's normal range flushed to zero): the amx_emulated variant, which tests run on CPUs without AMX.
 * It checks the blocking, the padding and the epilogue, not the hardware's rounding.
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

/* bm builds with -fassociative-math; each output's chain must keep its order (batch invariance). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-associative-math")
#elif defined(__clang__)
#pragma clang fp reassociate(off)
#endif

#include "isa.h"
#include "panel_gemm.h"
#include "bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BM_AMX 1 /* the tile instructions */
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(BM_AMX_EMULATE)
#define BM_AMX 2 /* the same path, each tile instruction in C */
#else
#define BM_AMX 0
#endif

#if !BM_AMX && BM_HAVE_AVX512 && defined(__AVX512BF16__)
#define BM_HAVE_DPBF16 1
#else
#define BM_HAVE_DPBF16 0
#endif

/* 1 where this build runs here. Linux gives a process AMX's tile state only once asked
 * (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); where it refuses (no AMX, an old kernel) the build
 * reports itself unavailable and bm keeps oneDNN, instead of faulting at the first tile instruction. */
int bm_bf16_gemm_available(void)
{
#if BM_AMX == 1
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#elif BM_AMX == 2
    return 1;
#else
    return BM_HAVE_DPBF16;
#endif
}

/* x rows per block: they stay in L2 while the thread's panels pass over them (decode batches, up to
 * ONE_BLOCK_ROWS rows, are one block, so each weight is read from memory once per call). */
#ifndef BM_BF16_GEMM_XBLOCK_BYTES
#define BM_BF16_GEMM_XBLOCK_BYTES (256 * 1024)
#endif
#ifndef BM_BF16_GEMM_ONE_BLOCK_ROWS
#define BM_BF16_GEMM_ONE_BLOCK_ROWS 128
#endif

#if BM_AMX
#include "bf16_amx.h"
#elif BM_HAVE_DPBF16

#define NR 16
#define MR 12

/* Row i's k-pair p as one 32-bit lane pattern (x[2p] low, x[2p + 1] high), broadcast to every lane. */
static inline __m512bh pair_of(const uint16_t *row, int64_t p)
{
    uint32_t v;
    memcpy(&v, row + 2 * p, sizeof v);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

/* np (1 or 2) panels against mr <= 12 rows; cols0 and cols1 (0-16) columns of each panel are stored. */
static inline __attribute__((always_inline)) void tile(
    const int mr, const int np, const uint16_t *x, int64_t ldx, const uint16_t *panel,
    const uint16_t *panel1, int64_t K, uint16_t *y, int64_t ldy, const uint16_t *bias, int cols0,
    int cols1)
{
    __m512 acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const int64_t pairs = K / 2;
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * NR);
        const __m512bh b1 = np == 2 ? (__m512bh)_mm512_loadu_si512(panel1 + p * 2 * NR) : b0;
        for (int i = 0; i < mr; i++) {
            const __m512bh a = pair_of(x + i * ldx, p);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
            if (np == 2) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
        }
    }
    if (K & 1) { /* the last, half-filled pair: (x[K-1], 0), read without touching x[K] */
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + pairs * 2 * NR);
        const __m512bh b1 = np == 2 ? (__m512bh)_mm512_loadu_si512(panel1 + pairs * 2 * NR) : b0;
        for (int i = 0; i < mr; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[i * ldx + K - 1]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
            if (np == 2) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
        }
    }
    for (int j = 0; j < np; j++) {
        const int cols = j ? cols1 : cols0;
        const __mmask16 keep = (__mmask16)((1u << cols) - 1u);
        __m512 c = _mm512_setzero_ps();
        if (bias) /* widened exactly; a masked load reads nothing past N */
            c = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + j * NR)), 16));
        for (int i = 0; i < mr; i++) {
            const __m512 v = bias ? _mm512_add_ps(acc[i][j], c) : acc[i][j];
            const __m256i bits = _mm512_cvtepi32_epi16(bf16x16_bits(v));
            if (cols == NR)
                _mm256_storeu_si256((__m256i *)(y + i * ldy + j * NR), bits);
            else
                _mm256_mask_storeu_epi16(y + i * ldy + j * NR, keep, bits);
        }
    }
}

#define BY_ROWS(np, h, ...) BM_TILE_BY_ROWS(tile, np, h, __VA_ARGS__)

/* Work item it (panels 2it and 2it + 1, or the one N leaves) against rows [0, M), in tiles of at most
 * twelve rows with heights as equal as possible (a short tile has too few independent accumulators to
 * hide the dot product's latency). */
static void item(int64_t it, const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *wp, int64_t K,
                 uint16_t *y, int64_t ldy, const uint16_t *bias, int64_t N)
{
    const int64_t kh = (K + 1) / 2, p = 2 * it, n0 = p * NR;
    const uint16_t *panel = wp + p * kh * 2 * NR, *panel1 = panel + kh * 2 * NR;
    int cols0, cols1;
    const int np = bm_pair_columns(N, n0, &cols0, &cols1);
    const uint16_t *b = bias ? bias + n0 : NULL;
    const int64_t tiles = (M + MR - 1) / MR;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t h = bm_tile_height(M, m, tiles, t);
        const uint16_t *xm = x + m * ldx;
        uint16_t *ym = y + m * ldy + n0;
        if (np == 2) {
            BY_ROWS(2, h, xm, ldx, panel, panel1, K, ym, ldy, b, cols0, cols1)
        } else {
            BY_ROWS(1, h, xm, ldx, panel, panel, K, ym, ldy, b, cols0, 0)
        }
        m += h;
    }
}

#endif

/* x [M, K] bf16 with row stride ldx; wp packed as above (ceil(N / 16) panels); bias [N] bf16 or NULL;
 * y [M, N] bf16 with row stride ldy. Each thread owns a contiguous run of panel pairs for every row (no
 * barrier between row blocks, never a split of k). Returns 0, or 2 where this build has no code. */
int bm_bf16_gemm(const uint16_t *x, int64_t ldx, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                 int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t num_threads)
{
#if BM_AMX
    BM_PANEL_GEMM_DRIVE(M, N, K, (int64_t)sizeof(uint16_t), 2 * AMX_ROWS, BM_BF16_GEMM_XBLOCK_BYTES,
                        BM_BF16_GEMM_ONE_BLOCK_ROWS, num_threads,
                        amx_item(it, x + m0 * ldx, ldx, rows, wp, K, y + m0 * ldy, ldy, bias, N));
    return 0;
#elif BM_HAVE_DPBF16
    BM_PANEL_GEMM_DRIVE(M, N, K, (int64_t)sizeof(uint16_t), MR, BM_BF16_GEMM_XBLOCK_BYTES, BM_BF16_GEMM_ONE_BLOCK_ROWS,
                        num_threads, item(it, x + m0 * ldx, ldx, rows, wp, K, y + m0 * ldy, ldy, bias, N));
    return 0;
#else
    (void)x, (void)ldx, (void)wp, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K;
    (void)num_threads;
    return 2;
#endif
}
