// Routed MoE experts in fp32 engines (AVX2 family): one call runs a MoE layer's step,
// every chosen expert's gate/up product, SiLU gating and down product on that expert's
// rows of the stacked weights, each output weighted by the router and summed into its
// token's row. Two weight forms: quantized rows through avx2_quant.cpp's linear_quantw
// (moe_quantw), and a bf16 checkpoint's experts held as bf16 panels
// (layers/panel_linear.py) through avx2_linear.cpp's linear_bf16w (moe_bf16w).
//
// Why a call per layer and not per expert: on the DeepSeek-V3.2 shape scaled to 400M
// (hidden 1024, experts of 256, top-4; AMD EPYC Zen 1, 2026-12-04) a decode step's
// routed experts spent 0.94 ms per layer in the Python routing loop, of which the eight
// products took 0.23 ms; the rest was indexing, gathering and scattering per expert.
//
// The arithmetic is layers/moe.routed_experts' with the same ops: experts in ascending
// order, each token's rows gathered, y = down(silu(g) * u), out[t] += y * w (the product
// rounded before the sum, as the reference's tensor ops round it).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "avx2_api.h"
#include "moe_routing.h"

namespace {

// The routing loop: up(e, rows) is expert e's [n, 2I] gate-then-up product of its tokens'
// rows, down(e, h) its [n, H] down product. x [T, H] fp32; topk_weights [T, k] fp32,
// topk_ids [T, k] integers in [0, E). Returns [T, H].
template <class Up, class Down>
torch::Tensor route(torch::Tensor x, const torch::Tensor& topk_weights, const torch::Tensor& topk_ids,
                    int64_t E, Up&& up, Down&& down) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_cpu(), "x: float32 [T, H] on the CPU");
  const int64_t T = x.size(0), H = x.size(1);
  x = x.contiguous();
  const ExpertTokens routes = tokens_by_expert(topk_weights, topk_ids, T, E);
  const auto& tokens = routes.tokens;
  const auto& picks = routes.picks;
  const float* wp = routes.weights.data_ptr<float>();
  auto out = torch::zeros_like(x);
  float* op = out.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(tokens[e].size());
    if (n == 0) continue;
    const torch::Tensor y = down(e, avx2_silu_and_mul(up(e, expert_rows(x, tokens[e])))).contiguous();
    TORCH_CHECK(y.scalar_type() == at::kFloat && y.size(0) == n && y.size(1) == H, "down: [n, H] float32");
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      float* dst = op + tokens[e][i] * H;
      const float* src = yp + i * H;
      const float w = wp[picks[e][i]];
      for (int64_t c = 0; c < H; ++c) {
        const volatile float p = src[c] * w;  // rounded before the sum, as the reference
        dst[c] += p;
      }
    }
  }
  return out;
}

constexpr int64_t KIND_W8A8 = 4;  // formats.KERNEL_KIND

// int8_w8a8's activations, formats.quantize_per_token with the same ATen ops (so the same
// numbers): per row xs = amax|x| / 127 (1 for a zero row), xq = clamp(round(x / xs), +-127),
// rounded half to even, held as integer-valued float32 (what linear_quantw's int8 form
// multiplies exactly: its int16 rounding keeps |x| <= 127 whole).
std::tuple<torch::Tensor, torch::Tensor> quantize_per_token(const torch::Tensor& x) {
  const auto amax = x.abs().amax(-1);
  const auto xs = torch::where(amax > 0, amax / 127, torch::ones_like(amax));
  // through int8 and back, as the reference's xq.to(int8).to(float32) (the same value for
  // finite x; a diverged model's NaN becomes what ATen's conversion makes of it there too)
  return {torch::round(x / xs.unsqueeze(1)).clamp_(-127, 127).to(at::kChar).to(at::kFloat), xs};
}

}  // namespace

// w13 the stacked gate/up rows [E * 2I, ...] with scale (and int4's zero), w2 the down
// rows [E * H, ...]: linear_quantw's operands of kind `kind` and `group_size`, or kind 4
// (int8_w8a8: int8 rows and per-row scales; each expert's input quantized per token, the
// integer products summed exactly in fp32 and scaled (acc * xs) * scale, as
// quantization/method.py's _apply_fp32 does for a linear layer).
torch::Tensor avx2_moe_quantw(torch::Tensor x, torch::Tensor topk_weights, torch::Tensor topk_ids,
                              int64_t num_experts, int64_t kind, int64_t group_size, torch::Tensor w13,
                              torch::Tensor s13, c10::optional<torch::Tensor> z13, torch::Tensor w2,
                              torch::Tensor s2, c10::optional<torch::Tensor> z2) {
  TORCH_CHECK(x.dim() == 2, "x: float32 [T, H]");
  const int64_t E = num_experts, H = x.size(1);
  TORCH_CHECK(E > 0 && w13.size(0) % E == 0 && w2.size(0) == E * H, "w13: [E * 2I, ...], w2: [E * H, ...]");
  const int64_t r13 = w13.size(0) / E;
  auto rows = [](const c10::optional<torch::Tensor>& t, int64_t start, int64_t n) -> c10::optional<torch::Tensor> {
    if (!t.has_value() || !t->defined()) return c10::nullopt;
    return t->narrow(0, start, n);
  };
  if (kind == KIND_W8A8) {
    TORCH_CHECK(w13.scalar_type() == at::kChar && w2.scalar_type() == at::kChar, "int8_w8a8: int8 weights");
    const auto ones = torch::ones({std::max(r13, H)}, x.options());
    auto product = [&](const torch::Tensor& a, const torch::Tensor& w, const torch::Tensor& s) {
      const auto [aq, as] = quantize_per_token(a);
      const auto acc = avx2_linear_int8w(aq, w, ones.narrow(0, 0, w.size(0)), c10::nullopt);
      return acc.mul_(as.unsqueeze(1)).mul_(s);
    };
    return route(
        x, topk_weights, topk_ids, E,
        [&](int64_t e, const torch::Tensor& xe) {
          return product(xe, w13.narrow(0, e * r13, r13), s13.narrow(0, e * r13, r13));
        },
        [&](int64_t e, const torch::Tensor& h) { return product(h, w2.narrow(0, e * H, H), s2.narrow(0, e * H, H)); });
  }
  return route(
      x, topk_weights, topk_ids, E,
      [&](int64_t e, const torch::Tensor& xe) {
        return avx2_linear_quantw(xe, kind, w13.narrow(0, e * r13, r13), s13.narrow(0, e * r13, r13),
                                  rows(z13, e * r13, r13), group_size, c10::nullopt);
      },
      [&](int64_t e, const torch::Tensor& h) {
        return avx2_linear_quantw(h, kind, w2.narrow(0, e * H, H), s2.narrow(0, e * H, H), rows(z2, e * H, H),
                                  group_size, c10::nullopt);
      });
}

// w13 [E, ceil(2I / 16), H, 16] and w2 [E, ceil(H / 16), I, 16]: each expert's gate/up and
// down weights as linear_bf16w's panels.
torch::Tensor avx2_moe_bf16w(torch::Tensor x, torch::Tensor topk_weights, torch::Tensor topk_ids,
                             torch::Tensor w13, int64_t n13, torch::Tensor w2) {
  TORCH_CHECK(x.dim() == 2, "x: float32 [T, H]");
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(0) == w2.size(0) && w13.size(0) > 0,
              "w13, w2: bf16 panels [E, panels, K, 16]");
  TORCH_CHECK(w13.is_cpu() && w2.is_cpu(), "CPU tensors only");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "w13, w2: contiguous panels");
  const int64_t E = w13.size(0), H = x.size(1);
  TORCH_CHECK(w13.size(2) == H, "w13's K must be x's hidden size");
  return route(
      x, topk_weights, topk_ids, E,
      [&](int64_t e, const torch::Tensor& xe) { return avx2_linear_bf16w(xe, w13[e], n13, c10::nullopt); },
      [&](int64_t e, const torch::Tensor& h) { return avx2_linear_bf16w(h, w2[e], H, c10::nullopt); });
}
