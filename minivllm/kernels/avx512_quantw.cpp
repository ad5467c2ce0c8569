// Weight-only int8 and int4 rows (int8_w8a16, int4_w4a16) in fp32 engines on AVX-512 CPUs
// with VNNI but no AVX512-BF16 (Intel Ice Lake, Cascade Lake): avx2_quant.cpp's integer
// register form at twice the width, one vpdpwssd (AVX512-VNNI: 32 int16 products, summed
// in pairs into 16 int32 lanes, added to them) where the AVX2 form spends a vpmaddwd of 16
// products and a vpaddd.
//
// The numbers are the AVX2 form's: x rounded to int16 in the same blocks with the same
// power-of-two scales (avx2_quant_rows.h's XInt16), each block's products summed exactly
// in int32, converted and scaled once per block. Only the order of the fp32 additions
// differs (16 lanes where AVX2 has 8), so the outputs agree with it to fp32 rounding.
//
// Why (2026-12-07, a 2-core Intel Xeon Ice Lake server, fp32 engine): batch-1 decode of
// the Qwen3-0.6B shape ran int8_w8a16 at 1.36x and int4_w4a16 at 1.42x the unquantized
// engine, well short of the weights' 2x and 3.5x fewer bytes: the AVX2 form's widening and
// multiply-adds, not the memory, set the pace. Per 32 weights and row this form issues one
// widening (int8: vpmovsxbw from memory) and one vpdpwssd; int4 decodes 128 k from one
// 64-byte load in five operations (Int4Words512) for four vpdpwssd per row.
//
// The AVX2 family is built for AVX2 alone: this file's code carries its own target and
// runs only where avx2_set_quantw_avx512 has switched it on (kernels/__init__.py does, where
// cpu_flags() has the extensions, so MINIVLLM_CPU_ISA=avx2 keeps the AVX2 forms).
#include <immintrin.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdint>

#include "avx2_api.h"
#include "avx2_math.h"
#include "avx2_quant_rows.h"

namespace {

using namespace avx2_quant;

std::atomic<bool> enabled{false};

// Rows up to which the form runs, past which the AVX2 family's panel form (fp32 panels
// dequantized once per call, FMAs) takes over. Measured per call on a 2-core Ice Lake Xeon,
// the 0.6B layer, ratio to the bf16 panels, this form / the panel form
// (python benchmarks/avx2_quant.py --rows 8 16 32 64, 2026-12-08): int8 2.2 / 1.0 at 8
// rows, 1.8 / 1.0 at 16, 1.4 / 0.9 at 32, 1.0 / 1.0 at 64; int4 1.3 / 1.1 at 8 rows (there
// the AVX2 register form), 1.0 / 1.0 at 16, 0.8 / 0.9 at 32 (its 2 x 2 tiles decode each
// weight once per two rows).
constexpr int64_t INT8_MAX_ROWS = 64, INT4_MAX_ROWS = 8;

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

// acc += a . b in int32 pairs, vpdpwssd. As dpbusd (avx512_int8.h): the asm keeps each
// accumulator in its register; b in a register too (see tile).
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// int8: 32 k of a row widened to int16 in order (x natural).
struct Int8Units {
  static constexpr int64_t kK = 32, kBytes = 32;
  static constexpr bool kInt4 = false;
  static inline void int16(const uint8_t* p, __m512i w[1]) {
    w[0] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

// int4: 128 k, four 16-byte chunks of formats.pack_int4 (k 0-15 in the low nibbles, 16-31
// in the high ones), read as 32 16-bit words: as Int4Words (avx2_quant.cpp), bits 0-3 and
// 12-15 of each word as they are and bits 4-7 and 8-11 as 16 times their value, the middle
// two vectors' products summed apart and the two sums joined as 16 a + b. x is laid out
// for it in XInt16's words512 order.
struct Int4Words512 {
  static constexpr int64_t kK = 128, kBytes = 64;
  static constexpr bool kInt4 = true;
  static inline void int16(const uint8_t* p, __m512i w[4]) {
    const __m512i b = _mm512_loadu_si512(p);
    const __m512i low = _mm512_set1_epi16(0x000F), mid = _mm512_set1_epi16(0x00F0);
    w[0] = _mm512_and_si512(b, low), w[1] = _mm512_and_si512(b, mid);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(b, 4), mid), w[3] = _mm512_srli_epi16(b, 12);
  }
};

// y[m, n] for x rows m0..m0+MR and weight rows n0..n0+R (all in range), as int16_tile
// (avx2_quant.cpp) does it: per block one int32 accumulator per (x row, weight row)
// (int4: two), scaled into a running fp32 vector at the block's end; int8's last K % 32
// k in fp32 on x as it is and its per-channel scale at the end, int4's zero-point term
// subtracted at the end. The int32 sums hold: int8 adds 8 products of at most 127 * 32767
// per lane and 128-k block; int4 G / 32 per accumulator, within the AVX2 form's bound
// (WORDS_MAX_GROUP).
template <class U, int MR, int R>
inline void tile(const Operands& o, const XInt16& xq, int64_t m0, int64_t n0, float* y) {
  constexpr int kVec = U::kInt4 ? 4 : 1;
  __m512 total[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm512_setzero_ps();
  const int64_t next = (n0 + R) * o.row_bytes, end = o.N * o.row_bytes;
  const uint8_t* rows = o.q + n0 * o.row_bytes;
  const int16_t* xrows = xq.q.data() + m0 * xq.kv;
  for (int64_t b = 0; b < xq.blocks; ++b) {
    __m512i acc[MR][R], acc16[MR][R];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = acc16[m][r] = _mm512_setzero_si512();
    const int64_t k0 = b * xq.block, k1 = std::min(k0 + xq.block, xq.kv);
    // every weight row's unit decoded first, then each x vector loaded once into a
    // register for all R rows: with x as a memory operand of each vpdpwssd the loads,
    // not the multiply-adds, set the pace (4 x 2 tiles in L1: 54 against 84 G MAC/s)
    for (int64_t k = k0, at = k0 / U::kK * U::kBytes; k < k1; k += U::kK, at += U::kBytes) {
      for (int64_t line = 0; line < U::kBytes * R; line += 64) prefetch_ahead(o, next + at * R + line, end);
      __m512i w[R][kVec];
      for (int r = 0; r < R; ++r) U::int16(rows + r * o.row_bytes + at, w[r]);
      for (int m = 0; m < MR; ++m) {
        const int16_t* xk = xrows + m * xq.kv + k;
        for (int v = 0; v < kVec; ++v) {
          const __m512i xv = _mm512_loadu_si512(xk + 32 * v);
          for (int r = 0; r < R; ++r) {
            if (v == 1 || v == 2) {  // Int4Words512's sixteen-times vectors
              acc16[m][r] = dpwssd(acc16[m][r], w[r][v], xv);
            } else {
              acc[m][r] = dpwssd(acc[m][r], w[r][v], xv);
            }
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int m = 0; m < MR; ++m) {
        const float xs = xq.scale[(m0 + m) * xq.blocks + b];
        if constexpr (U::kInt4) {  // 16 acc + acc16 = 16 times the sum, in int32
          const float s = xs * o.scale[(n0 + r) * o.groups + b] * 0.0625f;
          const __m512i sum16 = _mm512_add_epi32(_mm512_slli_epi32(acc[m][r], 4), acc16[m][r]);
          total[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum16), _mm512_set1_ps(s), total[m][r]);
        } else {
          total[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][r]), _mm512_set1_ps(xs), total[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < R; ++r) {
      float t = _mm512_reduce_add_ps(total[m][r]);
      if constexpr (U::kInt4) {
        t -= zero_point_term(o, n0 + r, xq.zterm.data() + (m0 + m) * xq.blocks);
      } else {  // the last K % 32 k, then the row's scale
        const uint8_t* row = o.q + (n0 + r) * o.row_bytes;
        for (int64_t k = xq.kv; k < o.K; ++k) t += o.x[(m0 + m) * o.K + k] * static_cast<float>(static_cast<int8_t>(row[k]));
        t *= o.scale[n0 + r];
      }
      y[(m0 + m) * o.N + n0 + r] = t;
    }
  }
}

template <class U>
void product(const Operands& o, float* y) {
  const XInt16 xq(o.x, o.M, o.K, U::kInt4 ? o.group_k : INT8_X_BLOCK, U::kInt4 ? XOrder::words512 : XOrder::natural);
  // int8: 4 x 2 tiles (8 accumulators, 8 running sums); int4 holds twice the
  // accumulators and four vectors a weight row: 2 x 2 (both: 1 x 4 at one row)
  constexpr int MR = U::kInt4 ? 2 : 4;
  register_product<MR, 2>(o, [&](int64_t m, int64_t n, auto mr, auto r) {
    tile<U, decltype(mr)::value, decltype(r)::value>(o, xq, m, n, y);
  });
}

#pragma GCC pop_options

}  // namespace

namespace avx2_quant {

bool avx512_quantw_takes(const Operands& o, bool int4) {
  if (!enabled.load(std::memory_order_relaxed) || o.M > (int4 ? INT4_MAX_ROWS : INT8_MAX_ROWS)) return false;
  return !int4 || (o.group_k % 128 == 0 && o.group_k <= WORDS_MAX_GROUP);
}

void avx512_quantw_product(const Operands& o, bool int4, float* y) {
  TORCH_CHECK(enabled.load(), "the AVX-512 form of the quantized rows is switched off");
  if (int4) {
    product<Int4Words512>(o, y);
  } else {
    product<Int8Units>(o, y);
  }
}

}  // namespace avx2_quant

bool avx2_set_quantw_avx512(bool on) {
  if (on) {
    __builtin_cpu_init();
    TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"),
                "set_quantw_avx512: this CPU lacks AVX-512 F/BW/VL or VNNI");
  }
  return enabled.exchange(on);
}
