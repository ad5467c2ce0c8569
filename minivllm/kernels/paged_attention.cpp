// Paged decode attention for CPU: one query token per request, reading the
// head-major KV cache [num_kv_heads, num_blocks, block_size, head_dim] in place
// (no gather copy of the context). Grouped-query: each KV head serves G query heads.
//
// For request b, KV head h, query head g in that group:
//   s_t = scale * <q_g, k_t>              for t in [begin, seq_len)
//   p_t = exp(s_t - max s) / sum exp(...)
//   o_g = sum_t p_t v_t
//
// Decode attention is a stream over the cache (at batch 64 and ~320 tokens, 2.3 GB
// per step for the 0.6B shape), so the kernel is shaped for bandwidth:
// - one pass over the context in chunks of up to 16 tokens with an online softmax
//   (Milakov & Gimelshein 2018, arXiv:1805.02867): a chunk's keys and values are
//   read once, for all G heads of the group;
// - each thread's next chunk (at an item's end, the next item's first) is prefetched
//   into L2 (prefetch_chunk). A head's part of a block is a short run in a scattered
//   place, which the hardware prefetcher picks up late: read alone in this order, 16
//   rows of 192 tokens over 28 layers' caches ran at 21 GB/s on a 2-core AMD EPYC
//   (Zen 4) VM that streams a flat buffer at 33; with the prefetch, 26. An earlier
//   version of this kernel measured a within-row prefetch slower (into L1 or L2, ~22
//   against ~27 GB/s without). The two-pass kernel this replaces read
//   ~13.5 GB/s even in order;
// - a chunk's 16 scores per head come from 16 dot-product accumulators summed in one
//   transposing tree (45 shuffles and adds instead of 16 horizontal sums);
// - the work per chunk is kept small, since what the memory cannot overlap adds up:
//   from L3 (one layer's cache) the kernel ran 44.6 GB/s before the three changes below
//   and 57-62 after, and from memory ~19 before and ~20-22 after (this VM, 16 x 192):
//   - two heads of a group share each key row's load (D <= 128), and full chunks
//     address their rows without clamping;
//   - values widen bf16 -> float as 32-bit pairs (a shift for the even dim, a mask for
//     the odd), the running sums held in that order and put back at the end.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "paged_decode.h"

namespace {

using bf16 = at::BFloat16;
constexpr int CHUNK = 16;  // tokens per chunk: one vector of scores per head

// Raw scores <q_g, k_t> of GT heads (1, or 2 where D <= 128) for the n (<= 16) keys at
// rows k[0, n), D = 32 * ND: s[g] holds head g's 16. Each key row is loaded once for the
// GT heads; one transposing tree sums 16 / GT tokens of each head (sum16 sums every lane
// the same way, so a score does not depend on which tree it went through). Full: n = 16;
// else rows past n repeat row n - 1 (always valid memory) and the caller masks their lanes.
template <int ND, int GT, bool Full>
inline void chunk_scores(const bf16* q, const bf16* k, int n, __m512* s) {
  constexpr int D = 32 * ND, T = CHUNK / GT;  // tokens per tree
  __m512bh qv[GT][ND];
  for (int g = 0; g < GT; ++g)
    for (int d = 0; d < ND; ++d) qv[g][d] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * d);
  __m512 tree[GT];
  for (int part = 0; part < GT; ++part) {
    __m512 acc[CHUNK];  // acc[g * T + t]
    for (int t = 0; t < T; ++t) {
      const int token = part * T + t;
      const bf16* row = k + (Full ? token : std::min(token, n - 1)) * D;
      for (int d = 0; d < ND; ++d) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(row + 32 * d);
        for (int g = 0; g < GT; ++g)
          acc[g * T + t] = _mm512_dpbf16_ps(d == 0 ? _mm512_setzero_ps() : acc[g * T + t], kv, qv[g][d]);
      }
    }
    tree[part] = sum16(acc);
  }
  if constexpr (GT == 1) {
    s[0] = tree[0];
  } else {  // tree p: head 0's tokens 8p .. 8p + 7 in lanes 0-7, head 1's in lanes 8-15
    s[0] = _mm512_shuffle_f32x4(tree[0], tree[1], _MM_SHUFFLE(1, 0, 1, 0));
    s[1] = _mm512_shuffle_f32x4(tree[0], tree[1], _MM_SHUFFLE(3, 2, 3, 2));
  }
}

template <int ND, int GT>
inline void scores_of(const bf16* q, const bf16* k, int n, __m512* s) {
  if (n == CHUNK)
    chunk_scores<ND, GT, true>(q, k, n, s);
  else
    chunk_scores<ND, GT, false>(q, k, n, s);
}

// The running sums keep each 32 dims of a head as their 16 even dims, then their 16 odd
// ones: a bf16 pair loaded as one 32-bit lane becomes two floats by a shift (the even
// one) and a mask (the odd one), with no widening load. finish_head puts them back in order.
//
// acc[g][d0 : d0 + 16 CH] = alpha[g] * acc[g][...] + sum_t p[g][t] v_t[...] for GT heads;
// the accumulators (GT x CH vectors) stay in registers across the chunk's tokens.
template <int GT, int CH>
inline void pv_chunk(const bf16* v, int n, int64_t D, const float* p, const float* alpha, float* acc) {
  static_assert(CH % 2 == 0, "whole 32-dim pairs of vectors");
  __m512 a[GT][CH];
  for (int g = 0; g < GT; ++g) {
    const __m512 al = _mm512_set1_ps(alpha[g]);
    for (int c = 0; c < CH; ++c) a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), al);
  }
  const __m512i odd_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int t = 0; t < n; ++t) {
    __m512 vv[CH];
    for (int c = 0; c < CH / 2; ++c) {
      const __m512i pair = _mm512_loadu_si512(v + t * D + 32 * c);
      vv[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      vv[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(pair, odd_half));
    }
    for (int g = 0; g < GT; ++g) {
      const __m512 pt = _mm512_set1_ps(p[g * CHUNK + t]);
      for (int c = 0; c < CH; ++c) a[g][c] = _mm512_fmadd_ps(pt, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

// out[0, D) = acc (even/odd order, above) times inv, in dim order, rounded to bf16.
inline void finish_head(const float* acc, int64_t D, float inv, bf16* out) {
  // lane i of a 16-dim half: the even (idx < 16) or odd (idx >= 16) sum of dim i
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 32) {
    const __m512 even = _mm512_loadu_ps(acc + d), odd = _mm512_loadu_ps(acc + d + 16);
    store_bf16x16(out + d, _mm512_mul_ps(_mm512_permutex2var_ps(even, first, odd), scale));
    store_bf16x16(out + d + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even, second, odd), scale));
  }
}

// pv_chunk over all G heads and all D dims, CH vectors of dims at a time and as many
// heads at once as fit in 16 accumulator registers.
template <int CH>
void pv_all(const bf16* v, int n, int64_t G, int64_t D, const float* p, const float* alpha, float* acc) {
  constexpr int GMAX = 16 / CH;
  for (int64_t d0 = 0; d0 < D; d0 += 16 * CH) {
    int64_t g = 0;
    while (g < G) {
      const int64_t rem = G - g;
      const float* pg = p + g * CHUNK;
      float* ag = acc + g * D + d0;
      if (GMAX >= 8 && rem >= 8) {
        if constexpr (GMAX >= 8) pv_chunk<8, CH>(v + d0, n, D, pg, alpha + g, ag);
        g += 8;
      } else if (GMAX >= 4 && rem >= 4) {
        if constexpr (GMAX >= 4) pv_chunk<4, CH>(v + d0, n, D, pg, alpha + g, ag);
        g += 4;
      } else if (rem >= 2) {
        pv_chunk<2, CH>(v + d0, n, D, pg, alpha + g, ag);
        g += 2;
      } else {
        pv_chunk<1, CH>(v + d0, n, D, pg, alpha + g, ag);
        g += 1;
      }
    }
  }
}

using paged_decode::Chunk;

// Fetches chunk c of a head's caches into L2 while the chunk before it is worked on. A
// thread's chunks are short runs (a head's part of one block) in scattered places, which
// the hardware prefetcher picks up late: read alone in this order on a 2-core AMD EPYC
// (Zen 4), 16 rows of 192 tokens over 28 layers went 20.7 -> 26 GB/s with the next chunk
// (the next item's first one at an item's end) prefetched into L2, not into L1 (~20); in
// this kernel, 1.02-1.09x over none (the median of 15 interleaved pairs, 3 runs), level at
// 64 rows of 320 tokens.
inline void prefetch_chunk(const bf16* k_head, const bf16* v_head, const Chunk& c, int64_t D) {
  const char* k = reinterpret_cast<const char*>(k_head + c.row * D);
  const char* v = reinterpret_cast<const char*>(v_head + c.row * D);
  const int64_t bytes = c.n * D * static_cast<int64_t>(sizeof(bf16));
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    _mm_prefetch(k + offset, _MM_HINT_T1);
    _mm_prefetch(v + offset, _MM_HINT_T1);
  }
}

// One request's KV head against its G query heads.
template <int ND>
void attend_one(const bf16* q, const bf16* k_head, const bf16* v_head, const std::vector<Chunk>& chunks,
                const bf16* next_k, const bf16* next_v, const paged_decode::Next& next, int64_t G, float scale,
                bf16* out, std::vector<float>& scratch) {
  constexpr int64_t D = 32 * ND;
  scratch.assign(G * (D + CHUNK + 3), 0.f);
  float* acc = scratch.data();   // [G][D]: running sums of p_t v_t
  float* p = acc + G * D;        // [G][16]: this chunk's probabilities (unnormalised)
  float* alpha = p + G * CHUNK;  // [G]: rescale of the running sums
  float* m = alpha + G;          // [G]: running max score
  float* l = m + G;              // [G]: running sum of exp(s - m)
  std::fill(m, m + G, -INFINITY);
  const __m512 sc = _mm512_set1_ps(scale);
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const Chunk& c = chunks[ci];
    if (ci + 1 < chunks.size())
      prefetch_chunk(k_head, v_head, chunks[ci + 1], D);
    else if (next_k != nullptr)
      prefetch_chunk(next_k, next_v, next.chunk, D);
    const bf16* k = k_head + c.row * D;
    const __mmask16 valid = static_cast<__mmask16>((1u << c.n) - 1);
    for (int64_t g = 0; g < G;) {
      __m512 s[2];
      // two heads at once where their query vectors and 16 sums fit in the registers
      const int heads = ND <= 4 && G - g >= 2 ? 2 : 1;
      if (heads == 2)
        scores_of<ND, ND <= 4 ? 2 : 1>(q + g * D, k, c.n, s);
      else
        scores_of<ND, 1>(q + g * D, k, c.n, s);
      for (int j = 0; j < heads; ++j, ++g) {
        const __m512 sg = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, _mm512_mul_ps(s[j], sc));
        const float m_new = std::max(m[g], _mm512_reduce_max_ps(sg));
        alpha[g] = std::exp(m[g] - m_new);  // 0 on the first chunk (m = -inf)
        const __m512 e = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(sg, _mm512_set1_ps(m_new))));
        l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(e);
        m[g] = m_new;
        _mm512_storeu_ps(p + g * CHUNK, e);
      }
    }
    const bf16* v = v_head + c.row * D;
    if constexpr (ND % 4 == 0) {
      pv_all<8>(v, c.n, G, D, p, alpha, acc);
    } else if constexpr (ND % 2 == 0) {
      pv_all<4>(v, c.n, G, D, p, alpha, acc);
    } else {
      pv_all<2>(v, c.n, G, D, p, alpha, acc);
    }
  }
  for (int64_t g = 0; g < G; ++g) finish_head(acc + g * D, D, 1.f / l[g], out + g * D);
}

}  // namespace

// q: [B, Hq, D] bf16; caches: [Hkv, NB, BS, D] bf16; block_tables: [B, max_blocks] int64;
// seq_lens: [B] int64; window: 0 for none. Returns [B, Hq, D].
torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window) {
  const auto shape = paged_decode::Shape::check(q, k_cache, v_cache, block_tables, seq_lens, at::kBFloat16, 32);
  const int64_t B = shape.B, Hq = shape.Hq, D = shape.D, Hkv = shape.Hkv, NB = shape.NB, BS = shape.BS;
  const int64_t G = shape.G, max_blocks = shape.max_blocks;
  auto out = torch::empty_like(q);
  auto qp = q.data_ptr<bf16>();
  auto kp = k_cache.data_ptr<bf16>();
  auto vp = v_cache.data_ptr<bf16>();
  auto op = out.data_ptr<bf16>();
  auto bt = block_tables.data_ptr<int64_t>();
  auto sl = seq_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  paged_decode::for_each_row_head(
      B, Hkv, sl, bt, max_blocks, BS, window, CHUNK,
      [&](int64_t b, int64_t h, const std::vector<Chunk>& chunks, std::vector<float>& scratch,
          const paged_decode::Next& next) {
        const bf16* qh = qp + (b * Hq + h * G) * D;
        const bf16* kh = kp + h * NB * BS * D;
        const bf16* vh = vp + h * NB * BS * D;
        const bf16* nk = next.head < 0 ? nullptr : kp + next.head * NB * BS * D;
        const bf16* nv = next.head < 0 ? nullptr : vp + next.head * NB * BS * D;
        bf16* oh = op + (b * Hq + h * G) * D;
        switch (D / 32) {
#define MINIVLLM_ATTEND(nd) \
  case nd:                  \
    attend_one<nd>(qh, kh, vh, chunks, nk, nv, next, G, sc, oh, scratch); \
    break;
          MINIVLLM_ATTEND(1)
          MINIVLLM_ATTEND(2)
          MINIVLLM_ATTEND(3)
          MINIVLLM_ATTEND(4)
          MINIVLLM_ATTEND(5)
          MINIVLLM_ATTEND(6)
          MINIVLLM_ATTEND(7)
          MINIVLLM_ATTEND(8)
#undef MINIVLLM_ATTEND
        }
      },
      [&](int64_t b, int64_t h) { std::fill(op + (b * Hq + h * G) * D, op + (b * Hq + (h + 1) * G) * D, bf16(0.f)); });
  return out;
}
