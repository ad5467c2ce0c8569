// AVX2 + FMA matrix products for CPUs without AVX-512 (AMD Zen 2/3, older Intel): fp32
// activations against bf16 weights held in "panels" (minivllm/layers/panel_linear.py).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x and y fp32, w bf16 widened to fp32 in
// registers (exact: a bf16 is the top half of an fp32). On these CPUs the engine runs
// fp32 (there is no bf16 arithmetic); holding the weights as bf16 when the checkpoint's
// values are bf16 anyway halves the bytes a decode step streams, losslessly.
//
// Panel layout: output rows are taken 16 at a time (a "panel", zero rows past N); a panel
// stores, for each k, its 16 weights as 8 32-bit pairs: pair j holds row j in its low
// half and row 8 + j in its high half. So one 256-bit load gives rows 0-7 as fp32 by a
// 16-bit shift left and rows 8-15 by masking the low halves: two single-uop integer ops,
// neither on the shuffle port. Every panel is K x 32 contiguous bytes, read in order.
//
// The product is the broadcast form of a GEMM micro-kernel (as in BLIS and GotoBLAS,
// Goto & van de Geijn 2008): an MR x 16 tile of y stays in 2 MR ymm accumulators while
// k runs, each step broadcasting x[m, k] and multiplying it into both halves of the
// panel's column. Threads split the panels; within a thread K runs in blocks of KC so
// a panel's block (KC x 32 bytes) stays in L1 while all M rows pass over it, and M runs
// in blocks of MC so those rows' KC columns stay in L2.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx2_gemm.h"

namespace {

using namespace avx2_gemm;

// One row of x against NP (<= 4) consecutive panels: decode, where one panel's two
// accumulators would leave the FMA pipes waiting on their latency.
template <int NP>
inline void micro_wide(const float* x, const uint16_t* w, int64_t panel_stride, int64_t kn, float* y,
                       bool first) {
#define MINIVLLM_PANELS(F) F(0) F(1) F(2) F(3)
#define MINIVLLM_DECL(p) __m256 c##p##a = _mm256_setzero_ps(), c##p##b = _mm256_setzero_ps();
  MINIVLLM_PANELS(MINIVLLM_DECL)
#undef MINIVLLM_DECL
  if (!first) {
#define MINIVLLM_LOAD(p)                                 \
  if constexpr (p < NP) {                                \
    c##p##a = _mm256_loadu_ps(y + 16 * p);               \
    c##p##b = _mm256_loadu_ps(y + 16 * p + 8);           \
  }
    MINIVLLM_PANELS(MINIVLLM_LOAD)
#undef MINIVLLM_LOAD
  }
  for (int64_t k = 0; k < kn; ++k) {
    const __m256 xv = _mm256_broadcast_ss(x + k);
#define MINIVLLM_FMA(p)                                          \
  if constexpr (p < NP) {                                        \
    __m256 lo, hi;                                               \
    widen(w + p * panel_stride + k * PANEL, lo, hi);             \
    c##p##a = _mm256_fmadd_ps(xv, lo, c##p##a);                  \
    c##p##b = _mm256_fmadd_ps(xv, hi, c##p##b);                  \
  }
    MINIVLLM_PANELS(MINIVLLM_FMA)
#undef MINIVLLM_FMA
  }
#define MINIVLLM_STORE(p)                          \
  if constexpr (p < NP) {                          \
    _mm256_storeu_ps(y + 16 * p, c##p##a);         \
    _mm256_storeu_ps(y + 16 * p + 8, c##p##b);     \
  }
  MINIVLLM_PANELS(MINIVLLM_STORE)
#undef MINIVLLM_STORE
#undef MINIVLLM_PANELS
}

// One thread's panels [p0, p1) for all M rows, into the padded output ypad [M, ldy].
void panels_product(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t p0, int64_t p1,
                    float* ypad, int64_t ldy) {
  const int64_t panel_stride = K * PANEL;
  if (M == 1) {
    // decode: four panels at a time keep 8 accumulators busy while the weights stream in
    for (int64_t p = p0; p < p1; p += 4) {
      const int64_t np = std::min<int64_t>(4, p1 - p);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kn = std::min(KC, K - k0);
        const uint16_t* wp = w + p * panel_stride + k0 * PANEL;
        float* yp = ypad + p * PANEL;
        const bool first = k0 == 0;
        switch (np) {
          case 4: micro_wide<4>(x + k0, wp, panel_stride, kn, yp, first); break;
          case 3: micro_wide<3>(x + k0, wp, panel_stride, kn, yp, first); break;
          case 2: micro_wide<2>(x + k0, wp, panel_stride, kn, yp, first); break;
          default: micro_wide<1>(x + k0, wp, panel_stride, kn, yp, first); break;
        }
      }
    }
    return;
  }
  // x's block [MC, KC] packed once per thread (pack_x_tiles)
  std::vector<float> packed(((MC + 5) / 6) * 6 * KC);
  alignas(32) float wide[KC * PANEL];
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t mn = std::min(MC, M - m0);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kn = std::min(KC, K - k0);
      pack_x_tiles(x, K, m0, mn, k0, kn, packed.data());
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* wp = w + p * panel_stride + k0 * PANEL;
        if (mn > 6) {  // widen the panel block once (16 KB, L1) for all its tiles
          for (int64_t k = 0; k < kn; ++k) {
            __m256 lo, hi;
            widen(wp + k * PANEL, lo, hi);
            _mm256_store_ps(wide + k * PANEL, lo);
            _mm256_store_ps(wide + k * PANEL + 8, hi);
          }
        }
        for (int64_t t = 0; t < mn; t += 6) {
          const int rows = static_cast<int>(std::min<int64_t>(6, mn - t));
          float* yt = ypad + (m0 + t) * ldy + p * PANEL;
          if (mn > 6) {
            micro_rows<true>(rows, packed.data() + t * kn, 1, 6, wide, kn, yt, ldy, k0 == 0);
          } else {
            micro_rows<false>(rows, packed.data() + t * kn, 1, 6, wp, kn, yt, ldy, k0 == 0);
          }
        }
      }
    }
  }
}

// Panels [p0, p0 + np) widened to fp32 in k-major order: wt[k, j] = w[16 p0 + j, k] (rows
// past N are the panels' zero padding). Each (panel, k) is 64 contiguous bytes of wt. The
// buffer is kept per calling thread and reused: a fresh one per call cost more in page
// faults than the widening itself.
torch::Tensor widen_panels(const torch::Tensor& panels, int64_t p0, int64_t np) {
  const int64_t K = panels.size(1), ld = np * PANEL;
  thread_local torch::Tensor buffer;
  if (!buffer.defined() || buffer.numel() < K * ld)
    buffer = torch::empty({K * ld}, panels.options().dtype(at::kFloat));
  auto wt = buffer.narrow(0, 0, K * ld).view({K, ld});
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()) + p0 * K * PANEL;
  float* out = wt.data_ptr<float>();
  at::parallel_for(0, np, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t k = 0; k < K; ++k) {
        __m256 lo, hi;
        widen(wp + (p * K + k) * PANEL, lo, hi);
        _mm256_storeu_ps(out + k * ld + p * PANEL, lo);
        _mm256_storeu_ps(out + k * ld + p * PANEL + 8, hi);
      }
  });
  return wt;
}

// y = x W^T through ATen's GEMM (MKL/oneDNN) on the weight widened to fp32, a slice of at
// most WIDEN_FLOATS at a time (an LM head widened whole would be 600 MB for Qwen3's vocabulary).
constexpr int64_t WIDEN_FLOATS = int64_t(4) << 20;  // 16 MB

torch::Tensor widened_product(const torch::Tensor& x, const torch::Tensor& panels, int64_t n) {
  const int64_t NP = panels.size(0), K = panels.size(1);
  const int64_t step = std::max<int64_t>(1, WIDEN_FLOATS / (K * PANEL));
  if (step >= NP) return at::mm(x, widen_panels(panels, 0, NP).narrow(1, 0, n));
  auto y = torch::empty({x.size(0), n}, x.options());
  for (int64_t p0 = 0; p0 < NP; p0 += step) {
    const int64_t np = std::min(step, NP - p0), cols = std::min(np * PANEL, n - p0 * PANEL);
    y.narrow(1, p0 * PANEL, cols).copy_(at::mm(x, widen_panels(panels, p0, np).narrow(1, 0, cols)));
  }
  return y;
}

}  // namespace

// Rows from which a product widens the whole weight to fp32 once and hands it to ATen's
// GEMM (MKL/oneDNN) instead of running the panel kernel, on Intel CPUs: there the widening
// costs a few percent of the product, and the library's GEMM is ~1.2x the panel kernel
// (measured on an AVX2-capped Xeon, 2 threads: ~60 against ~50 GMAC/s at 512 rows, a tie
// at 64). On AMD CPUs the panel kernel runs at every size (avx2_gemm::cpu_is_amd).
constexpr int64_t WIDEN_MIN_ROWS = 128;

// x: [M, K] fp32; panels: [ceil(N / 16), K, 16] bf16 (minivllm/layers/panel_linear.py); n: the real
// output size N; bias: [N] fp32 or none. Returns [M, N] fp32.
torch::Tensor avx2_linear_bf16w(torch::Tensor x, torch::Tensor panels, int64_t n,
                                c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.dim() == 3 && panels.size(2) == PANEL,
              "panels: bf16 [ceil(N / 16), K, 16]");
  TORCH_CHECK(panels.is_contiguous(), "panels must be contiguous");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == panels.size(1), "x: [M, K] with the panels' K");
  TORCH_CHECK(panels.size(1) > 0 && panels.size(0) > 0, "K and N must be at least 1");
  const int64_t NP = panels.size(0), K = panels.size(1), M = x.size(0);
  TORCH_CHECK(n > (NP - 1) * PANEL && n <= NP * PANEL, "n does not match the panel count");
  x = x.contiguous();
  const bool has_bias = bias.has_value() && bias->defined();
  if (M >= WIDEN_MIN_ROWS && !cpu_is_amd()) {
    auto y = widened_product(x, panels, n);
    if (has_bias) y.add_(bias->to(at::kFloat));
    return y;
  }
  const bool padded = n != NP * PANEL;
  auto y = torch::empty({M, padded ? NP * PANEL : n}, x.options());
  if (M == 0) return padded ? y.narrow(1, 0, n).contiguous() : y;
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.size(1);
  // at least 4 panels per task: a decode step's thread gets whole groups of 4
  at::parallel_for(0, (NP + 3) / 4, 1, [&](int64_t begin, int64_t end) {
    panels_product(xp, M, K, wp, begin * 4, std::min(end * 4, NP), yp, ldy);
  });
  if (padded) y = y.narrow(1, 0, n).contiguous();
  if (has_bias) y.add_(bias->to(at::kFloat));
  return y;
}
