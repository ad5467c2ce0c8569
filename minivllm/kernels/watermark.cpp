// Watermarked sampling's inner loop: for each row, argmax_v p_v / -ln(u_v) with u_v from
// vLLM's philox4x32-10-v1 token step (minivllm/watermark/prf.py has the mapping and the
// plain-PyTorch reference this kernel is tested against).
//
// One Philox call serves four consecutive token ids, so sixteen calls run side by side in
// AVX-512 lanes (lane g: counter group g, tokens 4g..4g+3). Most candidates are ruled out
// without a logarithm: -ln u >= 1 - u, so p / -ln u <= p / (1 - u), and a candidate whose
// bound p > best * (1 - u) fails cannot win; the exact score (one log) is computed only
// for the few that pass.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
constexpr uint32_t kTokenDomain = 0x574D544Bu;  // "WMTK"

// (high, low) 32-bit halves of a * m in each of 16 lanes
inline void mul_hi_lo(__m512i a, __m512i m, __m512i& hi, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(a, m);                         // lanes 0, 2, ...
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);   // lanes 1, 3, ...
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

// Philox4x32-10 on 16 counters sharing c1..c3 and the key; out[j] = word j of each lane
inline void philox16(__m512i c0, uint32_t s0, uint32_t s1, uint32_t s2, uint32_t k0,
                     uint32_t k1, __m512i out[4]) {
  __m512i c1 = _mm512_set1_epi32(static_cast<int>(s0));
  __m512i c2 = _mm512_set1_epi32(static_cast<int>(s1));
  __m512i c3 = _mm512_set1_epi32(static_cast<int>(s2));
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(kMul0));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(kMul1));
  for (int round = 0; round < 10; ++round) {
    __m512i hi0, lo0, hi1, lo1;
    mul_hi_lo(c0, m0, hi0, lo0);
    mul_hi_lo(c2, m1, hi1, lo1);
    const __m512i key0 = _mm512_set1_epi32(static_cast<int>(k0));
    const __m512i key1 = _mm512_set1_epi32(static_cast<int>(k1));
    c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), key0);
    c1 = lo1;
    c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), key1);
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

int64_t row_argmax(const float* p, int64_t vocab, const int64_t* state, const int64_t* key) {
  const uint32_t s0 = static_cast<uint32_t>(state[0]), s1 = static_cast<uint32_t>(state[1]);
  const uint32_t s2 = static_cast<uint32_t>(state[2]), s3 = static_cast<uint32_t>(state[3]);
  const uint32_t k0 = static_cast<uint32_t>(key[0]) ^ s3;
  const uint32_t k1 = static_cast<uint32_t>(key[1]) ^ kTokenDomain;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 scale = _mm512_set1_ps(1.0f / 16777217.0f);  // u = (m + 1) / (2^24 + 1)
  const __m512i top = _mm512_set1_epi32(16777216);
  float best = 0.0f;
  int64_t best_id = 0;
  const int64_t groups = (vocab + 3) / 4;
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    __m512i words[4];
    const __m512i group = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(g0)), lane);
    philox16(group, s0, s1, s2, k0, k1, words);
    for (int j = 0; j < 4; ++j) {
      const __m512i ids = _mm512_add_epi32(_mm512_slli_epi32(group, 2), _mm512_set1_epi32(j));
      const __mmask16 valid = _mm512_cmplt_epi32_mask(ids, _mm512_set1_epi32(static_cast<int>(vocab)));
      const __m512 probs = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, ids, p, 4);
      const __m512i m = _mm512_srli_epi32(words[j], 8);
      // 1 - u = (2^24 - m) / (2^24 + 1), exact in float (no cancellation)
      const __m512 one_minus_u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(top, m)), scale);
      // slightly loose (1 - 2^-20), so float rounding of the bound never prunes a winner
      const __m512 bound = _mm512_mul_ps(_mm512_set1_ps(best * (1.0f - 0x1p-20f)), one_minus_u);
      __mmask16 maybe = _mm512_mask_cmp_ps_mask(valid, probs, bound, _CMP_GT_OQ);
      if (!maybe) continue;
      alignas(64) uint32_t ws[16];
      _mm512_store_si512(ws, words[j]);
      while (maybe) {
        const int l = __builtin_ctz(maybe);
        maybe &= maybe - 1;
        const int64_t v = 4 * (g0 + l) + j;
        const double u = (static_cast<double>(ws[l] >> 8) + 1.0) / 16777217.0;
        const float score = static_cast<float>(p[v] / -std::log(u));
        if (score > best || (score == best && v < best_id)) {
          best = score;
          best_id = v;
        }
      }
    }
  }
  return best_id;
}

}  // namespace

torch::Tensor watermark_argmax(torch::Tensor probs, torch::Tensor states, torch::Tensor keys) {
  TORCH_CHECK(probs.device().is_cpu(), "watermark_argmax runs on CPU tensors");
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat, "probs: float32 [R, V]");
  TORCH_CHECK(states.dim() == 2 && states.size(1) == 4 && states.scalar_type() == at::kLong,
              "states: int64 [R, 4]");
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == 2 && keys.scalar_type() == at::kLong,
              "keys: int64 [R, 2]");
  const auto p = probs.contiguous();
  const auto st = states.contiguous();
  const auto k = keys.contiguous();
  const int64_t rows = p.size(0), vocab = p.size(1);
  TORCH_CHECK(st.size(0) == rows && k.size(0) == rows, "one state and key per row");
  auto out = torch::empty({rows}, torch::kLong);
  const float* pp = p.data_ptr<float>();
  const int64_t* sp = st.data_ptr<int64_t>();
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      op[r] = row_argmax(pp + r * vocab, vocab, sp + 4 * r, kp + 2 * r);
    }
  });
  return out;
}
