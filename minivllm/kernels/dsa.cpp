// DeepSeek Sparse Attention on CPU: the lightning indexer's top-k and the absorbed-MLA
// decode over the selected latent rows. minivllm/layers/attention/dsa.py has the math
// and the plain-PyTorch reference both are tested against.
//
// Both score a row's small query heads against one row shared by every head (the
// indexer's key of a token, MLA's latent row), so both put heads in lanes: the queries
// are stored pair-interleaved, qt[i][h] = (q[h, 2i], q[h, 2i + 1]), heads zero-padded
// to a multiple of 16, and each token's row is read as bf16 pairs broadcast to every
// lane. One vdpbf16ps then adds a pair to 16 heads' dot products at once:
//
//   lane h of acc += q[h, 2i] k[2i] + q[h, 2i + 1] k[2i + 1]      i = 0 .. D/2 - 1
//
// A token's row is read once for all heads, a head's score is one lane (no horizontal
// sum per (head, token) as row-major dot products need), and D only has to be even.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "kernels.h"

namespace {

using bf16 = at::BFloat16;
constexpr int CHUNK = 32;          // tokens scored at a time (a multiple of 16)
constexpr int64_t BLOCK = 512;     // indexer tokens per parallel work item
constexpr int64_t WAVE = 1 << 21;  // indexer scores held at once (8 MB)
constexpr float NO_MAX = -1e30f;   // a running max before any score (finite under -ffast-math)

// (q[2i], q[2i + 1]) of a bf16 row, in every 32-bit lane.
inline __m512bh pair_broadcast(const bf16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

// [N, H, D] -> [N, D/2, Hp, 2], the heads zero-padded to Hp (a zero head scores 0).
torch::Tensor pair_interleave(const torch::Tensor& q, int64_t Hp) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  auto qt = torch::zeros({N, D / 2, Hp, 2}, q.options());
  qt.narrow(2, 0, H).copy_(q.reshape({N, H, D / 2, 2}).transpose(1, 2));
  return qt;
}

// out[t * Hp + 16 g + lane] = scale * <q head 16 g + lane, rows[t]> for T rows and G
// groups of 16 heads; T x G accumulators stay in registers over all D/2 pairs.
template <int G, int T>
inline void scores_tile(const bf16* qt, int64_t Hp, const bf16* const* rows, int64_t pairs,
                        __m512 scale, float* out) {
  __m512 acc[T][G];
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) acc[t][g] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh qv[G];
    for (int g = 0; g < G; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(qt + (i * Hp + 16 * g) * 2);
    for (int t = 0; t < T; ++t) {
      const __m512bh k = pair_broadcast(rows[t] + 2 * i);
      for (int g = 0; g < G; ++g) acc[t][g] = _mm512_dpbf16_ps(acc[t][g], qv[g], k);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + t * Hp + 16 * g, _mm512_mul_ps(acc[t][g], scale));
}

// Every head's scaled score for rows [0, n rounded up to 16): out [.., Hp]. rows past
// n must be valid rows (the callers repeat the last); their scores are ignored.
void head_scores(const bf16* qt, int64_t Hp, const bf16* const* rows, int n, int64_t pairs, float scale,
                 float* out) {
  const __m512 sc = _mm512_set1_ps(scale);
  const int n16 = (n + 15) & ~15;
  for (int64_t g0 = 0; g0 < Hp / 16; g0 += 4) {  // up to 4 groups (64 heads) at a time
    const bf16* q = qt + 32 * g0;
    float* o = out + 16 * g0;
    switch (std::min<int64_t>(4, Hp / 16 - g0)) {
      case 1:
        for (int t = 0; t < n16; t += 16) scores_tile<1, 16>(q, Hp, rows + t, pairs, sc, o + t * Hp);
        break;
      case 2:
        for (int t = 0; t < n16; t += 8) scores_tile<2, 8>(q, Hp, rows + t, pairs, sc, o + t * Hp);
        break;
      case 3:
        for (int t = 0; t < n16; t += 4) scores_tile<3, 4>(q, Hp, rows + t, pairs, sc, o + t * Hp);
        break;
      default:
        for (int t = 0; t < n16; t += 4) scores_tile<4, 4>(q, Hp, rows + t, pairs, sc, o + t * Hp);
    }
  }
}

// Rows of a two-tier cache by flat id: below num_device the device rows, the rest host
// rows (dsa.gather_rows).
struct TwoTier {
  const bf16* device;
  int64_t num_device;
  const bf16* host;
  int64_t num_host;
  int64_t dim;

  const bf16* row(int64_t id) const {
    TORCH_CHECK(id >= 0 && id < num_device + num_host, "row id ", id, " outside the ",
                num_device + num_host, " rows of the cache");
    return id < num_device ? device + id * dim : host + (id - num_device) * dim;
  }
};

// s[t] = I(n, t) = sum_h w[h] relu(scale q_h . k_t) for tokens [t0, t1) of one query row.
void index_scores(const bf16* qt, const float* w, int64_t Hp, const int64_t* key_ids, int64_t t0,
                  int64_t t1, const TwoTier& keys, float scale, std::vector<float>& head, float* s) {
  const bf16* rows[CHUNK];
  head.resize(CHUNK * Hp);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t c = t0; c < t1; c += CHUNK) {
    const int n = static_cast<int>(std::min<int64_t>(CHUNK, t1 - c));
    for (int t = 0; t < CHUNK; ++t) rows[t] = keys.row(key_ids[c + std::min(t, n - 1)]);
    head_scores(qt, Hp, rows, n, keys.dim / 2, scale, head.data());
    for (int b = 0; b < n; b += 16) {
      __m512 tok[16];  // per token: its heads' weighted ReLUs, 16 lanes to sum
      for (int t = 0; t < 16; ++t) {
        const float* ht = head.data() + (b + t) * Hp;
        __m512 v = zero;
        for (int64_t h = 0; h < Hp; h += 16)
          v = _mm512_fmadd_ps(_mm512_loadu_ps(w + h), _mm512_max_ps(_mm512_loadu_ps(ht + h), zero), v);
        tok[t] = v;
      }
      const int m = std::min(16, n - b);
      _mm512_mask_storeu_ps(s + c + b, static_cast<__mmask16>((1u << m) - 1), sum16(tok));
    }
  }
}

// The topk best of s[0, len) as ascending token indices, ties to the earlier token:
// selection on a copy finds the k-th best value, then one pass keeps every token above
// it and the earliest of those equal to it.
void select_topk(const float* s, int64_t len, int64_t topk, std::vector<float>& copy, int64_t* out) {
  copy.assign(s, s + len);
  std::nth_element(copy.begin(), copy.begin() + (topk - 1), copy.end(), std::greater<float>());
  const float kth = copy[topk - 1];
  int64_t ties = topk - std::count_if(copy.begin(), copy.begin() + (topk - 1),
                                       [&](float v) { return v > kth; });
  int64_t j = 0;
  for (int64_t t = 0; t < len; ++t) {
    if (s[t] > kth) {
      out[j++] = t;
    } else if (s[t] == kth && ties > 0) {
      out[j++] = t;
      --ties;
    }
  }
}

// A call's inputs, as index_scores and select_topk read them.
struct IndexerRows {
  const bf16* qt;  // [N, Di/2, Hp, 2]
  const float* w;  // [N, Hp]
  int64_t Hp;
  const int64_t* key_rows;  // [B, Lmax]
  int64_t Lmax;
  const int64_t* row_req;
  const int64_t* positions;
  TwoTier keys;
  float scale;
  int64_t topk;
  int64_t* out;  // [N, topk]
};

// Scores then top-k for query rows that each see more than topk tokens. Scoring is split
// into blocks of BLOCK tokens (a batch-1 decode row spreads over the threads), selection
// by row.
void select_rows(const IndexerRows& in, const std::vector<int64_t>& rows, std::vector<float>& scores) {
  const int64_t num = static_cast<int64_t>(rows.size());
  std::vector<int64_t> offset(num + 1, 0);  // row i's scores: scores[offset[i] .. offset[i + 1])
  std::vector<std::pair<int64_t, int64_t>> items;  // (i, first token of a block)
  for (int64_t i = 0; i < num; ++i) {
    const int64_t len = in.positions[rows[i]] + 1;
    for (int64_t t = 0; t < len; t += BLOCK) items.emplace_back(i, t);
    offset[i + 1] = offset[i] + len;
  }
  scores.resize(offset[num]);
  const int64_t Di = in.keys.dim;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> head;
    for (int64_t j = begin; j < end; ++j) {
      const auto [i, t0] = items[j];
      const int64_t n = rows[i], t1 = std::min(t0 + BLOCK, offset[i + 1] - offset[i]);
      index_scores(in.qt + n * Di * in.Hp, in.w + n * in.Hp, in.Hp, in.key_rows + in.row_req[n] * in.Lmax, t0,
                   t1, in.keys, in.scale, head, scores.data() + offset[i]);
    }
  });
  at::parallel_for(0, num, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> copy;
    for (int64_t i = begin; i < end; ++i)
      select_topk(scores.data() + offset[i], offset[i + 1] - offset[i], in.topk, copy,
                  in.out + rows[i] * in.topk);
  });
}

}  // namespace

// index_q [N, Hi, Di] bf16; index_w [N, Hi] float32; key_rows [B, Lmax] int64 (token ->
// row id); row_req [N], positions [N] int64; keys [Rd, Di] bf16; host_keys [Rh, Di] bf16
// or None. Returns [N, topk] int64: dsa.indexer_topk.
torch::Tensor dsa_indexer_topk(torch::Tensor index_q, torch::Tensor index_w, torch::Tensor key_rows,
                               torch::Tensor row_req, torch::Tensor positions, torch::Tensor keys,
                               c10::optional<torch::Tensor> host_keys, int64_t topk, double scale) {
  TORCH_CHECK(index_q.scalar_type() == at::kBFloat16 && index_q.dim() == 3, "index_q: bf16 [N, Hi, Di]");
  const int64_t N = index_q.size(0), Hi = index_q.size(1), Di = index_q.size(2);
  TORCH_CHECK(Di % 2 == 0, "index head dim must be even, got ", Di);
  TORCH_CHECK(index_w.scalar_type() == at::kFloat && index_w.sizes() == at::IntArrayRef({N, Hi}),
              "index_w: float32 [N, Hi]");
  TORCH_CHECK(key_rows.scalar_type() == at::kLong && key_rows.dim() == 2, "key_rows: int64 [B, Lmax]");
  TORCH_CHECK(row_req.scalar_type() == at::kLong && row_req.numel() == N, "row_req: int64 [N]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == N, "positions: int64 [N]");
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && keys.dim() == 2 && keys.size(1) == Di,
              "keys: bf16 [Rd, Di]");
  TORCH_CHECK(topk >= 1, "topk must be positive");
  torch::Tensor host = host_keys.has_value() && host_keys->defined() ? host_keys->contiguous()
                                                                      : keys.new_empty({0, Di});
  TORCH_CHECK(host.scalar_type() == at::kBFloat16 && host.dim() == 2 &&
                  (host.size(0) == 0 || host.size(1) == Di),
              "host_keys: bf16 [Rh, Di]");
  keys = keys.contiguous();
  key_rows = key_rows.contiguous();
  const int64_t Hp = (Hi + 15) / 16 * 16, B = key_rows.size(0), Lmax = key_rows.size(1);
  const torch::Tensor qt = pair_interleave(index_q.contiguous(), Hp);
  auto w = torch::zeros({N, Hp}, index_w.options());
  w.narrow(1, 0, Hi).copy_(index_w);
  const auto req = row_req.contiguous(), pos = positions.contiguous();
  auto out = torch::full({N, topk}, -1, key_rows.options());
  const IndexerRows in{qt.data_ptr<bf16>(), w.data_ptr<float>(), Hp, key_rows.data_ptr<int64_t>(), Lmax,
                       req.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
                       {keys.data_ptr<bf16>(), keys.size(0), host.data_ptr<bf16>(), host.size(0), Di},
                       static_cast<float>(scale), topk, out.data_ptr<int64_t>()};
  // Rows seeing at most topk tokens keep them all; the others are scored and selected in
  // waves of at most WAVE scores, so a long prefill chunk's rows are not all held at once.
  std::vector<int64_t> wave;
  std::vector<float> scores;
  int64_t wave_len = 0;
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(in.row_req[n] >= 0 && in.row_req[n] < B, "row_req[", n, "] = ", in.row_req[n],
                " is not a request row");
    TORCH_CHECK(in.positions[n] >= 0 && in.positions[n] < Lmax, "positions[", n, "] = ", in.positions[n],
                " outside key_rows");
    const int64_t len = in.positions[n] + 1;
    if (len <= topk) {
      for (int64_t t = 0; t < len; ++t) in.out[n * topk + t] = t;
      continue;
    }
    if (!wave.empty() && wave_len + len > WAVE) {
      select_rows(in, wave, scores);
      wave.clear();
      wave_len = 0;
    }
    wave.push_back(n);
    wave_len += len;
  }
  if (!wave.empty()) select_rows(in, wave, scores);
  return out;
}

namespace {

// Running softmax state of one query row's heads over a run of its latent rows
// (Milakov & Gimelshein 2018, arXiv:1805.02867): max m, sum l of exp(s - m), and
// acc = sum exp(s - m) c_kv in the lane order of pv_tile (unpermuted at the end).
struct Partial {
  float* m;    // [Hp]
  float* l;    // [Hp]
  float* acc;  // [H][KVp], KVp = kv_lora rounded up to 32
};

// acc[h] = alpha[h] acc[h] + sum_t p[t, h] c_t[d0 : d0 + 32] for HB heads. Two latent
// rows interleaved (unpacklo/hi_epi16) make bf16 pairs (c_t[d], c_t+1[d]) that a
// broadcast (p[t, h], p[t+1, h]) multiplies in one vdpbf16ps; within each 128-bit lane
// the "lo" half holds dims 8j .. 8j+3, the "hi" half 8j+4 .. 8j+7.
template <int HB>
inline void pv_tile(const bf16* const* rows, int num_pairs, const int32_t* pb, int64_t Hp, const float* alpha,
                    int64_t d0, __mmask32 mask, float* acc, int64_t KVp) {
  __m512 lo[HB], hi[HB];
  for (int h = 0; h < HB; ++h) {
    const __m512 al = _mm512_set1_ps(alpha[h]);
    lo[h] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * KVp), al);
    hi[h] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * KVp + 16), al);
  }
  for (int i = 0; i < num_pairs; ++i) {
    const __m512i a = _mm512_maskz_loadu_epi16(mask, rows[2 * i] + d0);
    const __m512i b = _mm512_maskz_loadu_epi16(mask, rows[2 * i + 1] + d0);
    const __m512bh ab_lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
    const __m512bh ab_hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
    for (int h = 0; h < HB; ++h) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pb[i * Hp + h]);
      lo[h] = _mm512_dpbf16_ps(lo[h], ab_lo, p);
      hi[h] = _mm512_dpbf16_ps(hi[h], ab_hi, p);
    }
  }
  for (int h = 0; h < HB; ++h) {
    _mm512_storeu_ps(acc + h * KVp, lo[h]);
    _mm512_storeu_ps(acc + h * KVp + 16, hi[h]);
  }
}

// Softmax update for a chunk of n scores sc [n][Hp]: new max, alpha = exp(m_old - m),
// l = alpha l + sum p; p (bf16, as the reference rounds probs) packed in token pairs
// into pb [ceil(n/2)][Hp], a missing last partner 0.
void softmax_chunk(float* sc, int n, int64_t Hp, Partial& st, float* alpha, int32_t* pb) {
  for (int64_t h = 0; h < Hp; h += 16) {
    const __m512 m_old = _mm512_loadu_ps(st.m + h);
    __m512 m = m_old;
    for (int t = 0; t < n; ++t) m = _mm512_max_ps(m, _mm512_loadu_ps(sc + t * Hp + h));
    const __m512 al = exp_ps(_mm512_sub_ps(m_old, m));
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < n; ++t) {
      const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + t * Hp + h), m));
      sum = _mm512_add_ps(sum, p);
      _mm512_storeu_ps(sc + t * Hp + h, p);
    }
    _mm512_storeu_ps(st.l + h, _mm512_fmadd_ps(_mm512_loadu_ps(st.l + h), al, sum));
    _mm512_storeu_ps(st.m + h, m);
    _mm512_storeu_ps(alpha + h, al);
    for (int t = 0; t < n; t += 2) {
      const __m512 p1 = t + 1 < n ? _mm512_loadu_ps(sc + (t + 1) * Hp + h) : _mm512_setzero_ps();
      const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc + t * Hp + h)));
      const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1));
      _mm512_storeu_si512(pb + (t / 2) * Hp + h, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

struct DecodeShape {
  int64_t H, Hp, D, kv_lora, KVp;
  float scale;
};

// A thread's buffers for one chunk of latent rows.
struct DecodeScratch {
  explicit DecodeScratch(int64_t Hp) : sc(CHUNK * Hp), alpha(Hp), pb(CHUNK / 2 * Hp) {}
  std::vector<float> sc;     // [CHUNK][Hp] scores, then probabilities
  std::vector<float> alpha;  // [Hp] rescale of the running sums
  std::vector<int32_t> pb;   // [CHUNK / 2][Hp] probabilities as bf16 token pairs
  const bf16* rows[CHUNK + 1];
};

// One chunk of n (<= CHUNK) latent rows, scratch.rows[0, n), into a row's partial.
void attend_chunk(const bf16* qt, const DecodeShape& s, int n, Partial& st, DecodeScratch& scratch) {
  const bf16** rows = scratch.rows;
  for (int t = n; t <= CHUNK; ++t) rows[t] = rows[n - 1];  // padding: valid rows, p = 0
  head_scores(qt, s.Hp, rows, n, s.D / 2, s.scale, scratch.sc.data());
  softmax_chunk(scratch.sc.data(), n, s.Hp, st, scratch.alpha.data(), scratch.pb.data());
  const int num_pairs = (n + 1) / 2;
  for (int64_t d0 = 0; d0 < s.kv_lora; d0 += 32) {
    const int64_t left = s.kv_lora - d0;
    const __mmask32 mask = left >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << left) - 1);
    for (int64_t h = 0; h < s.H;) {  // as many heads at once as fit in 16 accumulators
      const int64_t heads = s.H - h >= 8 ? 8 : s.H - h >= 4 ? 4 : s.H - h >= 2 ? 2 : 1;
      const int32_t* pb = scratch.pb.data() + h;
      const float* alpha = scratch.alpha.data() + h;
      float* acc = st.acc + h * s.KVp + d0;
      switch (heads) {
        case 8: pv_tile<8>(rows, num_pairs, pb, s.Hp, alpha, d0, mask, acc, s.KVp); break;
        case 4: pv_tile<4>(rows, num_pairs, pb, s.Hp, alpha, d0, mask, acc, s.KVp); break;
        case 2: pv_tile<2>(rows, num_pairs, pb, s.Hp, alpha, d0, mask, acc, s.KVp); break;
        default: pv_tile<1>(rows, num_pairs, pb, s.Hp, alpha, d0, mask, acc, s.KVp);
      }
      h += heads;
    }
  }
}

// A query row's partial over latent rows ids[0, count) (-1 skipped), a chunk at a time.
void attend_rows(const bf16* qt, const DecodeShape& s, const bf16* latent, int64_t R, const int64_t* ids,
                 int64_t count, Partial& st, DecodeScratch& scratch) {
  std::fill(st.m, st.m + s.Hp, NO_MAX);
  std::fill(st.l, st.l + s.Hp + s.H * s.KVp, 0.f);  // l and acc
  int n = 0;
  for (int64_t k = 0; k < count; ++k) {
    if (ids[k] < 0) continue;
    TORCH_CHECK(ids[k] < R, "latent row ", ids[k], " outside the ", R, " rows");
    scratch.rows[n++] = latent + ids[k] * s.D;
    if (n == CHUNK) {
      attend_chunk(qt, s, n, st, scratch);
      n = 0;
    }
  }
  if (n > 0) attend_chunk(qt, s, n, st, scratch);
}

// lo/hi halves of pv_tile's accumulators back to dims d0 .. d0 + 15 and d0 + 16 .. d0 + 31.
inline void unpermute(__m512 lo, __m512 hi, __m512& first, __m512& second) {
  const __m512i i1 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i2 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  first = _mm512_permutex2var_ps(lo, i1, hi);
  second = _mm512_permutex2var_ps(lo, i2, hi);
}

inline void store_bf16_masked(bf16* p, __m512 v, int64_t count) {
  if (count <= 0) return;
  const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << count) - 1);
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// out[h, :kv_lora] = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s over a row's S
// partials for head h (zeros where the row had no valid index).
void combine(const std::vector<Partial>& parts, int64_t h, const DecodeShape& s, bf16* out) {
  float m = NO_MAX, l = 0.f;
  for (const Partial& p : parts) m = std::max(m, p.m[h]);
  std::vector<float> wt(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    wt[i] = std::exp(parts[i].m[h] - m);
    l += wt[i] * parts[i].l[h];
  }
  const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
  for (int64_t d0 = 0; d0 < s.kv_lora; d0 += 32) {
    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
    for (size_t i = 0; i < parts.size(); ++i) {
      const float* a = parts[i].acc + h * s.KVp + d0;
      lo = _mm512_fmadd_ps(_mm512_set1_ps(wt[i]), _mm512_loadu_ps(a), lo);
      hi = _mm512_fmadd_ps(_mm512_set1_ps(wt[i]), _mm512_loadu_ps(a + 16), hi);
    }
    __m512 first, second;
    unpermute(lo, hi, first, second);
    store_bf16_masked(out + d0, _mm512_mul_ps(first, inv), s.kv_lora - d0);
    store_bf16_masked(out + d0 + 16, _mm512_mul_ps(second, inv), s.kv_lora - d0 - 16);
  }
}

}  // namespace

// q_abs [N, H, D] bf16 (dsa.absorb_query); latent [R, D] bf16 ([c_kv | k_pe] rows);
// rows [N, K] int64 (-1: none). Returns p . c_kv, [N, H, kv_lora] bf16: dsa.sparse_mla_decode.
//
// Work items are (query row, split of its K indices): few rows (batch-1 decode) split
// their indices over the threads, each split keeps its own partial softmax, and the
// partials are combined per (row, head) at the end (flash-decoding's split-K).
torch::Tensor sparse_mla_decode(torch::Tensor q_abs, torch::Tensor latent, torch::Tensor rows,
                                int64_t kv_lora, double scale) {
  TORCH_CHECK(q_abs.scalar_type() == at::kBFloat16 && q_abs.dim() == 3, "q_abs: bf16 [N, H, D]");
  TORCH_CHECK(latent.scalar_type() == at::kBFloat16 && latent.dim() == 2 && latent.size(1) == q_abs.size(2),
              "latent: bf16 [R, D] with q_abs's D");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(0) == q_abs.size(0),
              "rows: int64 [N, K]");
  const int64_t N = q_abs.size(0), H = q_abs.size(1), D = q_abs.size(2), K = rows.size(1);
  TORCH_CHECK(D % 2 == 0, "latent dim must be even, got ", D);
  TORCH_CHECK(kv_lora >= 1 && kv_lora <= D, "kv_lora must be in [1, D]");
  latent = latent.contiguous();
  rows = rows.contiguous();
  const DecodeShape shape{H, (H + 15) / 16 * 16, D, kv_lora, (kv_lora + 31) / 32 * 32,
                          static_cast<float>(scale)};
  const torch::Tensor qt = pair_interleave(q_abs.contiguous(), shape.Hp);
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(1, std::min((2 * threads + N - 1) / N, (K + 255) / 256));
  const int64_t split_len = (K + splits - 1) / splits;
  const int64_t state = 2 * shape.Hp + H * shape.KVp;  // floats per partial
  std::vector<float> partials(N * splits * state);
  auto partial = [&](int64_t item) {
    float* base = partials.data() + item * state;
    return Partial{base, base + shape.Hp, base + 2 * shape.Hp};
  };
  const bf16* qp = qt.data_ptr<bf16>();
  const bf16* lp = latent.data_ptr<bf16>();
  const int64_t* ids = rows.data_ptr<int64_t>();
  const int64_t R = latent.size(0);
  at::parallel_for(0, N * splits, 1, [&](int64_t begin, int64_t end) {
    DecodeScratch scratch(shape.Hp);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / splits, k0 = item % splits * split_len, k1 = std::min(K, k0 + split_len);
      Partial st = partial(item);
      attend_rows(qp + n * D * shape.Hp, shape, lp, R, ids + n * K + k0, k1 - k0, st, scratch);
    }
  });
  auto out = torch::empty({N, H, kv_lora}, q_abs.options());
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<Partial> parts(splits);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / H;
      for (int64_t s = 0; s < splits; ++s) parts[s] = partial(n * splits + s);
      combine(parts, i % H, shape, op + i * kv_lora);
    }
  });
  return out;
}
