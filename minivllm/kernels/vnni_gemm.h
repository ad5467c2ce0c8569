// int8_w8a8's GEMM on AVX512-VNNI for CPUs without AMX, shared by both kernel families:
// the bf16 one's (quant_w8a8.cpp: bf16 x, y and bias) and the AVX2 one's for fp32 engines
// on AVX-512 CPUs without AVX512-BF16, Intel Ice Lake and Cascade Lake (avx2_vnni.cpp:
// fp32 x, y and bias). Everything here carries its own target, so a file built for AVX2
// alone can include it. The element type comes from an Io class:
//   using T;  static constexpr at::ScalarType dtype;  static constexpr const char* name;
//   static __m512 load16(const T* p)                      16 values as fp32
//   static __m512 load_masked(const T* p, __mmask16 live)  the lanes `live` marks, else 0
//   static void store_masked(T* p, __mmask16 live, __m512 v)
//
// Each row of x is quantized as formats.quantize_per_token does, bit for bit:
// xs = amax|x| / 127 (1 for a zero row), xq = clamp(round(x / xs), -127, 127), with a true
// division and rounding half to even. vpdpbusd multiplies unsigned by signed bytes, 64
// products a step into int32 lanes, so x goes in as xq + 128 and the sums are corrected
// with the weight's row sums: sum_k (xq + 128) q = sum_k xq q + 128 wsum[n].
// y = (acc - 128 wsum[n]) * xs[m] * scale[n] + bias, exact up to the float products: the
// reference's numbers whatever the element type.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "avx512_int8.h"

namespace vnni_gemm {

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

// Quantizes one row of x (K % 16 == 0) into q (+ offset) and returns its scale. The
// divisions use the rounding-mode forms, which -ffast-math cannot turn into reciprocals.
// quad_stride: the bytes from one group of 4 k to the next in q (4: a plain row; the
// GEMM's tiles interleave their rows' groups of 4, see Gemm).
template <class Io, typename Out>
float quantize_row(const typename Io::T* x, int64_t K, Out* q, int offset, int64_t quad_stride = 4) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(Io::load16(x + k)));
  const float top = _mm512_reduce_max_ps(amax);
  const float xs = top > 0.f ? _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(top), _mm_set_ss(127.f), kRound)) : 1.f;
  const __m512 vs = _mm512_set1_ps(xs);
  const __m512i lo = _mm512_set1_epi32(-127 + offset), hi = _mm512_set1_epi32(127 + offset);
  for (int64_t k = 0; k < K; k += 16) {
    __m512i v = _mm512_cvt_roundps_epi32(_mm512_div_round_ps(Io::load16(x + k), vs, kRound), kRound);
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

#pragma GCC pop_options

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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

template <class Io>
struct Gemm {
  using T = typename Io::T;
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
  const T* bias;
  T* y;

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
      const __m512 b = bias ? Io::load_masked(bias + n, live) : _mm512_setzero_ps();
      for (int m = 0; m < MR; ++m) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][j], corr));
        __m512 v = scale_in_order(a, _mm512_set1_ps(xs[m0 + m]), s);
        if (bias) v = _mm512_add_ps(v, b);
        Io::store_masked(y + (m0 + m) * N + n, live, v);
      }
    }
  }

  void tile_rows(int rows, const uint8_t* x, const int8_t* panel, int64_t n0, int64_t m0,
                 const int8_t* next) const {
    switch (rows) {
#define MINIVLLM_GTILE(r)                     \
  case r:                                     \
    if (next)                                 \
      tile<r, true>(x, panel, n0, m0, next);  \
    else                                      \
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

// y = x @ W^T (+ bias) on pack_vnni_w8a8's panels; `op` names the caller in errors.
template <class Io>
torch::Tensor linear(const char* op, torch::Tensor x, const torch::Tensor& packed, int64_t in_features,
                     const torch::Tensor& scale, const torch::Tensor& wsum, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"),
              op, ": int8_w8a8 needs AVX512-VNNI (with AVX512F, BW and VL)");
  TORCH_CHECK(x.scalar_type() == Io::dtype && x.dim() == 2, op, ": x must be ", Io::name, " [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kPanel &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              op, ": packed must be packing.pack_vnni_w8a8's int8 [N/32, K/4, 32, 4]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous(), op,
              ": scale must be float32 [N]");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.dim() == 1 && wsum.numel() == scale.numel() &&
                  wsum.is_contiguous(),
              op, ": wsum must be int32 [N], the weight's row sums");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scale.device().is_cpu() && wsum.device().is_cpu(),
              op, ": tensors must be on the CPU");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  TORCH_CHECK(K > 0 && K == in_features && K % 16 == 0 && K / 4 == packed.size(1), op, ": x has K=", K,
              ", the weight ", in_features, " (a multiple of 16, packed as ", packed.size(1), " groups of 4)");
  TORCH_CHECK((N + kPanel - 1) / kPanel == packed.size(0), op, ": scale has N=", N, ", the packed weight ",
              packed.size(0), " panels of 32 rows");
  using T = typename Io::T;
  const T* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == Io::dtype && bias->numel() == N && bias->is_contiguous() &&
                    bias->device().is_cpu(),
                op, ": bias must be ", Io::name, " [N]");
    b = bias->data_ptr<T>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto xu = torch::empty({M, K}, x.options().dtype(at::kByte));
  auto xs = torch::empty({M}, x.options().dtype(at::kFloat));
  const T* xp = x.data_ptr<T>();
  uint8_t* q = xu.data_ptr<uint8_t>();
  float* s = xs.data_ptr<float>();
  at::parallel_for(0, M, quantize_grain(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      // row m is row m - t0 of the tile starting at row t0, which has `rows` rows (Gemm::xu)
      const int64_t t0 = m / kMaxTileRows * kMaxTileRows, rows = std::min<int64_t>(kMaxTileRows, M - t0);
      s[m] = quantize_row<Io>(xp + m * K, K, q + t0 * K + 4 * (m - t0), 128, 4 * rows);
    }
  });
  Gemm<Io> g{q, M, N, K, packed.data_ptr<int8_t>(), s, scale.data_ptr<float>(), wsum.data_ptr<int32_t>(),
             b, y.data_ptr<T>()};
  g.run();
  return y;
}

}  // namespace vnni_gemm
