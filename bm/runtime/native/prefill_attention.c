/* Causal prefill attention for one context chunk, fp32 on the CPU, flash-attention style.

   Why a C kernel: torch's CPU flash attention runs at a third to a half of this machine's GEMM peak at
   head size 64 (its inner products go through small GEMM calls per tile, and the causal half of the
   key blocks still pays their overhead). Here the two products of attention, S = Q K^T and O += P V,
   run through 6 x 16 register tiles held in AVX2 accumulators, like bm's panel GEMM (small_gemm.c),
   with the online softmax between them, and only the keys a query tile can see are ever touched.

   Layout. The chunk's queries are T tokens at positions prefix .. prefix + T - 1: token t, head h at
   q + t * q_st + h * q_sh (unit stride within a head). Keys and values are either the chunk's own
   (prefix == 0; token t, kv head c at k + t * kv_st + c * kv_sh) or, with a cached prefix, read from
   one layer's cache halves [kv_heads, num_blocks, block_size, d] by block table (key j sits in block
   table[j / block_size]; the chunk's own keys are already written there). out + t * out_st + h * d
   receives token t, head h. Query head h attends kv head h / (heads / kv_heads).

   Work. First every kv head's keys are packed once into 16-key panels, k-major ([d][16], so a panel row
   is two vector loads), and its values into contiguous rows. Then the work items are (kv head, tile of
   QT query tokens): the tile's rows are its tokens times the heads of that kv head's group (row
   t * g + h), so one pass over a key panel serves all the group's heads. Items are handed out largest
   first (the last tiles see the most keys under the causal mask), which balances the threads.

   Without AVX2/FMA, or with a head size that is not a multiple of 8, the same loops run in plain C.
   AVX-512 builds (bm/cpu_isa.py) hold a panel row in one register and take two panels (S) or
   32 value columns (O) per register tile, and run the softmax in sixteen lanes. Each query row's result
   depends only on its own keys: tiles cut the chunk, never the batch.

   bf16 (bm_prefill_attention_bf16, AVX-512 builds): queries, keys and values bf16 (a bf16 model's
   cache), widened to float32 where they are copied anyway (the queries into the tile, keys and values
   into the packed panels), the output rounded to bf16. Everything between is the float32 code, so the
   result is exactly the float32 kernel's on the widened inputs, rounded.

   Quantized caches (bm_prefill_attention_kvq: kv_cache.dtype int8 or fp8_e4m3, float32 queries and
   output): keys and values read from the cache are widened times their scale as they are packed, the
   float32 products torch's dequantization makes; everything after is the float32 code, so the result
   is exactly the float32 kernel's over the dequantized cache, with no widened copy of the blocks. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h" /* BM_HAVE_AVX2, BM_HAVE_AVX512 */
#include "bf16.h"
#include "kv_quant.h" /* fp8_to_f32, int8_row_scale */

#define KP 16 /* keys per packed panel */
#define KB 64 /* keys per block of the online softmax */
#define QT 16 /* query tokens per tile */
#define MR 6  /* rows per register tile */

int bm_prefill_attention_vectorized(void) { return BM_HAVE_AVX2; }

typedef struct {
    const void *q; /* float32, or bf16 where k, v, ck, cv and out are (bf16 != 0) */
    int64_t q_st, q_sh;
    const void *k, *v;
    int64_t kv_st, kv_sh;
    const void *ck, *cv;
    const int64_t *table;
    int64_t num_blocks, block_size;
    void *out;
    int64_t out_st;
    int64_t T, prefix, heads, kv_heads, d;
    float scale;
    int vec;
    int64_t keys, panels;
    float *kp; /* [kv_heads][panels][d][KP], zero past the last key */
    float *vp; /* [kv_heads][keys][d] */
    int bf16;
    int kq;                 /* the cache's rows: 0 as q's dtype; 2 int8 with a scale each; 3 fp8 */
    float k_scale, v_scale; /* kq 3: the layer's key and value scales */
} args_t;

/* Key (value == 0) or value j of kv head c: a float32 or (a->bf16) a bf16 row of d; read from the cache
   (a table given), a quantized row of the cache's layout (a->kq). */
static const void *kv_row(const args_t *a, int64_t c, int64_t j, int value) {
    const int64_t esz = a->bf16 ? 2 : 4;
    if (a->table) {
        const int64_t bs = a->block_size;
        const int64_t row = a->kq == 2 ? a->d + 4 : a->kq == 3 ? a->d : a->d * esz; /* bytes */
        const char *half = value ? a->cv : a->ck;
        return half + ((c * a->num_blocks + a->table[j / bs]) * bs + j % bs) * row;
    }
    return (const char *)(value ? a->v : a->k) + (j * a->kv_st + c * a->kv_sh) * esz;
}

/* Element i of a quantized cache row, times its scale `sc`: the float32 torch's dequantization gives. */
static inline float kvq_value(const args_t *a, const void *row, int64_t i, float sc) {
    return (a->kq == 2 ? (float)((const int8_t *)row)[i] : fp8_to_f32(((const uint8_t *)row)[i])) * sc;
}

static void pack(const args_t *a, int64_t c, int64_t p) {
    const int64_t d = a->d;
    float *dst = a->kp + (c * a->panels + p) * d * KP;
    for (int64_t x = 0; x < KP; x++) {
        const int64_t j = p * KP + x;
        if (j < a->keys && a->kq) { /* a quantized cache's rows, dequantized */
            const void *kr = kv_row(a, c, j, 0), *vr = kv_row(a, c, j, 1);
            const float ks = a->kq == 2 ? int8_row_scale(kr, d) : a->k_scale;
            const float vs = a->kq == 2 ? int8_row_scale(vr, d) : a->v_scale;
            float *vd = a->vp + (c * a->keys + j) * d;
            for (int64_t i = 0; i < d; i++) dst[i * KP + x] = kvq_value(a, kr, i, ks);
            for (int64_t i = 0; i < d; i++) vd[i] = kvq_value(a, vr, i, vs);
        } else if (j < a->keys && a->bf16) { /* widened: exact */
            const uint16_t *kr = kv_row(a, c, j, 0), *vr = kv_row(a, c, j, 1);
            float *vd = a->vp + (c * a->keys + j) * d;
            for (int64_t i = 0; i < d; i++) dst[i * KP + x] = bf16_to_f32(kr[i]);
            for (int64_t i = 0; i < d; i++) vd[i] = bf16_to_f32(vr[i]);
        } else if (j < a->keys) {
            const float *kr = kv_row(a, c, j, 0);
            for (int64_t i = 0; i < d; i++) dst[i * KP + x] = kr[i];
            memcpy(a->vp + (c * a->keys + j) * d, kv_row(a, c, j, 1), sizeof(float) * (size_t)d);
        } else {
            for (int64_t i = 0; i < d; i++) dst[i * KP + x] = 0.f;
        }
    }
}

#if BM_HAVE_AVX2
/* s[i][0..16) = qs[i] . (16 keys of the panel), for mr <= MR rows. */
static inline __attribute__((always_inline)) void s_tile(const int mr, const float *qs, int64_t d,
                                                          const float *kp, float *s) {
    __m256 acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < d; kk++) {
        const __m256 b0 = _mm256_loadu_ps(kp + kk * KP), b1 = _mm256_loadu_ps(kp + kk * KP + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 x = _mm256_broadcast_ss(qs + i * d + kk);
            acc[i][0] = _mm256_fmadd_ps(x, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(x, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(s + i * KB, acc[i][0]);
        _mm256_storeu_ps(s + i * KB + 8, acc[i][1]);
    }
}

/* o[i][0..16) = alpha[i] * o[i][0..16) + sum_n p[i][n] * v[n][0..16), for mr <= MR rows. */
static inline __attribute__((always_inline)) void pv_tile16(const int mr, const float *p, int64_t nk,
                                                             const float *v, int64_t d, float *o,
                                                             const float *alpha) {
    __m256 acc[MR][2];
    for (int i = 0; i < mr; i++) {
        const __m256 s = _mm256_broadcast_ss(alpha + i);
        acc[i][0] = _mm256_mul_ps(_mm256_loadu_ps(o + i * d), s);
        acc[i][1] = _mm256_mul_ps(_mm256_loadu_ps(o + i * d + 8), s);
    }
    for (int64_t n = 0; n < nk; n++) {
        const __m256 b0 = _mm256_loadu_ps(v + n * d), b1 = _mm256_loadu_ps(v + n * d + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 x = _mm256_broadcast_ss(p + i * KB + n);
            acc[i][0] = _mm256_fmadd_ps(x, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(x, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(o + i * d, acc[i][0]);
        _mm256_storeu_ps(o + i * d + 8, acc[i][1]);
    }
}

/* The same for the last 8 columns of a head size that is 8 more than a multiple of 16. */
static inline __attribute__((always_inline)) void pv_tile8(const int mr, const float *p, int64_t nk,
                                                            const float *v, int64_t d, float *o,
                                                            const float *alpha) {
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_mul_ps(_mm256_loadu_ps(o + i * d), _mm256_broadcast_ss(alpha + i));
    for (int64_t n = 0; n < nk; n++) {
        const __m256 b0 = _mm256_loadu_ps(v + n * d);
        for (int i = 0; i < mr; i++) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i * KB + n), b0, acc[i]);
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(o + i * d, acc[i]);
}

#define BY_ROWS(call, mr, ...)                                                                    \
    switch (mr) {                                                                                 \
    case 6: call(6, __VA_ARGS__); break;                                                          \
    case 5: call(5, __VA_ARGS__); break;                                                          \
    case 4: call(4, __VA_ARGS__); break;                                                          \
    case 3: call(3, __VA_ARGS__); break;                                                          \
    case 2: call(2, __VA_ARGS__); break;                                                          \
    default: call(1, __VA_ARGS__); break;                                                         \
    }

/* 2^x for x <= 0 (scores are kept in base 2: the queries carry log2(e)): 2^n * p(r), n = round(x),
   r = x - n in [-0.5, 0.5], p the degree-6 Taylor polynomial of 2^r (relative error about 1.2e-7).
   Below -126 it returns 2^-126, not 0: masked keys are zeroed by the caller. */
static inline __m256 exp2_8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.618129107628477e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.550410866482158e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.2402265069591007f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.6931471805599453f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax8(__m256 x) {
    __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_max_ps(y, _mm_movehl_ps(y, y));
    y = _mm_max_ss(y, _mm_shuffle_ps(y, y, 1));
    return _mm_cvtss_f32(y);
}

static inline float hsum8(__m256 x) {
    __m128 y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_add_ps(y, _mm_movehl_ps(y, y));
    y = _mm_add_ss(y, _mm_shuffle_ps(y, y, 1));
    return _mm_cvtss_f32(y);
}
#endif

#if BM_HAVE_AVX512
/* s[i][0..16 np) = qs[i] . (16 np keys of np adjacent panels), for mr <= MR rows, np 1 or 2. */
static inline __attribute__((always_inline)) void s_tile512(const int mr, const int np, const float *qs,
                                                             int64_t d, const float *kp, float *s) {
    __m512 acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const float *kp1 = kp + d * KP;
    for (int64_t kk = 0; kk < d; kk++) {
        const __m512 b0 = _mm512_loadu_ps(kp + kk * KP);
        const __m512 b1 = np == 2 ? _mm512_loadu_ps(kp1 + kk * KP) : b0;
        for (int i = 0; i < mr; i++) {
            const __m512 x = _mm512_set1_ps(qs[i * d + kk]);
            acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
            if (np == 2) acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) _mm512_storeu_ps(s + i * KB + j * KP, acc[i][j]);
}
static inline __attribute__((always_inline)) void s_tile512_1(const int mr, const float *qs, int64_t d,
                                                               const float *kp, float *s) {
    s_tile512(mr, 1, qs, d, kp, s);
}
static inline __attribute__((always_inline)) void s_tile512_2(const int mr, const float *qs, int64_t d,
                                                               const float *kp, float *s) {
    s_tile512(mr, 2, qs, d, kp, s);
}

/* o[i][0..16 nc) = alpha[i] * o[i][..] + sum_n p[i][n] * v[n][..], nc (1 or 2) sixteen-column groups. */
static inline __attribute__((always_inline)) void pv_tile512(const int mr, const int nc, const float *p,
                                                              int64_t nk, const float *v, int64_t d,
                                                              float *o, const float *alpha) {
    __m512 acc[MR][2];
    for (int i = 0; i < mr; i++) {
        const __m512 s = _mm512_set1_ps(alpha[i]);
        for (int j = 0; j < nc; j++) acc[i][j] = _mm512_mul_ps(_mm512_loadu_ps(o + i * d + 16 * j), s);
    }
    for (int64_t n = 0; n < nk; n++) {
        const __m512 b0 = _mm512_loadu_ps(v + n * d);
        const __m512 b1 = nc == 2 ? _mm512_loadu_ps(v + n * d + 16) : b0;
        for (int i = 0; i < mr; i++) {
            const __m512 x = _mm512_set1_ps(p[i * KB + n]);
            acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
            if (nc == 2) acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nc; j++) _mm512_storeu_ps(o + i * d + 16 * j, acc[i][j]);
}
static inline __attribute__((always_inline)) void pv_tile32(const int mr, const float *p, int64_t nk,
                                                             const float *v, int64_t d, float *o,
                                                             const float *alpha) {
    pv_tile512(mr, 2, p, nk, v, d, o, alpha);
}
static inline __attribute__((always_inline)) void pv_tile16z(const int mr, const float *p, int64_t nk,
                                                              const float *v, int64_t d, float *o,
                                                              const float *alpha) {
    pv_tile512(mr, 1, p, nk, v, d, o, alpha);
}

/* exp2_8 in sixteen lanes (the same result lane for lane). */
static inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402265069591007f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931471805599453f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

/* One row's online-softmax step (in base 2) over w = panels * 16 scores of a key block starting at key j0: keys
   past `pos` are masked when `masked`. The scores become probabilities relative to the new running max
   (0 where masked), alpha the factor the row's accumulated output must be scaled by. */
static void softmax_row(const args_t *a, float *s, int64_t w, int64_t j0, int64_t pos, int masked, float *m,
                        float *l, float *alpha) {
    const float old = *m;
    float mx = -INFINITY;
    int64_t n = 0;
#if BM_HAVE_AVX512
    if (a->vec) { /* w is a whole number of 16-key panels */
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 posv = _mm512_set1_ps((float)(pos - j0));
        __m512 mv = ninf;
        for (; n < w; n += 16) {
            __m512 x = _mm512_loadu_ps(s + n);
            if (masked) {
                const __mmask16 keep =
                    _mm512_cmp_ps_mask(_mm512_add_ps(lanes, _mm512_set1_ps((float)n)), posv, _CMP_LE_OQ);
                x = _mm512_mask_blend_ps(keep, ninf, x);
                _mm512_storeu_ps(s + n, x);
            }
            mv = _mm512_max_ps(mv, x);
        }
        mx = _mm512_reduce_max_ps(mv);
    }
#elif BM_HAVE_AVX2
    if (a->vec) {
        const __m256 ninf = _mm256_set1_ps(-INFINITY), lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 posv = _mm256_set1_ps((float)(pos - j0));
        __m256 mv = ninf;
        for (; n < w; n += 8) {
            __m256 x = _mm256_loadu_ps(s + n);
            if (masked) {
                const __m256 keep = _mm256_cmp_ps(_mm256_add_ps(lanes, _mm256_set1_ps((float)n)), posv, _CMP_LE_OQ);
                x = _mm256_blendv_ps(ninf, x, keep);
                _mm256_storeu_ps(s + n, x);
            }
            mv = _mm256_max_ps(mv, x);
        }
        mx = hmax8(mv);
    }
#endif
    for (; n < w; n++) {
        if (masked && j0 + n > pos) s[n] = -INFINITY;
        mx = s[n] > mx ? s[n] : mx;
    }
    const float top = mx > old ? mx : old;
    if (top == -INFINITY) { /* nothing attended yet: keep the row as it is */
        memset(s, 0, sizeof(float) * (size_t)w);
        *alpha = 1.f;
        return;
    }
    float sum = 0.f;
    n = 0;
#if BM_HAVE_AVX512
    if (a->vec) {
        const __m512 topv = _mm512_set1_ps(top), ninf = _mm512_set1_ps(-INFINITY);
        __m512 sv = _mm512_setzero_ps();
        for (; n < w; n += 16) {
            const __m512 x = _mm512_loadu_ps(s + n);
            const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
            const __m512 e = _mm512_maskz_mov_ps(live, exp2_16(_mm512_sub_ps(x, topv)));
            _mm512_storeu_ps(s + n, e);
            sv = _mm512_add_ps(sv, e);
        }
        sum = _mm512_reduce_add_ps(sv);
    }
#elif BM_HAVE_AVX2
    if (a->vec) {
        const __m256 topv = _mm256_set1_ps(top), ninf = _mm256_set1_ps(-INFINITY);
        __m256 sv = _mm256_setzero_ps();
        for (; n < w; n += 8) {
            const __m256 x = _mm256_loadu_ps(s + n);
            /* masked scores are -inf: exp2_8 clamps them to a tiny value, so zero them exactly */
            const __m256 e = _mm256_and_ps(exp2_8(_mm256_sub_ps(x, topv)), _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
            _mm256_storeu_ps(s + n, e);
            sv = _mm256_add_ps(sv, e);
        }
        sum = hsum8(sv);
    }
#endif
    for (; n < w; n++) {
        s[n] = s[n] == -INFINITY ? 0.f : exp2f(s[n] - top);
        sum += s[n];
    }
    /* after the first blocks the running max seldom moves: no exp then */
    *alpha = old == top ? 1.f : old == -INFINITY ? 0.f : exp2f(old - top);
    *l = *l * *alpha + sum;
    *m = top;
}

/* Keys of the block [j0, j0 + nk) that rows r .. r + mr - 1 (positions lo + row / g) can attend: on the
   diagonal block the first row groups stop early. */
static inline int64_t keys_for(int64_t r, int mr, int64_t lo, int64_t g, int64_t j0, int64_t nk) {
    const int64_t seen = lo + (r + mr - 1) / g - j0 + 1;
    return seen < nk ? seen : nk;
}

/* Rows [0, rows) of the tile against one key block of nk keys: S = Q K^T into s (rows x panels*16, where
   a panel no row of a register tile attends is left as it was: the causal mask covers it). */
static void scores(const args_t *a, const float *qs, int64_t rows, const float *kp, int64_t nk, float *s,
                   int64_t lo, int64_t j0) {
    const int64_t d = a->d, g = a->heads / a->kv_heads;
#if BM_HAVE_AVX512
    if (a->vec) {
        for (int64_t r = 0; r < rows; r += MR) {
            const int mr = rows - r < MR ? (int)(rows - r) : MR;
            const int64_t panels = (keys_for(r, mr, lo, g, j0, nk) + KP - 1) / KP;
            int64_t p = 0;
            for (; p + 2 <= panels; p += 2)
                BY_ROWS(s_tile512_2, mr, qs + r * d, d, kp + p * d * KP, s + r * KB + p * KP);
            if (p < panels) BY_ROWS(s_tile512_1, mr, qs + r * d, d, kp + p * d * KP, s + r * KB + p * KP);
        }
        return;
    }
#elif BM_HAVE_AVX2
    if (a->vec) {
        for (int64_t r = 0; r < rows; r += MR) {
            const int mr = rows - r < MR ? (int)(rows - r) : MR;
            const int64_t panels = (keys_for(r, mr, lo, g, j0, nk) + KP - 1) / KP;
            for (int64_t p = 0; p < panels; p++)
                BY_ROWS(s_tile, mr, qs + r * d, d, kp + p * d * KP, s + r * KB + p * KP);
        }
        return;
    }
#endif
    const int64_t panels = (nk + KP - 1) / KP;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t p = 0; p < panels; p++) {
            float acc[KP] = {0};
            const float *panel = kp + p * d * KP;
            for (int64_t kk = 0; kk < d; kk++) {
                const float x = qs[r * d + kk];
                for (int x16 = 0; x16 < KP; x16++) acc[x16] += x * panel[kk * KP + x16];
            }
            memcpy(s + r * KB + p * KP, acc, sizeof acc);
        }
}

/* o = alpha * o + P V over the block's nk keys (values v, rows d floats apart). */
static void accumulate(const args_t *a, const float *s, int64_t rows, int64_t nk, const float *v, float *o,
                       const float *alpha, int64_t lo, int64_t j0) {
    const int64_t d = a->d, g = a->heads / a->kv_heads;
#if BM_HAVE_AVX2
    if (a->vec) {
        for (int64_t r = 0; r < rows; r += MR) {
            const int mr = rows - r < MR ? (int)(rows - r) : MR;
            const int64_t n = keys_for(r, mr, lo, g, j0, nk); /* the rest have probability 0 */
            int64_t col = 0;
#if BM_HAVE_AVX512
            for (; col + 32 <= d; col += 32)
                BY_ROWS(pv_tile32, mr, s + r * KB, n, v + col, d, o + r * d + col, alpha + r);
            for (; col + 16 <= d; col += 16)
                BY_ROWS(pv_tile16z, mr, s + r * KB, n, v + col, d, o + r * d + col, alpha + r);
#endif
            for (; col + 16 <= d; col += 16)
                BY_ROWS(pv_tile16, mr, s + r * KB, n, v + col, d, o + r * d + col, alpha + r);
            if (col < d) BY_ROWS(pv_tile8, mr, s + r * KB, n, v + col, d, o + r * d + col, alpha + r);
        }
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++) {
        float *orow = o + r * d;
        for (int64_t i = 0; i < d; i++) orow[i] *= alpha[r];
        for (int64_t n = 0; n < nk; n++) {
            const float p = s[r * KB + n];
            const float *vr = v + n * d;
            for (int64_t i = 0; i < d; i++) orow[i] += p * vr[i];
        }
    }
}

/* Scratch floats one thread needs for a tile. */
static int64_t tile_floats(const args_t *a) {
    const int64_t rows = QT * (a->heads / a->kv_heads);
    return rows * (2 * a->d + KB + 3);
}

/* Query tokens [t0, t0 + QT) of kv head c's group. */
static void tile(const args_t *a, int64_t c, int64_t t0, float *buf) {
    const int64_t g = a->heads / a->kv_heads, d = a->d;
    const int64_t nt = a->T - t0 < QT ? a->T - t0 : QT, rows = nt * g;
    float *qs = buf, *o = qs + QT * g * d, *s = o + QT * g * d;
    float *m = s + QT * g * KB, *l = m + QT * g, *alpha = l + QT * g;
    const float scale2 = a->scale * 1.44269504088896341f; /* scores in base 2: exp(x) = 2^(x log2 e) */
    for (int64_t t = 0; t < nt; t++)
        for (int64_t h = 0; h < g; h++) {
            const int64_t at = (t0 + t) * a->q_st + (c * g + h) * a->q_sh;
            float *dst = qs + (t * g + h) * d;
            if (a->bf16) {
                const uint16_t *src = (const uint16_t *)a->q + at;
                for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]) * scale2;
            } else {
                const float *src = (const float *)a->q + at;
                for (int64_t i = 0; i < d; i++) dst[i] = src[i] * scale2;
            }
        }
    memset(o, 0, sizeof(float) * (size_t)(rows * d));
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int64_t lo = a->prefix + t0, end = lo + nt; /* rows sit at positions lo .. end - 1 */
    const float *kpc = a->kp + c * a->panels * d * KP, *vpc = a->vp + c * a->keys * d;
    for (int64_t j0 = 0; j0 < end; j0 += KB) {
        const int64_t nk = end - j0 < KB ? end - j0 : KB, panels = (nk + KP - 1) / KP, w = panels * KP;
        scores(a, qs, rows, kpc + j0 * d, nk, s, lo, j0);
        const int masked = j0 + w - 1 > lo; /* some key of the block lies past some row's position */
        for (int64_t r = 0; r < rows; r++)
            softmax_row(a, s + r * KB, w, j0, lo + r / g, masked, m + r, l + r, alpha + r);
        accumulate(a, s, rows, nk, vpc + j0 * d, o, alpha, lo, j0);
    }
    for (int64_t t = 0; t < nt; t++)
        for (int64_t h = 0; h < g; h++) {
            const int64_t r = t * g + h;
            const float inv = 1.f / l[r];
            const int64_t at = (t0 + t) * a->out_st + (c * g + h) * d;
            if (a->bf16) { /* rounded to nearest even, as torch's .to(torch.bfloat16) */
                uint16_t *dst = (uint16_t *)a->out + at;
                for (int64_t i = 0; i < d; i++) dst[i] = f32_to_bf16(o[r * d + i] * inv);
            } else {
                float *dst = (float *)a->out + at;
                for (int64_t i = 0; i < d; i++) dst[i] = o[r * d + i] * inv;
            }
        }
}

/* The chunk's attention over threads: pack every kv head's keys and values, then the query tiles.
   Returns 0 on success, 1 when scratch memory could not be allocated (out is then incomplete). */
static int run_chunk(args_t a, int64_t threads) {
    const int64_t T = a.T, kv_heads = a.kv_heads, d = a.d;
    if (T <= 0) return 0;
    a.keys = a.prefix + T;
    a.panels = (a.keys + KP - 1) / KP;
    const size_t packed = (size_t)(kv_heads * (a.panels * KP * d + a.keys * d));
    float *buf = malloc(sizeof(float) * packed);
    if (!buf) return 1;
    a.kp = buf;
    a.vp = buf + kv_heads * a.panels * KP * d;
    const int64_t tiles = (T + QT - 1) / QT, items = tiles * kv_heads, packs = kv_heads * a.panels;
    if (threads < 1) threads = 1;
    int status = 0;
#ifdef BM_OPENMP
#pragma omp parallel num_threads((int)threads) if (threads > 1) reduction(| : status)
#endif
    {
#ifdef BM_OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t it = 0; it < packs; it++) pack(&a, it / a.panels, it % a.panels);
        float *scratch = malloc(sizeof(float) * (size_t)tile_floats(&a));
        if (!scratch) status |= 1;
        /* Largest first: the last tiles attend the most keys. */
#ifdef BM_OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t it = 0; it < items; it++)
            if (scratch) tile(&a, it % kv_heads, (tiles - 1 - it / kv_heads) * QT, scratch);
        free(scratch);
    }
    (void)threads;
    free(buf);
    return status;
}

/* Returns 0 on success, 1 when scratch memory could not be allocated (out is then incomplete).
   table == NULL: keys and values are the chunk's own (k, v), and prefix must be 0. vectorize == 0 runs
   the plain C loops even where AVX2 is available (tests compare the two). */
int bm_prefill_attention_f32(const float *q, int64_t q_st, int64_t q_sh, const float *k, const float *v,
                             int64_t kv_st, int64_t kv_sh, const float *ck, const float *cv,
                             const int64_t *table, int64_t num_blocks, int64_t block_size, float *out,
                             int64_t out_st, int64_t T, int64_t prefix, int64_t heads, int64_t kv_heads,
                             int64_t d, float scale, int64_t threads, int64_t vectorize) {
    const args_t a = {q, q_st, q_sh, k, v, kv_st, kv_sh, ck, cv, table, num_blocks, block_size, out, out_st,
                      T, prefix, heads, kv_heads, d, scale, BM_HAVE_AVX2 && vectorize && d % 8 == 0, 0, 0,
                      NULL, NULL, 0, 0, 1.f, 1.f};
    return run_chunk(a, threads);
}

/* The same after a cached prefix in a quantized cache (kq 2: int8 rows with a scale each; 3: fp8 at the
   layer's k_scale and v_scale), float32 q, k, v and out: see the header. table must not be NULL. */
int bm_prefill_attention_kvq(const float *q, int64_t q_st, int64_t q_sh, const float *k, const float *v,
                             int64_t kv_st, int64_t kv_sh, const void *ck, const void *cv,
                             const int64_t *table, int64_t num_blocks, int64_t block_size, float *out,
                             int64_t out_st, int64_t T, int64_t prefix, int64_t heads, int64_t kv_heads,
                             int64_t d, float scale, int64_t threads, int64_t vectorize, int64_t kq,
                             float k_scale, float v_scale) {
    if (!table || (kq != 2 && kq != 3)) return 2;
    const args_t a = {q, q_st, q_sh, k, v, kv_st, kv_sh, ck, cv, table, num_blocks, block_size, out, out_st,
                      T, prefix, heads, kv_heads, d, scale, BM_HAVE_AVX2 && vectorize && d % 8 == 0, 0, 0,
                      NULL, NULL, 0, (int)kq, k_scale, v_scale};
    return run_chunk(a, threads);
}

#if BM_HAVE_AVX512
/* The same with q, k, v, the cache halves and out in bf16 (strides in elements): see the header. Only
   the AVX-512 builds have it, as the bf16 decode kernel (bm.runtime.native.kv_cache_dtype). */
int bm_prefill_attention_bf16(const uint16_t *q, int64_t q_st, int64_t q_sh, const uint16_t *k,
                              const uint16_t *v, int64_t kv_st, int64_t kv_sh, const uint16_t *ck,
                              const uint16_t *cv, const int64_t *table, int64_t num_blocks, int64_t block_size,
                              uint16_t *out, int64_t out_st, int64_t T, int64_t prefix, int64_t heads,
                              int64_t kv_heads, int64_t d, float scale, int64_t threads, int64_t vectorize) {
    const args_t a = {q, q_st, q_sh, k, v, kv_st, kv_sh, ck, cv, table, num_blocks, block_size, out, out_st,
                      T, prefix, heads, kv_heads, d, scale, vectorize && d % 8 == 0, 0, 0, NULL, NULL, 1, 0,
                      1.f, 1.f};
    return run_chunk(a, threads);
}
#endif
