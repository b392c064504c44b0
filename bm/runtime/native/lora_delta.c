/* y[row] += (x[row] @ A_s^T) @ B_s for every row whose adapter slot s is >= 0: the LoRA delta of one
 * linear layer for a whole packed batch, in one call, in float32 (the BGMV / SGMV idea of Punica and
 * S-LoRA, written for bm's CPU layout).
 *
 * Why a kernel: the delta's arithmetic is tiny (rank 8 against a 384-wide layer is ~2% of the layer),
 * but done with torch it took about 90 small ops per decode forward of the benchmark model, and their
 * dispatch cost more than the whole base forward's arithmetic gain from the packed GEMM. Here each
 * targeted linear costs one call, whatever the mix of adapters in the batch.
 *
 * Layout (one linear, every slot): A [slots, R, K] (each slot's A as peft stores it, rank rows padded
 * to R), B [slots, R, N] (B^T, the adapter's scaling folded in), rank[s] the rows slot s uses (0: the
 * adapter leaves this linear alone). x rows are K floats ldx apart, y rows N floats ldy apart; slot[row]
 * is -1 for rows without an adapter, which are never read or written.
 *
 * Rows are taken in tiles of up to four consecutive rows of one slot (the engine sorts a forward's
 * tokens by slot), so a tile reads its adapter once. Every output is computed in one fixed order per
 * row (x @ A^T: eight-lane partial sums over k, then their sum, then the k tail; then y plus each rank
 * term in turn), so a row's result does not depend on the other rows of the batch or on threads.
 *
 * With AVX2 + FMA (bm/cpu_isa.py's avx2 and avx512 builds) the loops use 8-wide vectors;
 * elsewhere the same loops run in plain C, in the written order.
 */
#include <stdint.h>
#include <stddef.h>

/* bm builds with -fassociative-math, which lets the compiler vectorize a plain-C reduction however it
   likes in each inlined copy of a tile (one per row count), so a row's sum would depend on how many rows
   of its adapter share its tile; measured in the scalar build. Here every sum keeps its written order. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-associative-math")
#elif defined(__clang__)
#pragma clang fp reassociate(off)
#endif

#include "isa.h" /* BM_HAVE_AVX2 (this kernel has no AVX-512 path) */

#define MR 4          /* rows per tile */
#define MAX_RANK 256  /* rank rows a tile keeps in its stack buffer; larger ranks are done in chunks */

int bm_lora_delta_avx2(void) { return BM_HAVE_AVX2; }

/* One linear's stacked adapters; built once per allocation by the caller. */
typedef struct {
    const float *a;      /* [slots, R, K] */
    const float *b;      /* [slots, R, N] */
    const int64_t *rank; /* [slots] */
    int64_t slots, R, K, N;
} bm_lora_weights;

#if BM_HAVE_AVX2
static inline float hsum8(__m256 v)
{
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

/* xa[i * MAX_RANK + j] = x[i] . a[j] for i < mr and jb rank rows j0 .. j0 + jb: jb x mr independent
 * sums, so the FMA units are not waiting on one another. */
static inline __attribute__((always_inline)) void down_rows(const int mr, const int jb, const float *x,
                                                            int64_t ldx, const float *a, int64_t j0,
                                                            int64_t K, float *xa)
{
    const int64_t K8 = K & ~(int64_t)7;
    float s[2][MR];
#if BM_HAVE_AVX2
    __m256 acc[2][MR];
    for (int j = 0; j < jb; j++)
        for (int i = 0; i < mr; i++) acc[j][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
        __m256 xv[MR];
        for (int i = 0; i < mr; i++) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
        for (int j = 0; j < jb; j++) {
            const __m256 av = _mm256_loadu_ps(a + (j0 + j) * K + k);
            for (int i = 0; i < mr; i++) acc[j][i] = _mm256_fmadd_ps(xv[i], av, acc[j][i]);
        }
    }
    for (int j = 0; j < jb; j++)
        for (int i = 0; i < mr; i++) s[j][i] = hsum8(acc[j][i]);
#else
    float acc[2][MR][8];
    for (int j = 0; j < jb; j++)
        for (int i = 0; i < mr; i++)
            for (int l = 0; l < 8; l++) acc[j][i][l] = 0.f;
    for (int64_t k = 0; k < K8; k += 8)
        for (int j = 0; j < jb; j++)
            for (int i = 0; i < mr; i++)
                for (int l = 0; l < 8; l++) acc[j][i][l] += x[i * ldx + k + l] * a[(j0 + j) * K + k + l];
    for (int j = 0; j < jb; j++)
        for (int i = 0; i < mr; i++) {
            /* the same pairing as hsum8 above */
            const float *v = acc[j][i];
            s[j][i] = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
        }
#endif
    for (int j = 0; j < jb; j++) {
        const float *aj = a + (j0 + j) * K;
        for (int i = 0; i < mr; i++) {
            float t = s[j][i];
            for (int64_t k = K8; k < K; k++) t += x[i * ldx + k] * aj[k];
            xa[i * MAX_RANK + j0 + j] = t;
        }
    }
}

/* xa[i * MAX_RANK + j] = x[i] . a[j] for i < mr, j < r (r <= MAX_RANK). */
static inline __attribute__((always_inline)) void down(const int mr, const float *x, int64_t ldx,
                                                       const float *a, int64_t r, int64_t K, float *xa)
{
    int64_t j = 0;
    for (; j + 2 <= r; j += 2) down_rows(mr, 2, x, ldx, a, j, K, xa);
    if (j < r) down_rows(mr, 1, x, ldx, a, j, K, xa);
}

/* y[i] += sum_j xa[i][j] * b[j] for i < mr, j < r, sixteen columns at a time. */
static inline __attribute__((always_inline)) void up(const int mr, const float *xa, const float *b,
                                                     int64_t r, int64_t N, float *y, int64_t ldy)
{
    int64_t n = 0;
#if BM_HAVE_AVX2
    for (; n + 16 <= N; n += 16) {
        __m256 acc[MR][2];
        for (int i = 0; i < mr; i++) {
            acc[i][0] = _mm256_loadu_ps(y + i * ldy + n);
            acc[i][1] = _mm256_loadu_ps(y + i * ldy + n + 8);
        }
        for (int64_t j = 0; j < r; j++) {
            const __m256 b0 = _mm256_loadu_ps(b + j * N + n), b1 = _mm256_loadu_ps(b + j * N + n + 8);
            for (int i = 0; i < mr; i++) {
                const __m256 s = _mm256_broadcast_ss(xa + i * MAX_RANK + j);
                acc[i][0] = _mm256_fmadd_ps(s, b0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(s, b1, acc[i][1]);
            }
        }
        for (int i = 0; i < mr; i++) {
            _mm256_storeu_ps(y + i * ldy + n, acc[i][0]);
            _mm256_storeu_ps(y + i * ldy + n + 8, acc[i][1]);
        }
    }
#endif
    for (; n < N; n++)
        for (int i = 0; i < mr; i++) {
            float acc = y[i * ldy + n];
            for (int64_t j = 0; j < r; j++) acc += xa[i * MAX_RANK + j] * b[j * N + n];
            y[i * ldy + n] = acc;
        }
}

static inline __attribute__((always_inline)) void tile_mr(const int mr, const float *x, int64_t ldx,
                                                          float *y, int64_t ldy, const float *a,
                                                          const float *b, int64_t r, int64_t K, int64_t N)
{
    float xa[MR * MAX_RANK];
    /* Ranks above MAX_RANK in chunks: each chunk's terms are added to y in rank order, as in one pass. */
    for (int64_t j0 = 0; j0 < r; j0 += MAX_RANK) {
        const int64_t rc = r - j0 < MAX_RANK ? r - j0 : MAX_RANK;
        down(mr, x, ldx, a + j0 * K, rc, K, xa);
        up(mr, xa, b + j0 * N, rc, N, y, ldy);
    }
}

static void tile(int mr, const float *x, int64_t ldx, float *y, int64_t ldy, const float *a,
                 const float *b, int64_t r, int64_t K, int64_t N)
{
    switch (mr) {
    case 4: tile_mr(4, x, ldx, y, ldy, a, b, r, K, N); break;
    case 3: tile_mr(3, x, ldx, y, ldy, a, b, r, K, N); break;
    case 2: tile_mr(2, x, ldx, y, ldy, a, b, r, K, N); break;
    default: tile_mr(1, x, ldx, y, ldy, a, b, r, K, N); break;
    }
}

/* The rows [4t, 4t + 4) of the batch: each run of one slot inside them is one tile. */
static void rows_block(int64_t t, const float *x, int64_t ldx, float *y, int64_t ldy, const int64_t *slot,
                       int64_t rows, const bm_lora_weights *w)
{
    const int64_t end = (t + 1) * MR < rows ? (t + 1) * MR : rows;
    for (int64_t m = t * MR; m < end;) {
        const int64_t s = slot[m];
        int64_t m1 = m + 1;
        while (m1 < end && slot[m1] == s) m1++;
        if (s >= 0 && s < w->slots && w->rank[s] > 0)
            tile((int)(m1 - m), x + m * ldx, ldx, y + m * ldy, ldy, w->a + s * w->R * w->K,
                 w->b + s * w->R * w->N, w->rank[s], w->K, w->N);
        m = m1;
    }
}

/* Returns 0; 1 when an argument is inconsistent (nothing is written then). */
int bm_lora_delta_f32(const float *x, int64_t ldx, float *y, int64_t ldy, const int64_t *slot, int64_t rows,
                      const bm_lora_weights *w, int64_t num_threads)
{
    if (rows < 0 || ldx < w->K || ldy < w->N || w->R < 0) return 1;
    for (int64_t s = 0; s < w->slots; s++)
        if (w->rank[s] < 0 || w->rank[s] > w->R) return 1;
    const int64_t blocks = (rows + MR - 1) / MR;
    /* Threads only where the work outweighs waking them: rows x rank x (K + N) multiply-adds. */
    const int64_t work = rows * w->R * (w->K + w->N);
#ifdef BM_OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && blocks > 1 && work >= (1 << 20))
#endif
    for (int64_t t = 0; t < blocks; t++) rows_block(t, x, ldx, y, ldy, slot, rows, w);
    (void)num_threads;
    (void)work;
    return 0;
}
