// int4_w4a8 on AVX512-VNNI: int4 weights (a scale and zero point per row and group of G
// k) times x rounded to int8 per row and group, as formats.quantize_per_group says:
// inv = 127 / amax (one fp32 division), xq = round(x inv) to nearest even, xs = amax / 127
// (1 for a group of zeros; NaN for one holding an inf or NaN, so that it reaches the output).
//
//   y[m, n] = sum_g xs[m, g] ws[n, g] sum_{k in g} (v[n, k] - z[n, g]) xq[m, k]  (+ bias)
//
// The weights' nibbles are unsigned (0..15) and x's bytes signed: the operand order of
// vpdpbusd, which multiplies 64 pairs and adds them in fours into 16 int32 lanes. The
// GEMM reads a copy of the weight packed once at load (packing.pack_vnni_w4a8) in panels
// of 16 rows, as quant_w8a8.cpp's GEMM does: the 16 lanes of an accumulator are 16
// weight rows, a 64-byte load is 8 k of the panel (the low nibbles k 0-3 of each row,
// the high ones k 4-7), and each step broadcasts 4 bytes of a row of x. A group ends
// with one scaling per 16 outputs: the zero point's part comes off as z * (the group's
// sum of xq), all integers below 2^24 (for groups up to 8,192 k) and so exact in fp32,
// then times xs * ws into 16 fp32 running sums, stored once at the end. The integer sums
// are exact; the result differs from formats.reference_linear (float64 on the same
// rounded x) by float32 rounding in the scaling and the bf16 output's only.
//
// A first version kept the checkpoint's row layout (16 lanes along k) and scaled each
// group per (row of x, weight row): five vector operations per two vpdpbusd at groups of
// 128 k, and it ran slower than int4_w4a16 at every batch. On the panels, the four
// linears of Qwen3-0.6B's shape from memory (2-core AMD EPYC Zen 4, 2026-12-05): 1.2x
// int4_w4a16 at one row, 2.1-2.4x at 4-16, 2x at 512; 1.8x bf16 at 16 rows, 1.7x at
// 512. Groups are a multiple of 32 k, as int4's (the scheme's default is 128).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "quant_operands.h"

namespace {

using bf16 = at::BFloat16;
using quant_operands::check_tensor;
// x's rows are taken in chunks that stay in L2 while every weight block passes over them
constexpr int64_t kChunkBytes = 384 << 10;

#pragma GCC push_options
#pragma GCC target("avx512vnni")

// formats.quantize_per_group's scale of G values of x and (inv) the factor that rounds
// them: inv = 127 / amax in one fp32 division (-ffast-math would make it a reciprocal times
// 127, which moves x's rounding: hence the scalar instruction, not the operator), scale
// amax / 127; a group of zeros: scale 1, inv 0; one holding an inf or NaN: scale NaN.
inline float group_scale(const bf16* src, int64_t G, float* inv) {
  __m512i top = _mm512_setzero_si512();  // the largest |x| as fp32 bits (inf, NaN above finite)
  for (int64_t k = 0; k < G; k += 16)
    top = _mm512_max_epu32(top, _mm512_and_si512(_mm512_castps_si512(load_bf16x16(src + k)),
                                                 _mm512_set1_epi32(0x7FFFFFFF)));
  const uint32_t bits = _mm512_reduce_max_epu32(top);
  float amax;
  std::memcpy(&amax, &bits, sizeof amax);
  *inv = 0.f;
  if (bits >= 0x7F800000u) return std::numeric_limits<float>::quiet_NaN();
  if (bits == 0) return 1.f;
  *inv = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(127.f), _mm_set_ss(amax)));
  return amax / 127.f;
}

// A panel (packing.pack_vnni_w4a8) is, per 8 k, 64 bytes (row i's byte j: k j in the low
// nibble, k j + 4 in the high one), then its scales and its zero points as [groups, 16]
// floats (8 where symmetric; rows past N are zeros).
constexpr int64_t kPanel = 16;

inline int64_t panel_bytes(int64_t K, int64_t groups) { return K / 8 * 64 + groups * kPanel * 8; }

// x rounded to int8 per (row, group), with each group's scale and sum of xq
struct XPlain {
  std::vector<int8_t> q;    // [M, K]
  std::vector<float> scale, sum;  // [M, groups]
  int64_t K, G, groups;

  XPlain(const bf16* x, int64_t M, int64_t K_, int64_t G_) : K(K_), G(G_), groups(K_ / G_) {
    q.resize(M * K);
    scale.resize(M * groups);
    sum.resize(M * groups);
    at::parallel_for(0, M, quantize_grain(K), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t g = 0; g < groups; ++g) {
          float inv;
          scale[m * groups + g] = group_scale(x + m * K + g * G, G, &inv);
          const __m512 vinv = _mm512_set1_ps(inv);
          __m512i total = _mm512_setzero_si512();
          for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
            const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16x16(x + m * K + k), vinv));
            total = _mm512_add_epi32(total, v);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + m * K + k), _mm512_cvtepi32_epi8(v));
          }
          sum[m * groups + g] = static_cast<float>(_mm512_reduce_add_epi32(total));
        }
    });
  }
};

struct W4A8Panels {
  const uint8_t* w;  // [panels, panel_bytes]
  const bf16* bias;
  bf16* y;
  int64_t N, K, pbytes;
  const XPlain* x;

  // y for rows m0 .. m0 + MR of x and the P panels from p0
  template <int MR, int P>
  void tile(int64_t m0, int64_t p0) const {
    const int64_t groups = x->groups, G = x->G;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const uint8_t* panel = w + p0 * pbytes;
    __m512 total[MR][P];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < P; ++j) total[m][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512i acc[MR][P];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < P; ++j) acc[m][j] = _mm512_setzero_si512();
      for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
        const int8_t* xk = x->q.data() + m0 * K + k;
        for (int j = 0; j < P; ++j) {
          const __m512i b = _mm512_loadu_si512(panel + j * pbytes + k * 8);
          const __m512i lo = _mm512_and_si512(b, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
          for (int m = 0; m < MR; ++m) {
            int32_t q0, q1;
            std::memcpy(&q0, xk + m * K, 4);
            std::memcpy(&q1, xk + m * K + 4, 4);
            acc[m][j] = dpbusd(acc[m][j], lo, _mm512_set1_epi32(q0));
            acc[m][j] = dpbusd(acc[m][j], hi, _mm512_set1_epi32(q1));
          }
        }
      }
      // per output: (sum v xq - z sum xq), exact in fp32, times xs ws
      for (int j = 0; j < P; ++j) {
        const float* meta = reinterpret_cast<const float*>(panel + j * pbytes + K / 8 * 64);
        const __m512 ws = _mm512_loadu_ps(meta + g * kPanel), z = _mm512_loadu_ps(meta + (groups + g) * kPanel);
        for (int m = 0; m < MR; ++m) {
          const int64_t at = (m0 + m) * groups + g;
          const __m512 exact = _mm512_fnmadd_ps(z, _mm512_set1_ps(x->sum[at]), _mm512_cvtepi32_ps(acc[m][j]));
          total[m][j] = _mm512_fmadd_ps(exact, _mm512_mul_ps(ws, _mm512_set1_ps(x->scale[at])), total[m][j]);
        }
      }
    }
    for (int j = 0; j < P; ++j) {
      const int64_t n = (p0 + j) * kPanel;
      if (n >= N) break;
      const __mmask16 live = N - n >= kPanel ? 0xFFFF : static_cast<__mmask16>((1u << (N - n)) - 1);
      const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, bias + n)), 16))
                            : _mm512_setzero_ps();
      for (int m = 0; m < MR; ++m)
        _mm256_mask_storeu_epi16(y + (m0 + m) * N + n, live,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(total[m][j], b)));
    }
  }

  template <int MR, int P>
  void rows(int mr, int64_t m0, int64_t p0) const {
    if constexpr (MR > 1) {
      if (mr < MR) return rows<MR - 1, P>(mr, m0, p0);
    }
    tile<MR, P>(m0, p0);
  }

  // Threads split the panels in runs of P; each run is multiplied with every row of the
  // chunk, MR rows at a time (after the first tile it is read from L1 or L2).
  template <int MR, int P>
  void run(int64_t c0, int64_t c1) const {
    const int64_t panels = (N + kPanel - 1) / kPanel, runs = panels / P;
    at::parallel_for(0, (panels + P - 1) / P, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t m0 = c0; m0 < c1; m0 += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, c1 - m0));
          if (r < runs) {
            rows<MR, P>(mr, m0, r * P);
          } else {  // the last panels % P, one at a time
            for (int64_t p = r * P; p < panels; ++p) rows<MR, 1>(mr, m0, p);
          }
        }
    });
  }
};

#pragma GCC pop_options

}  // namespace

torch::Tensor int4_w4a8_packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                      int64_t group_size, c10::optional<torch::Tensor> bias) {
  static const char* who = "int4_w4a8_packed_linear";
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), who, ": needs AVX512-VNNI");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, who, ": x must be bf16 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0, who,
              ": group_size must be a multiple of 32 dividing K=", K, ", got ", group_size);
  const int64_t panels = (N + kPanel - 1) / kPanel, pbytes = panel_bytes(K, K / group_size);
  check_tensor(packed, "packed", at::kByte, {panels, pbytes}, who);
  const bf16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_tensor(*bias, "bias", at::kBFloat16, {N}, who);
    b = bias->data_ptr<bf16>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const XPlain xq(x.data_ptr<bf16>(), M, K, group_size);
  const W4A8Panels p{packed.data_ptr<uint8_t>(), b, y.data_ptr<bf16>(), N, K, pbytes, &xq};
  // int32 sums and fp32 running sums (2 MR P vectors), with a panel's two unpacked
  // vectors, within the 32 registers
  if (M == 1) return p.run<1, 8>(0, 1), y;
  if (M == 2) return p.run<2, 6>(0, 2), y;
  if (M <= 4) return p.run<4, 3>(0, M), y;
  const int64_t chunk = std::max<int64_t>(12, kChunkBytes / K / 12 * 12);
  for (int64_t c0 = 0; c0 < M; c0 += chunk) p.run<12, 1>(c0, std::min(M, c0 + chunk));
  return y;
}
