// moe_routing.cpp's op, compiled into both CPU families (no intrinsics) and bound by each,
// and the step's tokens grouped by expert for both families' one-call expert ops.
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

// (weights [T, top_k] float32, ids [T, top_k] int64) from float32 router logits [T, E]:
// layers/moe.grouped_topk's numbers.
std::tuple<torch::Tensor, torch::Tensor> moe_grouped_topk(torch::Tensor router_logits,
                                                          c10::optional<torch::Tensor> correction_bias,
                                                          int64_t top_k, int64_t num_groups, int64_t topk_group,
                                                          bool renormalize, double scaling);

// A step's routing grouped by expert (avx2_moe.cpp, moe_quant.cpp): tokens[e] the rows of x
// expert e serves, ascending, picks[e] their flat indices into `weights` [T, k] (float32,
// contiguous). Checks topk_ids [T, k] (integers in [0, E), an expert at most once a token)
// and topk_weights (the same shape).
struct ExpertTokens {
  std::vector<std::vector<int64_t>> tokens, picks;
  torch::Tensor weights;
};
ExpertTokens tokens_by_expert(const torch::Tensor& topk_weights, const torch::Tensor& topk_ids, int64_t T,
                              int64_t E);

// The rows of x [T, H] one expert serves (its `tokens`, ascending): x itself when it serves
// every token, else a gathered copy.
inline torch::Tensor expert_rows(const torch::Tensor& x, const std::vector<int64_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == x.size(0)) return x;
  return x.index_select(0, torch::from_blob(const_cast<int64_t*>(tokens.data()), {n}, torch::dtype(at::kLong)));
}
