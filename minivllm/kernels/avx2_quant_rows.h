// The quantized rows' product in fp32 engines, the pieces that avx2_quant.cpp's AVX2 forms
// and avx512_quantw.cpp's AVX-512 form share: the operands, x rounded to int16 in blocks,
// int4's zero-point term and the tiling over threads. Everything here is built for AVX2
// alone in both files (included before any target pragma), so each inline definition is
// the same code wherever the linker takes it from.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "avx2_math.h"

namespace avx2_quant {

// int8's blocks of x (int4's are its groups): 128 k, 8 vpmaddwd sums in each int32 lane
constexpr int64_t INT8_X_BLOCK = 128;

// The largest int4 group Int4Words takes: its sixteen-times sums stay below 2^31 (see
// int16_tile); larger groups take Int4Pair.
constexpr int64_t WORDS_MAX_GROUP = 2048;

// What one product needs: x, the rows, per-group scales (and int4 zeros).
struct Operands {
  const float* x;      // [M, K]
  const uint8_t* q;    // [N, row_bytes]
  const float* scale;  // [N, groups]
  const float* zero;   // int4: [N, groups], or null for symmetric (8); else null
  int64_t M, K, N, row_bytes, groups, group_k;
  bool int4;
};

// The R rows of a register-form tile are one contiguous region, and the next tile's
// follows it: rows of 1-3 KB are short streams for the hardware prefetcher, which
// re-learns each one (measured: int8 rows read at ~10 GB/s against the bf16 panels'
// single stream at ~20), so each step also prefetches the next tile's bytes at the pace
// this tile consumes its own. `ahead` and `end` are byte offsets, compared before a
// pointer is formed (none past the rows' end).
inline void prefetch_ahead(const Operands& o, int64_t ahead, int64_t end) {
  if (ahead < end) _mm_prefetch(reinterpret_cast<const char*>(o.q + ahead), _MM_HINT_T0);
}

// The largest |x| of n floats (n a multiple of 8) as its bits: |x| as integers orders as
// the floats do, inf and NaN above every finite value.
inline uint32_t magnitude_bits(const float* src, int64_t n) {
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i top = _mm256_setzero_si256();
  for (int64_t k = 0; k < n; k += 8)
    top = _mm256_max_epi32(top, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(src + k)), magnitude));
  __m128i t = _mm_max_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  t = _mm_max_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_max_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(t));
}

// x rounded to int16 for the integer register form: row m's k in [0, kv) (kv: K rounded
// down to 32) in blocks of `block` k, block b of row m as q[m kv + k] * scale[m blocks + b]
// with scale a power of two, amax / 32767 <= scale < 2 amax / 32767 (at least 2^-126; 1
// for a block of zeros, NaN for one holding an inf or NaN, so that it reaches the
// output); zterm: each block's sum of q times its scale (int4's zero-point term). Order within each 64 k
// (blocks a multiple of 64), as the unit reads its weights: `pair`, the eight 8-k pieces
// as 0 4 1 5 2 6 3 7 (Int4Pair's); `words`, four vectors of 16 whose lane i < 8 holds k
// 2i, 16 + 2i, 2i + 1, 17 + 2i and lane 8 + i the same plus 32 (Int4Words' nibbles);
// `words512` the same within each 128 k (blocks a multiple of 128) for 512-bit loads: four
// vectors of 32 whose lanes 8c + i hold chunk c's (c = 0..3) four k as above
// (avx512_quantw.cpp's Int4Words512).
enum class XOrder { natural, pair, words, words512 };
struct XInt16 {
  std::vector<int16_t> q;
  std::vector<float> scale;
  std::vector<float> zterm;  // int4: scale * sum of q per block, the zero point's factor
  int64_t kv, block, blocks;

  XInt16(const float* x, int64_t M, int64_t K, int64_t block_k, XOrder order)
      : kv(K & ~int64_t(31)), block(block_k), blocks((kv + block_k - 1) / block_k) {
    q.resize(M * kv);
    scale.resize(M * blocks);
    zterm.resize(M * blocks);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k0 = b * block, k1 = std::min(k0 + block, kv);
        const float* src = x + m * K;
        const uint32_t bits = magnitude_bits(src + k0, k1 - k0);
        float amax;
        std::memcpy(&amax, &bits, sizeof amax);
        float s = 1.f;
        if (bits >= 0x7F800000u) {
          s = std::numeric_limits<float>::quiet_NaN();
        } else if (bits != 0) {
          int e;
          std::frexp(static_cast<double>(amax) / 32767.0, &e);  // amax / 32767 < 2^e
          // a normal number, so that 1 / s is finite (blocks below ~1e-33 round coarser)
          s = std::ldexp(1.f, std::max(e, -126));
        }
        scale[m * blocks + b] = s;
        const __m256 inv = _mm256_set1_ps(bits >= 0x7F800000u ? 0.f : 1.f / s);  // exact: a power of two
        __m256i total = _mm256_setzero_si256();
        for (int64_t k = k0; k < k1; k += 16) {
          // rounded to nearest (MXCSR's mode); packs interleaves the 128-bit halves,
          // the permute puts k back in order
          const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + k), inv));
          const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + k + 8), inv));
          total = _mm256_add_epi32(total, _mm256_add_epi32(lo, hi));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + m * kv + k),
                              _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
        }
        zterm[m * blocks + b] = s * static_cast<float>(hsum8_epi32(total));
      }
      int16_t* row = q.data() + m * kv;
      const int64_t span = order == XOrder::words512 ? 128 : 64;  // pair, words: 64
      for (int64_t k = 0; order != XOrder::natural && k < kv; k += span) {
        int16_t natural[128];
        std::memcpy(natural, row + k, span * sizeof(int16_t));
        if (order == XOrder::pair) {
          for (int j = 0; j < 4; ++j) {
            std::memcpy(row + k + 16 * j, natural + 8 * j, 8 * sizeof(int16_t));
            std::memcpy(row + k + 16 * j + 8, natural + 32 + 8 * j, 8 * sizeof(int16_t));
          }
        } else {  // chunk c's 8 lanes of each of the four vectors (span / 4 values each)
          for (int64_t c = 0; c < span / 32; ++c) {
            for (int i = 0; i < 8; ++i) {
              const int16_t* at = natural + 32 * c + 2 * i;
              int16_t* lane = row + k + 8 * c + i;
              lane[0] = at[0], lane[span / 4] = at[16], lane[span / 2] = at[1], lane[3 * span / 4] = at[17];
            }
          }
        }
      }
    }
  }
};

// int4's zero-point term for weight row n against one row of x: sum_g z[n, g] ws[n, g]
// c[g], c being x's group scale times its group's sum of q (z = 8 when symmetric), eight
// groups a vector.
inline float zero_point_term(const Operands& o, int64_t n, const float* c) {
  const float* ws = o.scale + n * o.groups;
  const float* z = o.zero ? o.zero + n * o.groups : nullptr;
  __m256 v = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= o.groups; g += 8) {
    const __m256 zw = _mm256_mul_ps(z ? _mm256_loadu_ps(z + g) : _mm256_set1_ps(8.f), _mm256_loadu_ps(ws + g));
    v = _mm256_fmadd_ps(zw, _mm256_loadu_ps(c + g), v);
  }
  float t = hsum8(v);
  for (; g < o.groups; ++g) t += (z ? z[g] : 8.f) * ws[g] * c[g];
  return t;
}

// tile(m, n, MR, R) computes the tile at (m, n): MR x rows by R weight rows where both
// fit, MR x 1 at the weight rows' edge, 1 x R (or 1 x 1) for the rows past the last MR.
template <int MR, int R, class Tile>
void tile_rows(int64_t M, int64_t n_begin, int64_t n_end, Tile tile) {
  using std::integral_constant;
  for (int64_t n = n_begin; n < n_end; n += R) {
    const bool full = n + R <= n_end;
    int64_t m = 0;
    for (; m + MR <= M; m += MR) {
      if (full) {
        tile(m, n, integral_constant<int, MR>{}, integral_constant<int, R>{});
      } else {
        for (int64_t nn = n; nn < n_end; ++nn) tile(m, nn, integral_constant<int, MR>{}, integral_constant<int, 1>{});
      }
    }
    for (; m < M; ++m) {
      if (full) {
        tile(m, n, integral_constant<int, 1>{}, integral_constant<int, R>{});
      } else {
        for (int64_t nn = n; nn < n_end; ++nn) tile(m, nn, integral_constant<int, 1>{}, integral_constant<int, 1>{});
      }
    }
  }
}

// A register form over all rows: one row a call, 1 x 4 tiles; fewer rows than MR, 2 x 2;
// else MR x R tiles (the 16 ymm registers hold the accumulators and the decoded vectors). Threads take 16
// weight rows at a time.
template <int MR, int R, class Tile>
void register_product(const Operands& o, Tile tile) {
  constexpr int64_t BLOCK = 16;
  const int64_t blocks = (o.N + BLOCK - 1) / BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    KeepSubnormals keep;
    const int64_t n0 = begin * BLOCK, n1 = std::min(end * BLOCK, o.N);
    if (o.M == 1) {
      tile_rows<1, 4>(o.M, n0, n1, tile);
    } else if (o.M < MR) {
      tile_rows<2, 2>(o.M, n0, n1, tile);
    } else {
      tile_rows<MR, R>(o.M, n0, n1, tile);
    }
  });
}

// avx512_quantw.cpp's AVX-512 form of the integer register form (int8, int4 rows):
// whether it takes these operands (switched on by avx2_set_quantw_avx512, int4 groups a
// multiple of 128 up to WORDS_MAX_GROUP), and the product.
bool avx512_quantw_takes(const Operands& o, bool int4);
void avx512_quantw_product(const Operands& o, bool int4, float* y);

}  // namespace avx2_quant
