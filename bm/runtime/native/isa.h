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

#endif
