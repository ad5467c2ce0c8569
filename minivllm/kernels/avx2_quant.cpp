// Quantized weights in fp32 engines on AVX2 + FMA CPUs (AMD Zen 2/3, older Intel): int8,
// int4 and fp8 rows (minivllm/quantization/formats.py's layouts, as stored and as the weight
// cache holds them), multiplied into fp32 activations.
//
// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) with w the scheme's dequantized weight:
// int8 q * s[n], fp8 e4m3(q) * s[n], int4 (q - z[n, g]) * s[n, g] in groups of G k.
//
// Up to 8 rows (decode, small batches) the product is a register form, R weight rows at
// a time, each weight byte read once per call from memory (once per pair of rows from L1):
//   int8, int4  the integer form: each row of x is rounded to int16 in blocks (int8: 128 k,
//         int4: its group) with a power-of-two scale per block, and the weights, widened
//         to int16, meet it in vpmaddwd (16 products, summed in pairs into 8 exact int32
//         lanes, per instruction); each block's int32 sums are scaled once at its end.
//   fp8   the fp32 form: a 16-k unit turned into two fp32 vectors, FMAs into two
//         accumulators per (x row, weight row) that alternate (two chains of latency).
//   int4_w4a8  int4's rows against x rounded to int8 per group as the scheme says
//         (formats.quantize_per_group): vpmaddubsw, 32 products per instruction, summed
//         in int16 for up to 256 k (int8x_tile).
// Past 8 rows (larger batches, prefill) the bf16 panels' GEMM micro-kernel (avx2_gemm.h)
// runs on fp32 panels dequantized from the rows block by block, each weight decoded once
// per call.
//
// Why int16 activations (2026-12-03, AMD EPYC Zen 1, one core, weights in L1): widening
// int8 to fp32 (vpmovsxbd, vcvtdq2ps) and an FMA per 8 weights ran at 6.5 G weights/s,
// int8 -> int16 and vpmaddwd per 16 at 13.7, int4 likewise at 11.3 (the fp32 form's int4:
// ~4); from memory on two cores the fp32 form's int8 streamed at 11 GB/s where the bf16
// panels reach 21, so the weights' bytes were not what a step waited on. The cost is the
// rounding of x: with block scale s (amax / 32767 <= s < 2 amax / 32767) each x_k moves
// by at most s / 2, a relative 2^-16..2^-15 of the block's largest value, where a bf16
// engine's activations move by 2^-9 of each value. Integer-valued x (int8_w8a8's
// quantized activations, |x| <= 127: s = 2^-8) is held exactly.
//
// Decoding, per scheme (every decoded value is exact; the fp32 forms differ from
// formats.reference_linear only in their sums' order, the integer form by x's rounding):
//   int8  vpmovsxbw, 16 k per vector (integer form); vpmovsxbd + vcvtdq2ps, 8 k (panels).
//   fp8   e4m3 bytes moved into fp16 bit patterns (the value times 2^-8, subnormals
//         included) and widened by F16C's vcvtph2ps (avx2_math.h's fp8x8_fp16), the 2^8
//         folded into the row's scale (Fp8Unit::kScale); exact whatever MXCSR's DAZ/FTZ say. The scalar tail (fp8_scalar) moves
//         the bits into fp32 instead, which needs subnormal inputs kept: each thread
//         clears DAZ/FTZ for the call.
//   int4  a 16-byte chunk holds k 0-15 in its low nibbles and 16-31 in its high ones
//         (formats.pack_int4): & 0xF and (>> 4) & 0xF, each widened to int16, are those
//         32 k in order (the panel form widens 8 of them to fp32). The products use q, not q - z: per group, z * sum_k x is
//         subtracted at the end.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx2_gemm.h"
#include "avx2_math.h"
#include "avx2_quant_rows.h"

namespace {

using namespace avx2_quant;

constexpr int64_t KIND_INT8 = 1, KIND_INT4 = 2, KIND_FP8 = 3, KIND_INT4_A8 = 5;  // formats.KERNEL_KIND

inline __m256 int8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float fp8_scalar(uint8_t b) {
  const int32_t d = static_cast<int8_t>(b);
  const uint32_t bits = ((static_cast<uint32_t>(d) << 20) & 0x07F00000u) | (static_cast<uint32_t>(d) & 0x80000000u);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * 0x1p120f;
}

// A scheme's decoding. `raw8` decodes 8 consecutive k of a row (k a multiple of 8) in
// natural order to fp32, before scale and zero point (the panel form). The integer
// register form's units: `int16` widens the kK k at byte p of a row to kVec int16
// vectors, in x's order (kK = 32: k in order; 64: Int4Pair's), and `scalar` decodes one k
// (a per-channel row's last K % 32). Fp8's fp32 register
// form: kK k in kBytes bytes decoded into kVec vectors, `scalar` for its last K % 16.
// kScale: what `decode` and `raw8` leave out of each value, for the caller's scale to
// carry (fp8: 2^8, exact; see avx2_math.h's fp8x8_fp16).
struct Int8Unit {
  static constexpr int64_t kK = 32, kBytes = 32;
  static constexpr int kVec = 2;
  static constexpr float kScale = 1.f;
  static inline void int16(const uint8_t* p, __m256i w[2]) {
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  static inline float scalar(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b)); }
  static inline __m256 raw8(const uint8_t* row, int64_t k) { return int8x8(row + k); }
};
struct Fp8Unit {
  static constexpr int64_t kK = 16, kBytes = 16;
  static constexpr int kVec = 2;
  static constexpr float kScale = 256.f;
  static inline void decode(const uint8_t* p, __m256* w) { w[0] = fp8x8_fp16(p), w[1] = fp8x8_fp16(p + 8); }
  static inline float scalar(uint8_t b) { return fp8_scalar(b); }  // the value itself
  static inline __m256 raw8(const uint8_t* row, int64_t k) { return fp8x8_fp16(row + k); }
};
struct Int4Unit {
  static constexpr int64_t kK = 32, kBytes = 16;
  static constexpr int kVec = 2;
  static constexpr float kScale = 1.f;
  static inline void int16(const uint8_t* p, __m256i w[2]) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), nibble = _mm_set1_epi8(0x0F);
    w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(b, nibble));
    w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), nibble));
  }
  static inline float scalar(uint8_t) { return 0.f; }  // int4 rows have no tail (K % 32 == 0)
  // k's chunk holds k 0-15 in the low nibbles of its 16 bytes and 16-31 in the high ones
  static inline __m256 raw8(const uint8_t* row, int64_t k) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 32 * 16 + k % 16));
    if (k % 32 >= 16) b = _mm_srli_epi16(b, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F))));
  }
};
// int4 two chunks (64 k) at a time, for groups of a multiple of 64: one 32-byte load, and
// each 128-bit half's low and high nibbles widened in place (vpunpck*bw against zero), so
// vector j holds k 8j..8j+7 of the first chunk in its lower half and of the second in its
// upper half, as x is laid out for it (XInt16's `pair` order). Measured in isolation on a
// Zen 1 core: 14.3 G weights/s against 11.3 one chunk at a time.
struct Int4Pair {
  static constexpr int64_t kK = 64, kBytes = 32;
  static constexpr int kVec = 4;
  static inline void int16(const uint8_t* p, __m256i w[4]) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), nibble = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(b, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
    const __m256i zero = _mm256_setzero_si256();
    w[0] = _mm256_unpacklo_epi8(lo, zero), w[1] = _mm256_unpackhi_epi8(lo, zero);
    w[2] = _mm256_unpacklo_epi8(hi, zero), w[3] = _mm256_unpackhi_epi8(hi, zero);
  }
  static inline float scalar(uint8_t) { return 0.f; }
};
// int4 64 k at a time read as 16-bit words, for groups of a multiple of 64 up to
// WORDS_MAX_GROUP: word i of a 32-byte load holds four nibbles, bits 0-3 and 12-15 taken
// as they are (& 0xF, >> 12) and bits 4-7 and 8-11 as 16 times their value (& 0xF0,
// (>> 4) & 0xF0): five operations for the four vectors where Int4Pair spends seven, and
// no byte shuffles (on Zen 1 one 0.6B layer at one row: 0.88 ms against Int4Pair's 0.94,
// 2026-12-03). kSixteens: the
// middle two vectors' sums go to a second accumulator; 16 times the first plus the second,
// scaled by 1/16 (exact), is the sum.
// x is laid out for it in XInt16's `words` order.
struct Int4Words {
  static constexpr int64_t kK = 64, kBytes = 32;
  static constexpr int kVec = 4;
  static constexpr bool kSixteens = true;
  static inline void int16(const uint8_t* p, __m256i w[4]) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i low = _mm256_set1_epi16(0x000F), mid = _mm256_set1_epi16(0x00F0);
    w[0] = _mm256_and_si256(b, low), w[1] = _mm256_and_si256(b, mid);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(b, 4), mid), w[3] = _mm256_srli_epi16(b, 12);
  }
  static inline float scalar(uint8_t) { return 0.f; }
};
// Units without the second accumulator.
template <class U, class = void>
struct Sixteens : std::false_type {};
template <class U>
struct Sixteens<U, std::void_t<decltype(U::kSixteens)>> : std::bool_constant<U::kSixteens> {};


// The integer register form: y[m, n] for rows m0..m0+MR and weight rows n0..n0+R (all in
// range). Per block, one int32 accumulator per (x row, weight row) (integer adds have no
// latency chain to split; Int4Words keeps a second for its sixteen-times vectors); at the
// block's end its 8 lanes are converted and scaled into a running fp32 vector (int8: by
// x's block scale, the per-channel scale once at the end; int4: by x's and the group's),
// and a per-channel row's last K % 32 k added in fp32 on x as it is. int4 multiplies q,
// not q - z: at the tile's end it subtracts sum_g z ws (x's block scale * sum_k q_x),
// eight groups a vector (per group in scalar at each block's end it cost ~5% of the
// op's time on Zen 1). The int32 sums, |q_x| <= 32767: int8 adds 128 / 8 = 16
// products of at most 127 * 32767 per lane and block; int4 G / 8 of at most 15 * 32767
// (Int4Words: 16 times the first accumulator plus the second, which holds products of
// at most 240 * 32767, is converted at once: at WORDS_MAX_GROUP 16 * 0.063e9 + 1.006e9 =
// 2.01e9 < 2^31). (Subtracting the zero-point term in the int32 lanes
// instead, exact there for these groups, measured 5-15% slower on Zen 1.)
template <class U, int MR, int R>
inline void int16_tile(const Operands& o, const XInt16& xq, int64_t m0, int64_t n0, float* y) {
  constexpr bool sixteens = Sixteens<U>::value;
  constexpr bool int4 = !std::is_same_v<U, Int8Unit>;
  __m256 total[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps();
  float tail[MR][R] = {};
  const int64_t next = (n0 + R) * o.row_bytes, end = o.N * o.row_bytes;
  const uint8_t* rows = o.q + n0 * o.row_bytes;
  const int16_t* xrows = xq.q.data() + m0 * xq.kv;
  for (int64_t b = 0; b < xq.blocks; ++b) {
    __m256i acc[MR][R], acc16[MR][R];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = acc16[m][r] = _mm256_setzero_si256();
    const int64_t k0 = b * xq.block, k1 = std::min(k0 + xq.block, xq.kv);
    for (int64_t k = k0; k < k1; k += U::kK) {
      const int64_t at = k / U::kK * U::kBytes;  // the unit's byte offset in a row
      for (int64_t line = 0; line < U::kBytes * R; line += 64) prefetch_ahead(o, next + at * R + line, end);
      for (int r = 0; r < R; ++r) {
        __m256i w[U::kVec];
        U::int16(rows + r * o.row_bytes + at, w);
        for (int m = 0; m < MR; ++m) {
          const __m256i* xk = reinterpret_cast<const __m256i*>(xrows + m * xq.kv + k);
          if constexpr (sixteens) {
            acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(xk)),
                                                                     _mm256_madd_epi16(w[3], _mm256_loadu_si256(xk + 3))));
            acc16[m][r] = _mm256_add_epi32(acc16[m][r], _mm256_add_epi32(_mm256_madd_epi16(w[1], _mm256_loadu_si256(xk + 1)),
                                                                         _mm256_madd_epi16(w[2], _mm256_loadu_si256(xk + 2))));
          } else {
            for (int v = 0; v < U::kVec; v += 2)
              acc[m][r] = _mm256_add_epi32(
                  acc[m][r], _mm256_add_epi32(_mm256_madd_epi16(w[v], _mm256_loadu_si256(xk + v)),
                                              _mm256_madd_epi16(w[v + 1], _mm256_loadu_si256(xk + v + 1))));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (!int4) {
        for (int m = 0; m < MR; ++m)
          total[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][r]), _mm256_set1_ps(xq.scale[(m0 + m) * xq.blocks + b]),
                                        total[m][r]);
      } else {
        const float ws = o.scale[(n0 + r) * o.groups + b];
        for (int m = 0; m < MR; ++m) {
          const float s = xq.scale[(m0 + m) * xq.blocks + b] * ws;
          if constexpr (sixteens) {  // 16 acc + acc16 = 16 times the sum, in int32 (see above)
            const __m256i sum16 = _mm256_add_epi32(_mm256_slli_epi32(acc[m][r], 4), acc16[m][r]);
            total[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum16), _mm256_set1_ps(s * 0.0625f), total[m][r]);
          } else {
            total[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][r]), _mm256_set1_ps(s), total[m][r]);
          }
        }
      }
    }
  }
  if constexpr (int4) {  // sum_b z ws (x's scale * sum q_x), 8 groups a vector
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MR; ++m) tail[m][r] = -zero_point_term(o, n0 + r, xq.zterm.data() + (m0 + m) * xq.blocks);
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < R; ++r) {
      float t = hsum8(total[m][r]) + tail[m][r];
      if constexpr (!int4) {  // int8: the last K % 32 k, then the row's scale
        const uint8_t* row = o.q + (n0 + r) * o.row_bytes;
        for (int64_t k = xq.kv; k < o.K; ++k) t += o.x[(m0 + m) * o.K + k] * U::scalar(row[k]);
        t *= o.scale[n0 + r];
      }
      y[(m0 + m) * o.N + n0 + r] = t;
    }
  }
}

// The fp32 register form (fp8): y[m, n] for rows m0..m0+MR and weight rows n0..n0+R (all
// in range). Each group's two accumulators are scaled into a running vector (one FMA per
// group, a horizontal sum only at the end).
template <class U, int MR, int R>
inline void dot_tile(const Operands& o, int64_t m0, int64_t n0, float* y) {
  __m256 total[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps();
  float tail[MR][R] = {};  // the rows' last K % 16
  const int64_t next = (n0 + R) * o.row_bytes, end = o.N * o.row_bytes;
  for (int64_t g = 0; g < o.groups; ++g) {
    __m256 a[MR][R], b[MR][R];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r) a[m][r] = b[m][r] = _mm256_setzero_ps();
    const int64_t k0 = g * o.group_k, k1 = k0 + o.group_k, kv = k0 + (o.group_k & ~(U::kK - 1));
    for (int64_t k = k0; k < kv; k += U::kK) {
      prefetch_ahead(o, next + k * U::kBytes / U::kK * R, end);
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
      const __m256 sv = _mm256_set1_ps(s * U::kScale);  // the vectors' sums lack kScale
      for (int m = 0; m < MR; ++m) {
        total[m][r] = _mm256_fmadd_ps(_mm256_add_ps(a[m][r], b[m][r]), sv, total[m][r]);
        float t = 0.f;
        for (int64_t k = kv; k < k1; ++k) t += o.x[(m0 + m) * o.K + k] * U::scalar(row[k]);
        tail[m][r] += t * s;
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) y[(m0 + m) * o.N + n0 + r] = hsum8(total[m][r]) + tail[m][r];
}


template <class U>
void dot_product(const Operands& o, float* y) {
  register_product<2, 2>(o, [&](int64_t m, int64_t n, auto mr, auto r) { dot_tile<U, decltype(mr)::value, decltype(r)::value>(o, m, n, y); });
}

#ifndef MULTI_MR
#define MULTI_MR 4
#define MULTI_R 1
#endif

template <class U>
void int16_product(const Operands& o, float* y) {
  const XOrder order = std::is_same_v<U, Int4Pair> ? XOrder::pair : std::is_same_v<U, Int4Words> ? XOrder::words : XOrder::natural;
  const XInt16 xq(o.x, o.M, o.K, o.int4 ? o.group_k : INT8_X_BLOCK, order);
  register_product<MULTI_MR, MULTI_R>(o, [&](int64_t m, int64_t n, auto mr, auto r) { int16_tile<U, decltype(mr)::value, decltype(r)::value>(o, xq, m, n, y); });
}

// int4_w4a8's activations: x rounded to int8 per (row, group) as
// formats.quantize_per_group says: inv = 127 / amax, q = round(x inv) (fp32, to nearest
// even: vcvtps2dq in MXCSR's default mode) and scale amax / 127; a group of zeros has
// scale 1 and q = 0, one holding an inf or NaN scale NaN (so that it reaches the output).
// Returns the scale, sets inv (0 where q is all 0).
inline float int8_group_scale(const float* src, int64_t n, float* inv) {
  const uint32_t bits = magnitude_bits(src, n);
  float amax;
  std::memcpy(&amax, &bits, sizeof amax);
  if (bits >= 0x7F800000u) return *inv = 0.f, std::numeric_limits<float>::quiet_NaN();
  if (bits == 0) return *inv = 0.f, 1.f;
  // the reference's fp32 division, one rounding: the builtin keeps -ffast-math from
  // turning it into 127 times a reciprocal (two roundings), which moves x's rounding
  *inv = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(127.f), _mm_set_ss(amax)));
  return amax / 127.f;
}

// x as int8 for the register form, row m's group g at q[m K + g G] with scale[m groups + g].
// Within each 64 k the bytes are laid out as the weight unit's nibbles come: k 0-15,
// 32-47 (a 32-byte load's low nibbles), then 16-31, 48-63 (its high ones). zterm: each
// group's scale times its sum of q (the zero point's factor).
struct XInt8 {
  std::vector<int8_t> q;
  std::vector<float> scale, zterm;
  int64_t K, group, groups;

  XInt8(const float* x, int64_t M, int64_t K_, int64_t group_k) : K(K_), group(group_k), groups(K_ / group_k) {
    q.resize(M * K);
    scale.resize(M * groups);
    zterm.resize(M * groups);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = x + m * K + g * group;
        float inv_s;
        const float s = int8_group_scale(src, group, &inv_s);
        const __m256 inv = _mm256_set1_ps(inv_s);
        __m256i total = _mm256_setzero_si256();
        for (int64_t k = 0; k < group; k += 32) {
          __m256i v[4];
          for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + k + 8 * i), inv));
            total = _mm256_add_epi32(total, v[i]);
          }
          // the packs interleave 128-bit halves twice: the permute puts k 0-31 back in order
          const __m256i b8 = _mm256_permutevar8x32_epi32(
              _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])),
              _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
          // k 0-15 of these 32 go to their 64's low-nibble half, 16-31 to the high one
          const int64_t at = g * group + k, base = at / 64 * 64, half = at % 64 / 32;
          int8_t* row = q.data() + m * K;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(row + base + 16 * half), _mm256_castsi256_si128(b8));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(row + base + 32 + 16 * half), _mm256_extracti128_si256(b8, 1));
        }
        scale[m * groups + g] = s;
        zterm[m * groups + g] = s * static_cast<float>(hsum8_epi32(total));
      }
    }
  }
};

// The same rounding as fp32 values q * scale in x's natural order: what the panel form
// multiplies for int4_w4a8 past the register form's rows (and for groups of 32).
std::vector<float> int8_rounded(const float* x, int64_t M, int64_t K, int64_t group) {
  std::vector<float> out(M * K);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k0 = 0; k0 < K; k0 += group) {
      const float* src = x + m * K + k0;
      float inv_s;
      const float s = int8_group_scale(src, group, &inv_s);
      const __m256 inv = _mm256_set1_ps(inv_s), sv = _mm256_set1_ps(s);
      for (int64_t k = 0; k < group; k += 8) {
        const __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(src + k), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_ps(out.data() + m * K + k0 + k, _mm256_mul_ps(q, sv));
      }
    }
  }
  return out;
}

// int4_w4a8's register form: y[m, n] for rows m0..m0+MR and weight rows n0..n0+R. A
// 32-byte load of a row is 64 k: & 0xF and (>> 4) & 0xF are 32 unsigned bytes each, and
// vpmaddubsw multiplies them into x's signed bytes, summing pairs into 16 int16 lanes
// (|.| <= 2 * 15 * 127 = 3810). Those add in int16 for up to 256 k (8 instructions:
// 30480 < 32767) before vpmaddwd against ones widens them into the int32 accumulator,
// so a product costs half a multiply instruction of int4_w4a16's vpmaddwd per weight.
// Each group's int32 sum is scaled by x's group scale times the weight's; the zero
// point's term, sum_g z ws (xs sum_k q_x), is subtracted once at the tile's end.
constexpr int64_t SPAN_K = 256;  // k per int16 run

template <int MR, int R, bool kShort>
inline void int8x_tile(const Operands& o, const XInt8& xq, int64_t m0, int64_t n0, float* y) {
  __m256 total[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps();
  const int64_t next = (n0 + R) * o.row_bytes, end = o.N * o.row_bytes;
  const uint8_t* rows = o.q + n0 * o.row_bytes;
  const int8_t* xrows = xq.q.data() + m0 * xq.K;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < xq.groups; ++g) {
    __m256i acc[MR][R];  // the group's int32 sums (kShort: its one run's)
    for (int64_t k0 = g * xq.group; k0 < (g + 1) * xq.group; k0 += SPAN_K) {
      const int64_t k1 = std::min(k0 + SPAN_K, (g + 1) * xq.group);
      __m256i acc16[MR][R];
      for (int m = 0; m < MR; ++m)
        for (int r = 0; r < R; ++r) acc16[m][r] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k1; k += 64) {
        const int64_t at = k / 2;
        for (int64_t line = 0; line < 32 * R; line += 64) prefetch_ahead(o, next + at * R + line, end);
        for (int r = 0; r < R; ++r) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * o.row_bytes + at));
          const __m256i lo = _mm256_and_si256(b, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
          for (int m = 0; m < MR; ++m) {
            const __m256i* xk = reinterpret_cast<const __m256i*>(xrows + m * xq.K + k);
            acc16[m][r] = _mm256_add_epi16(acc16[m][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(xk)),
                                                                         _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xk + 1))));
          }
        }
      }
      const __m256i ones = _mm256_set1_epi16(1);
      for (int m = 0; m < MR; ++m) {
        for (int r = 0; r < R; ++r) {
          const __m256i wide = _mm256_madd_epi16(acc16[m][r], ones);
          acc[m][r] = kShort || k0 == g * xq.group ? wide : _mm256_add_epi32(acc[m][r], wide);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float ws = o.scale[(n0 + r) * o.groups + g];
      for (int m = 0; m < MR; ++m)
        total[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][r]), _mm256_set1_ps(xq.scale[(m0 + m) * xq.groups + g] * ws),
                                      total[m][r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m)
      y[(m0 + m) * o.N + n0 + r] = hsum8(total[m][r]) - zero_point_term(o, n0 + r, xq.zterm.data() + (m0 + m) * xq.groups);
}

void int8x_product(const Operands& o, float* y) {
  const XInt8 xq(o.x, o.M, o.K, o.group_k);
  if (o.group_k <= SPAN_K) {
    register_product<MULTI_MR, MULTI_R>(o, [&](int64_t m, int64_t n, auto mr, auto r) { int8x_tile<decltype(mr)::value, decltype(r)::value, true>(o, xq, m, n, y); });
  } else {
    register_product<MULTI_MR, MULTI_R>(o, [&](int64_t m, int64_t n, auto mr, auto r) { int8x_tile<decltype(mr)::value, decltype(r)::value, false>(o, xq, m, n, y); });
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
        s[r] = o.scale[(n0 + r) * o.groups + g] * U::kScale;
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
// uint8 e4m3 bits [N, K], scale [N], or [N, K/G] with group_size G > 0), 5 (int4_w4a8: int4's operands, x rounded to int8
// per group). bias: [N] or none. Returns [M, N] fp32.
torch::Tensor avx2_linear_quantw(torch::Tensor x, int64_t kind, torch::Tensor weight, torch::Tensor scale,
                                 c10::optional<torch::Tensor> zero, int64_t group_size,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(kind == KIND_INT8 || kind == KIND_INT4 || kind == KIND_FP8 || kind == KIND_INT4_A8,
              "kind: 1 int8, 2 int4, 3 fp8, 5 int4_w4a8");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x: float32 [M, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale: contiguous float32");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight: contiguous [N, row bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bool int4 = kind == KIND_INT4 || kind == KIND_INT4_A8;
  TORCH_CHECK(K > 0 && (!int4 || K % 32 == 0), "K must be positive (int4: a multiple of 32)");
  TORCH_CHECK(weight.scalar_type() == (kind == KIND_INT8 ? at::kChar : at::kByte), "weight: int8 (int8), uint8 (int4, fp8)");
  TORCH_CHECK(weight.size(1) == (int4 ? K / 2 : K), "weight's row size does not match K");
  // fp8 takes groups too (block-scaled checkpoints: a scale per row and G k)
  const bool fp8_groups = kind == KIND_FP8 && group_size > 0;
  const int64_t G = int4 || fp8_groups ? group_size : K;
  TORCH_CHECK(!int4 || (G > 0 && G % 32 == 0 && K % G == 0), "int4 groups: a multiple of 32 dividing K");
  TORCH_CHECK(!fp8_groups || (G % 16 == 0 && K % G == 0), "fp8 groups: a multiple of 16 dividing K");
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
             M, K, N, weight.size(1), groups, G, int4};
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if ((kind == KIND_INT8 || kind == KIND_INT4) && avx512_quantw_takes(o, int4)) {
    avx512_quantw_product(o, int4, y.data_ptr<float>());
  } else if (kind == KIND_INT4_A8 && M <= REGISTER_MAX_ROWS && G % 64 == 0) {
    int8x_product(o, y.data_ptr<float>());
  } else if ((M > REGISTER_MAX_ROWS && K % 8 == 0) || kind == KIND_INT4_A8) {  // int4: K % 32 == 0
    const int64_t ldy = (N + avx2_gemm::PANEL - 1) / avx2_gemm::PANEL * avx2_gemm::PANEL;
    auto ypad = ldy == N ? y : torch::empty({M, ldy}, x.options());
    if (kind == KIND_INT4_A8) {  // x rounded as the scheme says, then the weight-only panels
      const std::vector<float> rounded = int8_rounded(o.x, M, K, G);
      Operands r = o;
      r.x = rounded.data();
      panel_product<Int4Unit>(r, rounded.data(), ypad.data_ptr<float>(), ldy);
    } else if (int4) {
      panel_product<Int4Unit>(o, x.data_ptr<float>(), ypad.data_ptr<float>(), ldy);
    } else if (kind == KIND_FP8) {
      panel_product<Fp8Unit>(o, x.data_ptr<float>(), ypad.data_ptr<float>(), ldy);
    } else {
      panel_product<Int8Unit>(o, x.data_ptr<float>(), ypad.data_ptr<float>(), ldy);
    }
    if (ldy != N) y.copy_(ypad.narrow(1, 0, N));
  } else if (int4 && G % 64 == 0 && G <= WORDS_MAX_GROUP) {
    int16_product<Int4Words>(o, y.data_ptr<float>());
  } else if (int4 && G % 64 == 0) {
    int16_product<Int4Pair>(o, y.data_ptr<float>());
  } else if (int4) {
    int16_product<Int4Unit>(o, y.data_ptr<float>());
  } else if (kind == KIND_FP8) {
    dot_product<Fp8Unit>(o, y.data_ptr<float>());
  } else {
    int16_product<Int8Unit>(o, y.data_ptr<float>());
  }
  if (b.defined()) y.add_(b);
  return y;
}

// int8_w8a16's op under its earlier name: x [M, K] fp32, q [N, K] int8, scale [N].
torch::Tensor avx2_linear_int8w(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                c10::optional<torch::Tensor> bias) {
  return avx2_linear_quantw(x, KIND_INT8, q, scale, c10::nullopt, 0, bias);
}
