// Vector math for the AVX2 family (avx2_*.cpp): 8 fp32 lanes, AVX2 + FMA (+ F16C).
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

// 8 fp8 bytes at p as fp32, through fp16 and F16C's vcvtph2ps (exact). An fp8 number
// is a narrower fp16: e5m2 is fp16's top byte (the same 5-bit exponent and bias); e4m3's
// 7 magnitude bits shifted left by 7 land on fp16's exponent and mantissa fields with the
// exponent's top bit clear, which reads as the value times 2^-8 (bias 15 against 7),
// subnormals included, and one multiply by 2^8 (exact) restores it; its sign, bit 7
// sign-extended to 16 bits and shifted, lands on bit 15 (and 14, masked off). So every
// value decodes exactly whatever MXCSR's DAZ/FTZ say (the fp16 values are normal in fp32,
// e4m3's smallest, 2^-9, as 2^-17). e4m3's NaN byte reads as 480 (its pattern's number);
// e5m2's inf and NaN as themselves. (On Zen 1, 12 vector uops per 8 values before, when
// the bits were moved into fp32 and rebiased by a multiply by 2^120, and ~8 here.)
// fp8x8_fp16<4> is the e4m3 values times 2^-8, for callers that fold the 2^8 into a scale
// they apply anyway (exact: a power of two).
template <int EXP = 4>
inline __m256 fp8x8_fp16(const uint8_t* p) {
  static_assert(EXP == 4 || EXP == 5, "e4m3 or e5m2");
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (EXP == 5) {
    return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
  } else {
    const __m128i bits = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7),
                                       _mm_set1_epi16(static_cast<short>(0xBF80)));
    return _mm256_cvtph_ps(bits);
  }
}
template <int EXP = 4>
inline __m256 fp8x8(const uint8_t* p) {
  const __m256 v = fp8x8_fp16<EXP>(p);
  return EXP == 5 ? v : _mm256_mul_ps(v, _mm256_set1_ps(256.f));
}

}  // namespace
