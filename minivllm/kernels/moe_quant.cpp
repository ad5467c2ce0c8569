// Quantized routed experts in bf16 engines (AVX512-BF16 family): one call runs a MoE
// layer's step, every chosen expert's gate/up product, SiLU gating and down product on
// that expert's rows of the stacked quantized weights (quant_gemm.cpp's and
// quant_w8a8.cpp's quant_linear), each output weighted by the router and added into its
// token's row. The fp32 engines' counterpart is avx2_moe.cpp.
//
// Why a call per layer and not the Python routing loop (layers/moe.routed_experts, an op
// per expert): on the DeepSeek-V3.2 shape scaled to 400M (hidden 1024, 32 experts of 256,
// top-4, 11 MoE layers; AMD EPYC Zen 4, 2 vCPUs, 2026-12-04) int8 and int4 experts decoded
// slower than bf16's one-call moe.cpp (22-24 against 19-21 ms a token) though they stream
// a half and a quarter of its bytes: per layer the loop spends most of its time indexing,
// gathering and scattering per expert, not multiplying.
//
// The arithmetic is the loop's with the same ops, bit for bit: experts in ascending
// order; each expert's tokens gathered; g, u = quant_linear(x_e) split in halves;
// h = quant_linear(silu(g) * u) with ATen's bf16 silu and product (each rounded to bf16,
// as F.silu(gate) * up); out[t] += bf16(float(h) * weight), a bf16 add.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "moe_routing.h"

namespace {

c10::optional<torch::Tensor> rows_of(const c10::optional<torch::Tensor>& t, int64_t start, int64_t n) {
  if (!t.has_value() || !t->defined()) return c10::nullopt;
  return t->narrow(0, start, n);
}

}  // namespace

// x [T, H] bf16; topk_weights [T, k] float32; topk_ids [T, k] integers in [0, E). w13:
// the stacked gate/up rows [E * 2I, ...] with their scale (int4: [E * 2I, groups], and
// zero points or none), wsum (int8_w8a8's row sums, else none); w2 likewise for the down
// rows [E * H, ...]. kind and group_size: quant_linear's. An expert's product of up to
// max_kernel_rows tokens runs quant_linear (kernel_limits.max_kernel_rows); past them int8_w8a8
// runs w8a8_packed_linear on that expert's prepacked copy (packed13[e], packed2[e]; empty
// lists for the weight-only schemes, whose dequantize-and-GEMM path stays with the loop).
// int4_w4a8 (kind 5, which quant_linear has not) runs every product on its expert's panels
// (int4_w4a8_packed_linear, packing.pack_vnni_w4a8), as its dense layers do.
// Returns [T, H] bf16.
torch::Tensor moe_quant_experts(torch::Tensor x, torch::Tensor topk_weights, torch::Tensor topk_ids,
                                int64_t num_experts, int64_t kind, int64_t group_size, torch::Tensor w13,
                                torch::Tensor s13, c10::optional<torch::Tensor> z13,
                                c10::optional<torch::Tensor> ws13, torch::Tensor w2, torch::Tensor s2,
                                c10::optional<torch::Tensor> z2, c10::optional<torch::Tensor> ws2,
                                std::vector<torch::Tensor> packed13, std::vector<torch::Tensor> packed2,
                                int64_t max_kernel_rows) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "moe_quant_experts: x must be bf16 [T, H]");
  TORCH_CHECK(x.is_cpu(), "moe_quant_experts: CPU tensors only");
  const int64_t E = num_experts, T = x.size(0), H = x.size(1);
  TORCH_CHECK(E > 0 && w13.dim() == 2 && w13.size(0) % E == 0 && w13.size(0) / E % 2 == 0,
              "moe_quant_experts: w13 must be [E * 2I, ...]");
  TORCH_CHECK(w2.dim() == 2 && w2.size(0) == E * H, "moe_quant_experts: w2 must be [E * H, ...]");
  const int64_t r13 = w13.size(0) / E, I = r13 / 2;
  const bool packed = !packed13.empty();
  TORCH_CHECK(!packed || ((kind == 4 || kind == 5) && static_cast<int64_t>(packed13.size()) == E &&
                          static_cast<int64_t>(packed2.size()) == E),
              "moe_quant_experts: prepacked copies are int8_w8a8's or int4_w4a8's, one per expert");
  TORCH_CHECK(kind != 5 || packed, "moe_quant_experts: int4_w4a8 runs on its experts' panels, one per expert");
  // expert e's product of `part` (w, scale, zero, wsum, packed copies) on rows a [n, K]
  auto product = [&](const torch::Tensor& a, int64_t e, int64_t rows, const torch::Tensor& w,
                     const torch::Tensor& s, const c10::optional<torch::Tensor>& z,
                     const c10::optional<torch::Tensor>& ws, const std::vector<torch::Tensor>& copies) {
    if (kind == 5) return int4_w4a8_packed_linear(a, copies[e], rows, group_size, c10::nullopt);
    const auto se = s.narrow(0, e * rows, rows);
    if (a.size(0) <= max_kernel_rows)
      return quant_linear(a, kind, w.narrow(0, e * rows, rows), se, rows_of(z, e * rows, rows),
                          rows_of(ws, e * rows, rows), group_size, c10::nullopt);
    TORCH_CHECK(packed, "moe_quant_experts: ", a.size(0), " tokens for one expert, past the kernel's ",
                max_kernel_rows, " rows (the routing loop dequantizes for those)");
    return w8a8_packed_linear(a, copies[e], a.size(1), se, ws->narrow(0, e * rows, rows), c10::nullopt);
  };
  x = x.contiguous();
  const ExpertTokens routes = tokens_by_expert(topk_weights, topk_ids, T, E);
  const auto& tokens = routes.tokens;
  const auto& picks = routes.picks;
  const float* wp = routes.weights.data_ptr<float>();
  auto out = torch::zeros_like(x);
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(tokens[e].size());
    if (n == 0) continue;
    const auto gu = product(expert_rows(x, tokens[e]), e, r13, w13, s13, z13, ws13, packed13);
    const auto h = at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
    const auto y = product(h, e, H, w2, s2, z2, ws2, packed2);
    const at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < n; ++i) {
      at::BFloat16* dst = op + tokens[e][i] * H;
      const at::BFloat16* src = yp + i * H;
      const float w = wp[picks[e][i]];
      for (int64_t c = 0; c < H; ++c) {
        // (h * weight).to(bf16), then a bf16 add: each rounded, as the loop's tensor ops
        const volatile float weighted = static_cast<float>(src[c]) * w;
        const volatile float sum = static_cast<float>(dst[c]) + static_cast<float>(at::BFloat16(weighted));
        dst[c] = at::BFloat16(sum);
      }
    }
  }
  return out;
}
