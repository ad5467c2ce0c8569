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

namespace {

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
  // x's block [MC, KC] packed once per thread as tiles of 6 rows, k-major (row r of a tile
  // at k * 6 + r, zero rows past M): the tile's 6 broadcasts per k read one cache line
  std::vector<float> packed(((MC + 5) / 6) * 6 * KC);
  alignas(32) float wide[KC * PANEL];
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t mn = std::min(MC, M - m0);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kn = std::min(KC, K - k0);
      for (int64_t t = 0; t < mn; t += 6) {
        float* dst = packed.data() + t * kn;
        for (int r = 0; r < 6; ++r) {
          if (t + r < mn) {
            const float* src = x + (m0 + t + r) * K + k0;
            for (int64_t k = 0; k < kn; ++k) dst[k * 6 + r] = src[k];
          } else {
            for (int64_t k = 0; k < kn; ++k) dst[k * 6 + r] = 0.f;
          }
        }
      }
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
// GEMM (MKL/oneDNN) instead of running the panel kernel: there the widening costs a few
// percent of the product, and the library's GEMM is ~1.2x the panel kernel (measured on
// an AVX2-capped Xeon, 2 threads: ~60 against ~50 GMAC/s at 512 rows, a tie at 64).
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
  if (M >= WIDEN_MIN_ROWS) {
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

// ---- int8 weights (int8_w8a16 in an fp32 engine): y = (x q^T) * scale[n] (+ bias) ----------
//
// The weight stays in the quantization's row-major layout (minivllm/quantization/formats.py,
// what the weight cache holds), read in the dot-product form: R rows of q at a time, 8 k per
// step sign-extended and converted to fp32 in registers (vpmovsxbd, vcvtdq2ps), multiplied
// into MR x R accumulators, summed across lanes at the end. At one row this streams a
// quarter of fp32's bytes (half of the bf16 panels'); from INT8_WIDEN_ROWS rows the weight
// is converted to fp32 16 MB at a time for ATen's GEMM, as the panels are.

namespace {

constexpr int64_t INT8_WIDEN_ROWS = 16;

inline __m256 load_q8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// out[m * R + r] = sum_k x[m, k] q[r, k] for an MR x R tile (x rows K apart, q rows K apart).
template <int MR, int R>
inline void int8_tile(const float* x, const int8_t* q, int64_t K, float* out) {
  __m256 acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 w[R];
    for (int r = 0; r < R; ++r) w[r] = load_q8(q + r * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, w[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) {
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m][r]), _mm256_extractf128_ps(acc[m][r], 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      float v = _mm_cvtss_f32(s);
      for (int64_t k = k8; k < K; ++k) v += x[m * K + k] * static_cast<float>(q[r * K + k]);
      out[m * R + r] = v;
    }
}

template <int R>
inline void int8_tile_rows(int rows, const float* x, const int8_t* q, int64_t K, float* out) {
  switch (rows) {
    case 1: int8_tile<1, R>(x, q, K, out); break;
    case 2: int8_tile<2, R>(x, q, K, out); break;
    default: break;
  }
}

// Rows [0, N) of q in blocks of R (the last N % R one at a time), all M rows of x per block.
template <int R, int MR>
void int8_small(const float* x, const int8_t* q, const float* scale, const float* bias, float* y, int64_t M,
                int64_t K, int64_t N) {
  const int64_t blocks = (N + R - 1) / R;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    float out[MR * R];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R, nr = std::min<int64_t>(R, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - m0));
        // a full block of R rows at once; the last, partial one a row at a time
        const int width = nr == R ? R : 1;
        for (int64_t r0 = 0; r0 < nr; r0 += width) {
          if (width == R) {
            int8_tile_rows<R>(rows, x + m0 * K, q + n0 * K, K, out);
          } else {
            int8_tile_rows<1>(rows, x + m0 * K, q + (n0 + r0) * K, K, out);
          }
          for (int m = 0; m < rows; ++m)
            for (int r = 0; r < width; ++r) {
              const int64_t n = n0 + r0 + r;
              y[(m0 + m) * N + n] = out[m * width + r] * scale[n] + (bias ? bias[n] : 0.f);
            }
        }
      }
    }
  });
}

}  // namespace

// x: [M, K] fp32; q: [N, K] int8; scale: [N] fp32; bias: [N] or none. Returns [M, N] fp32.
torch::Tensor avx2_linear_int8w(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "x float32, q int8, scale float32");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "x: [M, K], q: [N, K]");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.numel() == q.size(0), "q contiguous, scale [N]");
  TORCH_CHECK(x.size(1) > 0, "K must be at least 1");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  if (M >= INT8_WIDEN_ROWS) {
    const int64_t step = std::max<int64_t>(1, WIDEN_FLOATS / K);
    auto y = torch::empty({M, N}, x.options());
    thread_local torch::Tensor buffer;
    for (int64_t n0 = 0; n0 < N; n0 += step) {
      const int64_t nn = std::min(step, N - n0);
      if (!buffer.defined() || buffer.numel() < nn * K) buffer = torch::empty({nn * K}, x.options());
      auto w = buffer.narrow(0, 0, nn * K).view({nn, K});
      // int8 -> fp32 (exact), written through the pointer: the buffer may have been made
      // under inference mode, where an in-place op on it would be refused outside
      const int8_t* src = q.data_ptr<int8_t>() + n0 * K;
      float* dst = w.data_ptr<float>();
      at::parallel_for(0, nn * K, 1 << 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) dst[i] = static_cast<float>(src[i]);
      });
      y.narrow(1, n0, nn).copy_(at::mm(x, w.t()) * scale.narrow(0, n0, nn));
    }
    if (b.defined()) y.add_(b);
    return y;
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const auto* qp = q.data_ptr<int8_t>();
  if (M == 1) {
    int8_small<8, 1>(x.data_ptr<float>(), qp, scale.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N);
  } else {
    int8_small<4, 2>(x.data_ptr<float>(), qp, scale.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N);
  }
  return y;
}
