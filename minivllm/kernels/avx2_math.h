// Vector math for the AVX2 family (avx2_*.cpp): 8 fp32 lanes, AVX2 + FMA only.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace {

// exp(x) for 8 lanes: 2^(x log2 e) = 2^n 2^f, f in [-0.5, 0.5], a degree-6 polynomial for
// 2^f (relative error ~2e-7) and 2^n built in the exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(1.5353362e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MXCSR's DAZ (bit 6) and FTZ (bit 15) cleared while alive, restored after.
class KeepSubnormals {
 public:
  KeepSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~((1u << 6) | (1u << 15))); }
  ~KeepSubnormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

// 8 fp8 bytes at p as fp32, with EXP exponent bits (4: e4m3, 5: e5m2; avx2_quant.cpp's
// header says how): the 7 magnitude bits shifted left by 16 + EXP put the exponent field
// and mantissa where fp32's are, the sign goes to bit 31, and one multiply by
// 2^(127 - bias) rebiases. Their subnormals need KeepSubnormals alive in the calling thread.
template <int EXP = 4>
inline __m256 fp8x8(const uint8_t* p) {
  constexpr int shift = 16 + EXP;                        // 20 for e4m3, 21 for e5m2
  constexpr int rebias = 127 - ((1 << (EXP - 1)) - 1);  // 120, 112
  const __m256i d = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(_mm256_slli_epi32(d, shift), _mm256_set1_epi32(0x7F << shift));
  const __m256i sign = _mm256_and_si256(d, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 scale = _mm256_castsi256_ps(_mm256_set1_epi32((127 + rebias) << 23));  // 2^rebias
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(magnitude, sign)), scale);
}

}  // namespace
