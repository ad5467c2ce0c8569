// The fp32 engine's decode step on AVX2 + FMA: every decoder layer of a Llama-family
// model in one call (avx2_decode_layers), and the two small ops it shares with the
// per-layer path, rotary (neox, in place) and the paged KV-cache write.
//
// Until 2026-12-03 the fp32 engine ran each layer from Python: ~60 small calls a layer
// (views, splits, rotary's neg/cat/mul, index_copy_ into the cache, the attention
// backend's gathers), ~30 ms of a ~65 ms int8 decode step of the Qwen3-0.6B shape on an
// AMD EPYC Zen 1. Here the AVX2 family's kernels run in the per-layer path's order, so
// the step's numbers are that path's bit for bit (tests/test_avx2_decode.py).
//
// The layer: x -> RMSNorm -> QKV (+bias) -> [q/k RMSNorm per head] -> rotary -> write
// k, v to the paged cache -> paged attention -> O -> add & RMSNorm -> gate/up ->
// SiLU-and-mul -> down. A linear is bf16 panels (kind 0, avx2_linear.cpp), quantized
// (kinds 1-3, avx2_quant.cpp's linear_quantw) or an fp32 weight that is not bf16 values
// (kind -1: at::linear, as UnquantizedLinearMethod runs it).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx2_api.h"

namespace {

c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  if (t.numel() == 0) return c10::nullopt;
  return t;
}

// One value as a cache of type T stores it, as torch's `to` rounds it (to nearest even);
// fp8 saturates at its largest finite value first, as the torch backend's to_cache_dtype.
template <class T>
inline T to_cache(float x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return c10::BFloat16(x);
  } else {
    const float top = static_cast<float>(std::numeric_limits<T>::max());
    return T(x < -top ? -top : (x > top ? top : x));  // NaN stays NaN
  }
}

template <class C>
void write_rows(C* base, const float* src, int64_t row_stride, const int64_t* slots, int64_t rows, int64_t Hkv,
                int64_t slots_per_head, int64_t D) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* from = src + t * row_stride + h * D;
      C* to = base + (h * slots_per_head + slots[t]) * D;
      if constexpr (std::is_same_v<C, float>)
        std::memcpy(to, from, D * sizeof(float));
      else
        for (int64_t d = 0; d < D; ++d) to[d] = to_cache<C>(from[d]);
    }
}

// cache: [2, Hkv, num_blocks, block_size, D] fp32, bf16, fp8 e4m3 or e5m2; src: T rows of
// Hkv heads, row stride `row_stride`, each head's D values contiguous.
void write_cache(torch::Tensor& cache, int which, const float* src, int64_t row_stride, const int64_t* slots,
                 int64_t T, int64_t Hkv, int64_t D) {
  const int64_t slots_per_head = cache.size(2) * cache.size(3);
  const int64_t offset = which * Hkv * slots_per_head * D;
  visit_cache_type(cache.scalar_type(), [&](auto* type) {
    using C = std::remove_pointer_t<decltype(type)>;
    write_rows(cache.data_ptr<C>() + offset, src, row_stride, slots, T, Hkv, slots_per_head, D);
  });
}

// x: T rows of H heads (row stride `row_stride`, each head's D values contiguous), rotated
// in place on each head's first R = cos.size(1) values (neox: halves rotated), as
// layers/rotary.py's plain path: out1 = x1 cos1 + (-x2) sin1, out2 = x2 cos2 + x1 sin2.
void rotate(float* x, int64_t row_stride, int64_t T, int64_t H, int64_t D, const int64_t* positions,
            const float* cos, const float* sin, int64_t R) {
  const int64_t half = R / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + positions[t] * R;
    const float* s = sin + positions[t] * R;
    for (int64_t h = 0; h < H; ++h) {
      float* v = x + t * row_stride + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

// x: T rows of H heads (row stride `row_stride`, each head's D values contiguous); head h
// times factor[h / group], in place (an fp8 cache's scales, quantization/kv_cache.py).
void scale_heads(float* x, int64_t row_stride, int64_t T, int64_t H, int64_t D, const float* factor,
                 int64_t group) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float* v = x + t * row_stride + h * D;
      const float f = factor[h / group];
      for (int64_t d = 0; d < D; ++d) v[d] *= f;
    }
}

// Every one of n indices in [0, bound): `what` names them in the error.
void check_indices(const int64_t* index, int64_t n, int64_t bound, const char* what) {
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(index[i] >= 0 && index[i] < bound, what, " out of range");
}

// positions [T] and the cos/sin tables for heads of D values; returns the positions.
const int64_t* check_rotary(const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
                            int64_t T, int64_t D) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T,
              "positions: int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2,
              "cos, sin: float32 [max_positions, R]");
  TORCH_CHECK(cos.size(1) % 2 == 0 && cos.size(1) <= D, "rotary size: even, at most the head size");
  check_indices(positions.data_ptr<int64_t>(), T, cos.size(0), "position");
  return positions.data_ptr<int64_t>();
}

// One linear of a layer: kind 0 panels (weight [N/16, K, 16] bf16), -1 a dense fp32 [N, K],
// else linear_quantw's kind with its scale and zero (empty: none); n the output size.
struct Linear {
  const torch::Tensor& w;
  const torch::Tensor& bias;
  const torch::Tensor& scale;
  const torch::Tensor& zero;
  int64_t kind, n, group_size;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == 0) return avx2_linear_bf16w(x, w, n, maybe(bias));
    if (kind == -1) return at::linear(x, w, maybe(bias));
    return avx2_linear_quantw(x, kind, w, scale, maybe(zero), group_size, maybe(bias));
  }
};

// Per layer, in this order (an empty tensor stands for "none"):
enum Slot { IN_NORM, QKV_W, QKV_B, Q_NORM, K_NORM, O_W, O_B, POST_NORM, GATE_UP_W, GATE_UP_B, DOWN_W, DOWN_B, NUM_SLOTS };

}  // namespace

// The per-layer path's rotary: q or k [T, heads, D] in place.
void avx2_rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x: float32 [T, heads, D] with each row's heads contiguous");
  const int64_t* pos = check_rotary(positions, cos, sin, x.size(0), x.size(2));
  rotate(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), x.size(2), pos, cos.data_ptr<float>(),
         sin.data_ptr<float>(), cos.size(1));
}

// k, v: [T, Hkv, D] fp32 (rows may be strided views into the fused qkv output) into a
// layer's cache [2, Hkv, NB, BS, D] at slots [T], rounded to the cache's dtype.
void avx2_write_kv_cache(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5,
              "kv_cache: contiguous [2, Hkv, NB, BS, D] of float32, bfloat16 or fp8");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slots: int64");
  const int64_t T = k.size(0), Hkv = kv_cache.size(1), D = kv_cache.size(4);
  for (const auto& t : {k, v}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(0) == T && t.size(1) == Hkv &&
                    t.size(2) == D && t.stride(2) == 1 && t.stride(1) == D,
                "k, v: float32 [T, Hkv, D] with each row's heads contiguous");
  }
  TORCH_CHECK(slot_mapping.numel() == T, "one slot per token");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  check_indices(slots, T, kv_cache.size(2) * kv_cache.size(3), "slot");
  write_cache(kv_cache, 0, k.data_ptr<float>(), k.stride(0), slots, T, Hkv, D);
  write_cache(kv_cache, 1, v.data_ptr<float>(), v.stride(0), slots, T, Hkv, D);
}

// hidden: [B, H] fp32 embeddings of the step's tokens; returns the final-normed hidden.
// kv_scales: per layer, an fp8 cache's scales [4, Hkv] or an empty tensor.
// weights: 12 per layer (Slot); linears: [kind, n, group_size] per linear (qkv, o, gate_up,
// down of each layer); quant: [scale, zero] per linear (empty tensors for panels).
torch::Tensor avx2_decode_layers(torch::Tensor hidden, std::vector<torch::Tensor> weights,
                                 std::vector<int64_t> linears, std::vector<torch::Tensor> quant,
                                 std::vector<torch::Tensor> kv_caches, std::vector<torch::Tensor> kv_scales,
                                 std::vector<int64_t> windows,
                                 torch::Tensor final_norm, torch::Tensor positions, torch::Tensor slot_mapping,
                                 torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor cos,
                                 torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 double eps, double scale) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * NUM_SLOTS, "weights: 12 per layer");
  TORCH_CHECK(static_cast<int64_t>(linears.size()) == L * 4 * 3, "linears: kind, n, group size per linear");
  TORCH_CHECK(static_cast<int64_t>(quant.size()) == L * 4 * 2, "quant: scale, zero per linear");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == L, "one window per layer");
  TORCH_CHECK(static_cast<int64_t>(kv_scales.size()) == L, "one KV-scale tensor per layer (empty: none)");
  for (const auto& s : kv_scales)
    TORCH_CHECK(s.numel() == 0 || (s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 &&
                                   s.size(0) == 4 && s.size(1) == num_kv_heads),
                "kv scales: float32 [4, Hkv] (k_scale, v_scale, 1 / k_scale, 1 / v_scale) or empty");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2, "hidden: float32 [B, H]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slots: int64");
  const int64_t B = hidden.size(0), D = head_dim;
  TORCH_CHECK(slot_mapping.numel() == B, "one slot per row");
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (const auto& cache : kv_caches)
    TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 &&
                    cache.size(1) == num_kv_heads && cache.size(4) == D,
                "kv caches: contiguous [2, Hkv, NB, BS, D] of float32, bfloat16 or fp8");
  check_indices(slots, B, kv_caches.empty() ? 0 : kv_caches[0].size(2) * kv_caches[0].size(3), "slot");
  const int64_t* pos = check_rotary(positions, cos, sin, B, D);
  torch::Tensor h, residual;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights.data() + l * NUM_SLOTS;
    if (l == 0) {
      residual = hidden.contiguous().clone();
      h = avx2_rms_norm(residual, w[IN_NORM], eps);
    } else {
      h = avx2_fused_add_rms_norm(h, residual, w[IN_NORM], eps);
    }
    auto lin = [&](int i, Slot weight, Slot bias) {  // linear i of the layer: qkv, o, gate_up, down
      const int64_t* info = linears.data() + (l * 4 + i) * 3;
      const torch::Tensor* qt = quant.data() + (l * 4 + i) * 2;
      return Linear{w[weight], w[bias], qt[0], qt[1], info[0], info[1], info[2]};
    };
    torch::Tensor qkv = lin(0, QKV_W, QKV_B)(h);  // [B, q + 2 kv]
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({B, num_heads, D});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, D});
    if (w[Q_NORM].numel()) q = avx2_rms_norm(q, w[Q_NORM], eps);
    if (w[K_NORM].numel()) k = avx2_rms_norm(k, w[K_NORM], eps);
    rotate(q.data_ptr<float>(), q.stride(0), B, num_heads, D, pos, cos.data_ptr<float>(), sin.data_ptr<float>(),
           cos.size(1));
    rotate(k.data_ptr<float>(), k.stride(0), B, num_kv_heads, D, pos, cos.data_ptr<float>(),
           sin.data_ptr<float>(), cos.size(1));
    float* v = qkv.data_ptr<float>() + q_size + kv_size;
    const float* ks = kv_scales[l].numel() ? kv_scales[l].data_ptr<float>() : nullptr;
    const int64_t G = num_heads / num_kv_heads;
    if (ks) {  // as Attention.forward: k_scale q, k / k_scale, v / v_scale (times reciprocals)
      scale_heads(q.data_ptr<float>(), q.stride(0), B, num_heads, D, ks, G);
      scale_heads(k.data_ptr<float>(), k.stride(0), B, num_kv_heads, D, ks + 2 * num_kv_heads, 1);
      scale_heads(v, qkv.stride(0), B, num_kv_heads, D, ks + 3 * num_kv_heads, 1);
    }
    torch::Tensor& cache = kv_caches[l];
    write_cache(cache, 0, k.data_ptr<float>(), k.stride(0), slots, B, num_kv_heads, D);
    write_cache(cache, 1, v, qkv.stride(0), slots, B, num_kv_heads, D);
    torch::Tensor attn =
        avx2_paged_attention_decode(q.contiguous(), cache[0], cache[1], block_tables, seq_lens, scale, windows[l]);
    if (ks) scale_heads(attn.data_ptr<float>(), q_size, B, num_heads, D, ks + num_kv_heads, G);
    torch::Tensor o = lin(1, O_W, O_B)(attn.view({B, q_size}));
    h = avx2_fused_add_rms_norm(o, residual, w[POST_NORM], eps);
    h = lin(3, DOWN_W, DOWN_B)(avx2_silu_and_mul(lin(2, GATE_UP_W, GATE_UP_B)(h)));
  }
  return avx2_fused_add_rms_norm(h, residual, final_norm, eps);
}
