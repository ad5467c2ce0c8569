// The AVX2 GEMM micro-kernel over fp32 or bf16 weight panels, shared by the bf16 panels
// (avx2_linear.cpp) and the quantized rows dequantized into fp32 panels (avx2_quant.cpp).
// See avx2_linear.cpp for the panel layout and the blocking.
#pragma once

#include <cpuid.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace avx2_gemm {

// Whether the CPU is AMD's (cpuid vendor "AuthenticAMD"): there MKL's fp32 GEMM ran well
// behind the micro-kernel below (AMD EPYC Zen 3, 2 threads, the 0.6B shape's layer: 128
// rows 53-75 ms through MKL against 32 ms, 512 rows 197 against 150), on an AVX2-capped
// Intel Xeon ahead of it (1.3-1.8x at 512 rows). Callers pick the GEMM by it.
inline bool cpu_is_amd() {
  static const bool amd = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
    return std::strcmp(vendor, "AuthenticAMD") == 0;
  }();
  return amd;
}


constexpr int64_t PANEL = 16;
constexpr int64_t KC = 256;  // k per block: a panel block is 8 KB (L1)
constexpr int64_t MC = 192;  // rows per block: x's block is 192 KB (L2)

// The panel's 16 weights at step k as two fp32 vectors (rows 0-7, rows 8-15).
inline void widen(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// acc[m][*] (+)= x[m, k0:k1] . panels[0:NP] over k in [k0, k1); the MR x (16 NP) tile of y
// is read (when `first` is false) and written at y + m * ldy.
// The accumulators are named variables, not an array: GCC kept an array's elements on the
// stack (a load and a store around every FMA, half the speed).
#define MINIVLLM_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5)

// y[0:MR, 0:16] (+)= x[0:MR, 0:kn] . one panel's kn steps; x[m, k] is at x[m * sm + k * sk]
// (rows of the caller's x: sm = K, sk = 1; a packed tile: sm = 1, sk = 6).
template <int MR, bool WIDE>
inline void micro(const float* x, int64_t sm, int64_t sk, const void* wv, int64_t kn, float* y,
                  int64_t ldy, bool first) {
#define MINIVLLM_DECL(m) __m256 c##m##a = _mm256_setzero_ps(), c##m##b = _mm256_setzero_ps();
  MINIVLLM_ROWS(MINIVLLM_DECL)
#undef MINIVLLM_DECL
  if (!first) {
#define MINIVLLM_LOAD(m)                                 \
  if constexpr (m < MR) {                                \
    c##m##a = _mm256_loadu_ps(y + m * ldy);              \
    c##m##b = _mm256_loadu_ps(y + m * ldy + 8);          \
  }
    MINIVLLM_ROWS(MINIVLLM_LOAD)
#undef MINIVLLM_LOAD
  }
  for (int64_t k = 0; k < kn; ++k) {
    __m256 lo, hi;
    if constexpr (WIDE) {
      lo = _mm256_load_ps(static_cast<const float*>(wv) + k * PANEL);
      hi = _mm256_load_ps(static_cast<const float*>(wv) + k * PANEL + 8);
    } else {
      widen(static_cast<const uint16_t*>(wv) + k * PANEL, lo, hi);
    }
#define MINIVLLM_FMA(m)                                           \
  if constexpr (m < MR) {                                         \
    const __m256 xv = _mm256_broadcast_ss(x + m * sm + k * sk);   \
    c##m##a = _mm256_fmadd_ps(xv, lo, c##m##a);                   \
    c##m##b = _mm256_fmadd_ps(xv, hi, c##m##b);                   \
  }
    MINIVLLM_ROWS(MINIVLLM_FMA)
#undef MINIVLLM_FMA
  }
#define MINIVLLM_STORE(m)                          \
  if constexpr (m < MR) {                          \
    _mm256_storeu_ps(y + m * ldy, c##m##a);        \
    _mm256_storeu_ps(y + m * ldy + 8, c##m##b);    \
  }
  MINIVLLM_ROWS(MINIVLLM_STORE)
#undef MINIVLLM_STORE
}

// Rows [0, rows) of a tile, rows <= 6: the row count as a template argument.
template <bool WIDE>
inline void micro_rows(int rows, const float* x, int64_t sm, int64_t sk, const void* w, int64_t kn,
                       float* y, int64_t ldy, bool first) {
  switch (rows) {
    case 1: micro<1, WIDE>(x, sm, sk, w, kn, y, ldy, first); break;
    case 2: micro<2, WIDE>(x, sm, sk, w, kn, y, ldy, first); break;
    case 3: micro<3, WIDE>(x, sm, sk, w, kn, y, ldy, first); break;
    case 4: micro<4, WIDE>(x, sm, sk, w, kn, y, ldy, first); break;
    case 5: micro<5, WIDE>(x, sm, sk, w, kn, y, ldy, first); break;
    case 6: micro<6, WIDE>(x, sm, sk, w, kn, y, ldy, first); break;
    default: break;
  }
}

// x's rows [m0, m0 + mn), columns [k0, k0 + kn), packed as tiles of 6 rows, k-major (row
// r of tile t at dst[t * kn + k * 6 + r], zero rows past mn): a tile's 6 broadcasts per k
// read one cache line.
inline void pack_x_tiles(const float* x, int64_t K, int64_t m0, int64_t mn, int64_t k0, int64_t kn, float* dst) {
  for (int64_t t = 0; t < mn; t += 6) {
    float* d = dst + t * kn;
    for (int r = 0; r < 6; ++r) {
      if (t + r < mn) {
        const float* src = x + (m0 + t + r) * K + k0;
        for (int64_t k = 0; k < kn; ++k) d[k * 6 + r] = src[k];
      } else {
        for (int64_t k = 0; k < kn; ++k) d[k * 6 + r] = 0.f;
      }
    }
  }
}

}  // namespace avx2_gemm
