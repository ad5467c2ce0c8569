// DeepSeek's group-limited top-k routing (layers/moe.grouped_topk) in one call. Plain C++,
// no intrinsics: both CPU families compile it (moe_routing.h), each binding it as
// "moe_grouped_topk".
//
// Why: the reference is ten PyTorch ops (sigmoid, add, view, topk, sum, topk, scatter,
// repeat_interleave, masked_fill, topk, gather, sum, div, mul), ~0.3 ms per MoE layer
// per decode step on AMD EPYC Zen 1 whatever the experts' format, where the work is a
// few hundred comparisons per token.
//
// The numbers are the reference's: the sigmoid is ATen's own op, the bias added in
// float32, a group's score the sum of its two largest biased affinities, the weights the
// unbiased affinities of the chosen experts divided by their sum plus 1e-20 and times the
// scaling, in float32. Ties go to the lower index (the reference leaves them unspecified);
// the chosen ids come out by descending biased affinity.
//
// A NaN affinity (a diverged model's router) ranks above every number, as torch.topk
// ranks it: its group and the expert are chosen first and the token's weights come out
// NaN, as the reference's do. The family builds with -ffast-math, under which the
// compiler may assume no NaN or infinity ever reaches a float compare or std::isnan: NaN
// is found from the bits (`is_nan`), flagged beside the value, and the value compared
// is a finite stand-in, so the ranking never compares a NaN (nor an infinity of ours).
#include "moe_routing.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// whether v is NaN (exponent all ones, mantissa nonzero), read from the bits
inline bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> moe_grouped_topk(torch::Tensor router_logits,
                                                          c10::optional<torch::Tensor> correction_bias,
                                                          int64_t top_k, int64_t num_groups, int64_t topk_group,
                                                          bool renormalize, double scaling) {
  TORCH_CHECK(router_logits.is_cpu() && router_logits.scalar_type() == at::kFloat && router_logits.dim() == 2,
              "router_logits: float32 [T, E] on the CPU");
  const int64_t T = router_logits.size(0), E = router_logits.size(1);
  TORCH_CHECK(num_groups >= 1 && E % num_groups == 0, "num_groups=", num_groups, " must divide ", E, " experts");
  const int64_t per_group = E / num_groups;
  TORCH_CHECK(num_groups == 1 || per_group >= 2, "a group is scored by its best two experts");
  TORCH_CHECK(topk_group >= 1 && topk_group <= num_groups, "topk_group must be in [1, num_groups]");
  TORCH_CHECK(top_k >= 1 && top_k <= topk_group * per_group, "top_k=", top_k, " must be in [1, ",
              topk_group * per_group, "] (the experts of topk_group groups)");
  const float* bias = nullptr;
  torch::Tensor bias_c;
  if (correction_bias.has_value() && correction_bias->defined()) {
    TORCH_CHECK(correction_bias->is_cpu() && correction_bias->scalar_type() == at::kFloat &&
                    correction_bias->numel() == E,
                "correction_bias: float32 [E] on the CPU");
    bias_c = correction_bias->contiguous();
    bias = bias_c.data_ptr<float>();
  }
  const auto scores = router_logits.sigmoid().contiguous();
  const float* sp = scores.data_ptr<float>();
  auto weights = torch::empty({T, top_k}, scores.options());
  auto ids = torch::empty({T, top_k}, scores.options().dtype(at::kLong));
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const float scale = static_cast<float>(scaling);

  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> choice(E), group_score(num_groups);
    std::vector<uint8_t> nan(E), group_nan(num_groups);
    std::vector<int64_t> groups(num_groups), candidates;
    candidates.reserve(E);
    for (int64_t t = begin; t < end; ++t) {
      const float* s = sp + t * E;
      for (int64_t e = 0; e < E; ++e) {
        const float v = bias ? s[e] + bias[e] : s[e];
        nan[e] = is_nan(v);
        choice[e] = nan[e] ? 0.f : v;
      }
      // NaN first, then the higher biased affinity, then the lower index
      auto before = [&](int64_t a, int64_t b) {
        if (nan[a] != nan[b]) return nan[a] > nan[b];
        return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
      };
      candidates.clear();
      if (num_groups > 1 && topk_group < num_groups) {
        for (int64_t g = 0; g < num_groups; ++g) {
          const float* c = choice.data() + g * per_group;
          float best = c[0] > c[1] ? c[0] : c[1], second = c[0] > c[1] ? c[1] : c[0];
          for (int64_t j = 2; j < per_group; ++j) {
            if (c[j] > best) {
              second = best;
              best = c[j];
            } else if (c[j] > second) {
              second = c[j];
            }
          }
          group_score[g] = best + second;
          group_nan[g] = std::any_of(nan.begin() + g * per_group, nan.begin() + (g + 1) * per_group,
                                     [](uint8_t f) { return f != 0; });
          groups[g] = g;
        }
        // a group holding a NaN scores NaN in the reference, which its top-k ranks first
        std::partial_sort(groups.begin(), groups.begin() + topk_group, groups.end(), [&](int64_t a, int64_t b) {
          if (group_nan[a] != group_nan[b]) return group_nan[a] > group_nan[b];
          return group_score[a] > group_score[b] || (group_score[a] == group_score[b] && a < b);
        });
        std::sort(groups.begin(), groups.begin() + topk_group);
        for (int64_t i = 0; i < topk_group; ++i)
          for (int64_t j = 0; j < per_group; ++j) candidates.push_back(groups[i] * per_group + j);
      } else {
        for (int64_t e = 0; e < E; ++e) candidates.push_back(e);
      }
      std::partial_sort(candidates.begin(), candidates.begin() + top_k, candidates.end(), before);
      float* w = wp + t * top_k;
      int64_t* id = ip + t * top_k;
      float sum = 0.f;
      for (int64_t i = 0; i < top_k; ++i) {
        id[i] = candidates[i];
        w[i] = s[candidates[i]];
        sum += w[i];
      }
      const float denom = sum + 1e-20f;
      for (int64_t i = 0; i < top_k; ++i) w[i] = (renormalize ? w[i] / denom : w[i]) * scale;
    }
  });
  return {weights, ids};
}

ExpertTokens tokens_by_expert(const torch::Tensor& topk_weights, const torch::Tensor& topk_ids, int64_t T,
                              int64_t E) {
  TORCH_CHECK(topk_ids.is_cpu() && topk_weights.is_cpu(), "CPU tensors only");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T, "topk_ids: [T, k]");
  TORCH_CHECK(!at::isFloatingType(topk_ids.scalar_type()) && topk_ids.scalar_type() != at::kBool,
              "topk_ids: integers");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights: [T, k] like topk_ids");
  const int64_t top = topk_ids.size(1);
  const auto ids = topk_ids.to(at::kLong).contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  ExpertTokens out{std::vector<std::vector<int64_t>>(E), std::vector<std::vector<int64_t>>(E),
                   topk_weights.to(at::kFloat).contiguous()};
  for (int64_t i = 0; i < T * top; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < E, "expert id ", ip[i], " out of [0, ", E, ")");
    // a router picks an expert at most once per token (the callers' n == T shortcut needs it)
    TORCH_CHECK(out.tokens[ip[i]].empty() || out.tokens[ip[i]].back() != i / top, "token ", i / top,
                " picks expert ", ip[i], " twice");
    out.tokens[ip[i]].push_back(i / top);
    out.picks[ip[i]].push_back(i);
  }
  return out;
}
