/* Included by a kernel whose every output is one float32 chain in a fixed order, with its scale and bias
 * applied apart (int8_gemm.c, group_gemm.c): bm builds with -fassociative-math, so the chains must keep
 * their order (batch invariance), and no multiply and add may contract into a fused multiply-add the
 * code does not write. Pragmas, so it goes before the kernel's functions. */
#ifndef BM_ORDERED_FP_H
#define BM_ORDERED_FP_H

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-associative-math")
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp reassociate(off)
#pragma clang fp contract(off)
#endif

#endif
