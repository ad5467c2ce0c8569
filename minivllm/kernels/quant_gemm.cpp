// Matrix products on quantized weights for CPU decode (a few rows of x): y = x W^T (+ b).
//
// The weight formats and the reference these kernels match are in
// minivllm/quantization/formats.py; quant_rows.h decodes the weight-only schemes
// (int8_w8a16, int4_w4a16, fp8_w8a16) and quant_w8a8.cpp runs int8_w8a8. As in
// gemv_bf16.cpp, threads split the output rows into blocks of R rows and every block is
// read from memory once for all M rows of x:
//  - M <= 4 (decode, bandwidth-bound at M = 1): each block is decoded in registers as it
//    streams in and used for all rows of x, while the blocks PREFETCH_AHEAD ahead are
//    fetched into L2.
//  - M > 4: a block is decoded once into a bf16 scratch (L1/L2) and multiplied with x in
//    tiles of MR rows by vdpbf16ps, so decoding is paid once per weight, not per tile.
// Past kernel_limits.max_kernel_rows the caller hands int4 and block-scaled fp8 up to
// kernel_limits.max_dequantized_rows to dequantized_linear (below: blocks of rows dequantized,
// scaled, into the scratch and multiplied the same way), and larger batches to
// dequantize_bf16 and oneDNN's GEMM.
// Measured on a 2-core Xeon (Sapphire Rapids class, AMX): at M = 1 the kernels are
// compute-bound, ~5-6 cycles per 64 int4 weights in L1, and overlap poorly with the
// memory stream; vdpbf16ps runs at half an instruction per cycle there, so from M ~ 4 the
// tiles cost about what gemv_bf16's do. The L2 prefetch is worth ~1.5x at M = 1; its
// distance (1-16 blocks), its level (L1, L2) or twice as many made no measurable difference.
// Rows are multiplied a "unit" (64 or 128 k) at a time; x is laid out once per call in
// the order a unit's decoded weights come out (zeros past K).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "quant_operands.h"
#include "quant_rows.h"

namespace {

using namespace quant_rows;
using namespace quant_operands;

struct Problem {
  const uint8_t* w;  // weight rows, ldw bytes apart
  int64_t ldw;
  const void* x;  // prepared activations [M, ldx], ldx = units * unit k: the decoder's X
                  // (float32 for int8 up to 4 rows), bf16 for the scratch
  int64_t ldx, M, N, units;
  int tail_bytes;      // bytes of a row in its last unit when that one is partial, else 0
  const float* scale;  // [N] or int4's [N, num_groups]
  float scale_mul;     // y = dot * scale[n] * scale_mul per channel, dot * scale_mul by
                       // groups (fp8's 2^-8; 1 for int4)
  // by groups of G k: int4, and block-scaled fp8 (G a multiple of its 64-k unit)
  const float* zero;  // int4's [N, num_groups]; nullptr: symmetric (8), or fp8
  int64_t num_groups;
  int64_t units_per_group;      // G / unit k where the unit divides G, else 0: lane_groups applies
  const int32_t* lane_groups;   // [units, 17]: per float lane its group - g0, then g0 (int4)
  const float* xsum;            // int4's [M, num_groups]: sum of x over each group; fp8 none
  const bf16* bias;
  bf16* y;
};

template <class D>
constexpr bool kInScratch = std::is_same_v<D, ScratchRows<D::kVectors>>;

template <class D>
inline const typename D::X* x_rows(const Problem& p, const void* x, int m, int64_t u) {
  return static_cast<const typename D::X*>(x) + m * p.ldx + u * D::kUnitK;
}

// acc[m][r] += units [u0, u1) of weight rows r times the same units of rows m of x
// (Tail: the row's partial last unit), prefetching the same part of `wnext` alongside.
// Plain loops in always-inlined functions: GCC kept a lambda's accumulators in memory.
template <class D, bool Tail, int MR, int R, int A>
__attribute__((always_inline)) inline void madd_units(const Problem& p, const uint8_t* w, int64_t ldw,
                                                      const void* x, const uint8_t* wnext, int64_t u0,
                                                      int64_t u1, __m512 (&acc)[MR][R][A]) {
  for (int64_t u = u0; u < u1; ++u)
    for (int r = 0; r < R; ++r) {
      const int64_t offset = r * ldw + u * D::kBytes;
      // rows from memory always prefetch (no branch in the loop: with one, GCC kept the
      // accumulators on the stack); rows in scratch never do
      if constexpr (!kInScratch<D>) _mm_prefetch(reinterpret_cast<const char*>(wnext + offset), _MM_HINT_T1);
      for (int m = 0; m < MR; ++m)
        D::template madd<Tail>(w + offset, p.tail_bytes, x_rows<D>(p, x, m, u),
                               acc[m][r][0], acc[m][r][A - 1]);
    }
}

template <class D, int MR, int R, int A>
__attribute__((always_inline)) inline void madd_span(const Problem& p, const uint8_t* w, int64_t ldw,
                                                     const void* x, const uint8_t* wnext, int64_t u0,
                                                     int64_t u1, __m512 (&acc)[MR][R][A]) {
  if (p.tail_bytes && u1 == p.units) {
    madd_units<D, false>(p, w, ldw, x, wnext, u0, u1 - 1, acc);
    madd_units<D, true>(p, w, ldw, x, wnext, u1 - 1, u1, acc);
  } else {
    madd_units<D, false>(p, w, ldw, x, wnext, u0, u1, acc);
  }
}

// out[m * R + r] = <x[m], decoded w[r]> for per-channel schemes. A single row of x keeps
// two accumulators per weight row, to have more sums in flight.
template <class D, int MR, int R>
inline void dot_tile(const Problem& p, const uint8_t* w, int64_t ldw, const void* x,
                     const uint8_t* wnext, int64_t, int64_t, float* out) {
  constexpr int A = MR == 1 ? 2 : 1;
  __m512 acc[MR][R][A];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[m][r][a] = _mm512_setzero_ps();
  madd_span<D>(p, w, ldw, x, wnext, 0, p.units, acc);
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) {
      const __m512 sum = A == 1 ? acc[m][r][0] : _mm512_add_ps(acc[m][r][0], acc[m][r][A - 1]);
      out[m * R + r] = _mm512_reduce_add_ps(sum);
    }
}

// Each accumulator lane's int4 scale for unit u of a row: vdpbf16ps adds bf16 lanes 2i,
// 2i + 1 into float lane i, so lanes 4c .. 4c + 3 hold the unit's 32-k chunk c.
inline __m512 lane_scales(const Problem& p, const float* row_scale, int64_t u) {
  const int32_t* t = p.lane_groups + u * 17;
  const int64_t g0 = t[16], left = p.num_groups - g0;
  const __mmask16 live = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
  return _mm512_permutexvar_ps(_mm512_loadu_si512(t), _mm512_maskz_loadu_ps(live, row_scale + g0));
}

// sum_g scale[g] (128 + zero[g]) xsum[g]: the offsets of the 128 + n encoding, one row pair.
inline float int4_offset(const float* scale, const float* zero, const float* xsum, int64_t groups) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 live = groups - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
    const __m512 z = zero ? _mm512_maskz_loadu_ps(live, zero + g) : _mm512_set1_ps(8.f);
    const __m512 sz = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, scale + g), _mm512_add_ps(z, _mm512_set1_ps(128.f)));
    acc = _mm512_fmadd_ps(sz, _mm512_maskz_loadu_ps(live, xsum + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// acc[m][r] += scale[r, g] * (rows r's partial sums over units [u0, u1) of group g): one
// group, or its part when the group is split around the row's partial last unit.
template <class D, int MR, int R, bool WholeUnits, bool Tail>
__attribute__((always_inline)) inline void scaled_group(const Problem& p, const uint8_t* w, int64_t ldw,
                                                        const void* x, const uint8_t* wnext, const float* scale,
                                                        int64_t g, int64_t u0, int64_t u1, __m512 (&acc)[MR][R]) {
  // one partial sum per row pair (two, as dot_tile keeps at M = 1, measured slower here)
  __m512 part[MR][R][1];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) part[m][r][0] = _mm512_setzero_ps();
  madd_units<D, Tail>(p, w, ldw, x, wnext, u0, u1, part);
  for (int r = 0; r < R; ++r) {
    const __m512 sv = WholeUnits ? _mm512_set1_ps(scale[r * p.num_groups + g])
                                 : lane_scales(p, scale + r * p.num_groups, u0);
    for (int m = 0; m < MR; ++m) acc[m][r] = _mm512_fmadd_ps(sv, part[m][r][0], acc[m][r]);
  }
}

// acc[m][r] = sum over groups of scale[r, g] * (the group's partial sums). WholeUnits:
// groups of a multiple of 128 k span whole units and take one broadcast scale; else groups
// (32, 64, 96, ...) are scaled unit by unit and lane by lane (lane_scales). The row's
// partial last unit (Tail) is taken after the loop, and each scaling has a loop of its
// own: with the tail or both scalings inside one loop GCC kept the partial sums and the
// accumulators on the stack, storing 16 vectors a unit (~1.4x slower at 128-k groups).
template <class D, int MR, int R, bool WholeUnits>
__attribute__((always_inline)) inline void scaled_groups(const Problem& p, const uint8_t* w, int64_t ldw,
                                                         const void* x, const uint8_t* wnext, int64_t n0,
                                                         __m512 (&acc)[MR][R]) {
  const int64_t step = WholeUnits ? p.units_per_group : 1;
  const int64_t whole = p.tail_bytes ? p.units - 1 : p.units;  // units without the tail
  const float* scale = p.scale + n0 * p.num_groups;
  int64_t u0 = 0, g = 0;
  for (; u0 + step <= whole; u0 += step, ++g)
    scaled_group<D, MR, R, WholeUnits, false>(p, w, ldw, x, wnext, scale, g, u0, u0 + step, acc);
  if (u0 < whole) scaled_group<D, MR, R, WholeUnits, false>(p, w, ldw, x, wnext, scale, g, u0, whole, acc);
  if (p.tail_bytes) {  // the last group's last unit (a group of its own where step is 1)
    const int64_t gt = WholeUnits ? (p.units - 1) / step : p.units - 1;
    scaled_group<D, MR, R, WholeUnits, true>(p, w, ldw, x, wnext, scale, gt, p.units - 1, p.units, acc);
  }
}

// As dot_tile, by groups: each group's partial sums, scaled, go into the total, less
// int4's offsets of its 128 + n encoding (xsum; block-scaled fp8 has none).
template <class D, int MR, int R>
inline void group_tile(const Problem& p, const uint8_t* w, int64_t ldw, const void* x,
                       const uint8_t* wnext, int64_t n0, int64_t m0, float* out) {
  __m512 acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  if (p.units_per_group)
    scaled_groups<D, MR, R, true>(p, w, ldw, x, wnext, n0, acc);
  else
    scaled_groups<D, MR, R, false>(p, w, ldw, x, wnext, n0, acc);
  const int64_t groups = p.num_groups;
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      const float* zero = p.zero ? p.zero + n * groups : nullptr;
      const float offset = p.xsum ? int4_offset(p.scale + n * groups, zero, p.xsum + (m0 + m) * groups, groups) : 0.f;
      out[m * R + r] = _mm512_reduce_add_ps(acc[m][r]) - offset;
    }
}

template <class D, bool Grouped, int MR, int R>
inline void any_tile(const Problem& p, const uint8_t* w, int64_t ldw, const void* x,
                     const uint8_t* wnext, int64_t n0, int64_t m0, float* out) {
  if constexpr (Grouped)
    group_tile<D, MR, R>(p, w, ldw, x, wnext, n0, m0, out);
  else
    dot_tile<D, MR, R>(p, w, ldw, x, wnext, n0, m0, out);
}

// A tile of `rows` (<= MR) rows of x: the row count becomes a template argument.
template <class D, bool Grouped, int MR, int R>
inline void tile_rows(int rows, const Problem& p, const uint8_t* w, int64_t ldw, const void* x,
                      int64_t n0, int64_t m0, float* out) {
  switch (rows) {
#define MINIVLLM_QTILE(n)                                                                \
  case n:                                                                                \
    if constexpr (n <= MR) any_tile<D, Grouped, n, R>(p, w, ldw, x, nullptr, n0, m0, out); \
    break;
    MINIVLLM_QTILE(1)
    MINIVLLM_QTILE(2)
    MINIVLLM_QTILE(3)
    MINIVLLM_QTILE(4)
#undef MINIVLLM_QTILE
    default: break;
  }
}

// y[m0 + m, n0 + r] = out[m * R + r] (times the row's scale) + bias, rounded to bf16.
inline void store(const Problem& p, bool grouped, const float* out, int R, int rows, int64_t n0,
                  int64_t m0, int mr) {
  for (int m = 0; m < mr; ++m)
    for (int r = 0; r < rows; ++r) {
      const int64_t n = n0 + r;
      float v = out[m * R + r];
      v *= grouped ? p.scale_mul : p.scale[n] * p.scale_mul;
      if (p.bias) v += static_cast<float>(p.bias[n]);
      p.y[(m0 + m) * p.N + n] = bf16(v);
    }
}

// Up to four rows of x (MR = M): blocks of R weight rows decoded in registers as they
// stream in, each used for every row of x at once; PREFETCH_AHEAD blocks ahead go to L2.
template <class D, bool Grouped, int MR, int R, int PREFETCH_AHEAD>
void stream_blocks(const Problem& p) {
  const int64_t num_blocks = (p.N + R - 1) / R;
  at::parallel_for(0, num_blocks, 4, [&](int64_t begin, int64_t end) {
    float out[MR * R];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R, rows = std::min<int64_t>(R, p.N - n0);
      const uint8_t* w = p.w + n0 * p.ldw;
      if (rows == R) {
        const int64_t ahead = std::min(n0 + PREFETCH_AHEAD * R, p.N - R);
        any_tile<D, Grouped, MR, R>(p, w, p.ldw, p.x, p.w + ahead * p.ldw, n0, 0, out);
      } else {
        for (int r = 0; r < rows; ++r) {
          float one[MR];
          const uint8_t* row = w + r * p.ldw;  // its own row as the prefetch target
          any_tile<D, Grouped, MR, 1>(p, row, p.ldw, p.x, row, n0 + r, 0, one);
          for (int m = 0; m < MR; ++m) out[m * R + r] = one[m];
        }
      }
      store(p, Grouped, out, R, static_cast<int>(rows), n0, 0, MR);
    }
  });
}

// Decodes `rows` weight rows from n0 into scratch, prefetching the rows `ahead` further on.
template <class D>
void decode_block(const Problem& p, int64_t n0, int64_t rows, int64_t ahead, __m512bh* scratch) {
  const int64_t per_row = p.units * D::kVectors;
  const uint8_t* next = p.w + std::min(n0 + ahead, p.N - rows) * p.ldw;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t u = 0; u < p.units; ++u) {
      const int64_t offset = r * p.ldw + u * D::kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(next + offset), _MM_HINT_T1);
      __m512bh* v = scratch + r * per_row + u * D::kVectors;
      if (p.tail_bytes && u + 1 == p.units)
        D::template decode<true>(p.w + n0 * p.ldw + offset, p.tail_bytes, v);
      else
        D::template decode<false>(p.w + n0 * p.ldw + offset, p.tail_bytes, v);
    }
}

// Rows n0 .. n0 + rows of the weight, decoded into the scratch `s` (ld_scratch bytes a
// row), times every row of x in tiles of MR rows, stored: times p.scale[n] where
// `row_scales` (per-channel schemes), else times p.scale_mul alone.
template <class S, bool Grouped, int MR, int R>
inline void multiply_scratch(const Problem& p, const uint8_t* s, int64_t ld_scratch, int64_t n0, int64_t rows,
                             bool row_scales) {
  float out[MR * R];
  for (int64_t m0 = 0; m0 < p.M; m0 += MR) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, p.M - m0));
    const void* x = static_cast<const bf16*>(p.x) + m0 * p.ldx;
    if (rows == R) {
      tile_rows<S, Grouped, MR, R>(mr, p, s, ld_scratch, x, n0, m0, out);
    } else {
      for (int r = 0; r < rows; ++r) {
        float one[MR];
        tile_rows<S, Grouped, MR, 1>(mr, p, s + r * ld_scratch, ld_scratch, x, n0 + r, m0, one);
        for (int m = 0; m < mr; ++m) out[m * R + r] = one[m];
      }
    }
    store(p, !row_scales, out, R, static_cast<int>(rows), n0, m0, mr);
  }
}

// Several rows of x: each block of R weight rows is decoded once, then multiplied with x
// in tiles of MR rows read from the scratch.
template <class D, bool Grouped, int MR, int R>
void decoded_blocks(const Problem& p) {
  using S = ScratchRows<D::kVectors>;
  const int64_t num_blocks = (p.N + R - 1) / R;
  const int64_t ld_scratch = p.units * S::kBytes;  // bytes per decoded row
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> scratch(R * p.units * D::kVectors);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R, rows = std::min<int64_t>(R, p.N - n0);
      decode_block<D>(p, n0, rows, 2 * R, scratch.data());
      multiply_scratch<S, Grouped, MR, R>(p, reinterpret_cast<const uint8_t*>(scratch.data()), ld_scratch, n0,
                                          rows, !Grouped);
    }
  });
}

// Register tiles: MR x R accumulators (twice that for int4's groups) within the 32 zmm.
template <class D, bool Grouped>
void run(const Problem& p) {
  constexpr int R = Grouped ? 2 : 4;
  switch (p.M) {
    case 1: return stream_blocks<D, Grouped, 1, 8, 4>(p);
    case 2: return stream_blocks<D, Grouped, 2, 2 * R, 4>(p);
    case 3: return stream_blocks<D, Grouped, 3, R, 4>(p);
    case 4: return stream_blocks<D, Grouped, 4, R, 4>(p);
    default: return decoded_blocks<D, Grouped, 4, Grouped ? 3 : 6>(p);
  }
}

// x [M, K] -> [M, units * unit_k], zeros past K, as float32 or bf16. int4's units (128 k)
// put each 32-k chunk's k in 8-k pieces across the four decoded vectors: piece i of
// chunk c goes to vector i, 128-bit lane c (see Int4Rows).
torch::Tensor prepare_x(const torch::Tensor& x, int64_t ldx, bool int4_order, bool as_float) {
  const int64_t M = x.size(0), K = x.size(1);
  auto xp = torch::zeros({M, ldx}, x.options().dtype(as_float ? at::kFloat : at::kBFloat16));
  const bf16* src = x.data_ptr<bf16>();
  for (int64_t m = 0; m < M; ++m) {
    const bf16* row = src + m * K;
    if (as_float) {
      float* dst = xp.data_ptr<float>() + m * ldx;
      for (int64_t k = 0; k < K; k += 16) _mm512_storeu_ps(dst + k, load_bf16x16(row + k));
    } else if (!int4_order) {
      std::memcpy(xp.data_ptr<bf16>() + m * ldx, row, K * sizeof(bf16));
    } else {
      bf16* dst = xp.data_ptr<bf16>() + m * ldx;
      for (int64_t k = 0; k < K; k += 8) {
        const int64_t unit = k / 128, chunk = k % 128 / 32, piece = k % 32 / 8;
        std::memcpy(dst + unit * 128 + piece * 32 + chunk * 8, row + k, 8 * sizeof(bf16));
      }
    }
  }
  return xp;
}

torch::Tensor group_sums(const torch::Tensor& x, int64_t group_size) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / group_size;
  auto sums = torch::empty({M, groups}, x.options().dtype(at::kFloat));
  const bf16* src = x.data_ptr<bf16>();
  float* out = sums.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 16)
        acc = _mm512_add_ps(acc, load_bf16x16(src + m * K + k));
      out[m * groups + g] = _mm512_reduce_add_ps(acc);
    }
  return sums;
}

// For groups that are not a multiple of 128 k: per unit, each float lane's group (its
// chunk's, lanes 4c .. 4c + 3 for chunk c) less the unit's first group g0, then g0.
std::vector<int32_t> int4_lane_groups(int64_t units, int64_t group_size) {
  std::vector<int32_t> table(units * 17);
  for (int64_t u = 0; u < units; ++u) {
    const int64_t g0 = u * 128 / group_size;
    for (int lane = 0; lane < 16; ++lane)
      table[u * 17 + lane] = static_cast<int32_t>((u * 128 + lane / 4 * 32) / group_size - g0);
    table[u * 17 + 16] = static_cast<int32_t>(g0);
  }
  return table;
}

// dequantized_linear's tiles: MR rows of x by R weight rows (gemv_bf16's 4 x 6); the
// rows it prefetches ahead of the one it dequantizes (two blocks)
constexpr int kDqRows = 4, kDqBlock = 6, kDqAhead = 2 * kDqBlock;

}  // namespace

// x @ dequantize_bf16(weight)^T + bias without the dequantized copy: each thread
// dequantizes a block of kDqBlock weight rows into a bf16 scratch (L1) and multiplies it
// with every row of x in gemv_bf16's tiles, so the weight streams from memory once, at
// its quantized size, and is never written out. Past quant_linear's rows (whose grouped
// tiles scale each group's sums in registers, slower from ~8 rows) and up to the rows
// where oneDNN's GEMM on the dequantized copy wins (kernel_limits.MAX_DEQUANTIZED_ROWS). The
// numbers are that path's but for the order of the float32 sums.
torch::Tensor dequantized_linear(torch::Tensor x, int64_t kind, torch::Tensor weight, torch::Tensor scale,
                                 c10::optional<torch::Tensor> zero, int64_t group_size,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "dequantized_linear: x must be bf16 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const Dequant d = check_dequant("dequantized_linear", kind, weight, scale, zero, group_size, N, K);
  const bf16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_tensor(*bias, "bias", at::kBFloat16, {N}, "dequantized_linear");
    b = bias->data_ptr<bf16>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  using S = ScratchRows<1>;  // a dequantized row: units of 32 k, no tail (K % 32 == 0)
  Problem p{nullptr, 0, x.data_ptr(), K, M, N, K / S::kUnitK, 0, nullptr, 1.f,
            nullptr, 0, 0, nullptr, nullptr, b, y.data_ptr<bf16>()};
  const int64_t num_blocks = (N + kDqBlock - 1) / kDqBlock, ld_scratch = K * sizeof(bf16);
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> scratch(kDqBlock * K);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kDqBlock, rows = std::min<int64_t>(kDqBlock, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        if (n0 + r + kDqAhead < N) prefetch_row(d, n0 + r + kDqAhead);
        dequantize_row(d, n0 + r, scratch.data() + r * K);
      }
      // no per-row scale (the scratch holds the scaled weights): y = the sum + bias
      multiply_scratch<S, false, kDqRows, kDqBlock>(p, reinterpret_cast<const uint8_t*>(scratch.data()),
                                                    ld_scratch, n0, rows, false);
    }
  });
  return y;
}

torch::Tensor quant_linear(torch::Tensor x, int64_t kind, torch::Tensor weight, torch::Tensor scale,
                           c10::optional<torch::Tensor> zero, c10::optional<torch::Tensor> wsum,
                           int64_t group_size, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(kind >= 1 && kind <= 4, "quant_linear: kind must be 1 (int8_w8a16), 2 (int4_w4a16), "
              "3 (fp8_w8a16) or 4 (int8_w8a8), got ", kind);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "quant_linear: x must be bf16 [M, K]");
  TORCH_CHECK(weight.dim() == 2, "quant_linear: weight must be 2-D");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K > 0 && K % 32 == 0, "quant_linear: K must be a positive multiple of 32, got ", K);
  const bool int4 = kind == 2, fp8_groups = kind == 3 && group_size > 0;
  check_tensor(weight, "weight", kind == 1 || kind == 4 ? at::kChar : at::kByte, {N, int4 ? K / 2 : K});
  const bool has_zero = zero.has_value() && zero->defined();
  if (fp8_groups) {
    TORCH_CHECK(group_size % Fp8Rows::kUnitK == 0 && K % group_size == 0,
                "quant_linear: block-scaled fp8 group_size must be a multiple of 64 dividing K=", K, ", got ",
                group_size);
    TORCH_CHECK(!has_zero, "quant_linear: only int4 (kind 2) takes zero points");
    check_tensor(scale, "scale", at::kFloat, {N, K / group_size});
  } else if (int4) {
    TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0,
                "quant_linear: int4 group_size must be a multiple of 32 dividing K=", K, ", got ", group_size);
    check_tensor(scale, "scale", at::kFloat, {N, K / group_size});
    if (has_zero) check_tensor(*zero, "zero", at::kFloat, {N, K / group_size});
  } else {
    TORCH_CHECK(!has_zero, "quant_linear: only int4 (kind 2) takes zero points");
    check_tensor(scale, "scale", at::kFloat, {N});
  }
  const bf16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_tensor(*bias, "bias", at::kBFloat16, {N});
    b = bias->data_ptr<bf16>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (kind == 4) {
    TORCH_CHECK(wsum.has_value() && wsum->defined(), "quant_linear: int8_w8a8 needs wsum");
    check_tensor(*wsum, "wsum", at::kInt, {N});
    w8a8_linear(x, weight, scale, *wsum, b, y);
    return y;
  }
  const int64_t unit_k = int4 ? Int4Rows::kUnitK : Int8Rows::kUnitK, units = (K + unit_k - 1) / unit_k;
  torch::Tensor xp = prepare_x(x, units * unit_k, int4, kind == 1 && M <= 4), xsum;
  Problem p{static_cast<const uint8_t*>(weight.data_ptr()), weight.size(1), xp.data_ptr(), units * unit_k,
            M, N, units, static_cast<int>(K % unit_k * weight.size(1) / K), scale.data_ptr<float>(), 1.f,
            nullptr, 0, 0, nullptr, nullptr, b, y.data_ptr<bf16>()};
  if (kind == 1) {
    run<Int8Rows, false>(p);
  } else if (kind == 3) {
    p.scale_mul = 1.f / 256.f;  // the decoded numbers are e4m3 * 2^8
    if (fp8_groups) {
      p.num_groups = K / group_size;
      p.units_per_group = group_size / Fp8Rows::kUnitK;
      run<Fp8Rows, true>(p);
    } else {
      run<Fp8Rows, false>(p);
    }
  } else {
    xsum = group_sums(x, group_size);
    std::vector<int32_t> lane_groups;
    p.zero = has_zero ? zero->data_ptr<float>() : nullptr;
    p.num_groups = K / group_size;
    p.xsum = xsum.data_ptr<float>();
    if (group_size % Int4Rows::kUnitK == 0) {
      p.units_per_group = group_size / Int4Rows::kUnitK;
    } else {
      lane_groups = int4_lane_groups(units, group_size);
      p.lane_groups = lane_groups.data();
    }
    run<Int4Rows, true>(p);
  }
  return y;
}
