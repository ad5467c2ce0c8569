// Small fused element-wise ops for the bf16 CPU decode path, where per-op
// dispatch overhead (not arithmetic) dominates: RMSNorm (optionally with the
// residual add), neox rotary embedding in place, and SiLU-and-multiply.
// Math in fp32, rounding to bf16 where the reference implementations round.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>

using bf16 = at::BFloat16;

namespace {

void rms_norm_row(const bf16* x, const bf16* w, bf16* out, int64_t H, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < H; ++i) {
    float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / H + eps);
  for (int64_t i = 0; i < H; ++i) {
    // like transformers: normalise in fp32, round to bf16, then scale by the weight
    bf16 normed = bf16(static_cast<float>(x[i]) * inv);
    out[i] = bf16(static_cast<float>(normed) * static_cast<float>(w[i]));
  }
}

}  // namespace

// x: [rows, H] -> new tensor
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 only");
  auto xc = x.contiguous();
  const int64_t H = xc.size(-1), rows = xc.numel() / H;
  auto out = torch::empty_like(xc);
  auto xp = xc.data_ptr<bf16>();
  auto wp = weight.data_ptr<bf16>();
  auto op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row(xp + r * H, wp, op + r * H, H, (float)eps);
  });
  return out;
}

// residual += x (rounded to bf16, as `x + residual` would be); returns norm(residual).
torch::Tensor fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(residual.is_contiguous() && x.is_contiguous(), "contiguous inputs");
  const int64_t H = x.size(-1), rows = x.numel() / H;
  auto out = torch::empty_like(x);
  auto xp = x.data_ptr<bf16>();
  auto rp = residual.data_ptr<bf16>();
  auto wp = weight.data_ptr<bf16>();
  auto op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t i = 0; i < H; ++i)
        rp[r * H + i] = bf16(static_cast<float>(xp[r * H + i]) + static_cast<float>(rp[r * H + i]));
      rms_norm_row(rp + r * H, wp, op + r * H, H, (float)eps);
    }
  });
  return out;
}

// Rotate the first `rot` dims of each head in place (neox halves). x: [T, heads, D] (row stride
// may exceed heads * D: a view into the fused qkv output); cos/sin: [max_pos, rot] fp32.
void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.stride(2) == 1 && x.stride(1) == x.size(2), "layout");
  const int64_t T = x.size(0), heads = x.size(1), row_stride = x.stride(0);
  const int64_t rot = cos.size(1), half = rot / 2;
  auto xp = x.data_ptr<bf16>();
  auto pp = positions.data_ptr<int64_t>();
  auto cp = cos.data_ptr<float>();
  auto sp = sin.data_ptr<float>();
  const int64_t D = x.size(2);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pp[t] * rot;
      const float* s = sp + pp[t] * rot;
      for (int64_t h = 0; h < heads; ++h) {
        bf16* v = xp + t * row_stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          float a = v[i], bb = v[i + half];
          // cos/sin are rounded to bf16 first, as the reference casts them to the input dtype
          float ca = static_cast<float>(bf16(c[i])), sa = static_cast<float>(bf16(s[i]));
          float cb = static_cast<float>(bf16(c[i + half])), sb = static_cast<float>(bf16(s[i + half]));
          v[i] = bf16(a * ca - bb * sa);
          v[i + half] = bf16(bb * cb + a * sb);
        }
      }
    }
  });
}

// x: [rows, 2 * I] (gate | up) -> [rows, I]
torch::Tensor silu_and_mul(torch::Tensor x) {
  auto xc = x.contiguous();
  const int64_t I = xc.size(-1) / 2, rows = xc.numel() / (2 * I);
  auto sizes = xc.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, xc.options());
  auto xp = xc.data_ptr<bf16>();
  auto op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t i = 0; i < I; ++i) {
        float g = xp[r * 2 * I + i];
        bf16 act = bf16(g / (1.f + std::exp(-g)));
        op[r * I + i] = bf16(static_cast<float>(act) * static_cast<float>(xp[r * 2 * I + I + i]));
      }
    }
  });
  return out;
}
