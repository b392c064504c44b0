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
#include "bf16.h"
#include "kv_quant.h" /* fp8_to_f32, int8_row_scale */

/* Keys and values are float32 (kvt 0), bf16 (kvt 1: AVX-512 builds only, bm_paged_decode_bf16), int8
   rows with a scale each (kvt 2: bm_paged_decode_i8) or float8 e4m3 at a scale per layer for keys and
   one for values (kvt 3: bm_paged_decode_f8). Every function below that reads them takes the flag as a
   compile-time constant (always_inline, or one copy per dtype), so the float32 code is what it was, and
   the other dtypes' code is the same code with each key or value widened to float32 in a register as it
   is loaded (an int8 or fp8 one times its scale): the same operations in the same order on the same
   float32 values. So a bf16, int8 or fp8 cache gives exactly the float32 kernel's results on its widened
   keys and values (tests/test_bf16_kv_cache.py and tests/test_kv_quant.py pin it), reading half or
   about a quarter of the bytes. */
#define KV_ESZ(kvt) ((kvt) == 1 ? 2 : (kvt) >= 2 ? 1 : 4) /* bytes per element */
#define KV_AT(p, n, kvt) ((const void *)((const char *)(p) + (int64_t)(n) * KV_ESZ(kvt)))

/* A quantized cache's element as a float, before its scale (widen_row, KV8S and KV16S apply it). */
#define KV1(p, n, kvt) ((kvt) == 1 ? bf16_to_f32(((const uint16_t *)(p))[n]) : (kvt) == 2 ? (float)((const int8_t *)(p))[n] : (kvt) == 3 ? fp8_to_f32(((const uint8_t *)(p))[n]) : ((const float *)(p))[n])
/* Elements of a row, and where the next row starts: an int8 row's d values are followed by its float32
   scale, so rows are d + 4 bytes apart; float32 and bf16 rows are d elements apart. */
#define KV_ROW(d, kvt) ((kvt) == 2 ? (d) + 4 : (d))
/* The scale of the quantized row starting at `row`: an int8 row's own (d values, then the scale), an
   fp8 row's layer's `ts` (the layer's key or value scale). */
static inline __attribute__((always_inline)) float row_scale(const void *row, int64_t d, const int kvt, float ts) {
    return kvt == 3 ? ts : int8_row_scale(row, d);
}
/* A quantized row's d values times its scale, into dst: the row as the float32 kernel would read it
   from the dequantized cache. The scalar loops widen a row first and then run the float32 code on it,
   so the compiler vectorizes their sums as it does the float32 kernel's (the same order, the same bits). */
static inline __attribute__((always_inline)) void widen_row(float *dst, const void *row, int64_t d, const int kvt, float ts) {
    const float sc = row_scale(row, d, kvt, ts);
    for (int64_t i = 0; i < d; i++) dst[i] = KV1(row, i, kvt) * sc;
}

#if BM_HAVE_AVX2
#define I8X8(p, n) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)(p) + (n)))))
/* Eight fp8 values widened as fp8_to_f32 does, lane by lane. */
static inline __m256 fp8x8_load(const void *p) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0x1p-9f));
    __m256 x = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em)));
    x = _mm256_blendv_ps(x, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7f))));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(x, _mm256_castsi256_ps(sign));
}
#define KV8(p, n, kvt) ((kvt) == 1 ? bf16x8_load((const uint16_t *)(p) + (n)) : (kvt) == 2 ? I8X8(p, n) : (kvt) == 3 ? fp8x8_load((const uint8_t *)(p) + (n)) : _mm256_loadu_ps((const float *)(p) + (n)))
#define KV8S(p, n, kvt, sv) ((kvt) >= 2 ? _mm256_mul_ps(KV8(p, n, kvt), sv) : KV8(p, n, kvt))

/* Eight dot products q . k[r] (r = 0..7, rows d floats apart), returned as one vector. */
static inline __attribute__((always_inline)) __m256 dot8(const float *q, const void *k, int64_t d, const int kvt,
                                                         float ts) {
    const int64_t rs = KV_ROW(d, kvt);
    __m256 s[8];
    for (int r = 0; r < 8; r++) s[r] = kvt >= 2 ? _mm256_set1_ps(row_scale(KV_AT(k, r * rs, kvt), d, kvt, ts)) : _mm256_setzero_ps();
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, KV8S(k, 0 * rs + i, kvt, s[0]), a0);
        a1 = _mm256_fmadd_ps(qv, KV8S(k, 1 * rs + i, kvt, s[1]), a1);
        a2 = _mm256_fmadd_ps(qv, KV8S(k, 2 * rs + i, kvt, s[2]), a2);
        a3 = _mm256_fmadd_ps(qv, KV8S(k, 3 * rs + i, kvt, s[3]), a3);
        a4 = _mm256_fmadd_ps(qv, KV8S(k, 4 * rs + i, kvt, s[4]), a4);
        a5 = _mm256_fmadd_ps(qv, KV8S(k, 5 * rs + i, kvt, s[5]), a5);
        a6 = _mm256_fmadd_ps(qv, KV8S(k, 6 * rs + i, kvt, s[6]), a6);
        a7 = _mm256_fmadd_ps(qv, KV8S(k, 7 * rs + i, kvt, s[7]), a7);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* The AVX-512 paths here also take AVX512DQ's 256-bit extracts. */
#if BM_HAVE_AVX512 && defined(__AVX512DQ__)
#define BM_DECODE_AVX512 1
#define I8X16(p, n) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)(p) + (n)))))
/* Sixteen fp8 values widened as fp8_to_f32 does, lane by lane. */
static inline __m512 fp8x16_load(const void *p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    __m512 x = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
    x = _mm512_mask_mul_ps(x, _mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8)), _mm512_cvtepi32_ps(em), _mm512_set1_ps(0x1p-9f));
    x = _mm512_mask_mov_ps(x, _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f)), _mm512_set1_ps(NAN));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign));
}
#define KV16(p, n, kvt) ((kvt) == 1 ? bf16x16_load((const uint16_t *)(p) + (n)) : (kvt) == 2 ? I8X16(p, n) : (kvt) == 3 ? fp8x16_load((const uint8_t *)(p) + (n)) : _mm512_loadu_ps((const float *)(p) + (n)))
#define KV16S(p, n, kvt, sv) ((kvt) >= 2 ? _mm512_mul_ps(KV16(p, n, kvt), sv) : KV16(p, n, kvt))
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
static inline __attribute__((always_inline)) void score8_heads(const float *q0, int64_t qsh, const void *k,
                                                               int64_t d, const int H, float *out,
                                                               int64_t ostride, float scale, const int kvt,
                                                               float ts) {
    const int64_t rs = KV_ROW(d, kvt);
    __m512 a[3][8], s[8];
    for (int r = 0; r < 8; r++) s[r] = kvt >= 2 ? _mm512_set1_ps(row_scale(KV_AT(k, r * rs, kvt), d, kvt, ts)) : _mm512_setzero_ps();
    for (int h = 0; h < H; h++)
        for (int r = 0; r < 8; r++) a[h][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        __m512 qv[3];
        for (int h = 0; h < H; h++) qv[h] = _mm512_loadu_ps(q0 + h * qsh + i);
        for (int r = 0; r < 8; r++) {
            const __m512 kv = KV16S(k, r * rs + i, kvt, s[r]);
            for (int h = 0; h < H; h++) a[h][r] = _mm512_fmadd_ps(qv[h], kv, a[h][r]);
        }
    }
    for (int h = 0; h < H; h++)
        _mm256_storeu_ps(out + h * ostride, _mm256_mul_ps(reduce8_512(a[h]), _mm256_set1_ps(scale)));
}

/* score8_heads for every query head of a kv head, three at a time; one copy per dtype. */
#define BM_SCORE8_ALL(name, kvt)                                                                          \
    static void name(const float *q0, int64_t qsh, const void *k, int64_t d, int64_t g, float *out,       \
                     int64_t ostride, float scale, float ts) {                                             \
        int64_t h = 0;                                                                                     \
        for (; h + 3 <= g; h += 3) score8_heads(q0 + h * qsh, qsh, k, d, 3, out + h * ostride, ostride, scale, kvt, ts); \
        if (g - h == 2) score8_heads(q0 + h * qsh, qsh, k, d, 2, out + h * ostride, ostride, scale, kvt, ts); \
        if (g - h == 1) score8_heads(q0 + h * qsh, qsh, k, d, 1, out + h * ostride, ostride, scale, kvt, ts); \
    }
BM_SCORE8_ALL(score8_all, 0)
BM_SCORE8_ALL(score8_all_bf16, 1)
BM_SCORE8_ALL(score8_all_i8, 2)
BM_SCORE8_ALL(score8_all_f8, 3)
#else
#define BM_DECODE_AVX512 0
#endif

typedef struct {
    const void *q; /* float32, or bf16 where k, v and out are */
    int64_t q_stride_token, q_stride_head;
    const void *k, *v; /* [kv_heads, num_blocks, block_size, head_dim], contiguous */
    const int64_t *token_index, *block_table, *lengths;
    void *out; /* [tokens, heads, head_dim], contiguous */
    int64_t rows, max_blocks, heads, kv_heads, num_blocks, block_size, head_dim, max_len;
    float scale;
    float softcap;        /* > 0: scores become softcap * tanh(score / softcap) */
    const float *alibi;   /* NULL, or one ALiBi slope per query head */
    int64_t window;       /* > 0: each row attends only its last `window` keys */
    const float *sinks;   /* NULL, or per query head a logit in the softmax's denominator only */
    int64_t first, last; /* work items [first, last) of this thread */
    int status;
    int kvt; /* 0: float32 throughout; 1: q, k, v and out are bf16 (bm_paged_decode_bf16); 2: k and v are
                int8 rows, each d values then its float32 scale, q and out float32 (bm_paged_decode_i8);
                3: k and v are fp8 e4m3 rows, q and out float32 (bm_paged_decode_f8) */
    float k_scale, v_scale; /* kvt 3: the layer's key and value scales */
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
#define vt_load_kv KV16
#define vt_store _mm512_storeu_ps
#define vt_fma _mm512_fmadd_ps
#define vt_set1 _mm512_set1_ps
#define vt_mul _mm512_mul_ps
#elif BM_HAVE_AVX2
#define BM_VT_LANES 8
#define BM_VT_MAXH 2 /* 2 heads x 4 vectors, 4 of values, 1 weight: 13 of 16 registers */
typedef __m256 vt_t;
#define vt_load _mm256_loadu_ps
#define vt_load_kv KV8
#define vt_store _mm256_storeu_ps
#define vt_fma _mm256_fmadd_ps
#define vt_set1 _mm256_set1_ps
#define vt_mul _mm256_mul_ps
#endif

#ifdef BM_VT_LANES
/* acc[h][c] += w[h][o] * v[o][c] over keys o in [o0, n) of one block, for H heads and C vectors of
   columns, the accumulators held in registers across the keys. Per output element it is the same
   fused multiply-add, in the same key order, that the plain loop compiles to in these builds (each
   sum starts from 0 and takes one FMA per key), so the bits do not change; only the loads and stores of
   the accumulators between keys go. `vb` is the block's columns from the tile's first on, `rows` the
   block itself (where an int8 row's scale is found: d values on from the row's start). */
static inline __attribute__((always_inline)) void v_tile(float *acc, const float *w, int64_t wstride,
                                                         const void *vb, const void *rows, int64_t o0,
                                                         int64_t n, int64_t d, const int H, const int C,
                                                         const int kvt, float ts) {
    const int64_t rs = KV_ROW(d, kvt);
    vt_t r[BM_VT_MAXH][4];
    for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) r[h][c] = vt_load(acc + h * d + c * BM_VT_LANES);
    for (int64_t o = o0; o < n; o++) {
        vt_t v[4];
        for (int c = 0; c < C; c++) v[c] = vt_load_kv(vb, o * rs + c * BM_VT_LANES, kvt);
        if (kvt >= 2) { /* a quantized row: each value times its scale, as torch's dequantization */
            const vt_t sv = vt_set1(row_scale(KV_AT(rows, o * rs, kvt), d, kvt, ts));
            for (int c = 0; c < C; c++) v[c] = vt_mul(v[c], sv);
        }
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
        case 1: v_tile(acc, w, wstride, vb, rows, o0, n, d, H, 1, kvt, ts); break; \
        case 2: v_tile(acc, w, wstride, vb, rows, o0, n, d, H, 2, kvt, ts); break; \
        case 3: v_tile(acc, w, wstride, vb, rows, o0, n, d, H, 3, kvt, ts); break; \
        default: v_tile(acc, w, wstride, vb, rows, o0, n, d, H, 4, kvt, ts); break; \
        }                                                                 \
        break;

/* One tile of nh (<= BM_VT_MAXH) heads by nc (<= 4) vectors, sizes made compile-time constants; one
   copy per dtype (v_tile_any, v_tile_any_bf16). */
static inline __attribute__((always_inline)) void v_tile_kv(float *acc, const float *w, int64_t wstride,
                                                            const void *vb, const void *rows, int64_t o0,
                                                            int64_t n, int64_t d, int nh, int nc, const int kvt,
                                                            float ts) {
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

/* One copy per dtype; `ts`: an fp8 cache's value scale. */
#define BM_V_TILE_ANY(name, kvt)                                                                         \
    static void name(float *acc, const float *w, int64_t wstride, const void *vb, const void *rows,     \
                     int64_t o0, int64_t n, int64_t d, int nh, int nc, float ts) {                      \
        v_tile_kv(acc, w, wstride, vb, rows, o0, n, d, nh, nc, kvt, ts);                                 \
    }
BM_V_TILE_ANY(v_tile_any, 0)
BM_V_TILE_ANY(v_tile_any_i8, 2)
BM_V_TILE_ANY(v_tile_any_f8, 3)
#if BM_DECODE_AVX512
BM_V_TILE_ANY(v_tile_any_bf16, 1)
#endif
#endif

/* acc[h * d + i] += scores[h * span + o] * v[o][i] for the keys o in [o0, n) of one value block vb
   (sb = the block's first key's scores), heads h < g. */
static inline __attribute__((always_inline)) void accumulate_v(float *acc, const float *sb, int64_t span,
                                                               const void *vb, int64_t o0, int64_t n, int64_t g,
                                                               int64_t d, float *row, const int kvt, float ts) {
#ifdef BM_VT_LANES
    if (d % BM_VT_LANES == 0) {
        const int64_t vecs = d / BM_VT_LANES;
        for (int64_t h0 = 0; h0 < g; h0 += BM_VT_MAXH)
            for (int64_t c0 = 0; c0 < vecs; c0 += 4) {
                const int nh = (int)(g - h0 < BM_VT_MAXH ? g - h0 : BM_VT_MAXH);
                const int nc = (int)(vecs - c0 < 4 ? vecs - c0 : 4);
#if BM_DECODE_AVX512
                if (kvt == 1)
                    v_tile_any_bf16(acc + h0 * d + c0 * BM_VT_LANES, sb + h0 * span, span,
                                    KV_AT(vb, c0 * BM_VT_LANES, kvt), vb, o0, n, d, nh, nc, ts);
                else
#endif
                if (kvt == 2)
                    v_tile_any_i8(acc + h0 * d + c0 * BM_VT_LANES, sb + h0 * span, span,
                                  KV_AT(vb, c0 * BM_VT_LANES, kvt), vb, o0, n, d, nh, nc, ts);
                else if (kvt == 3)
                    v_tile_any_f8(acc + h0 * d + c0 * BM_VT_LANES, sb + h0 * span, span,
                                  KV_AT(vb, c0 * BM_VT_LANES, kvt), vb, o0, n, d, nh, nc, ts);
                else
                    v_tile_any(acc + h0 * d + c0 * BM_VT_LANES, sb + h0 * span, span,
                               KV_AT(vb, c0 * BM_VT_LANES, kvt), vb, o0, n, d, nh, nc, ts);
            }
        return;
    }
#endif
    for (int64_t o = o0; o < n; o++) {
        const void *vp = KV_AT(vb, o * KV_ROW(d, kvt), kvt);
        if (kvt >= 2) widen_row(row, vp, d, kvt, ts); /* `row`: d floats of scratch */
        for (int64_t h = 0; h < g; h++) {
            const float w = sb[h * span + o];
            float *ah = acc + h * d;
            if (kvt >= 2)
                for (int64_t i = 0; i < d; i++) ah[i] += w * row[i];
            else
                for (int64_t i = 0; i < d; i++) ah[i] += w * KV1(vp, i, kvt);
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

/* One (row, kv head): scores, softmax, values, out. `qw` is g * head_dim floats of scratch where a bf16
   row's query heads are widened first (then read as the float32 ones are, head_dim apart). */
static inline __attribute__((always_inline)) void attend_kv(const job_t *a, int64_t item, float *scores,
                                                            float *acc, float *qw, const int kvt) {
    const int64_t g = a->heads / a->kv_heads, d = a->head_dim, bs = a->block_size;
    const int64_t row = item / a->kv_heads, kvh = item % a->kv_heads;
    const int64_t len = a->lengths[row], tok = a->token_index[row];
    /* Under a window the row attends keys [first, len) only; blocks before it may be released and are
       never read. `span` keys, scored at scores[h * span + (j - first)]. */
    const int64_t first = a->window > 0 && len > a->window ? len - a->window : 0, span = len - first;
    const int64_t *table = a->block_table + row * a->max_blocks;
    const int64_t rs = KV_ROW(d, kvt); /* elements from one key (or value) row to the next */
    const int64_t head_stride = a->num_blocks * bs * rs;
    const void *kh = KV_AT(a->k, kvh * head_stride, kvt), *vh = KV_AT(a->v, kvh * head_stride, kvt);
    const float *q0;
    int64_t qsh = a->q_stride_head;
    if (kvt == 1) {
        const uint16_t *qb = (const uint16_t *)a->q + tok * a->q_stride_token + kvh * g * qsh;
        for (int64_t h = 0; h < g; h++)
            for (int64_t i = 0; i < d; i++) qw[h * d + i] = bf16_to_f32(qb[h * qsh + i]);
        q0 = qw;
        qsh = d;
    } else {
        q0 = (const float *)a->q + tok * a->q_stride_token + kvh * g * qsh;
    }
    /* floats' worth of a run of keys or values, for prefetch_block */
#define KV_FLOATS(n) ((n) * KV_ESZ(kvt) / 4)

    for (int64_t j0 = first / bs * bs, b = first / bs; j0 < len; j0 += bs, b++) {
        const void *kb = KV_AT(kh, table[b] * bs * rs, kvt);
        const int64_t n = len - j0 < bs ? len - j0 : bs;
        /* The next block sits anywhere in the pool, where the hardware prefetcher cannot guess it: ask
           for it now, while this one is scored. After the last key block, the first value block. */
        if (j0 + bs < len)
            prefetch_block(KV_AT(kh, table[b + 1] * bs * rs, kvt), KV_FLOATS((len - j0 - bs < bs ? len - j0 - bs : bs) * rs));
        else prefetch_block(KV_AT(vh, table[first / bs] * bs * rs, kvt), KV_FLOATS((bs < span ? bs : span) * rs));
        float *sb = scores - first + j0; /* sb[h * span + o]: key j0 + o */
        int64_t o = first > j0 ? first - j0 : 0;
#if BM_DECODE_AVX512
        if (d % 16 == 0) {
            if (kvt == 1)
                for (; o + 8 <= n; o += 8) score8_all_bf16(q0, qsh, KV_AT(kb, o * rs, kvt), d, g, sb + o, span, a->scale, a->k_scale);
            else if (kvt == 2)
                for (; o + 8 <= n; o += 8) score8_all_i8(q0, qsh, KV_AT(kb, o * rs, kvt), d, g, sb + o, span, a->scale, a->k_scale);
            else if (kvt == 3)
                for (; o + 8 <= n; o += 8) score8_all_f8(q0, qsh, KV_AT(kb, o * rs, kvt), d, g, sb + o, span, a->scale, a->k_scale);
            else
                for (; o + 8 <= n; o += 8) score8_all(q0, qsh, KV_AT(kb, o * rs, kvt), d, g, sb + o, span, a->scale, a->k_scale);
        }
#endif
#if BM_HAVE_AVX2
        if (d % 8 == 0)
            for (; o + 8 <= n; o += 8)
                for (int64_t h = 0; h < g; h++)
                    _mm256_storeu_ps(sb + h * span + o,
                                     _mm256_mul_ps(dot8(q0 + h * qsh, KV_AT(kb, o * rs, kvt), d, kvt, a->k_scale),
                                                   _mm256_set1_ps(a->scale)));
#endif
        for (; o < n; o++) {
            const void *kp = KV_AT(kb, o * rs, kvt);
            if (kvt >= 2) widen_row(qw, kp, d, kvt, a->k_scale); /* a quantized cache's queries are float32: qw is free */
            for (int64_t h = 0; h < g; h++) {
                const float *qp = q0 + h * qsh;
                float s = 0.f;
                if (kvt >= 2)
                    for (int64_t i = 0; i < d; i++) s += qp[i] * qw[i];
                else
                    for (int64_t i = 0; i < d; i++) s += qp[i] * KV1(kp, i, kvt);
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
        const void *vb = KV_AT(vh, table[b] * bs * rs, kvt);
        const int64_t n = len - j0 < bs ? len - j0 : bs;
        if (j0 + bs < len)
            prefetch_block(KV_AT(vh, table[b + 1] * bs * rs, kvt), KV_FLOATS((len - j0 - bs < bs ? len - j0 - bs : bs) * rs));
        accumulate_v(acc, scores - first + j0, span, vb, first > j0 ? first - j0 : 0, n, g, d, qw, kvt, a->v_scale);
    }
#undef KV_FLOATS
    if (kvt == 1) { /* rounded to nearest even, as torch's .to(torch.bfloat16) of the float32 result */
        uint16_t *o0 = (uint16_t *)a->out + (tok * a->heads + kvh * g) * d;
        for (int64_t x = 0; x < g * d; x++) o0[x] = f32_to_bf16(acc[x]);
    } else {
        float *o0 = (float *)a->out + (tok * a->heads + kvh * g) * d;
        for (int64_t x = 0; x < g * d; x++) o0[x] = acc[x];
    }
}

static void attend(const job_t *a, int64_t item, float *scores, float *acc, float *qw) {
    attend_kv(a, item, scores, acc, qw, 0);
}

static void attend_i8(const job_t *a, int64_t item, float *scores, float *acc, float *qw) {
    attend_kv(a, item, scores, acc, qw, 2);
}

static void attend_f8(const job_t *a, int64_t item, float *scores, float *acc, float *qw) {
    attend_kv(a, item, scores, acc, qw, 3);
}

#if BM_DECODE_AVX512
static void attend_bf16(const job_t *a, int64_t item, float *scores, float *acc, float *qw) {
    attend_kv(a, item, scores, acc, qw, 1);
}
#endif

/* A work item in the job's dtype. */
static void attend_item(const job_t *a, int64_t item, float *scores, float *acc, float *qw) {
#if BM_DECODE_AVX512
    if (a->kvt == 1) {
        attend_bf16(a, item, scores, acc, qw);
        return;
    }
#endif
    if (a->kvt == 2) {
        attend_i8(a, item, scores, acc, qw);
        return;
    }
    if (a->kvt == 3) {
        attend_f8(a, item, scores, acc, qw);
        return;
    }
    attend(a, item, scores, acc, qw);
}

#ifndef BM_OPENMP
static void *run(void *arg) {
    job_t *a = (job_t *)arg;
    const int64_t g = a->heads / a->kv_heads;
    float *scores = malloc(sizeof(float) * (size_t)(g * (a->max_len > 0 ? a->max_len : 1) + 2 * g * a->head_dim));
    if (!scores) { a->status = 1; return NULL; }
    float *acc = scores + g * a->max_len;
    for (int64_t it = a->first; it < a->last; it++) attend_item(a, it, scores, acc, acc + g * a->head_dim);
    free(scores);
    return NULL;
}
#endif

/* The job over threads. Returns 0 on success, nonzero if a thread's scratch memory could not be
   allocated (the caller must then discard `out`). A thread that cannot be started leaves its share to
   the calling thread. */
static int run_job(const job_t job, int64_t threads) {
    const int64_t items = job.rows * job.kv_heads;
    if (threads > items) threads = items;
    if (threads < 1) threads = 1;
#ifdef BM_OPENMP
    /* torch's own OpenMP runtime (bm links this file against the copy torch loaded): its worker threads
       are still spinning from the last torch op, so they take these items at once instead of competing
       for the cores with threads of our own. Dynamic chunks even out rows of different lengths. */
    const int64_t g = job.heads / job.kv_heads, max_len = job.max_len, head_dim = job.head_dim;
    int status = 0;
#pragma omp parallel num_threads((int)threads) reduction(| : status)
    {
        float *scores = malloc(sizeof(float) * (size_t)(g * (max_len > 0 ? max_len : 1) + 2 * g * head_dim));
        if (!scores) status |= 1;
#pragma omp for schedule(dynamic, 4)
        for (int64_t it = 0; it < items; it++)
            if (scores) attend_item(&job, it, scores, scores + g * max_len, scores + g * max_len + g * head_dim);
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

/* One exported entry per cache dtype: `qt` the queries' and output's element type, `kt` the cache's;
   `k_scale` and `v_scale` are read by the fp8 entry only. Each returns 0 on success, nonzero if a thread's scratch memory could not be allocated (the caller
   must then discard `out`). */
#define BM_DECODE_ENTRY(name, qt, kt, kvt)                                                                  \
    int name(const qt *q, int64_t q_stride_token, int64_t q_stride_head, const kt *k, const kt *v,         \
             const int64_t *token_index, const int64_t *block_table, const int64_t *lengths, qt *out,      \
             int64_t rows, int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t num_blocks,        \
             int64_t block_size, int64_t head_dim, int64_t max_len, float scale, float softcap,            \
             const float *alibi, int64_t window, const float *sinks, float k_scale, float v_scale,         \
             int64_t threads) {                                                                             \
        const job_t job = {q, q_stride_token, q_stride_head, k, v, token_index, block_table, lengths, out,  \
                           rows, max_blocks, heads, kv_heads, num_blocks, block_size, head_dim, max_len,   \
                           scale, softcap, alibi, window, sinks, 0, rows * kv_heads, 0, kvt, k_scale,      \
                           v_scale};                                                                        \
        return run_job(job, threads);                                                                      \
    }

BM_DECODE_ENTRY(bm_paged_decode_f32, float, float, 0)

/* The same over an int8 cache (kv_cache.dtype: int8): each key and value row is head_dim int8 values and
   then its float32 scale (rows head_dim + 4 bytes apart); q and out are float32. Each value is widened
   and multiplied by its row's scale in a register, the float32 product torch's dequantization makes, and
   everything after is the float32 kernel's: so this gives exactly what bm_paged_decode_f32 gives on the
   dequantized cache, reading about a quarter of its bytes. Every build has it. */
BM_DECODE_ENTRY(bm_paged_decode_i8, float, int8_t, 2)

/* The same over an fp8 cache (kv_cache.dtype: fp8_e4m3): head_dim float8 e4m3 values a row, the layer's
   keys scaled by k_scale and its values by v_scale; q and out float32. Each value is widened exactly and
   multiplied by its scale in a register, the float32 product torch's dequantization makes: exactly
   bm_paged_decode_f32 on the dequantized cache, reading a quarter of its bytes. Every build has it. */
BM_DECODE_ENTRY(bm_paged_decode_f8, float, uint8_t, 3)

#if BM_DECODE_AVX512
/* The same over a bf16 cache, bf16 queries (strides in elements) and a bf16 `out`: keys, values and
   queries widened to float32 in registers, everything after as the float32 kernel computes it, the
   result rounded to bf16 (nearest even). Halves the bytes a decode step reads from the cache, which
   bounds this kernel's speed. Only the AVX-512 builds have it (bm.runtime.native.kv_cache_dtype keeps a
   float32 cache elsewhere; docs/cpu-kernels.md says why). */
BM_DECODE_ENTRY(bm_paged_decode_bf16, uint16_t, uint16_t, 1)
#endif

/* Writes a forward's new keys and values into the cache: for token t and kv head h, the d elements at
   k + t * k_st + h * k_sh go to ck + (h * num_slots + slots[t]) * d, and the same for v into cv (each
   cache half is [kv_heads, num_slots, d]; strides in elements of `esz` bytes). Unit stride along d.
   This is what two torch index_copy_ calls did per layer; they moved about 2.4 GB/s on strided rows, a
   plain copy several times that. A copy changes no bits. Returns 1 (having written nothing) if a slot
   lies outside [0, num_slots). */
static int kv_write(const char *k, int64_t k_st, int64_t k_sh, const char *v, int64_t v_st, int64_t v_sh,
                    char *ck, char *cv, const int64_t *slots, int64_t tokens, int64_t kv_heads,
                    int64_t num_slots, int64_t d, int64_t threads, int64_t esz) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    const size_t row = (size_t)(esz * d);
#ifdef BM_OPENMP
    if (threads > 1 && tokens * kv_heads * row >= 65536 * 4) { /* below that, waking a thread costs more */
#pragma omp parallel for num_threads((int)threads) schedule(static)
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t h = 0; h < kv_heads; h++) {
                memcpy(ck + (h * num_slots + slots[t]) * d * esz, k + (t * k_st + h * k_sh) * esz, row);
                memcpy(cv + (h * num_slots + slots[t]) * d * esz, v + (t * v_st + h * v_sh) * esz, row);
            }
        return 0;
    }
#endif
    (void)threads;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < kv_heads; h++) {
            memcpy(ck + (h * num_slots + slots[t]) * d * esz, k + (t * k_st + h * k_sh) * esz, row);
            memcpy(cv + (h * num_slots + slots[t]) * d * esz, v + (t * v_st + h * v_sh) * esz, row);
        }
    return 0;
}

int bm_kv_write_f32(const float *k, int64_t k_st, int64_t k_sh, const float *v, int64_t v_st, int64_t v_sh,
                    float *ck, float *cv, const int64_t *slots, int64_t tokens, int64_t kv_heads,
                    int64_t num_slots, int64_t d, int64_t threads) {
    return kv_write((const char *)k, k_st, k_sh, (const char *)v, v_st, v_sh, (char *)ck, (char *)cv, slots,
                    tokens, kv_heads, num_slots, d, threads, 4);
}

/* The same for a bf16 cache (keys and values copied as they are: the projections' bf16). */
int bm_kv_write_bf16(const uint16_t *k, int64_t k_st, int64_t k_sh, const uint16_t *v, int64_t v_st,
                     int64_t v_sh, uint16_t *ck, uint16_t *cv, const int64_t *slots, int64_t tokens,
                     int64_t kv_heads, int64_t num_slots, int64_t d, int64_t threads) {
    return kv_write((const char *)k, k_st, k_sh, (const char *)v, v_st, v_sh, (char *)ck, (char *)cv, slots,
                    tokens, kv_heads, num_slots, d, threads, 2);
}
