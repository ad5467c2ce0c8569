// Online quantization of bf16 weights at load: formats.quantize's int8, int4 and fp8
// schemes, bit for bit, in one pass over each row (the packed copies some schemes' GEMMs
// read are pack_weights.cpp's).
//
// formats._quantize_rows does it in torch ops on float32 copies of 256 K-element chunks:
// ~0.5 G weights a second on a 2-core AMD EPYC (Zen 4), ~7 s of a Qwen3-4B-shaped load.
// Here a row is read once (its amax or its groups' ranges), then quantized and written,
// with the same float32 arithmetic in the same order: true divisions (the rounding-mode
// forms, which -ffast-math cannot turn into reciprocals), rounding half to even, clamps
// on the integers (the reference clamps the rounded floats, the same numbers).
//
//  int8 (kind 1): scale = amax|w_row| / 127 (1 for a zero row), q = clamp(round(w / scale), +-127)
//                 (quantize_row_int8: int8_w8a8's activations take the same formula), and
//                 where asked int8_w8a8's wsum = sum_k q (torch's int8 -> int32 row sums of
//                 a whole weight ran ~1 G values a second, slower than quantizing it).
//  int4 (kind 2), per group of G k:
//    symmetric:  scale = amax|w_g| / 7 (1 for a zero group), q = clamp(round(w / scale), -8, 7) + 8;
//    asymmetric: lo = min(min w_g, 0), hi = max(max w_g, 0), scale = (hi - lo) / 15 (1 where
//                hi == lo), zero = clamp(round(-lo / scale), 0, 15),
//                q = clamp(round(w / scale) + zero, 0, 15);
//    packed as formats.pack_int4: chunks of 32 k, byte j = q[j] | q[16 + j] << 4.
//  fp8 (kind 3, fp8_w8a16): scale = amax|w_row| / 448 (1 for a zero row),
//                 q = e4m3fn(clamp(w / scale, +-448)), rounded to nearest even as torch's
//                 conversion rounds (its subnormals, multiples of 2^-9, included).
// A row (int4: a group) holding a NaN gets a NaN scale, which formats.quantize refuses, as
// the torch ops' NaN amax does.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

using bf16 = at::BFloat16;
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline float div_round(float a, float b) {
  return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(a), _mm_set_ss(b), kRound));
}

inline float round_even(float a) {
  return _mm_cvtss_f32(_mm_round_ss(_mm_setzero_ps(), _mm_set_ss(a), kRound));
}

// round(x / s) as int32 lanes, half to even
inline __m512i rounded_quotient(const bf16* x, __m512 s) {
  return _mm512_cvt_roundps_epi32(_mm512_div_round_ps(load_bf16x16(x), s, kRound), kRound);
}

// Whether x[0, K) holds a NaN (K % 16 == 0): the max that finds amax drops NaNs. Read on
// the bits (exponent all ones, mantissa not zero), which -ffast-math leaves alone.
bool has_nan(const bf16* x, int64_t K) {
  const __m256i magnitude = _mm256_set1_epi16(0x7FFF), inf = _mm256_set1_epi16(0x7F80);
  __mmask16 nan = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k));
    nan |= _mm256_cmpgt_epi16_mask(_mm256_and_si256(v, magnitude), inf);
  }
  return nan != 0;
}

// e4m3fn bits of v (|v| <= 448, no NaN), rounded to nearest even: normal numbers drop 20
// mantissa bits (a carry moves into the exponent) and rebias 127 -> 7; below 2^-6 the
// value is a multiple of 2^-9, 0..8 (8: the smallest normal, whose bits are the same).
inline __m128i e4m3_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(mag, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), odd));
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(up, 20), _mm512_set1_epi32(120 << 3));
  const __m512 absv = _mm512_castsi512_ps(mag);
  const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(absv, _mm512_set1_ps(512.f)), kRound);
  const __mmask16 small = _mm512_cmp_ps_mask(absv, _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ);
  return _mm512_cvtepi32_epi8(_mm512_or_si512(sign, _mm512_mask_blend_epi32(small, normal, sub)));
}

float fp8_row(const bf16* x, int64_t K, uint8_t* q) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16x16(x + k)));
  const float top = _mm512_reduce_max_ps(amax);
  const float s = top > 0.f ? div_round(top, 448.f) : 1.f;
  const __m512 vs = _mm512_set1_ps(s), lim = _mm512_set1_ps(448.f), neg = _mm512_set1_ps(-448.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_round_ps(load_bf16x16(x + k), vs, kRound), neg), lim);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), e4m3_bits(v));
  }
  return s;
}

// One row's int4 values (0..15, one byte each) into q, its scales and zero points (zero:
// nullptr for symmetric) into scale[K / G], zero[K / G]. G % 16 == 0.
void int4_row(const bf16* x, int64_t K, int64_t G, float* scale, float* zero, uint8_t* q) {
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
    float s;
    __m512i offset, lo_q, hi_q;
    if (!zero) {
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = g0; k < g0 + G; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16x16(x + k)));
      const float top = _mm512_reduce_max_ps(amax);
      s = top > 0.f ? div_round(top, 7.f) : 1.f;
      offset = _mm512_set1_epi32(8);
      lo_q = _mm512_set1_epi32(-8);
      hi_q = _mm512_set1_epi32(7);
    } else {
      __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();  // the ranges include 0
      for (int64_t k = g0; k < g0 + G; k += 16) {
        const __m512 v = load_bf16x16(x + k);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
      }
      const float l = _mm512_reduce_min_ps(lo), h = _mm512_reduce_max_ps(hi);
      const float range = _mm_cvtss_f32(_mm_sub_round_ss(_mm_set_ss(h), _mm_set_ss(l), kRound));
      s = h > l ? div_round(range, 15.f) : 1.f;
      const float z = std::min(std::max(round_even(div_round(-l, s)), 0.f), 15.f);
      zero[g] = z;
      offset = _mm512_set1_epi32(static_cast<int32_t>(z));
      lo_q = _mm512_set1_epi32(0);
      hi_q = _mm512_set1_epi32(15);
    }
    scale[g] = s;
    const __m512 vs = _mm512_set1_ps(s);
    for (int64_t k = g0; k < g0 + G; k += 16) {
      __m512i v = rounded_quotient(x + k, vs);
      if (zero) {  // the reference adds the zero point to the rounded value, then clamps
        v = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(v, offset), lo_q), hi_q);
      } else {  // ... or clamps to -8..7, then adds 8
        v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, lo_q), hi_q), offset);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(v));
    }
  }
}

// formats.pack_int4 of one row: 32 values -> 16 bytes, the second 16 in the high nibbles.
void pack_row(const uint8_t* q, int64_t K, uint8_t* out) {
  for (int64_t c = 0; c < K; c += 32) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c + 16));
    // b < 16: shifting its 16-bit lanes left by 4 keeps each byte's nibble in that byte
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c / 2), _mm_or_si128(a, _mm_slli_epi16(b, 4)));
  }
}

// sum_k q[k] (int8_w8a8's wsum), K % 16 == 0
int32_t row_sum(const int8_t* q, int64_t K) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 16)
    acc = _mm512_add_epi32(acc, _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
  return _mm512_reduce_add_epi32(acc);
}

void check_out(const torch::Tensor& t, const char* name, at::ScalarType dtype, std::vector<int64_t> shape) {
  check_tensor("quantize_weight", t, name, dtype, shape);
}

}  // namespace

void quantize_weight(torch::Tensor w, int64_t kind, int64_t group_size, torch::Tensor q, torch::Tensor scale,
                     c10::optional<torch::Tensor> zero, c10::optional<torch::Tensor> wsum) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "quantize_weight: w must be a contiguous bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  const bf16* x = w.data_ptr<bf16>();
  if (kind == 1 || kind == 3) {  // per channel: int8 (with int8_w8a8's row sums), fp8
    TORCH_CHECK(K % 16 == 0, "quantize_weight: int8 and fp8 need K % 16 == 0, got ", K);
    const bool int8 = kind == 1, sums = int8 && wsum.has_value() && wsum->defined();
    check_out(q, "q", int8 ? at::kChar : at::kByte, {N, K});
    check_out(scale, "scale", at::kFloat, {N});
    if (sums) check_out(*wsum, "wsum", at::kInt, {N});
    uint8_t* qp = static_cast<uint8_t*>(q.data_ptr());
    float* sp = scale.data_ptr<float>();
    int32_t* ws = sums ? wsum->data_ptr<int32_t>() : nullptr;
    at::parallel_for(0, N, quantize_grain(K), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const bf16* row = x + n * K;
        int8_t* as_int8 = reinterpret_cast<int8_t*>(qp + n * K);
        sp[n] = int8 ? quantize_row_int8(row, K, as_int8) : fp8_row(row, K, qp + n * K);
        if (ws) ws[n] = row_sum(as_int8, K);  // the row is still in L1
        if (has_nan(row, K)) sp[n] = NAN;
      }
    });
    return;
  }
  TORCH_CHECK(kind == 2, "quantize_weight: kind must be 1 (int8), 2 (int4) or 3 (fp8), got ", kind);
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && K % group_size == 0 && K % 32 == 0,
              "quantize_weight: int4 needs groups of a multiple of 16 k dividing K, and K % 32 == 0; got K=",
              K, ", group_size ", group_size);
  const int64_t groups = K / group_size;
  check_out(q, "q", at::kByte, {N, K / 2});
  check_out(scale, "scale", at::kFloat, {N, groups});
  const bool asymmetric = zero.has_value() && zero->defined();
  if (asymmetric) check_out(*zero, "zero", at::kFloat, {N, groups});
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  float* zp = asymmetric ? zero->data_ptr<float>() : nullptr;
  at::parallel_for(0, N, quantize_grain(K), [&](int64_t n0, int64_t n1) {
    std::vector<uint8_t> values(K);
    for (int64_t n = n0; n < n1; ++n) {
      int4_row(x + n * K, K, group_size, sp + n * groups, zp ? zp + n * groups : nullptr, values.data());
      pack_row(values.data(), K, qp + n * K / 2);
      for (int64_t g = 0; g < groups; ++g)
        if (has_nan(x + n * K + g * group_size, group_size)) sp[n * groups + g] = NAN;
    }
  });
}
