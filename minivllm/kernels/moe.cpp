// The routed experts of a mixture-of-experts layer for a few tokens (decode): each token
// through its k chosen experts, h = silu(x W1^T) * (x W3^T), y = h W2^T, and the weighted
// sum of the y (minivllm/layers/moe.py, moe_reference, is the reference).
//
// Decode is bandwidth-bound on the experts' weights, so tokens are grouped by expert and
// each chosen expert's weights are streamed once for all of its tokens. Threads split
// the output rows of each product, as gemv_bf16.cpp does: vdpbf16ps tiles of up to 4
// tokens x 8 weight rows, prefetching blocks a few ahead into L2. The two products are
// two parallel passes with h rounded to bf16 between them (the bf16 torch path has h in
// bf16). Each (token, slot) keeps its own fp32 y, summed in slot order at the end, so
// the result does not depend on the number of threads.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace {

using bf16 = at::BFloat16;
constexpr int MR = 4;     // tokens per tile
constexpr int NR = 8;     // weight rows per block (a work item)
constexpr int AHEAD = 4;  // blocks ahead prefetched into L2

// out[m * R + r] = <x[m], w[r]> for M tokens and R rows (both with stride K); the same
// part of the rows at wnext is prefetched into L2 on the way.
template <int M, int R>
inline void tile(const bf16* x, const bf16* w, const bf16* wnext, int64_t K, float* out) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __mmask32 mask) {
    for (int r = 0; r < R; ++r) _mm_prefetch((const char*)(wnext + r * K + k), _MM_HINT_T1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  };
  const int64_t k_full = K & ~int64_t(31);
  for (int64_t k = 0; k < k_full; k += 32) step(k, ~__mmask32(0));
  if (k_full < K) step(k_full, static_cast<__mmask32>((1u << (K - k_full)) - 1));  // zeros add nothing
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int R>
inline void tile_tokens(int tokens, const bf16* x, const bf16* w, const bf16* wnext, int64_t K, float* out) {
  switch (tokens) {
    case 1: tile<1, R>(x, w, wnext, K, out); break;
    case 2: tile<2, R>(x, w, wnext, K, out); break;
    case 3: tile<3, R>(x, w, wnext, K, out); break;
    default: tile<4, R>(x, w, wnext, K, out); break;
  }
}

// out[m * NR + r] = <x[m], w[r]> for `tokens` rows of x and `rows` (<= NR) rows of w.
void block_dots(const bf16* x, int64_t tokens, const bf16* w, int rows, const bf16* wnext, int64_t K,
                float* out) {
  float t[MR * NR];
  for (int64_t m0 = 0; m0 < tokens; m0 += MR) {
    const int mt = static_cast<int>(std::min<int64_t>(MR, tokens - m0));
    if (rows == NR) {
      tile_tokens<NR>(mt, x + m0 * K, w, wnext, K, t);
      for (int m = 0; m < mt; ++m) std::copy_n(t + m * NR, NR, out + (m0 + m) * NR);
      continue;
    }
    for (int r = 0; r < rows; ++r) {  // a matrix's last rows, one at a time
      tile_tokens<1>(mt, x + m0 * K, w + r * K, wnext, K, t);
      for (int m = 0; m < mt; ++m) out[(m0 + m) * NR + r] = t[m];
    }
  }
}

// The tokens that chose one expert: slots [begin, begin + count) of the grouped order.
struct Group {
  int64_t expert, begin, count;
};

// The T * k (token, slot) pairs grouped by expert: pair i sits at position pos_of[i].
struct Routing {
  std::vector<Group> groups;
  std::vector<int64_t> pos_of, pair_at;  // pair_at[pos_of[i]] == i
};

Routing group_by_expert(const int64_t* ids, int64_t pairs, int64_t E) {
  std::vector<int64_t> count(E, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "expert id ", ids[i], " outside [0, ", E, ")");
    ++count[ids[i]];
  }
  Routing r{{}, std::vector<int64_t>(pairs), std::vector<int64_t>(pairs)};
  std::vector<int64_t> next(E);
  int64_t begin = 0;
  for (int64_t e = 0; e < E; ++e) {
    next[e] = begin;
    if (count[e] > 0) r.groups.push_back({e, begin, count[e]});
    begin += count[e];
  }
  for (int64_t i = 0; i < pairs; ++i) {
    r.pos_of[i] = next[ids[i]]++;
    r.pair_at[r.pos_of[i]] = i;
  }
  return r;
}

struct Item {
  int64_t group, row0;  // a block of NR output rows of one group's product
};

// Blocks of `rows` output rows for every group, group-major (a thread streams along a
// matrix, so its prefetches ahead hit rows it will use).
std::vector<Item> blocks(const std::vector<Group>& groups, int64_t rows) {
  std::vector<Item> items;
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
    for (int64_t r = 0; r < rows; r += NR) items.push_back({g, r});
  return items;
}

// w + rows [row0 + AHEAD NR ..), clamped to the matrix's last block.
inline const bf16* ahead(const bf16* w, int64_t row0, int64_t rows, int64_t K) {
  return w + std::min(row0 + AHEAD * NR, std::max<int64_t>(0, rows - NR)) * K;
}

struct Experts {
  const bf16* w13;  // [E, 2I, Hd]
  const bf16* w2;   // [E, Hd, I]
  int64_t Hd, I;
};

// hs[p] = bf16(silu(xs[p] W1^T) * (xs[p] W3^T)) for the grouped rows xs [P, Hd] -> hs [P, I].
void gate_up(const Experts& ex, const std::vector<Group>& groups, const bf16* xs, bf16* hs) {
  const int64_t Hd = ex.Hd, I = ex.I;
  const std::vector<Item> items = blocks(groups, I);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate, up;
    for (int64_t i = begin; i < end; ++i) {
      const Group& g = groups[items[i].group];
      const int64_t j0 = items[i].row0;
      const int rows = static_cast<int>(std::min<int64_t>(NR, I - j0));
      const bf16* w1 = ex.w13 + g.expert * 2 * I * Hd;  // gate rows [0, I)
      const bf16* w3 = w1 + I * Hd;                      // up rows [I, 2I)
      const bf16* x = xs + g.begin * Hd;
      gate.resize(g.count * NR);
      up.resize(g.count * NR);
      block_dots(x, g.count, w1 + j0 * Hd, rows, ahead(w1, j0, I, Hd), Hd, gate.data());
      block_dots(x, g.count, w3 + j0 * Hd, rows, ahead(w3, j0, I, Hd), Hd, up.data());
      for (int64_t m = 0; m < g.count; ++m)
        for (int r = 0; r < rows; ++r) {
          const float a = gate[m * NR + r];
          hs[(g.begin + m) * I + j0 + r] = bf16(a / (1.f + std::exp(-a)) * up[m * NR + r]);
        }
    }
  });
}

// ys[p] = hs[p] W2^T in fp32: hs [P, I] -> ys [P, Hd].
void down(const Experts& ex, const std::vector<Group>& groups, const bf16* hs, float* ys) {
  const int64_t Hd = ex.Hd, I = ex.I;
  const std::vector<Item> items = blocks(groups, Hd);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> y;
    for (int64_t i = begin; i < end; ++i) {
      const Group& g = groups[items[i].group];
      const int64_t n0 = items[i].row0;
      const int rows = static_cast<int>(std::min<int64_t>(NR, Hd - n0));
      const bf16* w = ex.w2 + g.expert * Hd * I;
      y.resize(g.count * NR);
      block_dots(hs + g.begin * I, g.count, w + n0 * I, rows, ahead(w, n0, Hd, I), I, y.data());
      for (int64_t m = 0; m < g.count; ++m)
        std::copy_n(y.data() + m * NR, rows, ys + (g.begin + m) * Hd + n0);
    }
  });
}

}  // namespace

// x [T, Hd] bf16; w13 [E, 2I, Hd] bf16 (gate rows, then up); w2 [E, Hd, I] bf16;
// weights [T, k] float32; ids [T, k] int64. Returns [T, Hd] bf16: moe.moe_reference.
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor weights,
                          torch::Tensor ids) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x: bf16 [T, Hd]");
  TORCH_CHECK(w13.scalar_type() == at::kBFloat16 && w13.dim() == 3 && w13.size(2) == x.size(1) &&
                  w13.size(1) % 2 == 0,
              "w13: bf16 [E, 2I, Hd]");
  const int64_t T = x.size(0), Hd = x.size(1), E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w2.scalar_type() == at::kBFloat16 && w2.sizes() == at::IntArrayRef({E, Hd, I}),
              "w2: bf16 [E, Hd, I] matching w13");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == T, "ids: int64 [T, k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == ids.sizes(),
              "weights: float32 [T, k]");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "expert weights must be contiguous");
  x = x.contiguous();
  ids = ids.contiguous();
  weights = weights.contiguous();
  const int64_t k = ids.size(1), P = T * k;
  const Routing routing = group_by_expert(ids.data_ptr<int64_t>(), P, E);
  std::vector<bf16> xs(P * Hd), hs(P * I);  // each pair's token, and its h, in grouped order
  std::vector<float> ys(P * Hd);
  const bf16* xp = x.data_ptr<bf16>();
  for (int64_t p = 0; p < P; ++p) std::copy_n(xp + routing.pair_at[p] / k * Hd, Hd, xs.data() + p * Hd);
  const Experts ex{w13.data_ptr<bf16>(), w2.data_ptr<bf16>(), Hd, I};
  gate_up(ex, routing.groups, xs.data(), hs.data());
  down(ex, routing.groups, hs.data(), ys.data());
  // out[t] = sum_j weights[t, j] y[t, j], in slot order
  auto out = torch::empty({T, Hd}, x.options());
  bf16* op = out.data_ptr<bf16>();
  const float* wt = weights.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(Hd);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const float wj = wt[t * k + j];
        const float* y = ys.data() + routing.pos_of[t * k + j] * Hd;
        for (int64_t d = 0; d < Hd; ++d) sum[d] += wj * y[d];
      }
      for (int64_t d = 0; d < Hd; ++d) op[t * Hd + d] = bf16(sum[d]);
    }
  });
  return out;
}
