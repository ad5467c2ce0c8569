// int8_w8a8 in fp32 engines on AVX-512 CPUs without AVX512-BF16 (Intel Ice Lake, Cascade
// Lake): the VNNI GEMM of vnni_gemm.h on pack_vnni_w8a8's panels, with fp32 x, y and bias.
// Without it these CPUs multiplied int8_w8a8 in fp32 (avx2_quant.cpp: the quantized
// activations' integers through AVX2 FMAs), a quarter of what one vpdpbusd does per
// instruction. The AVX2 family is built for AVX2 alone: this file's AVX-512 code carries
// its own target (vnni_gemm.h) and the op refuses to run where the CPU lacks it;
// quantization/method.py offers it only where cpu_flags() has those extensions.
#include <immintrin.h>
#include <torch/extension.h>

#include "avx2_api.h"
#include "vnni_gemm.h"

namespace {

#pragma GCC push_options
#pragma GCC target("avx512f")

// fp32 elements for vnni_gemm.h
struct F32Io {
  using T = float;
  static constexpr at::ScalarType dtype = at::kFloat;
  static constexpr const char* name = "float32";
  static __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load_masked(const float* p, __mmask16 live) { return _mm512_maskz_loadu_ps(live, p); }
  static void store_masked(float* p, __mmask16 live, __m512 v) { _mm512_mask_storeu_ps(p, live, v); }
};

#pragma GCC pop_options

}  // namespace

torch::Tensor avx2_vnni_w8a8_linear(torch::Tensor x, torch::Tensor packed, int64_t in_features, torch::Tensor scale,
                                    torch::Tensor wsum, c10::optional<torch::Tensor> bias) {
  return vnni_gemm::linear<F32Io>("vnni_w8a8_linear", x, packed, in_features, scale, wsum, bias);
}
