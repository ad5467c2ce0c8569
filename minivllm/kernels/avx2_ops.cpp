// fp32 RMSNorm (plain and with the residual add) and SiLU-and-mul for the AVX2 family: the
// plain-PyTorch path of layers/layernorm.py and layers/activation.py in one pass per row,
// where that path runs five to seven ATen ops (each a pass over the rows and a dispatch):
// at batch 1 these small ops were a third of an fp32 decode step.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>

#include "avx2_math.h"

namespace {

// out = weight * (x / sqrt(mean(x^2) + eps)), as RMSNorm's fp32 path.
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t H, float eps) {
  const int64_t Hv = H & ~int64_t(7);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < Hv; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = hsum8(acc);
  for (int64_t i = Hv; i < H; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
  const __m256 iv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < Hv; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), iv)));
  for (int64_t i = Hv; i < H; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(-1), "weight: [H]");
}

}  // namespace

// x: [..., H] -> a new tensor
torch::Tensor avx2_rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_norm(x, weight);
  auto xc = x.contiguous();
  const int64_t H = xc.size(-1), rows = H ? xc.numel() / H : 0;
  auto out = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row(xp + r * H, wp, op + r * H, H, static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place); returns RMSNorm(residual).
torch::Tensor avx2_fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.sizes() == x.sizes(), "residual: x's shape, float32");
  TORCH_CHECK(residual.is_contiguous() && x.is_contiguous(), "contiguous inputs");
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* row = rp + r * H;
      for (int64_t i = 0; i < H; ++i) row[i] += xp[r * H + i];
      rms_norm_row(row, wp, op + r * H, H, static_cast<float>(eps));
    }
  });
  return out;
}

// x: [..., 2 I] (gate | up) -> [..., I]: silu(gate) * up
torch::Tensor avx2_silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) % 2 == 0, "float32 [..., 2 I]");
  auto xc = x.contiguous();
  const int64_t I = xc.size(-1) / 2, rows = I ? xc.numel() / (2 * I) : 0;
  auto sizes = xc.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t Iv = I & ~int64_t(7);
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    const __m256 one = _mm256_set1_ps(1.f);
    for (int64_t r = b; r < e; ++r) {
      const float* gate = xp + r * 2 * I;
      for (int64_t i = 0; i < Iv; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 act = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(op + r * I + i, _mm256_mul_ps(act, _mm256_loadu_ps(gate + I + i)));
      }
      for (int64_t i = Iv; i < I; ++i) op[r * I + i] = gate[i] / (1.f + std::exp(-gate[i])) * gate[I + i];
    }
  });
  return out;
}
