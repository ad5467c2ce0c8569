// Weight-only int8, int4 and fp8 linears at batched sizes on AMX-BF16 tiles (Intel Sapphire
// Rapids and later), on formats' rows as they are: no second copy of the weight.
//
// Each block of 16 weight rows is decoded once per call into an L2 scratch of bf16 tiles
// (quant_rows' decoders: every stored number exactly, up to a per-row or per-group affine
// map) and becomes the A operand of TDPBF16PS; x, transposed once per call into tile pairs,
// is the B operand. A C tile therefore holds y transposed, 16 outputs by 16 rows of x:
//
//   C[i][j] = sum_k a[n0 + i][k] * x[m0 + j][k]          i: weight row, j: row of x
//
// The products are exact (8 significant bits at most on the weight side) and the scales
// stay outside the sums, which are float32 (AMX's own accumulation):
//
//   int8_w8a16   a = q                      y[m][n] = scale[n] * C[n][m]
//   fp8_w8a16    a = e4m3 * 2^8             y[m][n] = scale[n] * 2^-8 * C[n][m]
//   int4_w4a16   a = 128 + nibble           y[m][n] = sum_g scale[n][g] * (C_g[n][m] - (128 + z[n][g]) S_g[m])
//
// where C_g sums group g's k, S_g[m] is x[m]'s sum over that group and z is the zero point
// (8 where symmetric). int4 is decoded 128 k at a time in quant_rows::Int4Rows' order (lane
// c of vector t holds k 32c + 8t + [0, 8)), so x's tiles are laid out in that order too and
// groups must be whole units (a multiple of 128 k). Against formats.reference_linear this
// changes only the order of the float32 arithmetic (tests/test_amx_weight_only.py).
//
// Why: past a few rows the weight-streaming kernels (quant_gemm.cpp) are compute bound on
// AVX-512 FMAs, and dequantizing to bf16 for oneDNN writes and rereads a full bf16 copy per
// call; here the decode is the only per-weight vector work and the tile unit does the rest.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "quant_rows.h"

namespace {

using bf16 = at::BFloat16;

constexpr int64_t kStepK = 32;           // k per tile row: 32 bf16
constexpr int64_t kTileWords = 256;      // one 16 x 64-byte tile in 32-bit words
constexpr int64_t kInt4UnitK = 128;      // k per decoded int4 unit (quant_rows::Int4Rows)
constexpr int kMaxTilesM = 4;            // C tiles per pass: 64 rows of x
constexpr int64_t kUnitSteps = 4;        // steps decoded at a time: 128 k
constexpr float kFp8Unscale = 1.f / 256;  // quant_rows::Fp8Rows decodes e4m3 * 2^8
constexpr float kInt4Offset = 128.f;      // Int4Rows decodes 128 + nibble

constexpr int64_t KIND_INT8 = 1, KIND_INT4 = 2, KIND_FP8 = 3;

// r[i] lane j -> r[j] lane i, for 16 vectors of 16 32-bit lanes.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [r2i e0, r2i+1 e0, r2i e1, r2i+1 e1] and e2, e3
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // u[4a + c], lane L: rows 4a .. 4a + 3 of column 4L + c
    u[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  constexpr int EVEN = _MM_SHUFFLE(2, 0, 2, 0), ODD = _MM_SHUFFLE(3, 1, 3, 1);
  for (int c = 0; c < 4; ++c) {  // gather column 4L + c's four lanes from u[c], u[4 + c], ...
    const __m512i v = _mm512_shuffle_i32x4(u[c], u[4 + c], EVEN);
    const __m512i w = _mm512_shuffle_i32x4(u[c], u[4 + c], ODD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], EVEN);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], ODD);
    r[c] = _mm512_shuffle_i32x4(v, v2, EVEN);
    r[8 + c] = _mm512_shuffle_i32x4(v, v2, ODD);
    r[4 + c] = _mm512_shuffle_i32x4(w, w2, EVEN);
    r[12 + c] = _mm512_shuffle_i32x4(w, w2, ODD);
  }
}

struct Problem {
  int64_t kind, M, N, K, steps, tiles_m;  // steps: K / 32; tiles_m: ceil(M / 16)
  const uint8_t* w;                       // formats' rows: K bytes (int8, fp8) or K / 2 (int4)
  const float *scale, *zero;              // [N] or int4's [N, groups]; zero: None -> 8
  int64_t groups, group_steps;            // int4
  const uint32_t* xt;                     // [steps][tiles_m][16 k pairs][16 rows of x]
  const float* xsum;                      // int4: [groups][tiles_m * 16]
  const bf16* bias;
  bf16* y;
};

// x's B tiles: step s, tile t holds, in row r, the k pair r of each of rows 16t .. 16t + 15
// (zeros past M). int4's steps take the k of Int4Rows' vectors (above).
void transpose_x(const Problem& p, const bf16* x, uint32_t* xt) {
  const bool int4 = p.kind == KIND_INT4;
  const int64_t units = int4 ? p.K / kInt4UnitK : p.steps;
  at::parallel_for(0, units * p.tiles_m, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t unit = i / p.tiles_m, t = i % p.tiles_m;
      __m512i v[4][16];  // int4: the unit's four steps; else one
      for (int j = 0; j < 16; ++j) {
        const int64_t m = 16 * t + j;
        if (!int4) {
          v[0][j] = m < p.M ? _mm512_loadu_si512(x + m * p.K + kStepK * unit) : _mm512_setzero_si512();
          continue;
        }
        __m512i z[4];
        for (int c = 0; c < 4; ++c)
          z[c] = m < p.M ? _mm512_loadu_si512(x + m * p.K + kInt4UnitK * unit + kStepK * c)
                         : _mm512_setzero_si512();
        // a 4 x 4 transpose of 128-bit lanes: step s's lane c is chunk c's lane s
        const __m512i a = _mm512_shuffle_i32x4(z[0], z[1], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i bb = _mm512_shuffle_i32x4(z[0], z[1], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i c = _mm512_shuffle_i32x4(z[2], z[3], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i d = _mm512_shuffle_i32x4(z[2], z[3], _MM_SHUFFLE(3, 2, 3, 2));
        v[0][j] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));
        v[1][j] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));
        v[2][j] = _mm512_shuffle_i32x4(bb, d, _MM_SHUFFLE(2, 0, 2, 0));
        v[3][j] = _mm512_shuffle_i32x4(bb, d, _MM_SHUFFLE(3, 1, 3, 1));
      }
      for (int s = 0; s < (int4 ? 4 : 1); ++s) {
        transpose16(v[s]);
        const int64_t step = int4 ? 4 * unit + s : unit;
        uint32_t* tile = xt + (step * p.tiles_m + t) * kTileWords;
        for (int r = 0; r < 16; ++r) _mm512_store_si512(tile + 16 * r, v[s][r]);
      }
    }
  });
}

// int4: S_g[m], each group's sum of x[m] (zeros past M).
void sum_groups(const Problem& p, const bf16* x, float* xsum) {
  const int64_t G = p.K / p.groups, Mp = p.tiles_m * 16;
  std::fill(xsum, xsum + p.groups * Mp, 0.f);
  at::parallel_for(0, p.M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < p.groups; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 16) acc = _mm512_add_ps(acc, load_bf16x16(x + m * p.K + k));
        xsum[g * Mp + m] = _mm512_reduce_add_ps(acc);
      }
  });
}

#ifdef MINIVLLM_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

// Tiles 0-3: C (16 outputs x 16 rows of x, fp32); 4: A (16 weight rows x 32 k); 5-7: B.
template <int MT>
inline void zero_c() {
  _tile_zero(0);
  if constexpr (MT > 1) _tile_zero(1);
  if constexpr (MT > 2) _tile_zero(2);
  if constexpr (MT > 3) _tile_zero(3);
}

// C_j += A (one step of the decoded block) x B_j (that step's tiles of x, 1 KB apart)
template <int MT>
inline void multiply(const uint8_t* a, const uint32_t* b) {
  _tile_loadd(4, a, 64);
  _tile_loadd(5, b, 64);
  _tile_dpbf16ps(0, 4, 5);
  if constexpr (MT > 1) {
    _tile_loadd(6, b + kTileWords, 64);
    _tile_dpbf16ps(1, 4, 6);
  }
  if constexpr (MT > 2) {
    _tile_loadd(7, b + 2 * kTileWords, 64);
    _tile_dpbf16ps(2, 4, 7);
  }
  if constexpr (MT > 3) {
    _tile_loadd(5, b + 3 * kTileWords, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

template <int MT>
inline void store_c(float (*c)[16][16]) {
  _tile_stored(0, c[0], 64);
  if constexpr (MT > 1) _tile_stored(1, c[1], 64);
  if constexpr (MT > 2) _tile_stored(2, c[2], 64);
  if constexpr (MT > 3) _tile_stored(3, c[3], 64);
}

struct Worker {
  const Problem& p;
  uint8_t* abuf;           // [steps][16 rows][64 bytes]: the block's A tiles
  float (*c)[16][16];      // [kMaxTilesM]: C tiles as stored
  float (*acc)[16][16];    // [kMaxTilesM]: int4's scaled group sums

  const __m512i kUpperHalves = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31,
                                                 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  // Steps [s0, s1) of rows n0 .. n0 + rows decoded into abuf (rows past N: zeros); int4's
  // in whole units.
  void decode(int64_t n0, int64_t rows, int64_t s0, int64_t s1) const {
    for (int64_t i = 0; i < 16; ++i) {
      uint8_t* dst = abuf + 64 * i;
      if (i >= rows) {
        for (int64_t s = s0; s < s1; ++s) std::memset(dst + s * 1024, 0, 64);
        continue;
      }
      if (p.kind == KIND_INT4) {
        for (int64_t u = s0 / kUnitSteps; u < s1 / kUnitSteps; ++u) {
          __m512bh v[4];
          quant_rows::Int4Rows::decode<false>(p.w + (n0 + i) * (p.K / 2) + 64 * u, 0, v);
          for (int t = 0; t < 4; ++t) _mm512_store_si512(dst + (kUnitSteps * u + t) * 1024, (__m512i)v[t]);
        }
        continue;
      }
      const uint8_t* src = p.w + (n0 + i) * p.K;
      for (int64_t s = s0; s < s1; ++s) {
        __m512bh v;
        if (p.kind == KIND_FP8) {
          v = quant_rows::Fp8Rows::decode32(src + kStepK * s);
        } else {
          // the floats of int8 values are exact in their upper halves: picked, not rounded
          const __m512i lo = (__m512i)quant_rows::Int8Rows::floats(src + kStepK * s, 0);
          const __m512i hi = (__m512i)quant_rows::Int8Rows::floats(src + kStepK * s, 1);
          v = (__m512bh)_mm512_permutex2var_epi16(lo, kUpperHalves, hi);
        }
        _mm512_store_si512(dst + s * 1024, (__m512i)v);
      }
    }
  }

  // acc_j[i] += scale[n][g] * (C_j[i] - (128 + z[n][g]) * S_g[rows of tile j])
  template <int MT>
  void add_group(int64_t n0, int64_t rows, int64_t g, int64_t t0) const {
    const int64_t Mp = p.tiles_m * 16;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t at = (n0 + i) * p.groups + g;
      const float s = p.scale[at], zs = s * (kInt4Offset + (p.zero ? p.zero[at] : 8.f));
      const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(zs);
      for (int j = 0; j < MT; ++j) {
        const __m512 sums = _mm512_loadu_ps(p.xsum + g * Mp + 16 * (t0 + j));
        __m512 a = _mm512_fmadd_ps(_mm512_load_ps(c[j][i]), sv, _mm512_load_ps(acc[j][i]));
        _mm512_store_ps(acc[j][i], _mm512_fnmadd_ps(zv, sums, a));
      }
    }
  }

  // Steps [s_begin, s_end) into the C tiles. The first pass over a block decodes them as
  // it goes, a unit of 4 steps (128 k) ahead: the vector units decode while the tile unit
  // multiplies, and a tile load does not meet bytes still in the store buffer. Decoding
  // the whole block first, then multiplying, ran the two one after the other (0.53 ms
  // against 0.44 for a 4096 x 1024 int8 weight at 1 row, one thread, in cache); a step
  // ahead instead of a unit read each row 64 bytes at a time, and the weights streamed from
  // memory slower (Qwen3-0.6B's linears at 16 rows: 0.9 -> 1.5 ms a layer).
  template <int MT>
  void multiply_steps(int64_t n0, int64_t rows, int64_t s_begin, int64_t s_end, const uint32_t* b,
                      bool first) const {
    const int64_t ahead = kUnitSteps, b_step = p.tiles_m * kTileWords;
    if (first && s_begin == 0) decode(n0, rows, 0, std::min(p.steps, ahead));
    for (int64_t s = s_begin; s < s_end; ++s) {
      if (first && s % ahead == 0 && s + ahead < p.steps)
        decode(n0, rows, s + ahead, std::min(p.steps, s + 2 * ahead));
      multiply<MT>(abuf + s * 1024, b + s * b_step);
    }
  }

  // One pass: rows 16 t0 .. 16 (t0 + MT) of x against the block, into y.
  template <int MT>
  void pass(int64_t n0, int64_t rows, int64_t t0) const {
    const uint32_t* b = p.xt + t0 * kTileWords;
    const bool first = t0 == 0;
    float (*out)[16][16] = c;
    zero_c<MT>();
    if (p.kind == KIND_INT4) {
      for (int j = 0; j < MT; ++j) std::memset(acc[j], 0, sizeof(acc[j]));
      for (int64_t g = 0; g < p.groups; ++g) {
        multiply_steps<MT>(n0, rows, g * p.group_steps, (g + 1) * p.group_steps, b, first);
        store_c<MT>(c);
        zero_c<MT>();
        add_group<MT>(n0, rows, g, t0);
      }
      out = acc;
    } else {
      multiply_steps<MT>(n0, rows, 0, p.steps, b, first);
      store_c<MT>(c);
    }
    write<MT>(out, n0, rows, t0);
  }

  // y[m][n0 .. n0 + rows] from out_j transposed, scaled (per-channel schemes), biased.
  template <int MT>
  void write(float (*out)[16][16], int64_t n0, int64_t rows, int64_t t0) const {
    const __mmask16 live = rows >= 16 ? 0xFFFF : (__mmask16)((1u << rows) - 1);
    __m512 scale = _mm512_set1_ps(1.f);
    if (p.kind != KIND_INT4) {
      scale = _mm512_maskz_loadu_ps(live, p.scale + n0);
      if (p.kind == KIND_FP8) scale = _mm512_mul_ps(scale, _mm512_set1_ps(kFp8Unscale));
    }
    __m512 bias = _mm512_setzero_ps();
    if (p.bias) {
      const __m256i raw = _mm256_maskz_loadu_epi16(live, p.bias + n0);
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int j = 0; j < MT; ++j) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(out[j][i]);
      transpose16(r);
      for (int jj = 0; jj < 16; ++jj) {
        const int64_t m = 16 * (t0 + j) + jj;
        if (m >= p.M) return;
        const __m512 v = _mm512_fmadd_ps(_mm512_castsi512_ps(r[jj]), scale, bias);
        _mm256_mask_storeu_epi16(p.y + m * p.N + n0, live, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }

  void run(int64_t nb0, int64_t nb1) const {
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const int64_t n0 = 16 * nb, rows = std::min<int64_t>(16, p.N - n0);
      for (int64_t t0 = 0; t0 < p.tiles_m; t0 += kMaxTilesM) {
        switch (std::min<int64_t>(kMaxTilesM, p.tiles_m - t0)) {
          case 1: pass<1>(n0, rows, t0); break;
          case 2: pass<2>(n0, rows, t0); break;
          case 3: pass<3>(n0, rows, t0); break;
          default: pass<4>(n0, rows, t0); break;
        }
      }
    }
  }
};

void run_problem(const Problem& p) {
  at::parallel_for(0, (p.N + 15) / 16, 1, [&](int64_t nb0, int64_t nb1) {
    // per thread: the decoded block (K / 32 KB: 96 KB at K = 3072, in L2) and the C tiles
    std::vector<__m512i> scratch(p.steps * 16 + 2 * kMaxTilesM * 16);
    auto* abuf = reinterpret_cast<uint8_t*>(scratch.data());
    auto* c = reinterpret_cast<float(*)[16][16]>(scratch.data() + p.steps * 16);
    Worker worker{p, abuf, c, c + kMaxTilesM};
    amx_load_tile_config();  // thread state
    worker.run(nb0, nb1);
    amx_release_tiles();
  });
}

#pragma GCC pop_options
#endif  // MINIVLLM_HAVE_AMX

}  // namespace

bool amx_weight_only_supports(int64_t kind, int64_t in_features, int64_t group_size) {
  if (in_features <= 0 || in_features % kStepK) return false;
  if (kind == KIND_INT8) return group_size == 0;
  if (kind == KIND_FP8) return group_size == 0;  // per channel (block-scaled fp8: not here)
  if (kind == KIND_INT4) return group_size > 0 && group_size % kInt4UnitK == 0 && in_features % group_size == 0;
  return false;
}

torch::Tensor amx_weight_only_linear(torch::Tensor x, int64_t kind, torch::Tensor weight, torch::Tensor scale,
                                     c10::optional<torch::Tensor> zero, int64_t group_size,
                                     c10::optional<torch::Tensor> bias) {
  const char* op = "amx_weight_only_linear";
  TORCH_CHECK(amx_bf16_available(), op, ": this CPU (or kernel) does not offer AMX-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.device().is_cpu(), op,
              ": x must be a CPU bf16 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(amx_weight_only_supports(kind, K, group_size), op, ": kind ", kind, " with K=", K, " and group ",
              group_size, " is not one it takes (int8 / fp8 per channel, int4 groups of a multiple of 128; K a "
              "multiple of 32)");
  const bool int4 = kind == KIND_INT4;
  check_tensor(op, weight, "weight", int4 || kind == KIND_FP8 ? at::kByte : at::kChar, {N, int4 ? K / 2 : K});
  const int64_t groups = int4 ? K / group_size : 0;
  if (int4) {
    check_tensor(op, scale, "scale", at::kFloat, {N, groups});
    if (zero.has_value() && zero->defined()) check_tensor(op, *zero, "zero", at::kFloat, {N, groups});
  } else {
    check_tensor(op, scale, "scale", at::kFloat, {N});
  }
  const bf16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_tensor(op, *bias, "bias", at::kBFloat16, {N});
    b = bias->data_ptr<bf16>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#ifdef MINIVLLM_HAVE_AMX
  const int64_t tiles_m = (M + 15) / 16, steps = K / kStepK;
  auto xt = torch::empty({steps * tiles_m * kTileWords}, x.options().dtype(at::kInt));
  auto xsum = torch::empty({int4 ? groups * tiles_m * 16 : 0}, x.options().dtype(at::kFloat));
  const bool has_zero = zero.has_value() && zero->defined();
  Problem p{kind,
            M,
            N,
            K,
            steps,
            tiles_m,
            reinterpret_cast<const uint8_t*>(weight.data_ptr()),
            scale.data_ptr<float>(),
            has_zero ? zero->data_ptr<float>() : nullptr,
            groups,
            int4 ? group_size / kStepK : 0,
            reinterpret_cast<const uint32_t*>(xt.data_ptr<int32_t>()),
            xsum.data_ptr<float>(),
            b,
            y.data_ptr<bf16>()};
  transpose_x(p, x.data_ptr<bf16>(), reinterpret_cast<uint32_t*>(xt.data_ptr<int32_t>()));
  if (int4) sum_groups(p, x.data_ptr<bf16>(), xsum.data_ptr<float>());
  run_problem(p);
#endif
  return y;
}
