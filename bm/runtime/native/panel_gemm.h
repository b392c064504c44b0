/* What bm's panel GEMMs over a packed weight (bf16_gemm.c, int8_gemm.c) share: how a call's rows are cut
 * into blocks, and the dispatch of a tile of h rows to the tile function built for exactly h rows.
 *
 * Both keep each output one chain over k whatever the blocking (batch invariance), so these decide speed
 * only: a block's x rows stay in L2 while a thread's panels pass over them, and a tile's height is a
 * compile-time constant, so its accumulators live in registers. */
#ifndef BM_PANEL_GEMM_H
#define BM_PANEL_GEMM_H

#include <stdint.h>

/* Rows per block for M rows of K elements of `elem` bytes: about `block_bytes` of x, a multiple of the
 * tile height `mr`; all M rows where M <= `one_block_rows` (a decode batch: each weight is then read from
 * memory once per call); then evened out, so the blocks differ by at most one row. */
static inline int64_t bm_rows_per_block(int64_t M, int64_t K, int64_t elem, int64_t mr, int64_t block_bytes,
                                        int64_t one_block_rows)
{
    int64_t mb = block_bytes / ((K > 0 ? K : 1) * elem) / mr * mr;
    if (mb < mr) mb = mr;
    if (M <= one_block_rows) mb = M;
    const int64_t blocks = (M + mb - 1) / mb;
    return (M + blocks - 1) / blocks;
}

/* The panel pair of a work item starting at output column n0 of N: how many panels it has (1 or 2) and
 * how many of each panel's 16 columns are stored (*cols0, *cols1; 0 for an absent second panel). */
static inline int bm_pair_columns(int64_t N, int64_t n0, int *cols0, int *cols1)
{
    const int64_t left = N - n0;
    const int np = left > 16 ? 2 : 1;
    *cols0 = left >= 16 ? 16 : (int)left;
    *cols1 = np == 2 ? (left - 16 >= 16 ? 16 : (int)(left - 16)) : 0;
    return np;
}

/* The height of tile t of `tiles` covering rows [row, M): as equal as possible (a short tile has too
 * few independent accumulators to hide the FMA latency, so it costs nearly as long as a full one). */
static inline int64_t bm_tile_height(int64_t M, int64_t row, int64_t tiles, int64_t t)
{
    return (M - row) / (tiles - t) + ((M - row) % (tiles - t) != 0);
}

/* The cases of a height of 1 to 6, each a call of tile with a constant height (BM_TILE_BY_ROWS*). */
#define BM_TILE_CASES_6(tile, np, ...)                                                                \
    case 6: tile(6, np, __VA_ARGS__); break;                                                          \
    case 5: tile(5, np, __VA_ARGS__); break;                                                          \
    case 4: tile(4, np, __VA_ARGS__); break;                                                          \
    case 3: tile(3, np, __VA_ARGS__); break;                                                          \
    case 2: tile(2, np, __VA_ARGS__); break;                                                          \
    default: tile(1, np, __VA_ARGS__); break;

/* tile(h, np, ...) for a run-time h of 1 to 12, each case a call with a constant height. */
#define BM_TILE_BY_ROWS(tile, np, h, ...)                                                             \
    switch (h) {                                                                                      \
    case 12: tile(12, np, __VA_ARGS__); break;                                                        \
    case 11: tile(11, np, __VA_ARGS__); break;                                                        \
    case 10: tile(10, np, __VA_ARGS__); break;                                                        \
    case 9: tile(9, np, __VA_ARGS__); break;                                                          \
    case 8: tile(8, np, __VA_ARGS__); break;                                                          \
    case 7: tile(7, np, __VA_ARGS__); break;                                                          \
    BM_TILE_CASES_6(tile, np, __VA_ARGS__)                                                            \
    }

/* tile(h, np, ...) for a run-time h of 1 to 6 (the AVX2 tiles' heights). */
#define BM_TILE_BY_ROWS6(tile, np, h, ...)                                                            \
    switch (h) {                                                                                      \
    BM_TILE_CASES_6(tile, np, __VA_ARGS__)                                                            \
    }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The first `cols` of up to 16 per-column values (a scale, a bias) copied into dst, zero past them, so
 * that a panel's last, partial tile reads no further than its columns. */
static inline void bm_pad16(const float *src, int cols, float *dst)
{
    for (int j = 0; j < 16; j++) dst[j] = j < cols ? src[j] : 0.0f;
}

/* The end of one row of an AVX2 tile over a 16-column panel: its two 8-column accumulators, times scale16
 * (when given), plus bias16 (when given), each applied apart, stored to the row's first `cols` columns.
 * The accumulators come by value: an address of them would keep them in memory through the tile. */
static inline __attribute__((always_inline)) void bm_store_row16(
    float *row, __m256 v0, __m256 v1, const float *scale16, const float *bias16, int cols)
{
    if (scale16) {
        v0 = _mm256_mul_ps(v0, _mm256_loadu_ps(scale16));
        v1 = _mm256_mul_ps(v1, _mm256_loadu_ps(scale16 + 8));
    }
    if (bias16) {
        v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias16));
        v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias16 + 8));
    }
    /* lanes past `cols` are masked off (AVX2's masked store neither writes nor faults there) */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(row, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane), v0);
    _mm256_maskstore_ps(row + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane), v1);
}
#endif

#ifdef BM_OPENMP
#define BM_PANEL_TEAM(team) _Pragma("omp parallel num_threads(team) if (team > 1)")
#else
#define BM_PANEL_TEAM(team)
#endif

/* The one driver of bm's panel GEMMs: the work items are pairs of 16-column panels, each thread owns a
 * contiguous run of them for every row (no barrier between row blocks, never a split of k), and rows
 * come in blocks of bm_rows_per_block. ITEM is one call, run with `m0` (the block's first row), `rows`
 * (its height) and `it` (the panel pair) in scope. */
#define BM_PANEL_GEMM_DRIVE(M, N, K, elem, mr, block_bytes, one_block_rows, num_threads, ITEM)         \
    do {                                                                                              \
        const int64_t items_ = ((N) + 31) / 32;                                                       \
        if ((M) <= 0 || items_ <= 0) break;                                                           \
        const int64_t mb_ = bm_rows_per_block(M, K, elem, mr, block_bytes, one_block_rows);           \
        const int64_t team = bm_team_size(num_threads, items_);                                       \
        BM_PANEL_TEAM(team)                                                                           \
        {                                                                                             \
            int64_t lo_, hi_;                                                                         \
            bm_thread_share(items_, &lo_, &hi_);                                                      \
            for (int64_t m0 = 0; m0 < (M); m0 += mb_) {                                               \
                const int64_t rows = (M) - m0 < mb_ ? (M) - m0 : mb_;                                 \
                for (int64_t it = lo_; it < hi_; it++) ITEM;                                          \
            }                                                                                         \
        }                                                                                             \
        (void)team;                                                                                   \
    } while (0)

#endif
