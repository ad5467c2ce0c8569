// Paged decode attention in fp32 with AVX2 + FMA, for CPUs without AVX-512: the same
// algorithm and cache layout as paged_attention.cpp (bf16, AVX-512), 8 lanes wide.
//
// One query token per row b, the head-major cache [num_kv_heads, num_blocks, block_size,
// head_dim] read in place, each KV head serving its G query heads. The context is read
// once, in chunks of up to 16 tokens, with an online softmax (Milakov & Gimelshein 2018,
// arXiv:1805.02867): for each head, s_t = scale <q, k_t>, the running max and sum are
// rescaled per chunk, and o = sum_t p_t v_t / sum_t p_t.
//
// The plain-PyTorch path it replaces gathers every row's blocks into a padded copy,
// masks it and runs two batched matmuls: at batch 32 that gather was a third of a step.
//
// The cache may hold fp32, bf16, fp8 e4m3 or fp8 e5m2 (kv_cache_dtype): each key and value
// is widened to fp32 as it is loaded (bf16: shifted into the top half; fp8: through fp16,
// `load8`), and everything after is the fp32 kernel's.
// At batch 1 decode attention streams the context once per step, so a bf16 cache halves
// its bytes and fp8 quarters them. e4m3's NaN byte reads as 480, e5m2's inf and NaN as
// themselves (avx2_math.h): writes saturate, so only a model already producing NaN stores one.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "avx2_api.h"
#include "avx2_math.h"
#include "moe_routing.h"
#include "paged_decode.h"

namespace {

constexpr int CHUNK = 16;  // tokens per chunk (a block of 16): two vectors of scores per head

// 8 cached values from p, as fp32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) { return fp8x8(reinterpret_cast<const uint8_t*>(p)); }
inline __m256 load8(const c10::Float8_e5m2* p) { return fp8x8<5>(reinterpret_cast<const uint8_t*>(p)); }

// Lane i of the result: the sum of the 8 lanes of v_i.
inline __m256 sum8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
  const __m256 a = _mm256_hadd_ps(v0, v1), b = _mm256_hadd_ps(v2, v3);
  const __m256 c = _mm256_hadd_ps(v4, v5), d = _mm256_hadd_ps(v6, v7);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  // ab: lanes [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high 128-bit halves' partial sums)
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// Raw scores <q, k_t> for the n (<= 8) keys at rows k[0, n), D = 8 * ND; rows past n repeat
// row n - 1 (valid memory) and are masked by the caller. d is the outer loop so that the
// 8 tokens' sums are 8 independent FMA chains (one token's 16-FMA chain at a time waited
// on FMA latency).
template <class T>
inline __m256 chunk_scores(const float* q, const T* k, int n, int64_t ND) {
  const int64_t stride = 8 * ND;
  const T *r0 = k, *r1 = k + std::min(1, n - 1) * stride, *r2 = k + std::min(2, n - 1) * stride,
              *r3 = k + std::min(3, n - 1) * stride, *r4 = k + std::min(4, n - 1) * stride,
              *r5 = k + std::min(5, n - 1) * stride, *r6 = k + std::min(6, n - 1) * stride,
              *r7 = k + std::min(7, n - 1) * stride;
  // eight named accumulators: as an array GCC kept a copy of it on the stack, stored on
  // every step, and those stores were what the loop waited on
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < stride; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(load8(r0 + d), qd, a0);
    a1 = _mm256_fmadd_ps(load8(r1 + d), qd, a1);
    a2 = _mm256_fmadd_ps(load8(r2 + d), qd, a2);
    a3 = _mm256_fmadd_ps(load8(r3 + d), qd, a3);
    a4 = _mm256_fmadd_ps(load8(r4 + d), qd, a4);
    a5 = _mm256_fmadd_ps(load8(r5 + d), qd, a5);
    a6 = _mm256_fmadd_ps(load8(r6 + d), qd, a6);
    a7 = _mm256_fmadd_ps(load8(r7 + d), qd, a7);
  }
  return sum8(a0, a1, a2, a3, a4, a5, a6, a7);
}

// acc[0, 8 NV) = alpha acc + sum_t p_t v_t over the chunk's n rows of v: NV accumulators
// fixed at compile time, so they stay in registers (a run-time count kept them on the
// stack, each FMA waiting on a store and a load).
template <int NV, class T>
inline void pv_block(const T* v, int n, int64_t D, const float* p, __m256 alpha, float* acc) {
  __m256 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), alpha);
  for (int t = 0; t < n; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    for (int c = 0; c < NV; ++c) a[c] = _mm256_fmadd_ps(pt, load8(v + t * D + 8 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

// 64 dims at a time (8 chains), then 32, then 8 (D is a multiple of 8).
template <class T>
inline void pv(const T* v, int n, int64_t D, const float* p, float alpha, float* acc) {
  const __m256 al = _mm256_set1_ps(alpha);
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pv_block<8>(v + d0, n, D, p, al, acc + d0);
  if (d0 + 32 <= D) pv_block<4>(v + d0, n, D, p, al, acc + d0), d0 += 32;
  for (; d0 < D; d0 += 8) pv_block<1>(v + d0, n, D, p, al, acc + d0);
}

using paged_decode::Chunk;

template <class T>
void attend_one(const float* q, const T* k_head, const T* v_head, const std::vector<Chunk>& chunks,
                int64_t G, int64_t D, float scale, float* out, std::vector<float>& scratch) {
  // a cache narrower than fp32 (several query heads) is widened a chunk at a time
  const int64_t wide = std::is_same_v<T, float> || G == 1 ? 0 : 2 * CHUNK * D;
  scratch.assign(G * (D + CHUNK + 2) + wide, 0.f);
  float* acc = scratch.data();  // [G][D]
  float* p = acc + G * D;       // [G][CHUNK]
  float* m = p + G * CHUNK;     // [G]
  float* l = m + G;             // [G]
  float* wide_k = l + G;        // [CHUNK][D], when wide
  float* wide_v = wide_k + CHUNK * D;
  std::fill(m, m + G, -INFINITY);
  const __m256 sc = _mm256_set1_ps(scale);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Chunk& c = chunks[i];
    const T* k = k_head + c.row * D;
    const T* v = v_head + c.row * D;
    if (i + 1 < chunks.size()) {
      // the next chunk's rows, while this one computes: a request's blocks need not be
      // adjacent (the op ran at 1.06-1.08x with this, on Zen 1)
      const Chunk& ahead = chunks[i + 1];
      const char* kn = reinterpret_cast<const char*>(k_head + ahead.row * D);
      const char* vn = reinterpret_cast<const char*>(v_head + ahead.row * D);
      for (int64_t b = 0; b < ahead.n * D * int64_t(sizeof(T)); b += 64) _mm_prefetch(kn + b, _MM_HINT_T0), _mm_prefetch(vn + b, _MM_HINT_T0);
    }
    // tokens 0-7 and 8-15 of the chunk: lanes past n masked (the second half may be empty)
    const int n0 = std::min(c.n, 8), n1 = c.n - n0;
    const __m256 valid0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n0), lane));
    const __m256 valid1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n1), lane));
    const __m256 none = _mm256_set1_ps(-INFINITY);
    // the chunk for each of the G query heads of this KV head: k, v are T or widened fp32
    auto attend_chunk = [&](const auto* k, const auto* v) {
      for (int64_t g = 0; g < G; ++g) {
        const __m256 s0 = _mm256_blendv_ps(none, _mm256_mul_ps(chunk_scores(q + g * D, k, n0, D / 8), sc), valid0);
        const __m256 s1 = n1 > 0 ? _mm256_blendv_ps(none, _mm256_mul_ps(chunk_scores(q + g * D, k + 8 * D, n1, D / 8), sc),
                                                     valid1)
                                 : none;
        const float m_new = std::max(m[g], hmax8(_mm256_max_ps(s0, s1)));
        const float alpha = std::exp(m[g] - m_new);  // 0 on the first chunk (m = -inf)
        const __m256 shift = _mm256_set1_ps(m_new);
        const __m256 e0 = _mm256_and_ps(valid0, exp8(_mm256_sub_ps(s0, shift)));
        const __m256 e1 = _mm256_and_ps(valid1, exp8(_mm256_sub_ps(s1, shift)));
        l[g] = l[g] * alpha + hsum8(_mm256_add_ps(e0, e1));
        m[g] = m_new;
        _mm256_storeu_ps(p + g * CHUNK, e0);
        _mm256_storeu_ps(p + g * CHUNK + 8, e1);
        pv(v, c.n, D, p + g * CHUNK, alpha, acc + g * D);
      }
    };
    if (std::is_same_v<T, float> || G == 1) {
      attend_chunk(k, v);
    } else {  // widened once here, not once per query head
      for (int64_t j = 0; j < c.n * D; j += 8) {
        _mm256_storeu_ps(wide_k + j, load8(k + j));
        _mm256_storeu_ps(wide_v + j, load8(v + j));
      }
      attend_chunk(static_cast<const float*>(wide_k), static_cast<const float*>(wide_v));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(1.f / l[g]);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(out + g * D + d, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + d), inv));
  }
}

template <class T>
void decode_all(const paged_decode::Shape& shape, const float* qp, const T* kp, const T* vp, const int64_t* bt,
                const int64_t* sl, float sc, int64_t window, float* op) {
  const int64_t Hq = shape.Hq, D = shape.D, NB = shape.NB, BS = shape.BS, G = shape.G;
  paged_decode::for_each_row_head(
      shape.B, shape.Hkv, sl, bt, shape.max_blocks, BS, window, CHUNK,
      [&](int64_t b, int64_t h, const std::vector<Chunk>& chunks, std::vector<float>& scratch,
          const paged_decode::Next&) {
        attend_one(qp + (b * Hq + h * G) * D, kp + h * NB * BS * D, vp + h * NB * BS * D, chunks, G, D, sc,
                   op + (b * Hq + h * G) * D, scratch);
      },
      [&](int64_t b, int64_t h) { std::fill(op + (b * Hq + h * G) * D, op + (b * Hq + (h + 1) * G) * D, 0.f); });
}

}  // namespace

// q: [B, Hq, D] fp32; caches: [Hkv, NB, BS, D] fp32, bf16, fp8 e4m3 or e5m2 (both alike);
// block_tables: [B, max_blocks] int64; seq_lens: [B] int64; window: 0 for none. Returns
// [B, Hq, D] fp32.
torch::Tensor avx2_paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                          int64_t window) {
  const auto shape =
      paged_decode::Shape::check(q, k_cache, v_cache, block_tables, seq_lens, at::kFloat, 8, k_cache.scalar_type());
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  visit_cache_type(k_cache.scalar_type(), [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    decode_all(shape, qp, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), bt, sl, sc, window, op);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("linear_bf16w", &avx2_linear_bf16w, "fp32 x @ W^T + b over bf16 weight panels (AVX2)", nogil);
  m.def("linear_int8w", &avx2_linear_int8w, "fp32 x @ (q * scale)^T + b, int8 rows (AVX2)", nogil);
  m.def("linear_quantw", &avx2_linear_quantw,
        "fp32 x @ dequantized(int8 | int4 | fp8 rows)^T + b (AVX2), formats.reference_linear's numbers", nogil);
  m.def("moe_quantw", &avx2_moe_quantw,
        "a MoE layer's routed experts over stacked quantized rows, fp32 (AVX2): routed_experts' numbers", nogil);
  m.def("moe_bf16w", &avx2_moe_bf16w,
        "a MoE layer's routed experts over per-expert bf16 panels, fp32 (AVX2): routed_experts' numbers", nogil);
  m.def("moe_grouped_topk", &moe_grouped_topk, "DeepSeek's group-limited top-k routing: (weights, ids)", nogil);
  m.def("rms_norm", &avx2_rms_norm, "fp32 RMSNorm (AVX2)", nogil);
  m.def("fused_add_rms_norm", &avx2_fused_add_rms_norm, "residual += x; RMSNorm(residual), fp32", nogil);
  m.def("silu_and_mul", &avx2_silu_and_mul, "silu(gate) * up, fp32", nogil);
  m.def("paged_attention_decode", &avx2_paged_attention_decode, "fp32 paged decode attention (AVX2)", nogil);
  m.def("rotary_inplace", &avx2_rotary_inplace, "neox rotary in place, fp32", nogil);
  m.def("write_kv_cache", &avx2_write_kv_cache, "k, v into a paged fp32 cache", nogil);
  m.def("decode_layers", &avx2_decode_layers, "every decoder layer of a decode step, fp32 (AVX2)", nogil);
  m.def("vnni_w8a8_linear", &avx2_vnni_w8a8_linear,
        "int8_w8a8's fp32 x @ W^T + b on pack_vnni_w8a8's panels (AVX512-VNNI; refused without it)", nogil);
  m.def("pack_vnni_w8a8", &pack_vnni_w8a8, "int8 [N, K] -> packing.pack_vnni_w8a8's panels, into out", nogil);
  m.def("set_quantw_avx512", &avx2_set_quantw_avx512,
        "switch linear_quantw's AVX-512 form of int8/int4 rows on or off; returns the previous state", nogil);
}
