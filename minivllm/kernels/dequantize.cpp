// Quantized weights as bf16: dequantize_bf16 (the op), and the checks and the row
// dequantization it shares with quant_gemm.cpp's dequantized_linear (quant_operands.h).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>

#include "kernels.h"
#include "quant_operands.h"
#include "quant_rows.h"

namespace quant_operands {

Dequant check_dequant(const char* who, int64_t kind, const torch::Tensor& weight, const torch::Tensor& scale,
                      const c10::optional<torch::Tensor>& zero, int64_t group_size, int64_t N, int64_t K) {
  TORCH_CHECK(kind >= 1 && kind <= 4, who, ": kind must be 1-4, got ", kind);
  const bool int4 = kind == 2, has_zero = zero.has_value() && zero->defined();
  const bool fp8_groups = kind == 3 && group_size > 0;
  TORCH_CHECK(K > 0 && K % 32 == 0, who, ": K must be a positive multiple of 32, got ", K);
  check_tensor(weight, "weight", kind == 1 || kind == 4 ? at::kChar : at::kByte, {N, int4 ? K / 2 : K}, who);
  if (fp8_groups || int4) {
    TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0, who,
                ": group_size must be a positive multiple of 32 dividing K=", K, ", got ", group_size);
    check_tensor(scale, "scale", at::kFloat, {N, K / group_size}, who);
  } else {
    check_tensor(scale, "scale", at::kFloat, {N}, who);
  }
  TORCH_CHECK(!has_zero || int4, who, ": only int4 (kind 2) takes zero points");
  if (has_zero) check_tensor(*zero, "zero", at::kFloat, {N, K / group_size}, who);
  return {kind, K, int4 || fp8_groups ? K / group_size : 1, group_size, fp8_groups,
          static_cast<const uint8_t*>(weight.data_ptr()), scale.data_ptr<float>(),
          has_zero ? zero->data_ptr<float>() : nullptr};
}

void dequantize_row(const Dequant& d, int64_t n, bf16* row) {
  auto put = [](bf16* dst, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v)); };
  const int64_t K = d.K;
  if (d.kind == 1 || d.kind == 4) {
    const __m512 s = _mm512_set1_ps(d.scale[n]);
    const int8_t* q = reinterpret_cast<const int8_t*>(d.w) + n * K;
    for (int64_t k = 0; k < K; k += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
      put(row + k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s));
    }
  } else if (d.kind == 3) {  // the decoded bf16 is the e4m3 number * 2^8: exact, as is s * 2^-8
    for (int64_t k = 0; k < K; k += 32) {
      const __m512 s = _mm512_set1_ps(d.scale[d.fp8_groups ? n * d.groups + k / d.group_size : n] / 256.f);
      const __m512i bits = (__m512i)quant_rows::Fp8Rows::decode32(d.w + n * K + k);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
      put(row + k, _mm512_mul_ps(lo, s));
      put(row + k + 16, _mm512_mul_ps(hi, s));
    }
  } else {  // int4: 16 bytes a 32-k chunk, byte j = q[j] | q[j + 16] << 4
    const uint8_t* q = d.w + n * (K / 2);
    int64_t k = 0;
    // 64 k at a time by table: each group's 16 possible values, (v - z) * s rounded to
    // bf16 as below, looked up by nibble (vpermw): the same numbers for a third of the
    // instructions. Words 16-31 of the table are the second 32-k chunk's group.
    const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    auto table = [&](int64_t g) {
      const __m512 s = _mm512_set1_ps(d.scale[g]), z = _mm512_set1_ps(d.zero ? d.zero[g] : 8.f);
      return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(values, z), s));
    };
    int64_t g_lo = -1, g_hi = -1;
    __m512i lut = _mm512_setzero_si512();
    for (; k + 64 <= K; k += 64) {
      const int64_t g0 = n * d.groups + k / d.group_size, g1 = n * d.groups + (k + 32) / d.group_size;
      if (g0 != g_lo || g1 != g_hi) {
        const __m256i t0 = table(g0), t1 = g1 == g0 ? t0 : table(g1);
        lut = _mm512_inserti64x4(_mm512_castsi256_si512(t0), t1, 1);
        g_lo = g0, g_hi = g1;
      }
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k / 2)));
      const __m512i lo = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi16(15)), second);
      const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(b, 4), second);
      const __m512i vlo = _mm512_permutexvar_epi16(lo, lut), vhi = _mm512_permutexvar_epi16(hi, lut);
      // vlo: k 0-15 of each chunk, vhi: k 16-31; back in order, chunk by chunk
      _mm512_storeu_si512(row + k, _mm512_shuffle_i64x2(vlo, vhi, 0x44));
      _mm512_storeu_si512(row + k + 32, _mm512_shuffle_i64x2(vlo, vhi, 0xEE));
    }
    for (; k < K; k += 32) {  // a last chunk of 32
      const int64_t g = n * d.groups + k / d.group_size;
      const __m512 s = _mm512_set1_ps(d.scale[g]), z = _mm512_set1_ps(d.zero ? d.zero[g] : 8.f);
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2)));
      const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
      const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
      put(row + k, _mm512_mul_ps(_mm512_sub_ps(low, z), s));
      put(row + k + 16, _mm512_mul_ps(_mm512_sub_ps(high, z), s));
    }
  }
}

}  // namespace quant_operands

// formats.dequantize(qw).to(bf16), bit for bit: each weight in float32 (q * s, the fp8
// number * s, or (q - z) * s for int4), rounded to bf16 once. fp8's NaN bytes (which
// formats.from_fp8_values refuses) decode as numbers here, as in the other fp8 kernels.
// The weight-only schemes hand this to oneDNN's bf16 GEMM at large batches (prefill); in
// plain PyTorch the same dequantization took several passes over float32 copies, about 3x
// the GEMM at prefill.
void dequantize_bf16(int64_t kind, torch::Tensor weight, torch::Tensor scale, c10::optional<torch::Tensor> zero,
                     int64_t group_size, torch::Tensor out) {
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.is_contiguous(),
              "dequantize_bf16: out must be a contiguous bf16 [N, K]");
  using namespace quant_operands;
  const Dequant d = check_dequant("dequantize_bf16", kind, weight, scale, zero, group_size, out.size(0), out.size(1));
  bf16* o = out.data_ptr<bf16>();
  at::parallel_for(0, out.size(0), 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) dequantize_row(d, n, o + n * d.K);
  });
}
