// Paged decode attention for CPU: one query token per request, reading the
// head-major KV cache [num_kv_heads, num_blocks, block_size, head_dim] in place
// (no gather copy of the context). Grouped-query: each KV head serves G query heads.
//
// For request b, KV head h, query head g in that group:
//   s_t = scale * <q_g, k_t>              for t in [begin, seq_len)
//   p_t = exp(s_t - max s) / sum exp(...)
//   o_g = sum_t p_t v_t
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "kernels.h"

namespace {

inline __m512 bf16x16_to_fp32(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// <q, k> over D (multiple of 32) with bf16 pairs and fp32 accumulation.
inline float dot_bf16(const at::BFloat16* q, const at::BFloat16* k, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + d), (__m512bh)_mm512_loadu_si512(q + d));
  }
  return _mm512_reduce_add_ps(acc);
}

// s[0, L) <- softmax(s[0, L)), vectorised.
inline void softmax_inplace(float* s, int64_t L) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= L; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
  float m = _mm512_reduce_max_ps(mv);
  for (; i < L; ++i) m = std::max(m, s[i]);
  const __m512 mb = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= L; i += 16) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), mb));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; i < L; ++i) {
    s[i] = std::exp(s[i] - m);
    total += s[i];
  }
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (i = 0; i + 16 <= L; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
  for (; i < L; ++i) s[i] *= 1.f / total;
}

// Calls fn(t, row) for tokens t in [begin, end), walking the block table block by
// block (no division per token).
template <typename Fn>
inline void for_each_token(const at::BFloat16* head, const int64_t* blocks, int64_t begin, int64_t end,
                           int64_t block_size, int64_t D, Fn fn) {
  for (int64_t b = begin / block_size; b * block_size < end; ++b) {
    const int64_t t0 = std::max(begin, b * block_size), t1 = std::min(end, (b + 1) * block_size);
    const at::BFloat16* base = head + blocks[b] * block_size * D;
    for (int64_t t = t0; t < t1; ++t) fn(t, base + (t - b * block_size) * D);
  }
}

void attend_one(const at::BFloat16* q, const at::BFloat16* k_head, const at::BFloat16* v_head,
                const int64_t* blocks, int64_t begin, int64_t seq_len, int64_t block_size, int64_t G,
                int64_t D, float scale, at::BFloat16* out, std::vector<float>& scores,
                std::vector<float>& acc) {
  const int64_t L = seq_len - begin;
  scores.resize(G * L);
  float* sc = scores.data();
  for_each_token(k_head, blocks, begin, seq_len, block_size, D, [&](int64_t t, const at::BFloat16* k) {
    for (int64_t g = 0; g < G; ++g) sc[g * L + (t - begin)] = scale * dot_bf16(q + g * D, k, D);
  });
  for (int64_t g = 0; g < G; ++g) softmax_inplace(sc + g * L, L);
  // o_g = sum_t p_t v_t, 64 dims (four fp32 vectors) of one head at a time in registers
  acc.assign(G * D, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    const float* p = sc + g * L;
    for (int64_t d = 0; d < D; d += 64) {
      const int64_t vecs = std::min<int64_t>(4, (D - d) / 16);
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for_each_token(v_head, blocks, begin, seq_len, block_size, D, [&](int64_t t, const at::BFloat16* v) {
        const __m512 pt = _mm512_set1_ps(p[t - begin]);
        a0 = _mm512_fmadd_ps(pt, bf16x16_to_fp32(v + d), a0);
        a1 = _mm512_fmadd_ps(pt, bf16x16_to_fp32(v + d + 16), a1);
        if (vecs > 2) {
          a2 = _mm512_fmadd_ps(pt, bf16x16_to_fp32(v + d + 32), a2);
          a3 = _mm512_fmadd_ps(pt, bf16x16_to_fp32(v + d + 48), a3);
        }
      });
      float* o = acc.data() + g * D + d;
      _mm512_storeu_ps(o, a0);
      _mm512_storeu_ps(o + 16, a1);
      if (vecs > 2) {
        _mm512_storeu_ps(o + 32, a2);
        _mm512_storeu_ps(o + 48, a3);
      }
    }
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = at::BFloat16(acc[i]);
}

}  // namespace

// q: [B, Hq, D] bf16; caches: [Hkv, NB, BS, D] bf16; block_tables: [B, max_blocks] int64;
// seq_lens: [B] int64; window: 0 for none. Returns [B, Hq, D].
torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(D % 32 == 0 && Hq % Hkv == 0, "head_dim must be a multiple of 32");
  const int64_t G = Hq / Hkv, max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  auto qp = q.data_ptr<at::BFloat16>();
  auto kp = k_cache.data_ptr<at::BFloat16>();
  auto vp = v_cache.data_ptr<at::BFloat16>();
  auto op = out.data_ptr<at::BFloat16>();
  auto bt = block_tables.data_ptr<int64_t>();
  auto sl = seq_lens.data_ptr<int64_t>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const int64_t seq_len = sl[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
      attend_one(qp + (b * Hq + h * G) * D, kp + h * NB * BS * D, vp + h * NB * BS * D,
                 bt + b * max_blocks, first, seq_len, BS, G, D, static_cast<float>(scale),
                 op + (b * Hq + h * G) * D, scores, acc);
    }
  });
  return out;
}
