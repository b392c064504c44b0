/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the few rows of a decode iteration, in float32.
 *
 * The weight is packed once (by the caller, in torch) into panels of 16 output columns, k-major:
 * wp[(n / 16) * K * 16 + k * 16 + (n % 16)]. Each panel is read straight through while up to six rows
 * of x are multiplied into 6 x 16 accumulators held in AVX2 registers, so a panel is read from memory
 * once per six rows and the arithmetic runs at the FMA units' rate; with one to a few rows the loop is
 * bound by reading the weight, which is the least any decode step must do.
 *
 * Every output element is one sequential sum over k in the same order whatever M is, so a row's result
 * does not depend on the other rows of the batch.
 *
 * Built per instruction set (bm/cpu_isa.py). With AVX-512 a panel row is one register, and a
 * tile covers two adjacent panels (32 columns) of up to twelve rows: 24 accumulators, twice the work per
 * instruction and fewer loads per FMA than the AVX2 tile. Its driver (gemm512) gives each thread a fixed
 * run of panel pairs for all rows (no barrier between row blocks), takes decode batches as one row
 * block (each weight is read from memory once per call), and has each pair's tiles prefetch the next
 * pair's weight into L2, spread evenly over their k steps: without it the first tile of every pair
 * waited on memory, and a 64-row GEMM with a cold weight ran at about two thirds of the FMA peak.
 * Every element is still the same sequential FMA chain over k, so the AVX-512 and AVX2 builds give
 * bit-identical results. Without AVX2 and FMA the same
 * tiles run in plain C (slower than oneDNN, but batch invariant, which oneDNN's GEMM is not).
 */
#include <stdint.h>
#include <stddef.h>

/* bm builds with -fassociative-math; the plain C path's sums must keep their order (batch invariance). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-associative-math")
#elif defined(__clang__)
#pragma clang fp reassociate(off)
#endif

#include "isa.h" /* BM_HAVE_AVX2, BM_HAVE_AVX512; bm_silu_mul16 */

#define NR 16
#define MR 6

int bm_small_gemm_available(void) { return 1; }
int bm_small_gemm_avx512(void) { return BM_HAVE_AVX512; }

#if BM_HAVE_AVX2

static inline __attribute__((always_inline)) void tile(
    const int mr, const float *x, int64_t ldx, const float *panel, int64_t K, float *y, int64_t ldy,
    const float *bias)
{
    __m256 acc[MR][2];
    for (int i = 0; i < MR; i++) {
        acc[i][0] = _mm256_setzero_ps();
        acc[i][1] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = _mm256_loadu_ps(panel + k * NR);
        const __m256 b1 = _mm256_loadu_ps(panel + k * NR + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
    if (bias) {
        c0 = _mm256_loadu_ps(bias);
        c1 = _mm256_loadu_ps(bias + 8);
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(y + i * ldy, bias ? _mm256_add_ps(acc[i][0], c0) : acc[i][0]);
        _mm256_storeu_ps(y + i * ldy + 8, bias ? _mm256_add_ps(acc[i][1], c1) : acc[i][1]);
    }
}

/* One full panel against rows [0, M): tiles of six rows, then the remainder with its own unrolling. */
static __attribute__((unused)) void panel_rows(const float *x, int64_t ldx, int64_t M, const float *panel, int64_t K, float *y,
                       int64_t ldy, const float *bias)
{
    /* As few tiles as six-row tiles need, their heights as equal as possible (16 rows: 6 + 5 + 5, not
       6 + 6 + 4): a short tile has too few independent accumulators to hide the FMA latency, so it costs
       nearly as long as a full one. */
    const int64_t tiles = (M + MR - 1) / MR;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t h = (M - m) / (tiles - t) + ((M - m) % (tiles - t) != 0);
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        switch (h) {
        case 6: tile(6, xm, ldx, panel, K, ym, ldy, bias); break;
        case 5: tile(5, xm, ldx, panel, K, ym, ldy, bias); break;
        case 4: tile(4, xm, ldx, panel, K, ym, ldy, bias); break;
        case 3: tile(3, xm, ldx, panel, K, ym, ldy, bias); break;
        case 2: tile(2, xm, ldx, panel, K, ym, ldy, bias); break;
        default: tile(1, xm, ldx, panel, K, ym, ldy, bias); break;
        }
        m += h;
    }
}

#if BM_HAVE_AVX512
#define MR512 12
/* Tuned with benchmarks/small_gemm.py on a 2-core Xeon (2 MiB L2 per core), SmolLM2-135M's prefill
 * shapes, the output not in cache as in a forward: a 256 KiB row block (was 1 MiB) and streamed outputs
 * were 1.05-1.15x at 2,048 rows together, bitwise the same. */
#ifndef BM_GEMM_XBLOCK_BYTES
#define BM_GEMM_XBLOCK_BYTES (256 * 1024)
#endif
#ifndef BM_GEMM_ONE_BLOCK_ROWS /* up to this many rows (a decode batch) are one block */
#define BM_GEMM_ONE_BLOCK_ROWS 128
#endif
#ifndef BM_GEMM_STREAM_BYTES /* outputs larger than this are written with non-temporal stores */
#define BM_GEMM_STREAM_BYTES (4 << 20)
#endif

/* What a call adds to the plain product (bm_small_gemm_f32_ex): an addend matrix (a residual) added to
 * the result, or a second weight (up) whose product multiplies SiLU of the first's (gate). */
typedef struct {
    const float *wp2; /* non-NULL: y = silu(x @ W^T) * (x @ W2^T), one output panel per work item */
    const float *add; /* non-NULL: y = (x @ W^T + bias) + add, row stride ldadd */
    int64_t ldadd;
} extra_t;

/* np (1 or 2) panels (panel, panel1) against mr <= 12 rows: acc[i][j] holds row i's 16 columns of panel
 * j. With silu set, the two are gate and up, and the tile writes silu(acc0) * acc1 as one panel of
 * output; otherwise each panel's columns, plus bias, plus the addend rows at add (when given), in
 * that order: torch's residual + linear(x). With stream set, the results go out with non-temporal
 * stores (see gemm512). While it runs, the tile
 * asks for the next pf_lines 64-byte lines at pf (two per k step at most) to be brought into L2: the
 * weight the next work item reads, so that its first tile does not wait on memory. */
static inline __attribute__((always_inline)) void tile512(
    const int mr, const int np, const int prefetch, const int stream, const int silu, const float *x,
    int64_t ldx, const float *panel, const float *panel1, int64_t K, float *y, int64_t ldy,
    const float *bias, const float *add, int64_t ldadd, const char *pf, const char *pf2, int64_t pf_lines)
{
    __m512 acc[MR512][2];
    for (int i = 0; i < MR512; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    /* pf_lines spread evenly over the K steps (Bresenham): a burst would fill the line-fill buffers
       and stall the loads of this tile. */
    int64_t credit = 0;
    for (int64_t k = 0; k < K; k++) {
        credit += pf_lines;
        if (prefetch && credit >= K) {
            _mm_prefetch(pf, _MM_HINT_T1);
            if (silu) _mm_prefetch(pf2, _MM_HINT_T1);
            pf += 64;
            pf2 += 64;
            credit -= K;
            if (credit >= K) {
                _mm_prefetch(pf, _MM_HINT_T1);
                if (silu) _mm_prefetch(pf2, _MM_HINT_T1);
                pf += 64;
                pf2 += 64;
                credit -= K;
            }
        }
        const __m512 b0 = _mm512_loadu_ps(panel + k * NR);
        const __m512 b1 = np == 2 ? _mm512_loadu_ps(panel1 + k * NR) : b0;
        for (int i = 0; i < mr; i++) {
            const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
            acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
            if (np == 2) acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    if (silu) {
        for (int i = 0; i < mr; i++) {
            const __m512 v = bm_silu_mul16(acc[i][0], acc[i][1]);
            if (stream)
                _mm512_stream_ps(y + i * ldy, v);
            else
                _mm512_storeu_ps(y + i * ldy, v);
        }
        return;
    }
    for (int j = 0; j < np; j++) {
        const __m512 c = bias ? _mm512_loadu_ps(bias + j * NR) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            __m512 v = bias ? _mm512_add_ps(acc[i][j], c) : acc[i][j];
            if (add) v = _mm512_add_ps(_mm512_loadu_ps(add + i * ldadd + j * NR), v);
            if (stream)
                _mm512_stream_ps(y + i * ldy + j * NR, v);
            else
                _mm512_storeu_ps(y + i * ldy + j * NR, v);
        }
    }
}

/* The tile for h rows, with its flags as constants (stream and silu come from the caller's scope). */
#define BY_ROWS512(np, pf, h, ...)                                                                    \
    if (silu) {                                                                                       \
        if (stream) {                                                                                 \
            BY_ROWS512_(np, pf, 1, 1, h, __VA_ARGS__)                                                 \
        } else {                                                                                      \
            BY_ROWS512_(np, pf, 0, 1, h, __VA_ARGS__)                                                 \
        }                                                                                             \
    } else if (stream) {                                                                              \
        BY_ROWS512_(np, pf, 1, 0, h, __VA_ARGS__)                                                     \
    } else {                                                                                          \
        BY_ROWS512_(np, pf, 0, 0, h, __VA_ARGS__)                                                     \
    }
#define BY_ROWS512_(np, pf, st, si, h, ...)                                                               \
    switch (h) {                                                                                      \
    case 12: tile512(12, np, pf, st, si, __VA_ARGS__); break;                                         \
    case 11: tile512(11, np, pf, st, si, __VA_ARGS__); break;                                         \
    case 10: tile512(10, np, pf, st, si, __VA_ARGS__); break;                                         \
    case 9: tile512(9, np, pf, st, si, __VA_ARGS__); break;                                           \
    case 8: tile512(8, np, pf, st, si, __VA_ARGS__); break;                                           \
    case 7: tile512(7, np, pf, st, si, __VA_ARGS__); break;                                           \
    case 6: tile512(6, np, pf, st, si, __VA_ARGS__); break;                                           \
    case 5: tile512(5, np, pf, st, si, __VA_ARGS__); break;                                           \
    case 4: tile512(4, np, pf, st, si, __VA_ARGS__); break;                                           \
    case 3: tile512(3, np, pf, st, si, __VA_ARGS__); break;                                           \
    case 2: tile512(2, np, pf, st, si, __VA_ARGS__); break;                                           \
    default: tile512(1, np, pf, st, si, __VA_ARGS__); break;                                          \
    }

/* np full panels against rows [0, M), in tiles of at most twelve rows with heights as equal as possible;
 * the tiles share out the prefetch of the pf_bytes at pf (the next work item's weight) between them. */
static void panels_rows512(const int np, const int stream, const int silu, const float *x, int64_t ldx,
                           int64_t M, const float *panel, const float *panel1, int64_t K, float *y,
                           int64_t ldy, const float *bias, const float *add, int64_t ldadd, const char *pf,
                           const char *pf2, int64_t pf_bytes)
{
    const int64_t tiles = (M + MR512 - 1) / MR512;
    const int64_t lines = (pf_bytes + 63) / 64, per_tile = (lines + tiles - 1) / tiles;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t h = (M - m) / (tiles - t) + ((M - m) % (tiles - t) != 0);
        const int64_t first = t * per_tile < lines ? t * per_tile : lines;
        const int64_t n_pf = lines - first < per_tile ? lines - first : per_tile;
        const char *pft = pf ? pf + first * 64 : NULL, *pft2 = pf2 ? pf2 + first * 64 : NULL;
        const float *am = add ? add + m * ldadd : NULL;
        const int64_t npf = pf ? n_pf : 0;
        if (np == 2 && pft)
            BY_ROWS512(2, 1, h, x + m * ldx, ldx, panel, panel1, K, y + m * ldy, ldy, bias, am, ldadd, pft, pft2, npf)
        else if (np == 2)
            BY_ROWS512(2, 0, h, x + m * ldx, ldx, panel, panel1, K, y + m * ldy, ldy, bias, am, ldadd, NULL, NULL, 0)
        else if (pft)
            BY_ROWS512(1, 1, h, x + m * ldx, ldx, panel, panel1, K, y + m * ldy, ldy, bias, am, ldadd, pft, pft2, npf)
        else
            BY_ROWS512(1, 0, h, x + m * ldx, ldx, panel, panel1, K, y + m * ldy, ldy, bias, am, ldadd, NULL, NULL, 0)
        m += h;
    }
}
#endif

#else
/* Plain C (the scalar build): the same tiles and the same per-element order, each output one sequential
   sum over k (multiply, then add: no FMA in the x86-64 baseline), so this build's rows are batch
   invariant too; its sums keep their written order (see the pragma above). */
static void tile(const int mr, const float *x, int64_t ldx, const float *panel, int64_t K, float *y,
                 int64_t ldy, const float *bias)
{
    float acc[MR][NR] = {{0}};
    for (int64_t k = 0; k < K; k++)
        for (int i = 0; i < mr; i++) {
            const float a = x[i * ldx + k];
            for (int j = 0; j < NR; j++) acc[i][j] += a * panel[k * NR + j];
        }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) y[i * ldy + j] = bias ? acc[i][j] + bias[j] : acc[i][j];
}

static void panel_rows(const float *x, int64_t ldx, int64_t M, const float *panel, int64_t K, float *y,
                       int64_t ldy, const float *bias)
{
    for (int64_t m = 0; m < M; m += MR)
        tile(M - m < MR ? (int)(M - m) : MR, x + m * ldx, ldx, panel, K, y + m * ldy, ldy, bias);
}
#endif

/* The last panel of an N that is not a multiple of 16 (zero-padded in wp): one row at a time through a
 * buffer, writing only its ncols valid columns. Same summation order as the full panels. */
static void tail_panel_rows(const float *x, int64_t ldx, int64_t M, const float *panel, int64_t K,
                            float *y, int64_t ldy, const float *bias, const float *add, int64_t ldadd,
                            int ncols)
{
    float buf[NR];
    for (int64_t m = 0; m < M; m++) {
        tile(1, x + m * ldx, ldx, panel, K, buf, NR, NULL);
        for (int j = 0; j < ncols; j++) {
            const float v = bias ? buf[j] + bias[j] : buf[j];
            y[m * ldy + j] = add ? add[m * ldadd + j] + v : v;
        }
    }
}

#if BM_HAVE_AVX512

/* Work item it: panels 2it and 2it+1 (or what N leaves from 2it) against rows [0, M), prefetching pf;
 * with e->wp2 (SiLU-gated), output panel it from gate panel it and up panel it, prefetching pf and pf2. */
static void item512(int64_t it, const int stream, const float *x, int64_t ldx, int64_t M,
                    const float *wp, int64_t K, float *y, int64_t ldy, const float *bias, int64_t N,
                    const extra_t *e, const char *pf, const char *pf2, int64_t pf_bytes)
{
    if (e->wp2) {
        panels_rows512(2, stream, 1, x, ldx, M, wp + it * K * NR, e->wp2 + it * K * NR, K, y + it * NR,
                       ldy, NULL, NULL, 0, pf, pf2, pf_bytes);
        return;
    }
    const int64_t p = it * 2;
    const float *b = bias ? bias + p * NR : NULL, *add = e->add ? e->add + p * NR : NULL;
    const float *panel = wp + p * K * NR;
    if ((p + 2) * NR <= N) { /* two full panels */
        panels_rows512(2, stream, 0, x, ldx, M, panel, panel + K * NR, K, y + p * NR, ldy, b, add,
                       e->ldadd, pf, NULL, pf_bytes);
        return;
    }
    if ((p + 1) * NR <= N) { /* one full panel, maybe a tail panel after it */
        panels_rows512(1, stream, 0, x, ldx, M, panel, panel, K, y + p * NR, ldy, b, add, e->ldadd, pf,
                       NULL, pf_bytes);
        if (N > (p + 1) * NR)
            tail_panel_rows(x, ldx, M, panel + K * NR, K, y + (p + 1) * NR, ldy, b ? b + NR : NULL,
                            add ? add + NR : NULL, e->ldadd, (int)(N - (p + 1) * NR));
        return;
    }
    tail_panel_rows(x, ldx, M, panel, K, y + p * NR, ldy, b, add, e->ldadd, (int)(N - p * NR));
}

/* Each thread owns a contiguous run of panel pairs for every row, so the threads never wait on each
 * other. Rows go in blocks of at most BM_GEMM_XBLOCK_BYTES of x (they stay in L2 while the thread's
 * pairs pass over them; decode batches, up to BM_GEMM_ONE_BLOCK_ROWS rows, are one block, so each
 * weight is read from memory once). In the first row block every item prefetches the weight of the
 * item the thread runs next; later blocks find the weights in cache, and skip the prefetch's few
 * instructions per step. */
static void gemm512(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy,
                    int64_t M, int64_t N, int64_t K, int64_t num_threads, const extra_t *e)
{
    /* a work item is two panels of W, or with wp2 one panel each of W and W2 (the same weight bytes) */
    const int64_t per_item = e->wp2 ? 1 : 2;
    const int64_t panels = (N + NR - 1) / NR, items = (panels + per_item - 1) / per_item;
    if (M <= 0 || items <= 0) return;
    int64_t mb_max = BM_GEMM_XBLOCK_BYTES / ((K > 0 ? K : 1) * (int64_t)sizeof(float)) / MR512 * MR512;
    if (mb_max < MR512) mb_max = MR512;
    if (M <= BM_GEMM_ONE_BLOCK_ROWS) mb_max = M; /* a decode batch: its weight read from memory once */
    const int64_t blocks = (M + mb_max - 1) / mb_max, mb = (M + blocks - 1) / blocks;
    /* An output larger than L2 is written with non-temporal stores: each of its lines would otherwise be
       read from memory only to be overwritten whole (one aligned 64-byte store per line). The values
       are the same; the next op reads them from memory instead of from a cache they did not fit. */
    const int stream = M * N * (int64_t)sizeof(float) > BM_GEMM_STREAM_BYTES && N % NR == 0 &&
                       ldy % NR == 0 && ((uintptr_t)y & 63) == 0;
    const int64_t team = bm_team_size(num_threads, items);
#ifdef BM_OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
    {
        int64_t lo, hi;
        bm_thread_share(items, &lo, &hi);
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
            const int64_t rows = M - m0 < mb ? M - m0 : mb;
            for (int64_t it = lo; it < hi; it++) {
                const int64_t next = it + 1 < hi ? it + 1 : (m0 + mb < M ? lo : -1);
                const int64_t first = per_item * next, left = panels - first;
                const int64_t next_panels = next < 0 ? 0 : (left < per_item ? left : per_item);
                const int go = next >= 0 && m0 == 0;
                const char *pf = go ? (const char *)(wp + first * K * NR) : NULL;
                const char *pf2 = go && e->wp2 ? (const char *)(e->wp2 + first * K * NR) : NULL;
                const float *add = e->add ? e->add + m0 * e->ldadd : NULL;
                const extra_t em = {e->wp2, add, e->ldadd};
                item512(it, stream, x + m0 * ldx, ldx, rows, wp, K, y + m0 * ldy, ldy, bias, N, &em, pf, pf2,
                        next_panels * K * NR * (int64_t)sizeof(float));
            }
        }
        if (stream) _mm_sfence(); /* the streamed lines are visible before the team's barrier */
    }
    (void)team;
}
#endif

/* The epilogues of a layer fused into its GEMMs (AVX-512 builds only; the others return 2 and the caller
 * runs the separate ops):
 * - wp2 given: y = silu(x @ W^T) * (x @ W2^T), a gated MLP's gate and up projections and its activation
 *   in one pass (no bias; N a multiple of 16). Each output is computed from the same two FMA chains and
 *   the same bm_silu_mul16 as the separate GEMMs and elementwise.c's silu_mul: the same bits, without
 *   writing and reading back the two [M, N] products.
 * - add given: y = (x @ W^T + bias) + add, the residual add after a down or output projection, as torch
 *   adds it (add is [M, N] with row stride ldadd).
 * Returns 0, 2 (not in this build) or 3 (the arguments do not fit). */
int bm_small_gemm_f32_ex(const float *x, int64_t ldx, const float *wp, const float *wp2, const float *bias,
                         const float *add, int64_t ldadd, float *y, int64_t ldy, int64_t M, int64_t N,
                         int64_t K, int64_t num_threads)
{
#if BM_HAVE_AVX512
    if ((wp2 && (bias || add || N % NR)) || (add && ldadd < N)) return 3;
    const extra_t e = {wp2, add, ldadd};
    gemm512(x, ldx, wp, bias, y, ldy, M, N, K, num_threads, &e);
    return 0;
#else
    (void)x, (void)ldx, (void)wp, (void)wp2, (void)bias, (void)add, (void)ldadd, (void)y, (void)ldy;
    (void)M, (void)N, (void)K, (void)num_threads;
    return 2;
#endif
}

/* wp holds ceil(N / 16) panels (the last zero-padded). Returns 0. */
int bm_small_gemm_f32(const float *x, int64_t ldx, const float *wp, const float *bias, float *y,
                      int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t num_threads)
{
#if BM_HAVE_AVX512
    const extra_t e = {NULL, NULL, 0};
    gemm512(x, ldx, wp, bias, y, ldy, M, N, K, num_threads, &e);
    return 0;
#else
    const int64_t panels = (N + NR - 1) / NR;
    /* Rows in blocks that stay in L2 (MB x K floats) while every panel passes over them. */
    const int64_t MB = 96;
    const int64_t items = panels; /* one panel per work item */
#ifdef BM_OPENMP
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1)
#endif
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = M - m0 < MB ? M - m0 : MB;
#ifdef BM_OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t it = 0; it < items; it++) {
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy;
            const int64_t p = it, left = N - p * NR;
            const float *b = bias ? bias + p * NR : NULL;
            if (left >= NR)
                panel_rows(xm, ldx, rows, wp + p * K * NR, K, ym + p * NR, ldy, b);
            else
                tail_panel_rows(xm, ldx, rows, wp + p * K * NR, K, ym + p * NR, ldy, b, NULL, 0, (int)left);
        }
    }
    (void)num_threads;
    return 0;
#endif
}
