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

/* tile(h, np, ...) for a run-time h of 1 to 12, each case a call with a constant height. */
#define BM_TILE_BY_ROWS(tile, np, h, ...)                                                             \
    switch (h) {                                                                                      \
    case 12: tile(12, np, __VA_ARGS__); break;                                                        \
    case 11: tile(11, np, __VA_ARGS__); break;                                                        \
    case 10: tile(10, np, __VA_ARGS__); break;                                                        \
    case 9: tile(9, np, __VA_ARGS__); break;                                                          \
    case 8: tile(8, np, __VA_ARGS__); break;                                                          \
    case 7: tile(7, np, __VA_ARGS__); break;                                                          \
    case 6: tile(6, np, __VA_ARGS__); break;                                                          \
    case 5: tile(5, np, __VA_ARGS__); break;                                                          \
    case 4: tile(4, np, __VA_ARGS__); break;                                                          \
    case 3: tile(3, np, __VA_ARGS__); break;                                                          \
    case 2: tile(2, np, __VA_ARGS__); break;                                                          \
    default: tile(1, np, __VA_ARGS__); break;                                                         \
    }

#endif
