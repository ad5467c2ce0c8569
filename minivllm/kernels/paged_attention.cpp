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
// - no software prefetch: over 28 layers' caches (cold), blocks laid out in order
//   read at ~27 GB/s without it and ~22 GB/s with the next chunks prefetched into
//   L1 or L2; blocks in random order read ~14 GB/s either way, which is what this
//   VM gives for scattered 4 KB reads (a 16-token block of a 128-dim head is 4 KB)
//   with any access code. The two-pass kernel this replaces read ~13.5 GB/s even
//   in order;
// - a chunk's 16 scores per head come from 16 dot-product accumulators summed in
//   one transposing tree (45 shuffles and adds instead of 16 horizontal sums).
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

// Raw scores <q, k_t> of one head for the n (<= 16) keys at rows k[0, n), D = 32 * ND.
// Rows past n repeat row n - 1 (always valid memory); the caller masks their lanes.
template <int ND>
inline __m512 chunk_scores(const bf16* q, const bf16* k, int n) {
  __m512bh qv[ND];
  for (int d = 0; d < ND; ++d) qv[d] = (__m512bh)_mm512_loadu_si512(q + 32 * d);
  __m512 acc[CHUNK];
  for (int t = 0; t < CHUNK; ++t) {
    const bf16* row = k + std::min(t, n - 1) * (32 * ND);
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(row), qv[0]);
    for (int d = 1; d < ND; ++d) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(row + 32 * d), qv[d]);
    acc[t] = a;
  }
  return sum16(acc);
}

// acc[g][d0 : d0 + 16 CH] = alpha[g] * acc[g][...] + sum_t p[g][t] v_t[...] for GT heads;
// the accumulators (GT x CH vectors) stay in registers across the chunk's tokens.
template <int GT, int CH>
inline void pv_chunk(const bf16* v, int n, int64_t D, const float* p, const float* alpha, float* acc) {
  __m512 a[GT][CH];
  for (int g = 0; g < GT; ++g) {
    const __m512 al = _mm512_set1_ps(alpha[g]);
    for (int c = 0; c < CH; ++c) a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), al);
  }
  for (int t = 0; t < n; ++t) {
    __m512 vv[CH];
    for (int c = 0; c < CH; ++c) vv[c] = load_bf16x16(v + t * D + 16 * c);
    for (int g = 0; g < GT; ++g) {
      const __m512 pt = _mm512_set1_ps(p[g * CHUNK + t]);
      for (int c = 0; c < CH; ++c) a[g][c] = _mm512_fmadd_ps(pt, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
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

// One request's KV head against its G query heads.
template <int ND>
void attend_one(const bf16* q, const bf16* k_head, const bf16* v_head, const std::vector<Chunk>& chunks,
                int64_t G, float scale, bf16* out, std::vector<float>& scratch) {
  constexpr int64_t D = 32 * ND;
  scratch.assign(G * (D + CHUNK + 3), 0.f);
  float* acc = scratch.data();   // [G][D]: running sums of p_t v_t
  float* p = acc + G * D;        // [G][16]: this chunk's probabilities (unnormalised)
  float* alpha = p + G * CHUNK;  // [G]: rescale of the running sums
  float* m = alpha + G;          // [G]: running max score
  float* l = m + G;              // [G]: running sum of exp(s - m)
  std::fill(m, m + G, -INFINITY);
  const __m512 sc = _mm512_set1_ps(scale);
  for (const Chunk& c : chunks) {
    const bf16* k = k_head + c.row * D;
    const __mmask16 valid = static_cast<__mmask16>((1u << c.n) - 1);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,
                                          _mm512_mul_ps(chunk_scores<ND>(q + g * D, k, c.n), sc));
      const float m_new = std::max(m[g], _mm512_reduce_max_ps(s));
      alpha[g] = std::exp(m[g] - m_new);  // 0 on the first chunk (m = -inf)
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
      l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(e);
      m[g] = m_new;
      _mm512_storeu_ps(p + g * CHUNK, e);
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
  for (int64_t g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / l[g]);
    for (int64_t d = 0; d < D; d += 16) {
      store_bf16x16(out + g * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + d), inv));
    }
  }
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
      [&](int64_t b, int64_t h, const std::vector<Chunk>& chunks, std::vector<float>& scratch) {
        const bf16* qh = qp + (b * Hq + h * G) * D;
        const bf16* kh = kp + h * NB * BS * D;
        const bf16* vh = vp + h * NB * BS * D;
        bf16* oh = op + (b * Hq + h * G) * D;
        switch (D / 32) {
#define MINIVLLM_ATTEND(nd) \
  case nd:                  \
    attend_one<nd>(qh, kh, vh, chunks, G, sc, oh, scratch); \
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
