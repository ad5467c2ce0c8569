// Causal prefill attention for one request's chunk on CPU, over the paged KV cache.
//
// Flash-attention style (Dao et al. 2022, arXiv:2205.14135): per tile of query rows,
// key tiles are visited in order with an online softmax, so no T x T score matrix
// exists. Unlike SDPA's CPU flash kernel, which costs the same with or without
// `is_causal` on this VM, key tiles wholly after a row tile's last query are skipped,
// halving the work of a fresh prompt.
//
// Both products use the AVX512-BF16 dot-product instruction in outer-product form,
// with no horizontal sums: per KV head the keys are first laid out as
// Kt[D/2][L] (a key's dims in pairs, keys along the vector) and the values as
// Vp[L/2][D] (pairs of consecutive keys per dim), so
//   S[r, j..j+15]   += dpbf16(Kt[d2, j..j+15],   broadcast(q_r[2 d2 : 2 d2 + 2]))
//   O[r, d..d+15]   += dpbf16(Vp[j2, d..d+15],   broadcast(p_r[2 j2 : 2 j2 + 2]))
// with the probabilities rounded to bf16 for the second product (as fused attention
// kernels do); scores, softmax statistics and O stay fp32.
//
// Where the CPU has AMX-BF16 (Sapphire Rapids and later) both products run on the tile
// unit instead, on the same layouts: S = Q K^T as 16 rows x 64 keys in four 16 x 16 fp32
// tiles (A: 16 query rows x 32 dims; B: the 16-key slice of Kt for 16 dim pairs, read
// with Kt's row stride), and O += P V with O's fp32 rows loaded into the accumulator tiles
// (B: 16 key pairs of Vp x 16 dims). The masking and the online softmax stay in AVX-512
// between the two. Measured on this project's 2-vCPU Xeon, one layer of the Qwen3-0.6B
// shape, the paths interleaved: 512 tokens 5.4 ms against 12.5 (1.9-2.7x from 128 to
// 2048 tokens; `benchmarks/prefill_attention.py`, docs/performance.md item 17).
//
// Query token i of the chunk sits at position num_context + i and sees keys
// [max(0, pos - window + 1), pos] (window 0: no limit), the same mask as the
// PyTorch path in layers/attention.py.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

using bf16 = at::BFloat16;
constexpr int KT = 64;  // keys per tile: four vectors of 16 scores
constexpr int QT = 32;  // query tokens per work item (times the group's G heads = rows)
constexpr int RB = 4;   // rows per register block

inline __m512bh bcast_pair(const bf16* p) {  // one 32-bit load broadcast to 16 lanes
  return (__m512bh)_mm512_castps_si512(_mm512_broadcastss_ps(_mm_load_ss(reinterpret_cast<const float*>(p))));
}

// Keys and values of one KV head, re-laid out for the dot-product instruction
// (Lp: the key count rounded up to KT).
struct HeadLayout {
  // [Lp/KT][D/2][KT]: per key tile, key pairs with the keys contiguous; tile-major so a
  // tile is one 16 KB run (a [D/2][Lp] layout put its rows Lp*4 bytes apart, on a few L1 sets)
  std::vector<uint32_t> kt;
  std::vector<bf16> vp;      // [Lp/2][D][2]: value pairs of consecutive keys
};

void lay_out_head(const bf16* k_head, const bf16* v_head, const int64_t* blocks, int64_t L,
                  int64_t BS, int64_t D, HeadLayout& out) {
  const int64_t Lp = (L + KT - 1) / KT * KT, D2 = D / 2;
  out.kt.resize(D2 * Lp);
  out.vp.resize(Lp * D);
  auto slot = [&](int64_t j) { return blocks[j / BS] * BS + j % BS; };
  // Kt: 16 keys at a time, one gathered vector of key pairs per d2
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(k_head);
  for (int64_t j0 = 0; j0 < Lp; j0 += 16) {
    alignas(64) int32_t offset[16];
    __mmask16 valid = 0;
    for (int t = 0; t < 16; ++t) {
      const bool ok = j0 + t < L;
      offset[t] = ok ? static_cast<int32_t>(slot(j0 + t) * D2) : 0;
      valid |= static_cast<__mmask16>(ok) << t;
    }
    const __m512i base = _mm512_load_si512(offset);
    for (int64_t d2 = 0; d2 < D2; ++d2) {
      const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(static_cast<int>(d2)));
      const __m512i keys = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, idx, k32, 4);
      _mm512_storeu_si512(out.kt.data() + (j0 / KT) * D2 * KT + d2 * KT + j0 % KT, keys);
    }
  }
  // Vp: interleave the values of keys 2 j2 and 2 j2 + 1, 16 dims per output vector
  alignas(64) static const int16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const int16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t j = 0; j < Lp; j += 2) {
    bf16* dst = out.vp.data() + j * D;
    const bf16* a = j < L ? v_head + slot(j) * D : nullptr;
    const bf16* b = j + 1 < L ? v_head + slot(j + 1) * D : nullptr;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i va = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
      const __m512i vb = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// O[RB rows][NV * 16 dims] += P[RB rows][KT keys] V[KT keys][same dims]; NV is a
// template argument so the accumulators stay in registers.
template <int NV>
inline void pv_block(float* o, int64_t o_stride, const bf16* p, const bf16* vp, int64_t D) {
  __m512 acc[RB][NV];
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_loadu_ps(o + i * o_stride + 16 * c);
  for (int64_t j2 = 0; j2 < KT / 2; ++j2) {
    __m512bh vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + j2 * 2 * D + 32 * c);
    for (int i = 0; i < RB; ++i) {
      const __m512bh pp = bcast_pair(p + i * KT + 2 * j2);
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], vv[c], pp);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + i * o_stride + 16 * c, acc[i][c]);
}

#ifdef MINIVLLM_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

// Tiles 0-3: accumulators (16 x 16 fp32); 4: A (16 rows x 32 bf16); 5-7: B (16 x 16 pairs),
// in the shared palette (amx_load_tile_config).

// s[16][KT] (fp32, unscaled) = q[16 rows][D] . K^T for one key tile; kt: the tile's [D/2][KT] pairs.
__attribute__((noinline)) void amx_scores(const bf16* q, int64_t D, const uint32_t* kt, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t d = 0; d < D; d += 32) {
    const uint32_t* kb = kt + d / 2 * KT;
    _tile_loadd(4, q + d, D * sizeof(bf16));
    _tile_loadd(5, kb, KT * sizeof(uint32_t));
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, kb + 16, KT * sizeof(uint32_t));
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, kb + 32, KT * sizeof(uint32_t));
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, kb + 48, KT * sizeof(uint32_t));
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, s, KT * sizeof(float));
  _tile_stored(1, s + 16, KT * sizeof(float));
  _tile_stored(2, s + 32, KT * sizeof(float));
  _tile_stored(3, s + 48, KT * sizeof(float));
}

// o[16 rows][NC * 16 dims] (fp32, row stride D) += p[16][KT] . V for one key tile;
// vp: the tile's Vp at the first of these dims.
template <int NC>
__attribute__((noinline)) void amx_pv(float* o, int64_t D, const bf16* p, const bf16* vp) {
  const int64_t ostride = D * sizeof(float), vstride = 2 * D * sizeof(bf16);
  _tile_loadd(0, o, ostride);
  _tile_loadd(1, o + 16, ostride);
  if constexpr (NC > 2) {
    _tile_loadd(2, o + 32, ostride);
    _tile_loadd(3, o + 48, ostride);
  }
  for (int ks = 0; ks < KT / 32; ++ks) {
    const bf16* vb = vp + ks * 16 * 2 * D;
    _tile_loadd(4, p + 32 * ks, KT * sizeof(bf16));
    _tile_loadd(5, vb, vstride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, vb + 32, vstride);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (NC > 2) {
      _tile_loadd(7, vb + 64, vstride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, vb + 96, vstride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, o, ostride);
  _tile_stored(1, o + 16, ostride);
  if constexpr (NC > 2) {
    _tile_stored(2, o + 32, ostride);
    _tile_stored(3, o + 48, ostride);
  }
}

#pragma GCC pop_options
#endif  // MINIVLLM_HAVE_AMX

// One row's unscaled scores for the 64 keys from j0, scaled, with the keys it may not see
// at -inf (after the query's position p, or before lo with a window). Only a tile that
// crosses p or lo is masked: the rest of a causal prompt's tiles, most of them, skip it
// (a separate masking pass over every tile was ~10% of a 512-token prefill's attention).
inline void scale_and_mask(__m512 (&sv)[4], const float* s, int64_t j0, int64_t p, int64_t lo, float scale) {
  for (int c = 0; c < 4; ++c) sv[c] = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * c), _mm512_set1_ps(scale));
  if (j0 + KT - 1 <= p && j0 >= lo) return;
  for (int c = 0; c < 4; ++c) {
    const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j0 + 16 * c)),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __mmask16 ok = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(p)));
    ok &= _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lo)));
    sv[c] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), ok, sv[c]);
  }
}

// One work item: query tokens [t0, t1) of KV head h, all G query heads of its group.
void attend_tile(const bf16* q, int64_t q_row_stride, const HeadLayout& lay, int64_t t0, int64_t t1,
                 int64_t h, int64_t G, int64_t D, int64_t num_context, int64_t window, float scale,
                 bf16* out, int64_t out_row_stride, std::vector<float>& o_buf,
                 std::vector<float>& s_buf, std::vector<bf16>& p_buf, std::vector<bf16>& q_buf,
                 bool amx) {
  const int64_t rstep = amx ? 16 : RB;  // AMX: whole 16-row tiles
  const int64_t rows = (t1 - t0) * G, R = (rows + rstep - 1) / rstep * rstep, D2 = D / 2;
  // rows r = (t - t0) * G + g; padded rows repeat the last real one (finite, discarded)
  q_buf.resize(R * D);
  std::vector<int64_t> pos(R);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t rr = std::min(r, rows - 1), t = t0 + rr / G, g = rr % G;
    std::memcpy(q_buf.data() + r * D, q + t * q_row_stride + (h * G + g) * D, D * sizeof(bf16));
    pos[r] = num_context + t;
  }
  o_buf.assign(R * D, 0.f);
  s_buf.resize(R * KT);
  p_buf.resize(R * KT);
  std::vector<float> m(R, -INFINITY), l(R, 0.f);
  const int64_t last = num_context + t1 - 1;  // the tile's last query position
  int64_t first = 0;
  if (window > 0) first = std::max<int64_t>(0, num_context + t0 - window + 1);
  for (int64_t j0 = first / KT * KT; j0 <= last; j0 += KT) {
    const uint32_t* kt = lay.kt.data() + (j0 / KT) * D2 * KT;
#ifdef MINIVLLM_HAVE_AMX
    if (amx) {
      for (int64_t r0 = 0; r0 < R; r0 += 16) amx_scores(q_buf.data() + r0 * D, D, kt, s_buf.data() + r0 * KT);
    }
#endif
    // S = Q K^T for this key tile (scaled and masked by the softmax below), RB rows x 64
    // keys at a time
    for (int64_t r0 = 0; !amx && r0 < R; r0 += RB) {
      __m512 acc[RB][4];
      for (int i = 0; i < RB; ++i)
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
      for (int64_t d2 = 0; d2 < D2; ++d2) {
        __m512bh kv[4];
        for (int c = 0; c < 4; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kt + d2 * KT + 16 * c);
        for (int i = 0; i < RB; ++i) {
          const __m512bh qb = bcast_pair(q_buf.data() + (r0 + i) * D + 2 * d2);
          for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], kv[c], qb);
        }
      }
      for (int i = 0; i < RB; ++i)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s_buf.data() + (r0 + i) * KT + 16 * c, acc[i][c]);
    }
    // online softmax: rescale O and l, P = exp(S - m) in bf16
    for (int64_t r = 0; r < R; ++r) {
      __m512 sv[4];
      scale_and_mask(sv, s_buf.data() + r * KT, j0, pos[r], window > 0 ? pos[r] - window + 1 : 0, scale);
      __m512 mx = _mm512_max_ps(_mm512_max_ps(sv[0], sv[1]), _mm512_max_ps(sv[2], sv[3]));
      const float tile_max = _mm512_reduce_max_ps(mx);
      bf16* pb = p_buf.data() + r * KT;
      if (tile_max == -INFINITY) {  // nothing visible to this row in this tile
        std::memset(static_cast<void*>(pb), 0, KT * sizeof(bf16));
        continue;
      }
      const float m_new = std::max(m[r], tile_max);
      // exp(-inf) = 0 on the first visible tile; a row whose maximum stands (most tiles,
      // once a row has seen a few) needs no exp and no rescaling of O
      const float alpha = m_new == m[r] ? 1.f : std::exp(m[r] - m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        const __m512 e = exp_ps(_mm512_sub_ps(sv[c], _mm512_set1_ps(m_new)));
        // round to bf16 first so that l sums exactly the weights used in O
        const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + 16 * c), eb);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
      if (alpha != 1.f) {
        float* o = o_buf.data() + r * D;
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(alpha)));
      }
    }
    // O += P V for this key tile, RB rows x 64 (or 32) dims at a time
    const bf16* vp = lay.vp.data() + j0 * D;  // key pair j2 starts at vp + j2 * 2 * D
#ifdef MINIVLLM_HAVE_AMX
    if (amx) {
      for (int64_t r0 = 0; r0 < R; r0 += 16) {
        float* o = o_buf.data() + r0 * D;
        const bf16* p = p_buf.data() + r0 * KT;
        int64_t d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) amx_pv<4>(o + d0, D, p, vp + 2 * d0);
        if (d0 < D) amx_pv<2>(o + d0, D, p, vp + 2 * d0);  // D % 64 == 32
      }
    }
#endif
    for (int64_t r0 = 0; !amx && r0 < R; r0 += RB) {
      float* o = o_buf.data() + r0 * D;
      const bf16* p = p_buf.data() + r0 * KT;
      int64_t d0 = 0;
      for (; d0 + 64 <= D; d0 += 64) pv_block<4>(o + d0, D, p, vp + 2 * d0, D);
      if (d0 < D) pv_block<2>(o + d0, D, p, vp + 2 * d0, D);  // D % 64 == 32
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, g = r % G;
    const float inv = 1.f / l[r];
    bf16* dst = out + t * out_row_stride + (h * G + g) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = bf16(o_buf[r * D + d] * inv);
  }
}

}  // namespace

// q: [T, Hq, D] bf16 (rows may be strided); caches: [Hkv, NB, BS, D]; block_table: [nb] int64
// covering num_context + T tokens, which are already in the cache. Returns [T, Hq, D].
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor block_table, int64_t num_context, double scale,
                                int64_t window, bool allow_amx) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [T, Hq, D] rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong, "int64 block table");
  block_table = block_table.contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(D % 32 == 0 && Hq % Hkv == 0, "head_dim must be a multiple of 32");
  const int64_t G = Hq / Hkv, L = num_context + T;
  TORCH_CHECK(block_table.numel() * BS >= L, "block table too short");
  TORCH_CHECK(NB * BS * D / 2 < (int64_t(1) << 31), "KV cache too large for 32-bit gather offsets");
  auto out = torch::empty({T, Hq, D}, q.options());
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kp = k_cache.data_ptr<bf16>();
  const bf16* vp = v_cache.data_ptr<bf16>();
  const int64_t* bt = block_table.data_ptr<int64_t>();
  bf16* op = out.data_ptr<bf16>();
  std::vector<HeadLayout> layouts(Hkv);
  at::parallel_for(0, Hkv, 1, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h)
      lay_out_head(kp + h * NB * BS * D, vp + h * NB * BS * D, bt, L, BS, D, layouts[h]);
  });
  // Work items (tile, head), most expensive (last) tiles first; dynamic scheduling
  // evens out the causal triangle between threads.
  const int64_t tiles = (T + QT - 1) / QT, items = tiles * Hkv;
  const bool amx = allow_amx && amx_bf16_available();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> o_buf, s_buf;
    std::vector<bf16> p_buf, q_buf;
#ifdef MINIVLLM_HAVE_AMX
    if (amx) amx_load_tile_config();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t tile = tiles - 1 - i / Hkv, h = i % Hkv;
      const int64_t t0 = tile * QT, t1 = std::min(T, t0 + QT);
      attend_tile(qp, q.stride(0), layouts[h], t0, t1, h, G, D, num_context, window,
                  static_cast<float>(scale), op, Hq * D, o_buf, s_buf, p_buf, q_buf, amx);
    }
#ifdef MINIVLLM_HAVE_AMX
    if (amx) amx_release_tiles();
#endif
  }
  return out;
}
