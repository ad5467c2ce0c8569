// Weight-streaming bf16 matrix products for CPU decode (a few rows of x).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32 accumulation with the
// AVX512-BF16 dot-product instruction (vdpbf16ps: 32 bf16 pairs per step).
// Decode is bandwidth-bound: every weight row is read from memory once for all
// M rows of x. Threads split the output rows into blocks of R weight rows; a
// block (R x K bf16, a few KB) is multiplied against x in tiles of MR rows, so
// after the first tile it is read from L1, and while a block is in use the next
// one is prefetched into L2. The tile sizes and the prefetch were chosen by
// measurement on an AMD EPYC (Zen 4) VM: 1x8 rows prefetching four blocks ahead
// into L2 streams ~32 GB/s at M = 1 (into L1: ~30; the old 1x4 kernel without
// prefetch: ~25), and 4x6 tiles beat oneDNN up to M = 64 (0.32 vs 0.19 TFLOP/s at
// M = 16; into L1 it was 0.26); past that oneDNN's packed GEMM wins.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>

#include "kernels.h"
#include "moe_routing.h"

namespace {

using bf16 = at::BFloat16;

// out[m * R + r] = <x[m], w[r]> for an MR x R tile; optionally prefetch the
// matching part of the next block (wnext) into L1 as the loop goes.
template <int MR, int R, bool PREFETCH, int HINT>
inline void tile(const bf16* x, const bf16* w, const bf16* wnext, int64_t K, float* out) {
  __m512 acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t k_full = K & ~int64_t(31);
  for (int64_t k = 0; k < k_full; k += 32) {
    if constexpr (PREFETCH) {
      for (int r = 0; r < R; ++r) _mm_prefetch((const char*)(wnext + r * K + k), static_cast<_mm_hint>(HINT));
    }
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
    for (int m = 0; m < MR; ++m) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  if (k_full < K) {  // masked tail: zeros contribute nothing
    const __mmask32 mask = (__mmask32)((1ull << (K - k_full)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k_full);
    for (int m = 0; m < MR; ++m) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k_full);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// A tile of `rows` (<= MR) rows of x: the row count is a template argument.
template <int MR, int R, int HINT>
inline void tile_rows(int rows, const bf16* x, const bf16* w, const bf16* wnext, int64_t K,
                      float* out) {
  switch (rows) {
#define MINIVLLM_TILE(n) \
  case n:                \
    if constexpr (n <= MR) tile<n, R, true, HINT>(x, w, wnext, K, out); \
    break;
    MINIVLLM_TILE(1)
    MINIVLLM_TILE(2)
    MINIVLLM_TILE(3)
    MINIVLLM_TILE(4)
#undef MINIVLLM_TILE
    default: break;
  }
}

inline void store(float value, const bf16* bias, int64_t n, bf16* y) {
  *y = bf16(value + (bias ? static_cast<float>(bias[n]) : 0.f));
}

// PREFETCH_AHEAD: how many blocks ahead of the one in use to prefetch; HINT: into
// which cache level.
template <int MR, int R, int PREFETCH_AHEAD, int HINT>
void small_gemm(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t M, int64_t K,
                int64_t N) {
  const int64_t num_blocks = N / R;
  at::parallel_for(0, num_blocks, 4, [&](int64_t begin, int64_t end) {
    float out[MR * R];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R;
      const bf16* wnext = w + std::min(b + PREFETCH_AHEAD, num_blocks - 1) * R * K;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - m0));
        tile_rows<MR, R, HINT>(rows, x + m0 * K, w + n0 * K, wnext, K, out);
        for (int m = 0; m < rows; ++m)
          for (int r = 0; r < R; ++r) store(out[m * R + r], bias, n0 + r, y + (m0 + m) * N + n0 + r);
      }
    }
  });
  for (int64_t n = num_blocks * R; n < N; ++n) {  // the last N % R rows
    float out[MR];
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, M - m0));
      tile_rows<MR, 1, HINT>(rows, x + m0 * K, w + n * K, w + n * K, K, out);
      for (int m = 0; m < rows; ++m) store(out[m], bias, n, y + (m0 + m) * N + n);
    }
  }
}

}  // namespace

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes: x [M, K], w [N, K]");
  TORCH_CHECK(x.size(0) >= 1, "at least one row");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const bf16* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kBFloat16 && bias_c.numel() == N, "bias: bf16 [N]");
    b = bias_c.data_ptr<bf16>();
  }
  auto xp = x.data_ptr<bf16>();
  auto wp = w.data_ptr<bf16>();
  auto yp = y.data_ptr<bf16>();
  if (M == 1) {
    small_gemm<1, 8, 4, _MM_HINT_T1>(xp, wp, b, yp, M, K, N);
  } else {
    small_gemm<4, 6, 1, _MM_HINT_T1>(xp, wp, b, yp, M, K, N);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL, as ATen ops do: a 40 ms decode step that held it
  // kept the server's event loop (another thread) from streaming the previous token.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "bf16 RMSNorm", nogil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; RMSNorm(residual)", nogil);
  m.def("rotary_inplace", &rotary_inplace, "neox rotary embedding, in place", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", nogil);
  m.def("argmax_bf16", &argmax_bf16, "row-wise argmax of bf16 logits", nogil);
  m.def("watermark_argmax", &watermark_argmax, "keyed Gumbel-max over each row (philox4x32-10-v1)", nogil);
  m.def("gemv_bf16", &gemv_bf16, "bf16 weight-streaming GEMV (AVX512-BF16)", nogil);
  m.def("quant_linear", &quant_linear,
        "x @ W^T + b on int8/int4/fp8 weights (minivllm/quantization/formats.py)", nogil);
  m.def("dequantize_bf16", &dequantize_bf16, "a quantized weight as bf16 (formats.dequantize, rounded once)", nogil);
  m.def("dequantized_linear", &dequantized_linear,
        "x @ dequantize_bf16(W)^T + b, dequantizing blocks of rows into a scratch (no full copy)", nogil);
  m.def("int4_w4a8_packed_linear", &int4_w4a8_packed_linear,
        "int4_w4a8 on AVX512-VNNI over packing.pack_vnni_w4a8's panels", nogil);
  m.def("quantize_per_token_int8", &quantize_per_token_int8,
        "bf16 rows -> int8 and per-row scales (amax / 127)", nogil);
  m.def("quantize_weight", &quantize_weight,
        "a bf16 weight quantized as formats.quantize does it (int8, int4, fp8), into the given tensors", nogil);
  m.def("pack_vnni_w8a8", &pack_vnni_w8a8, "packing.pack_vnni_w8a8 into the given tensor", nogil);
  m.def("pack_amx_w8a8", &pack_amx_w8a8, "packing.pack_amx_w8a8 into the given tensor", nogil);
  m.def("pack_vnni_w4a8", &pack_vnni_w4a8, "packing.pack_vnni_w4a8 into the given tensor", nogil);
  m.def("amx_w8a8_available", &amx_w8a8_available, "whether AMX-INT8 runs here (asks Linux for it once)");
  m.def("amx_bf16_available", &amx_bf16_available, "whether AMX-BF16 runs here (asks Linux for it once)");
  m.def("w8a8_packed_linear", &w8a8_packed_linear, "int8_w8a8 on a prepacked copy (AMX or VNNI)", nogil);
  m.def("vnni_w8a8_linear", &vnni_w8a8_linear, "int8_w8a8 GEMM on AVX512-VNNI, per-token scales fused", nogil);
  m.def("amx_w8a8_linear", &amx_w8a8_linear, "int8_w8a8 on AMX-INT8, per-token scales fused", nogil);
  m.def("amx_weight_only_linear", &amx_weight_only_linear,
        "weight-only int8 / fp8 / int4 x @ W^T + b on AMX-BF16 tiles, on formats' rows", nogil);
  m.def("amx_weight_only_supports", &amx_weight_only_supports,
        "whether amx_weight_only_linear takes a kind, K and group size");
  m.def("llama_decode_layers", &llama_decode_layers, "every Llama-family decoder layer, one decode step", nogil);
  m.def("prefill_attention", &prefill_attention, "bf16 causal prefill attention over the paged cache",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("num_context"),
        py::arg("scale"), py::arg("window"), py::arg("allow_amx") = true, nogil);
  m.def("write_kv_cache", &write_kv_cache, "write a step's keys and values into the paged cache", nogil);
  m.def("dsa_indexer_topk", &dsa_indexer_topk,
        "DSA lightning indexer: each query row's top-k tokens, ascending, -1-padded", nogil);
  m.def("sparse_mla_decode", &sparse_mla_decode, "absorbed-MLA decode over selected latent rows", nogil);
  m.def("moe_experts", &moe_experts, "routed MoE experts for a few tokens, grouped by expert", nogil);
  m.def("moe_quant_experts", &moe_quant_experts,
        "a MoE layer's quantized routed experts in one call (quant_linear per chosen expert)", nogil);
  m.def("paged_attention_decode", &paged_attention_decode, "bf16 paged decode attention", nogil);
  m.def("moe_grouped_topk", &moe_grouped_topk, "DeepSeek's group-limited top-k routing: (weights, ids)", nogil);
}
