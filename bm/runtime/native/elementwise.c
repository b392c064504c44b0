/* The elementwise chains of a decoder layer, each in one pass over memory, in float32 (bfloat16 at the end).
 *
 * In transformers' eager code an RMSNorm is seven torch operations, rotary embedding seven per tensor
 * and SiLU(gate) * up two, each reading and writing a whole activation tensor and each paying torch's
 * dispatch. On a 30-layer model at decode batch sizes that dispatch, not the arithmetic, dominates; at
 * prefill sizes it is the repeated trips to memory. Here each chain reads its inputs once and writes its
 * output once, and splits rows over OpenMP threads only when there is enough work to pay for the fork.
 *
 * The arithmetic follows transformers' formulas operation by operation (the same products and sums in
 * the same order per element); only the reduction order of RMSNorm's mean and the exp of SiLU differ
 * from torch's, by float rounding.
 *
 * Built per instruction set (bm/cpu_isa.py): AVX-512 loops take sixteen lanes first, then the
 * AVX2 loops eight, then plain C the rest. Rotary and SiLU give the same bits in every build (the same
 * per-element operations); RMSNorm's sum of squares is reduced in another order per build. Each row is
 * computed alone, so no result depends on the rest of the batch.
 */
#include <math.h>
#include <stdint.h>

/* Keep each product rounded on its own, as torch's separate multiply and add kernels do. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

#include "isa.h" /* BM_HAVE_AVX2, BM_HAVE_AVX512; bm_exp8, bm_silu_mul16 */
#include "bf16.h"

/* Below this many elements one thread does the whole tensor: waking the other costs more. */
#define PARALLEL_MIN 32768

/* One row: y = w * (x * (1 / sqrt(mean(x^2) + eps))). Shared by the plain and the add-fused RMSNorm, so
   the two give the same bits for the same input row. */
static void rms_row(const float *xr, const float *w, float *yr, int64_t cols, float eps)
{
    int64_t c = 0;
    float sum = 0.0f;
#if BM_HAVE_AVX512
    __m512 z0 = _mm512_setzero_ps(), z1 = _mm512_setzero_ps();
    for (; c + 32 <= cols; c += 32) {
        const __m512 a = _mm512_loadu_ps(xr + c), b = _mm512_loadu_ps(xr + c + 16);
        z0 = _mm512_fmadd_ps(a, a, z0);
        z1 = _mm512_fmadd_ps(b, b, z1);
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
#endif
#if BM_HAVE_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; c + 16 <= cols; c += 16) {
        const __m256 a = _mm256_loadu_ps(xr + c), b = _mm256_loadu_ps(xr + c + 8);
        s0 = _mm256_fmadd_ps(a, a, s0);
        s1 = _mm256_fmadd_ps(b, b, s1);
    }
    s0 = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    sum += _mm_cvtss_f32(h);
#endif
    for (; c < cols; c++)
        sum += xr[c] * xr[c];
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    c = 0;
#if BM_HAVE_AVX512
    const __m512 zinv = _mm512_set1_ps(inv);
    for (; c + 16 <= cols; c += 16) {
        const __m512 n = _mm512_mul_ps(_mm512_loadu_ps(xr + c), zinv);
        _mm512_storeu_ps(yr + c, _mm512_mul_ps(_mm512_loadu_ps(w + c), n));
    }
#endif
#if BM_HAVE_AVX2
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; c + 8 <= cols; c += 8) {
        const __m256 n = _mm256_mul_ps(_mm256_loadu_ps(xr + c), vinv);
        _mm256_storeu_ps(yr + c, _mm256_mul_ps(_mm256_loadu_ps(w + c), n));
    }
#endif
    for (; c < cols; c++)
        yr[c] = w[c] * (xr[c] * inv);
}

/* rows of x [rows, cols] (row stride ldx) -> y [rows, cols] contiguous:
   y = w * (x * (1 / sqrt(mean(x^2) + eps))) */
void bm_rms_norm_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t rows, int64_t cols,
                     float eps, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && rows > 1 && rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        rms_row(x + r * ldx, w, y + r * cols, cols, eps);
}

/* A decoder layer's residual add and the RMSNorm after it, in one pass: s = a + b (rows of a and b with
   row strides lda, ldb; s [rows, cols] contiguous, the new residual), then y = RMSNorm(s) as
   bm_rms_norm_f32 computes it, while the row is still in L1. Torch's separate add wrote s to memory
   and the norm read it back; each element's sum is the same single float add, so s and y are
   bitwise what the two calls give. */
void bm_add_rms_norm_f32(const float *a, int64_t lda, const float *b, int64_t ldb, const float *w, float *s,
                         float *y, int64_t rows, int64_t cols, float eps, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && rows > 1 && rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *ar = a + r * lda, *br = b + r * ldb;
        float *sr = s + r * cols;
        int64_t c = 0;
#if BM_HAVE_AVX512
        for (; c + 16 <= cols; c += 16)
            _mm512_storeu_ps(sr + c, _mm512_add_ps(_mm512_loadu_ps(ar + c), _mm512_loadu_ps(br + c)));
#endif
#if BM_HAVE_AVX2
        for (; c + 8 <= cols; c += 8)
            _mm256_storeu_ps(sr + c, _mm256_add_ps(_mm256_loadu_ps(ar + c), _mm256_loadu_ps(br + c)));
#endif
        for (; c < cols; c++)
            sr[c] = ar[c] + br[c];
        rms_row(sr, w, y + r * cols, cols, eps);
    }
}


/* y[r] = silu(g[r]) * u[r] for rows of g and u (row strides ldg, ldu), y [rows, cols] contiguous;
   silu(v) = v / (1 + e^-v), as torch computes it. */
void bm_silu_mul_f32(const float *g, int64_t ldg, const float *u, int64_t ldu, float *y, int64_t rows,
                     int64_t cols, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && rows > 1 && rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *gr = g + r * ldg, *ur = u + r * ldu;
        float *yr = y + r * cols;
        int64_t c = 0;
#if BM_HAVE_AVX512
        for (; c + 16 <= cols; c += 16)
            _mm512_storeu_ps(yr + c, bm_silu_mul16(_mm512_loadu_ps(gr + c), _mm512_loadu_ps(ur + c)));
#endif
#if BM_HAVE_AVX2
        const __m256 one = _mm256_set1_ps(1.0f);
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (; c + 8 <= cols; c += 8) {
            const __m256 v = _mm256_loadu_ps(gr + c);
            const __m256 e = bm_exp8(_mm256_xor_ps(v, sign));
            const __m256 s = _mm256_div_ps(v, _mm256_add_ps(one, e));
            _mm256_storeu_ps(yr + c, _mm256_mul_ps(s, _mm256_loadu_ps(ur + c)));
        }
#endif
        for (; c < cols; c++)
            yr[c] = gr[c] / (1.0f + expf(-gr[c])) * ur[c];
    }
}

/* Rotary embedding of x [tokens, heads, d] (strides ldt per token, ldh per head, unit along d) into
   y [tokens, heads, d] contiguous, with cos/sin [tokens, d] contiguous:
   y = x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x[d/2:], x[:d/2]). */
void bm_rotary_f32(const float *x, int64_t ldt, int64_t ldh, const float *cos_, const float *sin_, float *y,
                   int64_t tokens, int64_t heads, int64_t d, int64_t threads)
{
    const int64_t half = d / 2;
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && tokens > 1 && tokens * heads * d >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const float *ct = cos_ + t * d, *st = sin_ + t * d;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + t * ldt + h * ldh;
            float *yr = y + (t * heads + h) * d;
            int64_t i = 0;
#if BM_HAVE_AVX512
            for (; i + 16 <= half; i += 16) {
                const __m512 lo = _mm512_loadu_ps(xr + i), hi = _mm512_loadu_ps(xr + half + i);
                const __m512 a = _mm512_mul_ps(lo, _mm512_loadu_ps(ct + i));
                const __m512 b = _mm512_mul_ps(hi, _mm512_loadu_ps(st + i));
                _mm512_storeu_ps(yr + i, _mm512_sub_ps(a, b));
                const __m512 c = _mm512_mul_ps(hi, _mm512_loadu_ps(ct + half + i));
                const __m512 e = _mm512_mul_ps(lo, _mm512_loadu_ps(st + half + i));
                _mm512_storeu_ps(yr + half + i, _mm512_add_ps(c, e));
            }
#endif
#if BM_HAVE_AVX2
            for (; i + 8 <= half; i += 8) {
                const __m256 lo = _mm256_loadu_ps(xr + i), hi = _mm256_loadu_ps(xr + half + i);
                /* first half: lo * cos - hi * sin; second half: hi * cos + lo * sin (two products, one sum) */
                const __m256 a = _mm256_mul_ps(lo, _mm256_loadu_ps(ct + i));
                const __m256 b = _mm256_mul_ps(hi, _mm256_loadu_ps(st + i));
                _mm256_storeu_ps(yr + i, _mm256_sub_ps(a, b));
                const __m256 c = _mm256_mul_ps(hi, _mm256_loadu_ps(ct + half + i));
                const __m256 e = _mm256_mul_ps(lo, _mm256_loadu_ps(st + half + i));
                _mm256_storeu_ps(yr + half + i, _mm256_add_ps(c, e));
            }
#endif
            for (; i < half; i++) {
                const float a = xr[i] * ct[i], b = xr[half + i] * st[i];
                yr[i] = a - b;
                const float c = xr[half + i] * ct[half + i], e = xr[i] * st[half + i];
                yr[half + i] = c + e;
            }
        }
    }
}

/* ---- bfloat16 ------------------------------------------------------------------------------------
 * The same chains on bfloat16 tensors (a bf16 model on the CPU), each intermediate rounded to bf16
 * where torch's bf16 ops round it: torch computes every bf16 elementwise op in float32 and rounds its
 * result, so a chain of ops is a chain of float32 operations with a rounding after each. The arithmetic
 * in between is the float32 code's; plain C that the compiler vectorises (the conversions are integer
 * shifts and adds). */

/* bf16_to_f32, f32_to_bf16, round_bf16 and their sixteen-lane forms: bf16.h. */

/* One row of transformers' Llama RMSNorm in bf16: x to float32, x * (1 / sqrt(mean(x^2) + eps)) rounded
   to bf16, times the bf16 weight, rounded. Widening a bf16 value is a shift, so the row is widened
   again in the second loop rather than kept in a float32 copy. */
static void rms_row_bf16(const uint16_t *xr, const uint16_t *w, uint16_t *yr, int64_t cols, float eps)
{
    float sum = 0.0f;
    for (int64_t c = 0; c < cols; c++) {
        const float v = bf16_to_f32(xr[c]);
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    for (int64_t c = 0; c < cols; c++)
        yr[c] = f32_to_bf16(bf16_to_f32(w[c]) * round_bf16(bf16_to_f32(xr[c]) * inv));
}

void bm_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t rows,
                      int64_t cols, float eps, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && rows > 1 && rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        rms_row_bf16(x + r * ldx, w, y + r * cols, cols, eps);
}

/* s = a + b rounded to bf16 (torch's bf16 add), stored as the new residual, then RMSNorm(s). */
void bm_add_rms_norm_bf16(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, const uint16_t *w,
                          uint16_t *s, uint16_t *y, int64_t rows, int64_t cols, float eps, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && rows > 1 && rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *ar = a + r * lda, *br = b + r * ldb;
        uint16_t *sr = s + r * cols;
        for (int64_t c = 0; c < cols; c++)
            sr[c] = f32_to_bf16(bf16_to_f32(ar[c]) + bf16_to_f32(br[c]));
        rms_row_bf16(sr, w, y + r * cols, cols, eps);
    }
}

/* silu(g) rounded to bf16, times u, rounded: torch's SiLU then multiply in bf16. */
void bm_silu_mul_bf16(const uint16_t *g, int64_t ldg, const uint16_t *u, int64_t ldu, uint16_t *y,
                      int64_t rows, int64_t cols, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && rows > 1 && rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gr = g + r * ldg, *ur = u + r * ldu;
        uint16_t *yr = y + r * cols;
        int64_t c = 0;
#if BM_HAVE_AVX512
        for (; c + 16 <= cols; c += 16) {
            const __m512 act = bf16x16_round(bm_silu16(bf16x16_load(gr + c)));
            bf16x16_store(yr + c, _mm512_mul_ps(act, bf16x16_load(ur + c)));
        }
#endif
        for (; c < cols; c++) {
            const float v = bf16_to_f32(gr[c]);
            yr[c] = f32_to_bf16(round_bf16(v / (1.0f + expf(-v))) * bf16_to_f32(ur[c]));
        }
    }
}

/* Rotary embedding in bf16 (layout as bm_rotary_f32): each product rounded, then their sum. */
void bm_rotary_bf16(const uint16_t *x, int64_t ldt, int64_t ldh, const uint16_t *cos_, const uint16_t *sin_,
                    uint16_t *y, int64_t tokens, int64_t heads, int64_t d, int64_t threads)
{
    const int64_t half = d / 2;
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && tokens > 1 && tokens * heads * d >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *ct = cos_ + t * d, *st = sin_ + t * d;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xr = x + t * ldt + h * ldh;
            uint16_t *yr = y + (t * heads + h) * d;
            int64_t i = 0;
#if BM_HAVE_AVX512
            for (; i + 16 <= half; i += 16) {
                const __m512 lo = bf16x16_load(xr + i), hi = bf16x16_load(xr + half + i);
                const __m512 a = bf16x16_round(_mm512_mul_ps(lo, bf16x16_load(ct + i)));
                const __m512 b = bf16x16_round(_mm512_mul_ps(hi, bf16x16_load(st + i)));
                bf16x16_store(yr + i, _mm512_sub_ps(a, b));
                const __m512 c = bf16x16_round(_mm512_mul_ps(hi, bf16x16_load(ct + half + i)));
                const __m512 e = bf16x16_round(_mm512_mul_ps(lo, bf16x16_load(st + half + i)));
                bf16x16_store(yr + half + i, _mm512_add_ps(c, e));
            }
#endif
            for (; i < half; i++) {
                const float lo = bf16_to_f32(xr[i]), hi = bf16_to_f32(xr[half + i]);
                const float a = round_bf16(lo * bf16_to_f32(ct[i])), b = round_bf16(hi * bf16_to_f32(st[i]));
                yr[i] = f32_to_bf16(a - b);
                const float c = round_bf16(hi * bf16_to_f32(ct[half + i]));
                const float e = round_bf16(lo * bf16_to_f32(st[half + i]));
                yr[half + i] = f32_to_bf16(c + e);
            }
        }
    }
}
