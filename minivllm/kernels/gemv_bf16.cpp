// Weight-streaming bf16 matrix-vector products for CPU decode (few rows of x).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32 accumulation with the
// AVX512-BF16 dot-product instruction (vdpbf16ps: 32 bf16 pairs per step).
// Decode is bandwidth-bound: each weight row is read once for all M rows of x,
// R weight rows are streamed side by side, and threads split the output rows.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

namespace {

inline __m512bh load_bf16(const at::BFloat16* p, int64_t remaining) {
  if (remaining >= 32) return (__m512bh)_mm512_loadu_si512(p);
  __mmask32 mask = (remaining <= 0) ? 0 : (__mmask32)((1ull << remaining) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

template <int M, int R>
void gemv_block(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
                at::BFloat16* y, int64_t K, int64_t N, int64_t n0) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load_bf16(x + m * K + k, K - k);
    for (int r = 0; r < R; ++r) {
      __m512bh wv = load_bf16(w + (n0 + r) * K + k, K - k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float b = bias ? static_cast<float>(bias[n0 + r]) : 0.f;
    for (int m = 0; m < M; ++m) y[m * N + n0 + r] = at::BFloat16(_mm512_reduce_add_ps(acc[r][m]) + b);
  }
}

template <int M, int R>
void gemv(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y,
          int64_t K, int64_t N) {
  const int64_t num_blocks = N / R;
  at::parallel_for(0, num_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) gemv_block<M, R>(x, w, bias, y, K, N, b * R);
  });
  for (int64_t n = num_blocks * R; n < N; ++n) gemv_block<M, 1>(x, w, bias, y, K, N, n);
}

template <int M>
void dispatch_rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
                   at::BFloat16* y, int64_t K, int64_t N) {
  if constexpr (M <= 4) {
    gemv<M, 4>(x, w, bias, y, K, N);
  } else {
    gemv<M, 2>(x, w, bias, y, K, N);
  }
}

}  // namespace

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes: x [M, K], w [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "1 to 8 rows");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const at::BFloat16* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kBFloat16 && bias_c.numel() == N, "bias: bf16 [N]");
    b = bias_c.data_ptr<at::BFloat16>();
  }
  auto xp = x.data_ptr<at::BFloat16>();
  auto wp = w.data_ptr<at::BFloat16>();
  auto yp = y.data_ptr<at::BFloat16>();
  switch (M) {
    case 1: dispatch_rows<1>(xp, wp, b, yp, K, N); break;
    case 2: dispatch_rows<2>(xp, wp, b, yp, K, N); break;
    case 3: dispatch_rows<3>(xp, wp, b, yp, K, N); break;
    case 4: dispatch_rows<4>(xp, wp, b, yp, K, N); break;
    case 5: dispatch_rows<5>(xp, wp, b, yp, K, N); break;
    case 6: dispatch_rows<6>(xp, wp, b, yp, K, N); break;
    case 7: dispatch_rows<7>(xp, wp, b, yp, K, N); break;
    default: dispatch_rows<8>(xp, wp, b, yp, K, N); break;
  }
  return y;
}

torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "bf16 RMSNorm");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; RMSNorm(residual)");
  m.def("rotary_inplace", &rotary_inplace, "neox rotary embedding, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("gemv_bf16", &gemv_bf16, "bf16 weight-streaming GEMV (AVX512-BF16)");
  m.def("paged_attention_decode", &paged_attention_decode, "bf16 paged decode attention");
}
