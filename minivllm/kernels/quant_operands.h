// A quantized weight's operands (minivllm/quantization/formats.py's layout) as the bf16
// kernels check and dequantize them: quant_gemm.cpp's products and dequantize.cpp.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace quant_operands {

using bf16 = at::BFloat16;

// `t` has `dtype`, `shape` and is contiguous, else an error naming the op (`who`).
inline void check_tensor(const torch::Tensor& t, const char* name, at::ScalarType dtype, std::vector<int64_t> shape,
                  const char* who = "quant_linear") {
  TORCH_CHECK(t.scalar_type() == dtype, who, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(shape), who, ": ", name, " must have shape ", c10::IntArrayRef(shape),
              ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), who, ": ", name, " must be contiguous");
}

// A quantized weight's operands as dequantize_bf16 and dequantized_linear read them.
struct Dequant {
  int64_t kind, K, groups, group_size;
  bool fp8_groups;  // block-scaled fp8: a scale per row and group of k
  const uint8_t* w;
  const float *scale, *zero;
};

// Checks a weight's operands (N rows, K k) as formats.QuantWeights lays them out.
Dequant check_dequant(const char* who, int64_t kind, const torch::Tensor& weight, const torch::Tensor& scale,
                      const c10::optional<torch::Tensor>& zero, int64_t group_size, int64_t N, int64_t K);

// Asks for weight row n in L2, ahead of its dequantize_row.
inline void prefetch_row(const Dequant& d, int64_t n) {
  const int64_t row_bytes = d.kind == 2 ? d.K / 2 : d.K;
  const char* row = reinterpret_cast<const char*>(d.w + n * row_bytes);
  for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
}

// Row n of the weight as formats.dequantize gives it, rounded to bf16 once, into `row`.
void dequantize_row(const Dequant& d, int64_t n, bf16* row);

}  // namespace quant_operands
