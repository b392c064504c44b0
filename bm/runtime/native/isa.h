/* The instruction set a build of bm's kernels targets, as the variant's compiler flags select it.
 *
 * Each kernel is compiled once per variant (bm/cpu_isa.py: avx512, avx2, scalar; native off x86-64)
 * from the same source, whose vector paths sit behind these two switches:
 *   BM_HAVE_AVX2    AVX2 and FMA: 8-lane loops; <immintrin.h> and vec_exp.h (bm_exp8 ...) are included;
 *   BM_HAVE_AVX512  that and AVX-512F: 16-lane loops first (vec_exp.h's bm_exp16, bm_silu_mul16 ...).
 * With neither, the plain C loops run. One definition for every kernel, so a variant means the same
 * thing in each (bm.runtime.native.build hashes this header into every kernel's cache key).
 *
 * A source's own pragmas (fp-contract, the order of its sums) go before this include, so that they
 * apply to the intrinsics' inline functions too. */
#ifndef BM_ISA_H
#define BM_ISA_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vec_exp.h"
#define BM_HAVE_AVX2 1
#else
#define BM_HAVE_AVX2 0
#endif

#if BM_HAVE_AVX2 && defined(__AVX512F__)
#define BM_HAVE_AVX512 1
#else
#define BM_HAVE_AVX512 0
#endif

#include <stdint.h>
#ifdef BM_OPENMP
#include <omp.h>
#endif

/* The threads of a team for `items` work items: at most `num_threads`, no more than there are items,
 * at least one. */
static inline int64_t bm_team_size(int64_t num_threads, int64_t items)
{
    const int64_t team = num_threads < items ? num_threads : items;
    return team < 1 ? 1 : team;
}

/* The calling thread's share [*lo, *hi) of `items` work items split into contiguous runs over its team
 * (all of them outside a parallel region). A work item is whole columns of an output, so each output
 * is computed by one thread in one order however many threads share the call. */
static inline void bm_thread_share(int64_t items, int64_t *lo, int64_t *hi)
{
#ifdef BM_OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
    *lo = items * t / nt;
    *hi = items * (t + 1) / nt;
}

#endif
