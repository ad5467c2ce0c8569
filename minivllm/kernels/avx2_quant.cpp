// Quantized weights in fp32 engines on AVX2 + FMA CPUs (AMD Zen 2/3, older Intel): int8,
// int4 and fp8 rows (minivllm/quantization/formats.py's layouts, as stored and as the weight
// cache holds them), multiplied into fp32 activations.
//
// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) with w the scheme's dequantized weight:
// int8 q * s[n], fp8 e4m3(q) * s[n], int4 (q - z[n, g]) * s[n, g] in groups of G k.
//
// Up to 8 rows (decode, small batches) the product is the register form, R weight rows
// at a time: a unit of a row (16 k of int8 or fp8, 32 k of int4) is turned into fp32
// vectors in registers, multiplied into two accumulators per (x row, weight row) that
// alternate (two chains of FMA latency, not one), and each group's sum is scaled once at
// the group's end. Each weight byte is read once per call from memory (once per pair of
// rows from L1), and R rows share each x load. Past 8 rows (larger batches, prefill) the
// bf16 panels' GEMM micro-kernel (avx2_gemm.h) runs on fp32 panels dequantized from the
// rows block by block, each weight decoded once per call.
//
// Decoding, per scheme (every decoded value is exact; only the fp32 sums' order differs
// from formats.reference_linear):
//   int8  vpmovsxbd + vcvtdq2ps, 8 k per vector.
//   fp8   e4m3 byte b sign-extended to a 32-bit lane d: ((d << 20) & 0x07F00000) |
//         (d & 0x80000000) are fp32 bits with e4m3's exponent field and mantissa in place,
//         the number times 2^-120 (its subnormals, exponent 0, land on fp32 subnormals with
//         the same scaling); one multiply by 2^120 gives it. That needs the CPU to read
//         subnormal inputs as they are: each thread clears MXCSR's DAZ/FTZ for the call.
//   int4  a 16-byte chunk holds k 0-15 in its low nibbles and 16-31 in its high ones
//         (formats.pack_int4). Low nibbles in the lower 128 bits, high ones in the upper,
//         32-bit lane i then holds 4 consecutive k (4i + j, j = 0..3) in its 4 bytes, and
//         (v >> 8j) & 0xF gives 8 of them per vector with integer shifts only (no shuffles
//         per weight). x is laid out in the same order once per call (`prepare_int4_x`).
//         The products use q, not q - z: per group, z * sum_k x is subtracted at the end.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx2_gemm.h"
#include "avx2_math.h"

namespace {

constexpr int64_t KIND_INT8 = 1, KIND_INT4 = 2, KIND_FP8 = 3;  // formats.KERNEL_KIND

// MXCSR's DAZ (bit 6) and FTZ (bit 15) cleared while alive, restored after.
class KeepSubnormals {
 public:
  KeepSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~((1u << 6) | (1u << 15))); }
  ~KeepSubnormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

inline __m256 int8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 fp8x8(const uint8_t* p) {
  const __m256i d = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(_mm256_slli_epi32(d, 20), _mm256_set1_epi32(0x07F00000));
  const __m256i sign = _mm256_and_si256(d, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(magnitude, sign)), _mm256_set1_ps(0x1p120f));
}

// int4 chunk -> 4 vectors; vector j lane i holds k 4i + j of the chunk (in prepare_int4_x's order)
inline void int4x32(const uint8_t* p, __m256 w[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  const __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), nibble));
  w[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), nibble));
  w[3] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 24), nibble));
}

inline float fp8_scalar(uint8_t b) {
  const int32_t d = static_cast<int8_t>(b);
  const uint32_t bits = ((static_cast<uint32_t>(d) << 20) & 0x07F00000u) | (static_cast<uint32_t>(d) & 0x80000000u);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * 0x1p120f;
}

// A scheme's unit: kK k in kBytes bytes, decoded into kVec vectors matching x's layout
// (the register form); `scalar` decodes one k of a per-channel scheme (a row's last K %
// 16); `raw8` decodes 8 consecutive k of a row (k a multiple of 8) in natural order, before
// scale and zero point (the panel form).
struct Int8Unit {
  static constexpr int64_t kK = 16, kBytes = 16;
  static constexpr int kVec = 2;
  static inline void decode(const uint8_t* p, __m256* w) { w[0] = int8x8(p), w[1] = int8x8(p + 8); }
  static inline float scalar(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b)); }
  static inline __m256 raw8(const uint8_t* row, int64_t k) { return int8x8(row + k); }
};
struct Fp8Unit {
  static constexpr int64_t kK = 16, kBytes = 16;
  static constexpr int kVec = 2;
  static inline void decode(const uint8_t* p, __m256* w) { w[0] = fp8x8(p), w[1] = fp8x8(p + 8); }
  static inline float scalar(uint8_t b) { return fp8_scalar(b); }
  static inline __m256 raw8(const uint8_t* row, int64_t k) { return fp8x8(row + k); }
};
struct Int4Unit {
  static constexpr int64_t kK = 32, kBytes = 16;
  static constexpr int kVec = 4;
  static inline void decode(const uint8_t* p, __m256* w) { int4x32(p, w); }
  static inline float scalar(uint8_t) { return 0.f; }  // int4 rows have no tail (K % 32 == 0)
  // k's chunk holds k 0-15 in the low nibbles of its 16 bytes and 16-31 in the high ones
  static inline __m256 raw8(const uint8_t* row, int64_t k) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 32 * 16 + k % 16));
    if (k % 32 >= 16) b = _mm_srli_epi16(b, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F))));
  }
};

// What one product needs: x (prepared), the rows, per-group scales (and int4 zeros).
struct Operands {
  const float* x;      // [M, K] in the unit's order
  const uint8_t* q;    // [N, row_bytes]
  const float* scale;  // [N, groups]
  const float* zero;   // int4: [N, groups], or null for symmetric (8); else null
  const float* xsum;   // int4: [M, groups] sums of x per group; else null
  int64_t M, K, N, row_bytes, groups, group_k;
  bool int4;
};

// y[m, n] for rows m0..m0+MR and weight rows n0..n0+R (all in range). Each group's two
// accumulators are scaled into a running vector (one FMA per group, a horizontal sum
// only at the end); int4's z * sum(x) per group is subtracted in scalar.
//
// The R rows are one contiguous region, and the next tile's follows it: rows of 1-3 KB
// are short streams for the hardware prefetcher, which re-learns each one (measured: int8
// rows read at ~10 GB/s against the bf16 panels' single stream at ~20), so each step also
// prefetches the next tile's bytes at the pace this tile consumes its own.
template <class U, int MR, int R>
inline void dot_tile(const Operands& o, int64_t m0, int64_t n0, float* y) {
  __m256 total[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps();
  float tail[MR][R] = {};  // per-channel schemes' last K % 16, and int4's zero terms
  // byte offsets, compared before a pointer is formed (none past the rows' end)
  const int64_t next = (n0 + R) * o.row_bytes, end = o.N * o.row_bytes;
  for (int64_t g = 0; g < o.groups; ++g) {
    __m256 a[MR][R], b[MR][R];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r) a[m][r] = b[m][r] = _mm256_setzero_ps();
    const int64_t k0 = g * o.group_k, k1 = k0 + o.group_k, kv = k0 + (o.group_k & ~(U::kK - 1));
    for (int64_t k = k0; k < kv; k += U::kK) {
      const int64_t ahead = next + k * U::kBytes / U::kK * R;
      if (ahead < end) _mm_prefetch(reinterpret_cast<const char*>(o.q + ahead), _MM_HINT_T0);
      // one weight row's unit at a time: its kVec vectors and the 2 MR R accumulators fit
      // the 16 ymm registers, x comes from L1 as FMA memory operands
      for (int r = 0; r < R; ++r) {
        __m256 w[U::kVec];
        U::decode(o.q + (n0 + r) * o.row_bytes + k * U::kBytes / U::kK, w);
        for (int m = 0; m < MR; ++m) {
          const float* xk = o.x + (m0 + m) * o.K + k;
          for (int v = 0; v < U::kVec; v += 2) {
            a[m][r] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xk + 8 * v), a[m][r]);
            b[m][r] = _mm256_fmadd_ps(w[v + 1], _mm256_loadu_ps(xk + 8 * v + 8), b[m][r]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float s = o.scale[(n0 + r) * o.groups + g];
      const uint8_t* row = o.q + (n0 + r) * o.row_bytes;
      const __m256 sv = _mm256_set1_ps(s);
      for (int m = 0; m < MR; ++m) {
        total[m][r] = _mm256_fmadd_ps(_mm256_add_ps(a[m][r], b[m][r]), sv, total[m][r]);
        float t = 0.f;
        for (int64_t k = kv; k < k1; ++k) t += o.x[(m0 + m) * o.K + k] * U::scalar(row[k]);
        if (o.int4) t -= (o.zero ? o.zero[(n0 + r) * o.groups + g] : 8.f) * o.xsum[(m0 + m) * o.groups + g];
        tail[m][r] += t * s;
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) y[(m0 + m) * o.N + n0 + r] = hsum8(total[m][r]) + tail[m][r];
}

template <class U, int MR, int R>
void dot_rows(const Operands& o, int64_t n_begin, int64_t n_end, float* y) {
  for (int64_t n = n_begin; n < n_end; n += R) {
    const bool full = n + R <= n_end;
    for (int64_t m = 0; m < o.M; m += MR) {
      const bool rows = m + MR <= o.M;
      if (full && rows) {
        dot_tile<U, MR, R>(o, m, n, y);
      } else {  // the edges one (row, weight row) at a time
        for (int64_t mm = m; mm < std::min(m + MR, o.M); ++mm)
          for (int64_t nn = n; nn < std::min(n + R, n_end); ++nn) dot_tile<U, 1, 1>(o, mm, nn, y);
      }
    }
  }
}

// One row a call: 4 weight rows per tile; more rows: 2 x rows by 2 weight rows (16 ymm
// registers hold the MR x R x 2 accumulators and the decoded vectors).
template <class U>
void dot_product(const Operands& o, float* y) {
  constexpr int64_t BLOCK = 16;  // weight rows per task
  const int64_t blocks = (o.N + BLOCK - 1) / BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    KeepSubnormals keep;
    const int64_t n0 = begin * BLOCK, n1 = std::min(end * BLOCK, o.N);
    if (o.M == 1) {
      dot_rows<U, 1, 4>(o, n0, n1, y);
    } else {
      dot_rows<U, 2, 2>(o, n0, n1, y);
    }
  });
}

// x [M, K] -> xp, each 32-k chunk transposed 4 x 8 (xp[32c + 8j + i] = x[32c + 4i + j]),
// and xsum [M, K / G], each group's sum of x.
void prepare_int4_x(const float* x, int64_t M, int64_t K, int64_t G, float* xp, float* xsum) {
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    float* dst = xp + m * K;
    for (int64_t c = 0; c < K; c += 32)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 8; ++i) dst[c + 8 * j + i] = src[c + 4 * i + j];
    for (int64_t g = 0; g < K / G; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(src + k));
      xsum[m * (K / G) + g] = hsum8(acc);
    }
  }
}

// v[r][i] -> v[i][r] for an 8 x 8 block of fp32.
inline void transpose8(__m256 v[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    v[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// Rows n0 .. n0 + 7 (those past N as zeros), k in [k0, k0 + kn), dequantized into the
// k-major panel block: dst[k * 16 + r] for k from 0. Each 8 x 8 block is decoded row by
// row as stored, transposed in registers, then scaled (and int4's zero point subtracted)
// with one vector per 8 rows: per-channel scales are fixed for the block, int4's change
// at each group's first k.
template <class U>
inline void fill_half_panel(const Operands& o, int64_t n0, int64_t k0, int64_t kn, float* dst) {
  using avx2_gemm::PANEL;
  const int rows = static_cast<int>(std::min<int64_t>(8, o.N - n0));
  const uint8_t* q[8];
  for (int r = 0; r < 8; ++r) q[r] = o.q + (n0 + std::min(r, rows - 1)) * o.row_bytes;
  alignas(32) float s[8] = {}, z[8] = {};
  int64_t next_group = k0;  // the k at which the scales change next
  for (int64_t k = 0; k < kn; k += 8) {
    const int64_t kk = k0 + k;
    if (kk >= next_group) {  // a group's first k (per-channel schemes: once)
      const int64_t g = kk / o.group_k;
      next_group = (g + 1) * o.group_k;
      for (int r = 0; r < rows; ++r) {
        s[r] = o.scale[(n0 + r) * o.groups + g];
        z[r] = o.int4 ? (o.zero ? o.zero[(n0 + r) * o.groups + g] : 8.f) : 0.f;
      }
    }
    const __m256 sv = _mm256_load_ps(s), zv = _mm256_load_ps(z);
    __m256 v[8];
    for (int r = 0; r < 8; ++r) v[r] = U::raw8(q[r], kk);
    transpose8(v);
    for (int i = 0; i < 8; ++i) _mm256_store_ps(dst + (k + i) * PANEL, _mm256_mul_ps(_mm256_sub_ps(v[i], zv), sv));
  }
}

// Batched decode (a few rows to a few dozen): the bf16 panels' GEMM micro-kernel
// (avx2_gemm.h) on fp32 panels dequantized from the rows. Threads split the panels (16
// weight rows each); a panel's KC-k block is dequantized k-major (fill_half_panel, 16 KB,
// L1) and every tile of 6 x rows multiplies it, so each weight is decoded once per call
// however many rows there are. x is packed once, for every thread. K must be a multiple
// of 8 (the decoding runs 8 k x 8 rows at a time).
// ypad: [M, ldy] with ldy = 16 * panels (the last panel's rows past N are zero weights).
template <class U>
void panel_product(const Operands& o, const float* x, float* ypad, int64_t ldy) {
  using namespace avx2_gemm;
  const int64_t M = o.M, K = o.K, panels = (o.N + PANEL - 1) / PANEL, m_pad = (M + 5) / 6 * 6;
  std::vector<float> packed(m_pad * K);  // k-block k0's tiles at k0 * m_pad
  for (int64_t k0 = 0; k0 < K; k0 += KC) pack_x_tiles(x, K, 0, M, k0, std::min(KC, K - k0), packed.data() + k0 * m_pad);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    KeepSubnormals keep;
    alignas(32) float wide[KC * PANEL];
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kn = std::min(KC, K - k0);
        for (int half = 0; half < 2; ++half)  // rows 0-7, then 8-15 of the panel
          fill_half_panel<U>(o, p * PANEL + 8 * half, k0, kn, wide + 8 * half);
        for (int64_t t = 0; t < M; t += 6) {
          const int tile_rows = static_cast<int>(std::min<int64_t>(6, M - t));
          micro_rows<true>(tile_rows, packed.data() + k0 * m_pad + t * kn, 1, 6, wide, kn,
                           ypad + t * ldy + p * PANEL, ldy, k0 == 0);
        }
      }
    }
  });
}

// Rows up to which the register form runs: it decodes the weights again for every pair of
// rows, the panel form once per call (8 x 8 blocks: decode, transpose, scale). Measured on
// an AMD EPYC (Zen 3), 2 threads, the 0.6B shape's layer, ms per call for int8 / int4 /
// fp8, register form then panel form: 4 rows 2.8 3.3 3.5 / 4.7 4.8 5.4; 8 rows 4.2 5.8
// 6.2 / 6.2 6.2 6.6; 16 rows 8.7 11.9 13.0 / 8.9 8.1 9.0 (`python benchmarks/avx2_quant.py`).
// At 512 rows the panel form ran 1.3-1.7x the bf16 panels' then path (widened weight, MKL).
constexpr int64_t REGISTER_MAX_ROWS = 8;

}  // namespace

// x: [M, K] fp32. kind 1 (int8: weight int8 [N, K], scale [N]), 2 (int4: weight uint8
// [N, K/2] packed, scale [N, K/G], zero [N, K/G] or none, group_size G), 3 (fp8: weight
// uint8 e4m3 bits [N, K], scale [N]). bias: [N] or none. Returns [M, N] fp32.
torch::Tensor avx2_linear_quantw(torch::Tensor x, int64_t kind, torch::Tensor weight, torch::Tensor scale,
                                 c10::optional<torch::Tensor> zero, int64_t group_size,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(kind == KIND_INT8 || kind == KIND_INT4 || kind == KIND_FP8, "kind: 1 int8, 2 int4, 3 fp8");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x: float32 [M, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale: contiguous float32");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight: contiguous [N, row bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bool int4 = kind == KIND_INT4;
  TORCH_CHECK(K > 0 && (!int4 || K % 32 == 0), "K must be positive (int4: a multiple of 32)");
  TORCH_CHECK(weight.scalar_type() == (kind == KIND_INT8 ? at::kChar : at::kByte), "weight: int8 (int8), uint8 (int4, fp8)");
  TORCH_CHECK(weight.size(1) == (int4 ? K / 2 : K), "weight's row size does not match K");
  const int64_t G = int4 ? group_size : K;
  TORCH_CHECK(!int4 || (G > 0 && G % 32 == 0 && K % G == 0), "int4 groups: a multiple of 32 dividing K");
  const int64_t groups = K / G;
  TORCH_CHECK(scale.numel() == N * groups, "scale: [N] or [N, K / G]");
  const bool has_zero = int4 && zero.has_value() && zero->defined();
  if (has_zero)
    TORCH_CHECK(zero->scalar_type() == at::kFloat && zero->is_contiguous() && zero->numel() == N * groups,
                "zero: float32 [N, K / G]");
  x = x.contiguous();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == N, "bias: [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  Operands o{x.data_ptr<float>(),
             reinterpret_cast<const uint8_t*>(weight.data_ptr()),
             scale.data_ptr<float>(),
             has_zero ? zero->data_ptr<float>() : nullptr,
             nullptr,
             M, K, N, weight.size(1), groups, G, int4};
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (M > REGISTER_MAX_ROWS && K % 8 == 0) {
    const int64_t ldy = (N + avx2_gemm::PANEL - 1) / avx2_gemm::PANEL * avx2_gemm::PANEL;
    auto ypad = ldy == N ? y : torch::empty({M, ldy}, x.options());
    if (int4) {
      panel_product<Int4Unit>(o, x.data_ptr<float>(), ypad.data_ptr<float>(), ldy);
    } else if (kind == KIND_FP8) {
      panel_product<Fp8Unit>(o, x.data_ptr<float>(), ypad.data_ptr<float>(), ldy);
    } else {
      panel_product<Int8Unit>(o, x.data_ptr<float>(), ypad.data_ptr<float>(), ldy);
    }
    if (ldy != N) y.copy_(ypad.narrow(1, 0, N));
  } else if (int4) {
    std::vector<float> xp(M * K), xsum(M * groups);
    prepare_int4_x(x.data_ptr<float>(), M, K, G, xp.data(), xsum.data());
    o.x = xp.data();
    o.xsum = xsum.data();
    dot_product<Int4Unit>(o, y.data_ptr<float>());
  } else if (kind == KIND_FP8) {
    dot_product<Fp8Unit>(o, y.data_ptr<float>());
  } else {
    dot_product<Int8Unit>(o, y.data_ptr<float>());
  }
  if (b.defined()) y.add_(b);
  return y;
}

// int8_w8a16's op under its earlier name: x [M, K] fp32, q [N, K] int8, scale [N].
torch::Tensor avx2_linear_int8w(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                c10::optional<torch::Tensor> bias) {
  return avx2_linear_quantw(x, KIND_INT8, q, scale, c10::nullopt, 0, bias);
}
