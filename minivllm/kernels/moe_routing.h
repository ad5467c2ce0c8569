// moe_routing.cpp's op, compiled into both CPU families (no intrinsics) and bound by each.
#pragma once

#include <torch/extension.h>

#include <tuple>

// (weights [T, top_k] float32, ids [T, top_k] int64) from float32 router logits [T, E]:
// layers/moe.grouped_topk's numbers.
std::tuple<torch::Tensor, torch::Tensor> moe_grouped_topk(torch::Tensor router_logits,
                                                          c10::optional<torch::Tensor> correction_bias,
                                                          int64_t top_k, int64_t num_groups, int64_t topk_group,
                                                          bool renormalize, double scaling);
