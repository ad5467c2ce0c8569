// int8_w8a8: int8 weights times int8 activations quantized per token in the kernel, on
// AVX512-VNNI: the row kernel for a few rows (quant_linear's kind 4) and, for batches on
// CPUs without AMX, the GEMM on packed panels (vnni_gemm.h, shared with the AVX2 family),
// both with bf16 x and y. vnni_gemm.h says how x is quantized and the sums corrected.
//
// The VNNI code is compiled for that extension alone (the pragmas), so the rest of the
// module runs on CPUs without it; quant_linear refuses kind 4 there.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "vnni_gemm.h"

namespace {

using bf16 = at::BFloat16;

// bf16 elements for vnni_gemm.h
struct Bf16Io {
  using T = bf16;
  static constexpr at::ScalarType dtype = at::kBFloat16;
  static constexpr const char* name = "bf16";
  static __m512 load16(const bf16* p) { return load_bf16x16(p); }
  static __m512 load_masked(const bf16* p, __mmask16 live) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
  }
  static void store_masked(bf16* p, __mmask16 live, __m512 v) {
    _mm256_mask_storeu_epi16(p, live, (__m256i)_mm512_cvtneps_pbh(v));
  }
};

template <typename Out>
float quantize_row(const bf16* x, int64_t K, Out* q, int offset) {
  return vnni_gemm::quantize_row<Bf16Io>(x, K, q, offset);
}

#pragma GCC push_options
#pragma GCC target("avx512vnni")

// out[m * R + r] = sum_k xu[m, k] * w[r, k] in int32, over `units` of 64 k (the last one
// of 32 where half_tail); `wnext`: the next block, prefetched into L2 meanwhile.
template <int MR, int R>
inline void vnni_tile(const int8_t* w, int64_t K, const uint8_t* xu, int64_t ldx, int64_t units,
                      bool half_tail, const int8_t* wnext, int32_t* out) {
  __m512i acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_si512();
  for (int64_t u = 0; u < units; ++u) {
    const __mmask64 live = half_tail && u == units - 1 ? 0xFFFFFFFFull : ~0ull;
    __m512i wv[R];
    for (int r = 0; r < R; ++r) {
      if (wnext) _mm_prefetch(reinterpret_cast<const char*>(wnext + r * K + u * 64), _MM_HINT_T1);
      wv[r] = _mm512_maskz_loadu_epi8(live, w + r * K + u * 64);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_loadu_si512(xu + m * ldx + u * 64);
      for (int r = 0; r < R; ++r) acc[m][r] = dpbusd(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_epi32(acc[m][r]);
}

template <int MR, int R>
inline void vnni_rows(int rows, const int8_t* w, int64_t K, const uint8_t* xu, int64_t ldx,
                      int64_t units, bool half_tail, const int8_t* wnext, int32_t* out) {
  switch (rows) {
#define MINIVLLM_VTILE(n) \
  case n:                 \
    if constexpr (n <= MR) vnni_tile<n, R>(w, K, xu, ldx, units, half_tail, wnext, out); \
    break;
    MINIVLLM_VTILE(1)
    MINIVLLM_VTILE(2)
    MINIVLLM_VTILE(3)
    MINIVLLM_VTILE(4)
#undef MINIVLLM_VTILE
    default: break;
  }
}

struct W8A8 {
  const int8_t* w;
  const uint8_t* xu;  // [M, ldx]: xq + 128, zeros past K
  int64_t ldx, M, N, K, units;
  bool half_tail;
  const float *xs, *scale;
  const int32_t* wsum;
  const bf16* bias;
  bf16* y;

  void store(const int32_t* out, int R, int rows, int64_t n0, int64_t m0, int mr) const {
    for (int m = 0; m < mr; ++m)
      for (int r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        float v = scale_in_order(static_cast<float>(out[m * R + r] - 128 * wsum[n]), xs[m0 + m], scale[n]);
        if (bias) v += static_cast<float>(bias[n]);
        y[(m0 + m) * N + n] = bf16(v);
      }
  }
};

// Blocks of R weight rows split across threads; each multiplied with x in MR-row tiles
// (the block is read from L1 after the first), prefetching PREFETCH_AHEAD blocks ahead.
template <int MR, int R, int PREFETCH_AHEAD>
void w8a8_blocks(const W8A8& p) {
  const int64_t num_blocks = (p.N + R - 1) / R;
  at::parallel_for(0, num_blocks, 4, [&](int64_t begin, int64_t end) {
    int32_t out[MR * R];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R, rows = std::min<int64_t>(R, p.N - n0);
      const int8_t* w = p.w + n0 * p.K;
      const int8_t* wnext = p.w + std::min(n0 + PREFETCH_AHEAD * R, p.N - R) * p.K;
      for (int64_t m0 = 0; m0 < p.M; m0 += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, p.M - m0));
        const uint8_t* xu = p.xu + m0 * p.ldx;
        if (rows == R) {
          vnni_rows<MR, R>(mr, w, p.K, xu, p.ldx, p.units, p.half_tail, wnext, out);
        } else {
          for (int r = 0; r < rows; ++r) {
            int32_t one[MR];
            vnni_rows<MR, 1>(mr, w + r * p.K, p.K, xu, p.ldx, p.units, p.half_tail, nullptr, one);
            for (int m = 0; m < mr; ++m) out[m * R + r] = one[m];
          }
        }
        p.store(out, R, static_cast<int>(rows), n0, m0, mr);
      }
    }
  });
}

void w8a8_run(const W8A8& p) {
  if (p.M == 1)
    w8a8_blocks<1, 8, 4>(p);
  else
    w8a8_blocks<4, 6, 1>(p);
}

#pragma GCC pop_options

}  // namespace

float quantize_row_int8(const bf16* x, int64_t K, int8_t* q) { return quantize_row(x, K, q, 0); }

void w8a8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
                 const torch::Tensor& wsum, const bf16* bias, torch::Tensor& y) {
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), "quant_linear: int8_w8a8 needs AVX512-VNNI");
  const int64_t M = x.size(0), K = x.size(1), units = (K + 63) / 64, ldx = units * 64;
  auto xu = torch::zeros({M, ldx}, x.options().dtype(at::kByte));
  auto xs = torch::empty({M}, x.options().dtype(at::kFloat));
  for (int64_t m = 0; m < M; ++m)
    xs.data_ptr<float>()[m] = quantize_row(x.data_ptr<bf16>() + m * K, K, xu.data_ptr<uint8_t>() + m * ldx, 128);
  W8A8 p{static_cast<const int8_t*>(weight.data_ptr()), xu.data_ptr<uint8_t>(), ldx, M, weight.size(0), K,
         units, K % 64 != 0, xs.data_ptr<float>(), scale.data_ptr<float>(), wsum.data_ptr<int32_t>(),
         bias, y.data_ptr<bf16>()};
  w8a8_run(p);
}

std::tuple<torch::Tensor, torch::Tensor> quantize_per_token_int8(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "quantize_per_token_int8: x must be bf16 [M, K]");
  TORCH_CHECK(x.size(1) % 16 == 0, "quantize_per_token_int8: K must be a multiple of 16, got ", x.size(1));
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto xs = torch::empty({M}, x.options().dtype(at::kFloat));
  at::parallel_for(0, M, quantize_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      xs.data_ptr<float>()[m] = quantize_row(x.data_ptr<bf16>() + m * K, K, q.data_ptr<int8_t>() + m * K, 0);
  });
  return {q, xs};
}

torch::Tensor vnni_w8a8_linear(torch::Tensor x, torch::Tensor packed, int64_t in_features, torch::Tensor scale,
                               torch::Tensor wsum, c10::optional<torch::Tensor> bias) {
  return vnni_gemm::linear<Bf16Io>("vnni_w8a8_linear", x, packed, in_features, scale, wsum, bias);
}

torch::Tensor w8a8_packed_linear(torch::Tensor x, torch::Tensor packed, int64_t in_features, torch::Tensor scale,
                                 torch::Tensor wsum, c10::optional<torch::Tensor> bias) {
  if (packed.dim() == 5) return amx_w8a8_linear(x, packed, in_features, scale, bias);
  return vnni_w8a8_linear(x, packed, in_features, scale, wsum, bias);
}
