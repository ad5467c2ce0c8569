// int8_w8a8: int8 weights times int8 activations quantized per token in the kernel.
//
// Each row of x is quantized as formats.quantize_per_token does, bit for bit:
// xs = amax|x| / 127 (1 for a zero row), xq = clamp(round(x / xs), -127, 127), with a true
// division and rounding half to even. vpdpbusd (AVX512-VNNI) multiplies unsigned by signed
// bytes, 64 products a step into int32 lanes, so x goes in as xq + 128 and the sums are
// corrected with the weight's row sums: sum_k (xq + 128) q = sum_k xq q + 128 wsum[n].
// y = (acc - 128 wsum[n]) * xs[m] * scale[n] + bias, exact up to the float products.
//
// The VNNI code is compiled for that extension alone (the pragma below), so the rest of
// the module runs on CPUs without it; quant_linear refuses kind 4 there.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

using bf16 = at::BFloat16;
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// Quantizes one row of x (K % 16 == 0) into q (+ offset) and returns its scale. The
// divisions use the rounding-mode forms, which -ffast-math cannot turn into reciprocals.
// quad_stride: the bytes from one group of 4 k to the next in q (4: a plain row; the VNNI
// GEMM's tiles interleave their rows' groups of 4, see W8A8Gemm).
template <typename Out>
float quantize_row(const bf16* x, int64_t K, Out* q, int offset, int64_t quad_stride = 4) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16x16(x + k)));
  const float top = _mm512_reduce_max_ps(amax);
  const float xs = top > 0.f ? _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(top), _mm_set_ss(127.f), kRound)) : 1.f;
  const __m512 vs = _mm512_set1_ps(xs);
  const __m512i lo = _mm512_set1_epi32(-127 + offset), hi = _mm512_set1_epi32(127 + offset);
  for (int64_t k = 0; k < K; k += 16) {
    __m512i v = _mm512_cvt_roundps_epi32(_mm512_div_round_ps(load_bf16x16(x + k), vs, kRound), kRound);
    v = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(v, _mm512_set1_epi32(offset)), lo), hi);
    const __m128i bytes = _mm512_cvtepi32_epi8(v);
    if (quad_stride == 4) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), bytes);
    } else {
      alignas(16) int32_t quads[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(quads), bytes);
      for (int j = 0; j < 4; ++j) std::memcpy(q + (k / 4 + j) * quad_stride, &quads[j], 4);
    }
  }
  return xs;
}

#pragma GCC push_options
#pragma GCC target("avx512vnni")

// out[m * R + r] = sum_k xu[m, k] * w[r, k] in int32, over `units` of 64 k (the last one
// of 32 where half_tail); `wnext`: the next block, prefetched into L2 meanwhile.
template <int MR, int R>
inline void vnni_tile(const int8_t* w, int64_t K, const uint8_t* xu, int64_t ldx, int64_t units,
                      bool half_tail, const int8_t* wnext, int32_t* out) {
  __m512i acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_si512();
  for (int64_t u = 0; u < units; ++u) {
    const __mmask64 live = half_tail && u == units - 1 ? 0xFFFFFFFFull : ~0ull;
    __m512i wv[R];
    for (int r = 0; r < R; ++r) {
      if (wnext) _mm_prefetch(reinterpret_cast<const char*>(wnext + r * K + u * 64), _MM_HINT_T1);
      wv[r] = _mm512_maskz_loadu_epi8(live, w + r * K + u * 64);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_loadu_si512(xu + m * ldx + u * 64);
      for (int r = 0; r < R; ++r) acc[m][r] = dpbusd(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_epi32(acc[m][r]);
}

template <int MR, int R>
inline void vnni_rows(int rows, const int8_t* w, int64_t K, const uint8_t* xu, int64_t ldx,
                      int64_t units, bool half_tail, const int8_t* wnext, int32_t* out) {
  switch (rows) {
#define MINIVLLM_VTILE(n) \
  case n:                 \
    if constexpr (n <= MR) vnni_tile<n, R>(w, K, xu, ldx, units, half_tail, wnext, out); \
    break;
    MINIVLLM_VTILE(1)
    MINIVLLM_VTILE(2)
    MINIVLLM_VTILE(3)
    MINIVLLM_VTILE(4)
#undef MINIVLLM_VTILE
    default: break;
  }
}

struct W8A8 {
  const int8_t* w;
  const uint8_t* xu;  // [M, ldx]: xq + 128, zeros past K
  int64_t ldx, M, N, K, units;
  bool half_tail;
  const float *xs, *scale;
  const int32_t* wsum;
  const bf16* bias;
  bf16* y;

  void store(const int32_t* out, int R, int rows, int64_t n0, int64_t m0, int mr) const {
    for (int m = 0; m < mr; ++m)
      for (int r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        float v = scale_in_order(static_cast<float>(out[m * R + r] - 128 * wsum[n]), xs[m0 + m], scale[n]);
        if (bias) v += static_cast<float>(bias[n]);
        y[(m0 + m) * N + n] = bf16(v);
      }
  }
};

// Blocks of R weight rows split across threads; each multiplied with x in MR-row tiles
// (the block is read from L1 after the first), prefetching PREFETCH_AHEAD blocks ahead.
template <int MR, int R, int PREFETCH_AHEAD>
void w8a8_blocks(const W8A8& p) {
  const int64_t num_blocks = (p.N + R - 1) / R;
  at::parallel_for(0, num_blocks, 4, [&](int64_t begin, int64_t end) {
    int32_t out[MR * R];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R, rows = std::min<int64_t>(R, p.N - n0);
      const int8_t* w = p.w + n0 * p.K;
      const int8_t* wnext = p.w + std::min(n0 + PREFETCH_AHEAD * R, p.N - R) * p.K;
      for (int64_t m0 = 0; m0 < p.M; m0 += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, p.M - m0));
        const uint8_t* xu = p.xu + m0 * p.ldx;
        if (rows == R) {
          vnni_rows<MR, R>(mr, w, p.K, xu, p.ldx, p.units, p.half_tail, wnext, out);
        } else {
          for (int r = 0; r < rows; ++r) {
            int32_t one[MR];
            vnni_rows<MR, 1>(mr, w + r * p.K, p.K, xu, p.ldx, p.units, p.half_tail, nullptr, one);
            for (int m = 0; m < mr; ++m) out[m * R + r] = one[m];
          }
        }
        p.store(out, R, static_cast<int>(rows), n0, m0, mr);
      }
    }
  });
}

void w8a8_run(const W8A8& p) {
  if (p.M == 1)
    w8a8_blocks<1, 8, 4>(p);
  else
    w8a8_blocks<4, 6, 1>(p);
}

// -- the GEMM for batches past the kernel above, on CPUs without AMX ----------------------
//
// The weight is packed once at load (packing.pack_vnni_w8a8) into panels of kPanel output
// rows: [N / 32, K / 4, 32, 4], so the 4 k of 32 rows that one step multiplies are 128
// contiguous bytes (two vectors) and a panel streams front to back. A tile of MR rows of x
// keeps 2 x MR int32 accumulators in registers; each step broadcasts 4 bytes of a row of x
// and multiplies them into 16 outputs' 4 k at once (vpdpbusd: 64 products). Threads split
// the panels; x is taken in chunks that stay in L2 while every panel passes over it.
constexpr int64_t kPanel = 32;
constexpr int kMaxTileRows = 12;  // 24 accumulators + 2 weight vectors + the broadcast
constexpr int64_t kGemmChunkBytes = 384 << 10;
// From 8 rows of x a panel's multiply-adds take longer than its bytes take to stream, so
// the first tile over a panel prefetches the next one into L2 (two lines per 4 k) and the
// stream overlaps the arithmetic. Qwen3-0.6B's four linears x 28 streamed from memory,
// interleaved A/B on the AMD EPYC Zen 4 VM (2026-12-05, /tmp harness like
// benchmarks/w8a8_linear.py): 1.18x at 8 rows, 1.13x at 12, 1.07-1.09x at 16, 1.05x at
// 64, level at 512; below 8 rows the stream is the bound and prefetching cost 4-21%
// (0.79x at 1 row, 0.93x at 4), so those tiles leave it to the hardware prefetcher.
constexpr int64_t kPrefetchMinRows = 8;

struct W8A8Gemm {
  // xq + 128 in tiles of kMaxTileRows rows (the last one M % kMaxTileRows): a tile of R rows
  // at xu + m0 * K holds [K / 4, R, 4], so one step's R broadcasts read 4 R contiguous bytes
  // off one pointer (12 row pointers had spilled general registers inside the loop).
  // Qwen3-0.6B's four linears from memory, the two builds A/B in one process on the AMD
  // EPYC Zen 4 VM (2026-12-07): 1.05x at 16 rows, 1.07x at 128 and 512 (389 -> 417 G
  // multiply-adds a second; vpdpbusd's register-only peak there is ~450), 1.06x at 2048.
  const uint8_t* xu;
  int64_t M, N, K;
  const int8_t* w;  // packed [N / 32, K / 4, 32, 4]
  const float *xs, *scale;
  const int32_t* wsum;
  const bf16* bias;
  bf16* y;

  template <int MR, bool AHEAD>
  void tile(const uint8_t* x, const int8_t* panel, int64_t n0, int64_t m0, const int8_t* next) const {
    __m512i acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 4) {
      if constexpr (AHEAD) {
        _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel + 64), _MM_HINT_T1);
      }
      const __m512i w0 = _mm512_loadu_si512(panel + k * kPanel);
      const __m512i w1 = _mm512_loadu_si512(panel + k * kPanel + 64);
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, x + k * MR + 4 * m, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        acc[m][0] = dpbusd(acc[m][0], xv, w0);
        acc[m][1] = dpbusd(acc[m][1], xv, w1);
      }
    }
    // y = (float(acc - 128 wsum) * xs[m]) * scale[n] + bias: the reference's order
    for (int j = 0; j < 2; ++j) {
      const int64_t n = n0 + 16 * j;
      if (n >= N) break;
      const __mmask16 live = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1);
      const __m512i corr = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(live, wsum + n), 7);
      const __m512 s = _mm512_maskz_loadu_ps(live, scale + n);
      const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, bias + n)), 16))
                            : _mm512_setzero_ps();
      for (int m = 0; m < MR; ++m) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][j], corr));
        __m512 v = scale_in_order(a, _mm512_set1_ps(xs[m0 + m]), s);
        if (bias) v = _mm512_add_ps(v, b);
        _mm256_mask_storeu_epi16(y + (m0 + m) * N + n, live, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }

  void tile_rows(int rows, const uint8_t* x, const int8_t* panel, int64_t n0, int64_t m0,
                 const int8_t* next) const {
    switch (rows) {
#define MINIVLLM_GTILE(r)              \
  case r:                              \
    if (next)                          \
      tile<r, true>(x, panel, n0, m0, next);  \
    else                               \
      tile<r, false>(x, panel, n0, m0, next); \
    break;
      MINIVLLM_GTILE(1)
      MINIVLLM_GTILE(2)
      MINIVLLM_GTILE(3)
      MINIVLLM_GTILE(4)
      MINIVLLM_GTILE(5)
      MINIVLLM_GTILE(6)
      MINIVLLM_GTILE(7)
      MINIVLLM_GTILE(8)
      MINIVLLM_GTILE(9)
      MINIVLLM_GTILE(10)
      MINIVLLM_GTILE(11)
      MINIVLLM_GTILE(12)
#undef MINIVLLM_GTILE
      default: break;
    }
  }

  void run() const {
    const int64_t panels = (N + kPanel - 1) / kPanel;
    // a multiple of kMaxTileRows, so every tile below starts where xu's layout starts one
    // and has as many rows as xu gave it
    const int64_t chunk = std::max<int64_t>(kMaxTileRows, kGemmChunkBytes / K / kMaxTileRows * kMaxTileRows);
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
          for (int64_t m0 = c0; m0 < c1; m0 += kMaxTileRows) {
            // the chunk's first tile streams the panel from memory: it fetches the
            // thread's next panel into L2 meanwhile, where the next first tile finds it
            const bool ahead = m0 == c0 && p + 1 < p1 && c1 - c0 >= kPrefetchMinRows;
            const int8_t* next = ahead ? w + (p + 1) * K * kPanel : nullptr;
            tile_rows(static_cast<int>(std::min<int64_t>(kMaxTileRows, c1 - m0)), xu + m0 * K,
                      w + p * K * kPanel, p * kPanel, m0, next);
          }
      });
    }
  }
};

#pragma GCC pop_options

}  // namespace

float quantize_row_int8(const bf16* x, int64_t K, int8_t* q) { return quantize_row(x, K, q, 0); }

void w8a8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
                 const torch::Tensor& wsum, const bf16* bias, torch::Tensor& y) {
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), "quant_linear: int8_w8a8 needs AVX512-VNNI");
  const int64_t M = x.size(0), K = x.size(1), units = (K + 63) / 64, ldx = units * 64;
  auto xu = torch::zeros({M, ldx}, x.options().dtype(at::kByte));
  auto xs = torch::empty({M}, x.options().dtype(at::kFloat));
  for (int64_t m = 0; m < M; ++m)
    xs.data_ptr<float>()[m] = quantize_row(x.data_ptr<bf16>() + m * K, K, xu.data_ptr<uint8_t>() + m * ldx, 128);
  W8A8 p{static_cast<const int8_t*>(weight.data_ptr()), xu.data_ptr<uint8_t>(), ldx, M, weight.size(0), K,
         units, K % 64 != 0, xs.data_ptr<float>(), scale.data_ptr<float>(), wsum.data_ptr<int32_t>(),
         bias, y.data_ptr<bf16>()};
  w8a8_run(p);
}

std::tuple<torch::Tensor, torch::Tensor> quantize_per_token_int8(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "quantize_per_token_int8: x must be bf16 [M, K]");
  TORCH_CHECK(x.size(1) % 16 == 0, "quantize_per_token_int8: K must be a multiple of 16, got ", x.size(1));
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto xs = torch::empty({M}, x.options().dtype(at::kFloat));
  at::parallel_for(0, M, quantize_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      xs.data_ptr<float>()[m] = quantize_row(x.data_ptr<bf16>() + m * K, K, q.data_ptr<int8_t>() + m * K, 0);
  });
  return {q, xs};
}

torch::Tensor vnni_w8a8_linear(torch::Tensor x, torch::Tensor packed, int64_t in_features, torch::Tensor scale,
                               torch::Tensor wsum, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), "vnni_w8a8_linear: int8_w8a8 needs AVX512-VNNI");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "vnni_w8a8_linear: x must be bf16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kPanel &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "vnni_w8a8_linear: packed must be packing.pack_vnni_w8a8's int8 [N/32, K/4, 32, 4]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous(),
              "vnni_w8a8_linear: scale must be float32 [N]");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.dim() == 1 && wsum.numel() == scale.numel() &&
                  wsum.is_contiguous(),
              "vnni_w8a8_linear: wsum must be int32 [N], the weight's row sums");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scale.device().is_cpu() && wsum.device().is_cpu(),
              "vnni_w8a8_linear: tensors must be on the CPU");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  TORCH_CHECK(K > 0 && K == in_features && K % 16 == 0 && K / 4 == packed.size(1), "vnni_w8a8_linear: x has K=", K,
              ", the weight ", in_features, " (a multiple of 16, packed as ", packed.size(1), " groups of 4)");
  TORCH_CHECK((N + kPanel - 1) / kPanel == packed.size(0), "vnni_w8a8_linear: scale has N=", N,
              ", the packed weight ", packed.size(0), " panels of 32 rows");
  const bf16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous() &&
                    bias->device().is_cpu(),
                "vnni_w8a8_linear: bias must be bf16 [N]");
    b = bias->data_ptr<bf16>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto xu = torch::empty({M, K}, x.options().dtype(at::kByte));
  auto xs = torch::empty({M}, x.options().dtype(at::kFloat));
  const bf16* xp = x.data_ptr<bf16>();
  uint8_t* q = xu.data_ptr<uint8_t>();
  float* s = xs.data_ptr<float>();
  at::parallel_for(0, M, quantize_grain(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      // row m is row m - t0 of the tile starting at row t0, which has `rows` rows (W8A8Gemm::xu)
      const int64_t t0 = m / kMaxTileRows * kMaxTileRows, rows = std::min<int64_t>(kMaxTileRows, M - t0);
      s[m] = quantize_row(xp + m * K, K, q + t0 * K + 4 * (m - t0), 128, 4 * rows);
    }
  });
  W8A8Gemm g{q, M, N, K, packed.data_ptr<int8_t>(), s, scale.data_ptr<float>(), wsum.data_ptr<int32_t>(),
             b, y.data_ptr<bf16>()};
  g.run();
  return y;
}

torch::Tensor w8a8_packed_linear(torch::Tensor x, torch::Tensor packed, int64_t in_features, torch::Tensor scale,
                                 torch::Tensor wsum, c10::optional<torch::Tensor> bias) {
  if (packed.dim() == 5) return amx_w8a8_linear(x, packed, in_features, scale, bias);
  return vnni_w8a8_linear(x, packed, in_features, scale, wsum, bias);
}
