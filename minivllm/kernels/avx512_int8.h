// Pieces of int8_w8a8 that both kernel families use (kernels.h includes this
// for the bf16 one; the AVX2 family's avx2_vnni.cpp for fp32 engines on AVX-512 CPUs
// without AVX512-BF16). Each carries its own target, so a file built for AVX2 alone can
// include it; callers built with the same features inline them.
#pragma once

#include <immintrin.h>

#include <cstdint>

// parallel_for's grain for quantizing rows of x: they split once a batch holds more than
// ~8K values, where a thread's share pays for starting it. A decode batch's 16 rows of 1024 had gone to one
// thread (~0.8 ms of a 57 ms int8_w8a8 step on a 2-core Zen 4, the other thread waiting).
inline int64_t quantize_grain(int64_t K) { return K >= 8192 ? 1 : 8192 / (K > 0 ? K : 1); }

#pragma GCC push_options
#pragma GCC target("avx512f")
// int8_w8a8's output scaling, (acc * xs) * scale, rounded after each product as
// formats.reference_linear does. The rounding-mode forms keep -ffast-math from
// reassociating it into acc * (xs * scale), which differs in the last bit and, about once
// in 10^5 outputs, in the bf16 result (quant_w8a8.cpp, amx_w8a8.cpp).
inline __m512 scale_in_order(__m512 acc, __m512 xs, __m512 scale) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return _mm512_mul_round_ps(_mm512_mul_round_ps(acc, xs, kNearest), scale, kNearest);
}
inline float scale_in_order(float acc, float xs, float scale) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m128 a = _mm_mul_round_ss(_mm_set_ss(acc), _mm_set_ss(xs), kNearest);
  return _mm_cvtss_f32(_mm_mul_round_ss(a, _mm_set_ss(scale), kNearest));
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vnni")
// acc += a . b in place, vpdpbusd: a's unsigned bytes times b's signed ones, four products
// a lane. With the intrinsic GCC copied accumulator arrays through other registers every
// step (on the AMD EPYC Zen 4 the int8 GEMM ran at half its rate for the moves); the asm
// pins each accumulator in its register.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}
#pragma GCC pop_options
