/* Paged decode attention for bm's KV layout, fp32 on the CPU.

   Why a C kernel: on the CPU, attending single-token queries to paged keys through torch means first
   gathering every request's blocks into a dense tensor (index_select), then reading that copy again in
   SDPA; for the 15M benchmark model that was about a fifth of all engine time. This kernel reads each
   request's keys and values straight from its blocks, once, by block table, and splits the
   (request, kv head) pairs over threads. It is compiled from this file at first use (bm/runtime/native.py);
   where no C compiler is found, bm keeps the torch path, which gives the same results.

   Layout: k and v are one layer's [kv_heads, num_blocks, block_size, head_dim] halves of the cache; q is
   [tokens, heads, head_dim] with arbitrary token and head strides (unit stride within a head); out is a
   contiguous [tokens, heads, head_dim]. Query head h reads kv head h / (heads / kv_heads).
   Per layer, optionally: Gemma 2's logit soft-capping, ALiBi slopes (bloom, mpt, falcon), gpt-oss's sink
   logits, and a sliding window (a layer of a model whose layers attend different spans).

   Built per instruction set (bm/cpu_isa.py): AVX-512 builds score keys and exponentiate in
   sixteen lanes where the head size allows, AVX2 builds in eight, plain C elsewhere. Each (row, kv head)
   is computed alone, in one order fixed by its own length, whatever else is in the batch.

   Two passes (scores over K, then a pass over V), not one with an online softmax: that would change
   every result's bits, and this kernel's results must stay what they were (the oracle and
   batch-invariance tests rest on them; benchmarks/decode_kernel_ab.py checks a change against the
   previous source bit for bit). Within that, each pass is arranged to read memory at close to its
   speed: see score8_heads, v_tile, row_max and the prefetch of the next block in attend. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h" /* BM_HAVE_AVX2, BM_HAVE_AVX512; bm_exp8, bm_exp16 */

#if BM_HAVE_AVX2

/* Eight dot products q . k[r] (r = 0..7, rows d floats apart), returned as one vector. */
static inline __attribute__((always_inline)) __m256 dot8(const float *q, const float *k, int64_t d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 0 * d + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 1 * d + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * d + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * d + i), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * d + i), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * d + i), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * d + i), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * d + i), a7);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* The AVX-512 paths here also take AVX512DQ's 256-bit extracts. */
#if BM_HAVE_AVX512 && defined(__AVX512DQ__)
#define BM_DECODE_AVX512 1
/* For head sizes that are a multiple of 16: eight keys' sums of sixteen lanes each, folded to eight lanes,
   then the same reduction as dot8. */
static inline __attribute__((always_inline)) __m256 reduce8_512(const __m512 *a) {
    __m256 b[8];
    for (int r = 0; r < 8; r++) b[r] = _mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1));
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(b[4], b[5]), _mm256_hadd_ps(b[6], b[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The scaled scores of eight keys (rows d floats apart from k) for H query heads (q0, qsh apart), to
   out + h * ostride. Each (head, key) sum takes the same FMAs over the head in the same order, then the
   same reduction, as one head at a time did (the AVX-512 dot8 of earlier versions); only each key vector
   is now loaded once for all H heads instead of once per head. */
static inline __attribute__((always_inline)) void score8_heads(const float *q0, int64_t qsh, const float *k,
                                                               int64_t d, const int H, float *out,
                                                               int64_t ostride, float scale) {
    __m512 a[3][8];
    for (int h = 0; h < H; h++)
        for (int r = 0; r < 8; r++) a[h][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        __m512 qv[3];
        for (int h = 0; h < H; h++) qv[h] = _mm512_loadu_ps(q0 + h * qsh + i);
        for (int r = 0; r < 8; r++) {
            const __m512 kv = _mm512_loadu_ps(k + r * d + i);
            for (int h = 0; h < H; h++) a[h][r] = _mm512_fmadd_ps(qv[h], kv, a[h][r]);
        }
    }
    for (int h = 0; h < H; h++)
        _mm256_storeu_ps(out + h * ostride, _mm256_mul_ps(reduce8_512(a[h]), _mm256_set1_ps(scale)));
}

/* score8_heads for every query head of a kv head, three at a time. */
static void score8_all(const float *q0, int64_t qsh, const float *k, int64_t d, int64_t g, float *out,
                       int64_t ostride, float scale) {
    int64_t h = 0;
    for (; h + 3 <= g; h += 3) score8_heads(q0 + h * qsh, qsh, k, d, 3, out + h * ostride, ostride, scale);
    if (g - h == 2) score8_heads(q0 + h * qsh, qsh, k, d, 2, out + h * ostride, ostride, scale);
    if (g - h == 1) score8_heads(q0 + h * qsh, qsh, k, d, 1, out + h * ostride, ostride, scale);
}
#else
#define BM_DECODE_AVX512 0
#endif

typedef struct {
    const float *q;
    int64_t q_stride_token, q_stride_head;
    const float *k, *v; /* [kv_heads, num_blocks, block_size, head_dim], contiguous */
    const int64_t *token_index, *block_table, *lengths;
    float *out; /* [tokens, heads, head_dim], contiguous */
    int64_t rows, max_blocks, heads, kv_heads, num_blocks, block_size, head_dim, max_len;
    float scale;
    float softcap;        /* > 0: scores become softcap * tanh(score / softcap) */
    const float *alibi;   /* NULL, or one ALiBi slope per query head */
    int64_t window;       /* > 0: each row attends only its last `window` keys */
    const float *sinks;   /* NULL, or per query head a logit in the softmax's denominator only */
    int64_t first, last; /* work items [first, last) of this thread */
    int status;
} job_t;

/* Ask for `floats` floats from `p` on into the cache, one request per 64-byte line. */
static inline void prefetch_block(const float *p, int64_t floats) {
    if (floats > 256) floats = 256; /* the first kilobyte; the hardware streams the rest */
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(p + i, 0, 3);
}

#if BM_DECODE_AVX512
#define BM_VT_LANES 16
#define BM_VT_MAXH 6 /* 6 heads x 4 vectors of accumulators, 4 of values, 1 weight: 29 of 32 registers */
typedef __m512 vt_t;
#define vt_load _mm512_loadu_ps
#define vt_store _mm512_storeu_ps
#define vt_fma _mm512_fmadd_ps
#define vt_set1 _mm512_set1_ps
#elif BM_HAVE_AVX2
#define BM_VT_LANES 8
#define BM_VT_MAXH 2 /* 2 heads x 4 vectors, 4 of values, 1 weight: 13 of 16 registers */
typedef __m256 vt_t;
#define vt_load _mm256_loadu_ps
#define vt_store _mm256_storeu_ps
#define vt_fma _mm256_fmadd_ps
#define vt_set1 _mm256_set1_ps
#endif

#ifdef BM_VT_LANES
/* acc[h][c] += w[h][o] * v[o][c] over keys o in [o0, n) of one block, for H heads and C vectors of
   columns, the accumulators held in registers across the keys. Per output element it is the same
   fused multiply-add, in the same key order, that the plain loop compiles to in these builds (each
   sum starts from 0 and takes one FMA per key), so the bits do not change; only the loads and stores of
   the accumulators between keys go. */
static inline __attribute__((always_inline)) void v_tile(float *acc, const float *w, int64_t wstride,
                                                         const float *vb, int64_t o0, int64_t n,
                                                         int64_t d, const int H, const int C) {
    vt_t r[BM_VT_MAXH][4];
    for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) r[h][c] = vt_load(acc + h * d + c * BM_VT_LANES);
    for (int64_t o = o0; o < n; o++) {
        vt_t v[4];
        for (int c = 0; c < C; c++) v[c] = vt_load(vb + o * d + c * BM_VT_LANES);
        for (int h = 0; h < H; h++) {
            const vt_t wv = vt_set1(w[h * wstride + o]);
            for (int c = 0; c < C; c++) r[h][c] = vt_fma(wv, v[c], r[h][c]);
        }
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) vt_store(acc + h * d + c * BM_VT_LANES, r[h][c]);
}

#define BM_VT_CASE_C(H)                                                   \
    case H:                                                               \
        switch (nc) {                                                     \
        case 1: v_tile(acc, w, wstride, vb, o0, n, d, H, 1); break;       \
        case 2: v_tile(acc, w, wstride, vb, o0, n, d, H, 2); break;       \
        case 3: v_tile(acc, w, wstride, vb, o0, n, d, H, 3); break;       \
        default: v_tile(acc, w, wstride, vb, o0, n, d, H, 4); break;      \
        }                                                                 \
        break;

/* One tile of nh (<= BM_VT_MAXH) heads by nc (<= 4) vectors, sizes made compile-time constants. */
static void v_tile_any(float *acc, const float *w, int64_t wstride, const float *vb, int64_t o0,
                       int64_t n, int64_t d, int nh, int nc) {
    switch (nh) {
        BM_VT_CASE_C(1)
#if BM_VT_MAXH >= 2
        BM_VT_CASE_C(2)
#endif
#if BM_VT_MAXH >= 6
        BM_VT_CASE_C(3)
        BM_VT_CASE_C(4)
        BM_VT_CASE_C(5)
        BM_VT_CASE_C(6)
#endif
    }
}
#endif

/* acc[h * d + i] += scores[h * span + o] * v[o][i] for the keys o in [o0, n) of one value block vb
   (sb = the block's first key's scores), heads h < g. */
static void accumulate_v(float *acc, const float *sb, int64_t span, const float *vb, int64_t o0, int64_t n,
                         int64_t g, int64_t d) {
#ifdef BM_VT_LANES
    if (d % BM_VT_LANES == 0) {
        const int64_t vecs = d / BM_VT_LANES;
        for (int64_t h0 = 0; h0 < g; h0 += BM_VT_MAXH)
            for (int64_t c0 = 0; c0 < vecs; c0 += 4) {
                const int nh = (int)(g - h0 < BM_VT_MAXH ? g - h0 : BM_VT_MAXH);
                const int nc = (int)(vecs - c0 < 4 ? vecs - c0 : 4);
                v_tile_any(acc + h0 * d + c0 * BM_VT_LANES, sb + h0 * span, span, vb + c0 * BM_VT_LANES, o0,
                           n, d, nh, nc);
            }
        return;
    }
#endif
    for (int64_t o = o0; o < n; o++) {
        const float *vp = vb + o * d;
        for (int64_t h = 0; h < g; h++) {
            const float w = sb[h * span + o];
            float *ah = acc + h * d;
            for (int64_t i = 0; i < d; i++) ah[i] += w * vp[i];
        }
    }
}

/* The largest of x[0..n), n >= 1. A maximum is exact, so taking it lane-wise in vectors and then over
   the lanes gives the same value as one scan (vmaxps picks as `x > m ? x : m` does; the sign of a zero
   maximum may differ, which cannot change exp(s - m)). The scan, with its four-cycle dependency per
   element, was a third of the kernel's time on cached keys. */
static inline float row_max(const float *x, int64_t n) {
    float m = x[0];
    int64_t j = 1;
#if BM_DECODE_AVX512
    if (n >= 17) {
        __m512 m16 = _mm512_loadu_ps(x + 1);
        for (j = 17; j + 16 <= n; j += 16) m16 = _mm512_max_ps(_mm512_loadu_ps(x + j), m16);
        float lanes[16];
        _mm512_storeu_ps(lanes, m16);
        for (int l = 0; l < 16; l++) m = lanes[l] > m ? lanes[l] : m;
    }
#elif BM_HAVE_AVX2
    if (n >= 9) {
        __m256 m8 = _mm256_loadu_ps(x + 1);
        for (j = 9; j + 8 <= n; j += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(x + j), m8);
        float lanes[8];
        _mm256_storeu_ps(lanes, m8);
        for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    }
#endif
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

static void attend(const job_t *a, int64_t item, float *scores, float *acc) {
    const int64_t g = a->heads / a->kv_heads, d = a->head_dim, bs = a->block_size;
    const int64_t row = item / a->kv_heads, kvh = item % a->kv_heads;
    const int64_t len = a->lengths[row], tok = a->token_index[row];
    /* Under a window the row attends keys [first, len) only; blocks before it may be released and are
       never read. `span` keys, scored at scores[h * span + (j - first)]. */
    const int64_t first = a->window > 0 && len > a->window ? len - a->window : 0, span = len - first;
    const int64_t *table = a->block_table + row * a->max_blocks;
    const int64_t head_stride = a->num_blocks * bs * d;
    const float *kh = a->k + kvh * head_stride, *vh = a->v + kvh * head_stride;
    const float *q0 = a->q + tok * a->q_stride_token + kvh * g * a->q_stride_head;

    for (int64_t j0 = first / bs * bs, b = first / bs; j0 < len; j0 += bs, b++) {
        const float *kb = kh + table[b] * bs * d;
        const int64_t n = len - j0 < bs ? len - j0 : bs;
        /* The next block sits anywhere in the pool, where the hardware prefetcher cannot guess it: ask
           for it now, while this one is scored. After the last key block, the first value block. */
        if (j0 + bs < len) prefetch_block(kh + table[b + 1] * bs * d, (len - j0 - bs < bs ? len - j0 - bs : bs) * d);
        else prefetch_block(vh + table[first / bs] * bs * d, (bs < span ? bs : span) * d);
        float *sb = scores - first + j0; /* sb[h * span + o]: key j0 + o */
        int64_t o = first > j0 ? first - j0 : 0;
#if BM_DECODE_AVX512
        if (d % 16 == 0)
            for (; o + 8 <= n; o += 8) score8_all(q0, a->q_stride_head, kb + o * d, d, g, sb + o, span, a->scale);
#endif
#if BM_HAVE_AVX2
        if (d % 8 == 0)
            for (; o + 8 <= n; o += 8)
                for (int64_t h = 0; h < g; h++)
                    _mm256_storeu_ps(sb + h * span + o,
                                     _mm256_mul_ps(dot8(q0 + h * a->q_stride_head, kb + o * d, d),
                                                   _mm256_set1_ps(a->scale)));
#endif
        for (; o < n; o++) {
            const float *kp = kb + o * d;
            for (int64_t h = 0; h < g; h++) {
                const float *qp = q0 + h * a->q_stride_head;
                float s = 0.f;
                for (int64_t i = 0; i < d; i++) s += qp[i] * kp[i];
                sb[h * span + o] = s * a->scale;
            }
        }
    }
    if (a->softcap > 0.f || a->alibi) {
        /* Gemma 2's logit soft-capping (cap * tanh(s / cap)), then ALiBi's linear bias
           slope * (key - query): the query sits at len - 1. */
        for (int64_t h = 0; h < g; h++) {
            float *sh = scores + h * span;
            if (a->softcap > 0.f)
                for (int64_t j = 0; j < span; j++) sh[j] = a->softcap * tanhf(sh[j] / a->softcap);
            if (a->alibi) {
                const float slope = a->alibi[kvh * g + h];
                for (int64_t j = 0; j < span; j++) sh[j] += slope * (float)(first + j - (len - 1));
            }
        }
    }
    for (int64_t h = 0; h < g; h++) {
        float *sh = scores + h * span;
        float m = row_max(sh, span);
        const float sink = a->sinks ? a->sinks[kvh * g + h] : -INFINITY;
        m = sink > m ? sink : m;
        float total = a->sinks ? expf(sink - m) : 0.f;
        int64_t j = 0;
#if BM_DECODE_AVX512
        __m512 tot16 = _mm512_setzero_ps();
        const __m512 m16 = _mm512_set1_ps(m);
        for (; j + 16 <= span; j += 16) {
            const __m512 e = bm_exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + j), m16));
            _mm512_storeu_ps(sh + j, e);
            tot16 = _mm512_add_ps(tot16, e);
        }
        total += _mm512_reduce_add_ps(tot16);
#endif
#if BM_HAVE_AVX2
        __m256 tot8 = _mm256_setzero_ps();
        const __m256 m8 = _mm256_set1_ps(m);
        for (; j + 8 <= span; j += 8) {
            __m256 e = bm_exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), m8));
            _mm256_storeu_ps(sh + j, e);
            tot8 = _mm256_add_ps(tot8, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, tot8);
        for (int l = 0; l < 8; l++) total += lanes[l];
#endif
        for (; j < span; j++) { sh[j] = expf(sh[j] - m); total += sh[j]; }
        const float inv = 1.f / total;
        for (int64_t j = 0; j < span; j++) sh[j] *= inv;
        for (int64_t i = 0; i < d; i++) acc[h * d + i] = 0.f;
    }
    for (int64_t j0 = first / bs * bs, b = first / bs; j0 < len; j0 += bs, b++) {
        const float *vb = vh + table[b] * bs * d;
        const int64_t n = len - j0 < bs ? len - j0 : bs;
        if (j0 + bs < len) prefetch_block(vh + table[b + 1] * bs * d, (len - j0 - bs < bs ? len - j0 - bs : bs) * d);
        accumulate_v(acc, scores - first + j0, span, vb, first > j0 ? first - j0 : 0, n, g, d);
    }
    float *o0 = a->out + (tok * a->heads + kvh * g) * d;
    for (int64_t x = 0; x < g * d; x++) o0[x] = acc[x];
}

#ifndef BM_OPENMP
static void *run(void *arg) {
    job_t *a = (job_t *)arg;
    const int64_t g = a->heads / a->kv_heads;
    float *scores = malloc(sizeof(float) * (size_t)(g * (a->max_len > 0 ? a->max_len : 1) + g * a->head_dim));
    if (!scores) { a->status = 1; return NULL; }
    float *acc = scores + g * a->max_len;
    for (int64_t it = a->first; it < a->last; it++) attend(a, it, scores, acc);
    free(scores);
    return NULL;
}
#endif

/* Returns 0 on success, nonzero if a thread's scratch memory could not be allocated (the caller must
   then discard `out`). A thread that cannot be started leaves its share to the calling thread. */
int bm_paged_decode_f32(const float *q, int64_t q_stride_token, int64_t q_stride_head,
                        const float *k, const float *v, const int64_t *token_index,
                        const int64_t *block_table, const int64_t *lengths, float *out,
                        int64_t rows, int64_t max_blocks, int64_t heads, int64_t kv_heads,
                        int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t max_len,
                        float scale, float softcap, const float *alibi, int64_t window,
                        const float *sinks, int64_t threads) {
    const int64_t items = rows * kv_heads;
    if (threads > items) threads = items;
    if (threads < 1) threads = 1;
    const job_t job = {q, q_stride_token, q_stride_head, k, v, token_index, block_table, lengths, out,
                       rows, max_blocks, heads, kv_heads, num_blocks, block_size, head_dim, max_len,
                       scale, softcap, alibi, window, sinks, 0, items, 0};
#ifdef BM_OPENMP
    /* torch's own OpenMP runtime (bm links this file against the copy torch loaded): its worker threads
       are still spinning from the last torch op, so they take these items at once instead of competing
       for the cores with threads of our own. Dynamic chunks even out rows of different lengths. */
    const int64_t g = heads / kv_heads;
    int status = 0;
#pragma omp parallel num_threads((int)threads) reduction(| : status)
    {
        float *scores = malloc(sizeof(float) * (size_t)(g * (max_len > 0 ? max_len : 1) + g * head_dim));
        if (!scores) status |= 1;
#pragma omp for schedule(dynamic, 4)
        for (int64_t it = 0; it < items; it++)
            if (scores) attend(&job, it, scores, scores + g * max_len);
        free(scores);
    }
    return status;
#else
    enum { MAX_THREADS = 64 };
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int64_t t = 0; t < threads; t++) {
        jobs[t] = job;
        jobs[t].first = items * t / threads;
        jobs[t].last = items * (t + 1) / threads;
    }
    for (int64_t t = 1; t < threads; t++) started[t] = pthread_create(&tid[t], NULL, run, &jobs[t]) == 0;
    run(&jobs[0]);
    int status = jobs[0].status;
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run(&jobs[t]);
        status |= jobs[t].status;
    }
    return status;
#endif
}

/* Writes a forward's new keys and values into the cache: for token t and kv head h, the d floats at
   k + t * k_st + h * k_sh go to ck + (h * num_slots + slots[t]) * d, and the same for v into cv (each
   cache half is [kv_heads, num_slots, d]). Unit stride along d. This is what two torch index_copy_ calls
   did per layer; they moved about 2.4 GB/s on strided rows, a plain copy several times that. A copy
   changes no bits. Returns 1 (having written nothing) if a slot lies outside [0, num_slots). */
int bm_kv_write_f32(const float *k, int64_t k_st, int64_t k_sh, const float *v, int64_t v_st, int64_t v_sh,
                    float *ck, float *cv, const int64_t *slots, int64_t tokens, int64_t kv_heads,
                    int64_t num_slots, int64_t d, int64_t threads) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    const size_t row = sizeof(float) * (size_t)d;
#ifdef BM_OPENMP
    if (threads > 1 && tokens * kv_heads * d >= 65536) { /* below that, waking a thread costs more */
#pragma omp parallel for num_threads((int)threads) schedule(static)
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t h = 0; h < kv_heads; h++) {
                memcpy(ck + (h * num_slots + slots[t]) * d, k + t * k_st + h * k_sh, row);
                memcpy(cv + (h * num_slots + slots[t]) * d, v + t * v_st + h * v_sh, row);
            }
        return 0;
    }
#endif
    (void)threads;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < kv_heads; h++) {
            memcpy(ck + (h * num_slots + slots[t]) * d, k + t * k_st + h * k_sh, row);
            memcpy(cv + (h * num_slots + slots[t]) * d, v + t * v_st + h * v_sh, row);
        }
    return 0;
}
