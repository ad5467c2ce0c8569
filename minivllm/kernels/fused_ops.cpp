// Small fused element-wise ops for the bf16 CPU decode path, where per-op
// dispatch overhead (not arithmetic) dominates: RMSNorm (optionally with the
// residual add), neox rotary embedding in place, and SiLU-and-multiply.
// Math in fp32, rounding to bf16 where the reference implementations round.
// Vectorised 16 lanes at a time with a scalar tail: a 128-token prefill spent
// ~25 ms of its ~350 in the scalar versions (SiLU alone 12 ms).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>

#include "kernels.h"

using bf16 = at::BFloat16;

namespace {

void rms_norm_row(const bf16* x, const bf16* w, bf16* out, int64_t H, float eps) {
  const int64_t Hv = H & ~int64_t(15);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < Hv; i += 16) {
    const __m512 v = load_bf16x16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (int64_t i = Hv; i < H; ++i) {
    float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / H + eps);
  // like transformers: normalise in fp32, round to bf16, then scale by the weight
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < Hv; i += 16)
    store_bf16x16(out + i, _mm512_mul_ps(round_bf16x16(_mm512_mul_ps(load_bf16x16(x + i), iv)), load_bf16x16(w + i)));
  for (int64_t i = Hv; i < H; ++i) {
    bf16 normed = bf16(static_cast<float>(x[i]) * inv);
    out[i] = bf16(static_cast<float>(normed) * static_cast<float>(w[i]));
  }
}

// r = bf16(x + r), in place
void add_row(const bf16* x, bf16* r, int64_t H) {
  const int64_t Hv = H & ~int64_t(15);
  for (int64_t i = 0; i < Hv; i += 16) store_bf16x16(r + i, _mm512_add_ps(load_bf16x16(x + i), load_bf16x16(r + i)));
  for (int64_t i = Hv; i < H; ++i) r[i] = bf16(static_cast<float>(x[i]) + static_cast<float>(r[i]));
}

}  // namespace

// x: [rows, H] -> new contiguous tensor. x may also be [T, heads, H] with each token's
// heads contiguous but tokens further apart (q or k as a view into the fused qkv output,
// for Qwen3's per-head norms): its rows are read in place rather than copied first.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 only");
  const bool head_rows = x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(1) > 0;
  auto xc = x.is_contiguous() || !head_rows ? x.contiguous() : x;
  const int64_t H = xc.size(-1), rows = xc.numel() / H;
  const int64_t heads = xc.dim() == 3 ? xc.size(1) : 1, token_stride = xc.dim() == 3 ? xc.stride(0) : H;
  auto out = torch::empty(xc.sizes(), xc.options());
  auto xp = xc.data_ptr<bf16>();
  auto wp = weight.data_ptr<bf16>();
  auto op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      rms_norm_row(xp + (r / heads) * token_stride + (r % heads) * H, wp, op + r * H, H, (float)eps);
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
      add_row(xp + r * H, rp + r * H, H);
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
  // split past 4 tokens: a decode batch's 16 in two (~10 us a layer's q and k on one thread)
  at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pp[t] * rot;
      const float* s = sp + pp[t] * rot;
      const int64_t hv = half & ~int64_t(15);
      for (int64_t h = 0; h < heads; ++h) {
        bf16* v = xp + t * row_stride + h * D;
        for (int64_t i = 0; i < hv; i += 16) {
          const __m512 a = load_bf16x16(v + i), bb = load_bf16x16(v + i + half);
          const __m512 ca = round_bf16x16(_mm512_loadu_ps(c + i)), sa = round_bf16x16(_mm512_loadu_ps(s + i));
          const __m512 cb = round_bf16x16(_mm512_loadu_ps(c + i + half)), sb = round_bf16x16(_mm512_loadu_ps(s + i + half));
          store_bf16x16(v + i, _mm512_sub_ps(_mm512_mul_ps(a, ca), _mm512_mul_ps(bb, sa)));
          store_bf16x16(v + i + half, _mm512_add_ps(_mm512_mul_ps(bb, cb), _mm512_mul_ps(a, sb)));
        }
        for (int64_t i = hv; i < half; ++i) {
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
  const int64_t Iv = I & ~int64_t(15);
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const bf16* gate = xp + r * 2 * I;
      for (int64_t i = 0; i < Iv; i += 16) {
        const __m512 g = load_bf16x16(gate + i);
        const __m512 act = round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        store_bf16x16(op + r * I + i, _mm512_mul_ps(act, load_bf16x16(gate + I + i)));
      }
      for (int64_t i = Iv; i < I; ++i) {
        float g = xp[r * 2 * I + i];
        bf16 act = bf16(g / (1.f + std::exp(-g)));
        op[r * I + i] = bf16(static_cast<float>(act) * static_cast<float>(xp[r * 2 * I + I + i]));
      }
    }
  });
  return out;
}

// Row-wise argmax of bf16 logits [rows, V] -> int64 [rows]; the first index on ties, as
// torch.argmax. Greedy sampling at batch 64 spent ~15 ms a step converting the logits
// to fp32 first (and torch's bf16 argmax is slower still). NaNs are never the maximum.
torch::Tensor argmax_bf16(torch::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 && logits.dim() == 2, "logits: bf16 [rows, V]");
  TORCH_CHECK(logits.size(1) >= 1, "an empty vocabulary");
  auto lc = logits.contiguous();
  const int64_t rows = lc.size(0), V = lc.size(1), Vv = V & ~int64_t(15);
  auto out = torch::empty({rows}, lc.options().dtype(at::kLong));
  auto lp = lc.data_ptr<bf16>();
  auto op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const bf16* x = lp + r * V;
      // per lane: the largest value seen and where it was first seen
      __m512 best = _mm512_set1_ps(-INFINITY);
      __m512i where = _mm512_set1_epi32(-1);
      __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i step = _mm512_set1_epi32(16);
      for (int64_t i = 0; i < Vv; i += 16) {
        const __m512 v = load_bf16x16(x + i);
        const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, greater, v);
        where = _mm512_mask_mov_epi32(where, greater, idx);
        idx = _mm512_add_epi32(idx, step);
      }
      alignas(64) float bv[16];
      alignas(64) int32_t bi[16];
      _mm512_store_ps(bv, best);
      _mm512_store_si512(bi, where);
      float top = -INFINITY;
      int64_t arg = -1;
      for (int l = 0; l < 16; ++l)
        if (bi[l] >= 0 && (bv[l] > top || (bv[l] == top && bi[l] < arg))) top = bv[l], arg = bi[l];
      for (int64_t i = Vv; i < V; ++i) {
        const float v = static_cast<float>(x[i]);
        if (v > top) top = v, arg = i;
      }
      op[r] = arg < 0 ? 0 : arg;  // all -inf or NaN: index 0, like a row of equal values
    }
  });
  return out;
}
