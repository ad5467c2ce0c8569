// The AVX2 family's ops across its files (avx2_*.cpp): what one file calls of another's,
// and what avx2_attention.cpp binds into the module.
#pragma once

#include <torch/extension.h>

#include <vector>

// f(const-less null pointer of the element type) for a KV cache of fp32, bf16, fp8 e4m3 or
// e5m2 (kv_cache_dtype), the one place the AVX2 family maps a cache dtype to a C++ type.
template <class F>
void visit_cache_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(static_cast<float*>(nullptr));
    case at::kBFloat16:
      return f(static_cast<c10::BFloat16*>(nullptr));
    case at::kFloat8_e4m3fn:
      return f(static_cast<c10::Float8_e4m3fn*>(nullptr));
    case at::kFloat8_e5m2:
      return f(static_cast<c10::Float8_e5m2*>(nullptr));
    default:
      TORCH_CHECK(false, "KV cache: float32, bfloat16, float8_e4m3fn or float8_e5m2, got ", dtype);
  }
}

torch::Tensor avx2_paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                          int64_t window);
torch::Tensor avx2_linear_bf16w(torch::Tensor x, torch::Tensor panels, int64_t n,
                                c10::optional<torch::Tensor> bias);

torch::Tensor avx2_linear_int8w(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                c10::optional<torch::Tensor> bias);

torch::Tensor avx2_linear_quantw(torch::Tensor x, int64_t kind, torch::Tensor weight, torch::Tensor scale,
                                 c10::optional<torch::Tensor> zero, int64_t group_size,
                                 c10::optional<torch::Tensor> bias);

// linear_quantw's AVX-512 form of int8/int4 rows (avx512_quantw.cpp) on or off: returns
// the previous state, refuses `on` where the CPU lacks AVX-512 F/BW/VL or VNNI
bool avx2_set_quantw_avx512(bool on);

torch::Tensor avx2_moe_quantw(torch::Tensor x, torch::Tensor topk_weights, torch::Tensor topk_ids,
                              int64_t num_experts, int64_t kind, int64_t group_size, torch::Tensor w13,
                              torch::Tensor s13, c10::optional<torch::Tensor> z13, torch::Tensor w2,
                              torch::Tensor s2, c10::optional<torch::Tensor> z2);

torch::Tensor avx2_moe_bf16w(torch::Tensor x, torch::Tensor topk_weights, torch::Tensor topk_ids,
                             torch::Tensor w13, int64_t n13, torch::Tensor w2);

torch::Tensor avx2_rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor avx2_fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor avx2_silu_and_mul(torch::Tensor x);
void avx2_rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
void avx2_write_kv_cache(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping);
torch::Tensor avx2_decode_layers(torch::Tensor hidden, std::vector<torch::Tensor> weights,
                                 std::vector<int64_t> linears, std::vector<torch::Tensor> quant,
                                 std::vector<torch::Tensor> kv_caches, std::vector<torch::Tensor> kv_scales,
                                 std::vector<int64_t> windows,
                                 torch::Tensor final_norm, torch::Tensor positions, torch::Tensor slot_mapping,
                                 torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor cos,
                                 torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 double eps, double scale);

// int8_w8a8 on AVX512-VNNI panels in fp32 engines (avx2_vnni.cpp), and the panels' packer
// (pack_weights.cpp, shared with the bf16 family)
torch::Tensor avx2_vnni_w8a8_linear(torch::Tensor x, torch::Tensor packed, int64_t in_features, torch::Tensor scale,
                                    torch::Tensor wsum, c10::optional<torch::Tensor> bias);
void pack_vnni_w8a8(torch::Tensor q, torch::Tensor out);
