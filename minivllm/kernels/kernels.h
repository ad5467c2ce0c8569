// The kernels of minivllm's CPU extension, declared once for the files that call
// each other's (decode_layers.cpp) and for the Python bindings (gemv_bf16.cpp).
// All take and return bf16 tensors; see each definition for the layouts.
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor llama_decode_layers(torch::Tensor hidden, std::vector<torch::Tensor> weights,
                                  std::vector<torch::Tensor> kv_caches, std::vector<int64_t> windows,
                                  torch::Tensor final_norm, torch::Tensor positions,
                                  torch::Tensor slot_mapping, torch::Tensor block_tables,
                                  torch::Tensor seq_lens, torch::Tensor cos, torch::Tensor sin,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  double eps, double scale);
