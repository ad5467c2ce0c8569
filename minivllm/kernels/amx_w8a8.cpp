// int8_w8a8 at prefill and batched decode on AMX (Intel Sapphire Rapids and later).
//
// y = (acc * xs[m]) * scale[n] (+ bias), acc[m, n] = sum_k xq[m, k] q[n, k] in int32, exactly
// formats.reference_linear's contract: x is quantized per token as quantize_per_token does
// (quant_w8a8.cpp's quantize_row), the int8 products are summed by TDPBSSD (signed x signed
// bytes, 16 x 16 int32 sums over 64 k per instruction), and the float epilogue (both
// scales, the bias, the rounding to bf16) runs on each 16 x 16 block as it leaves the tile
// registers. That last part is why this exists: oneDNN's int8 GEMM takes one scale for all
// of x, so per-token scales cost two more passes over a float32 output, which ate its gain
// over bf16 (docs/quantization.md). It stays the fallback on CPUs without AMX.
//
// The weight is packed once at load (packing.pack_amx_w8a8) into the tiles' layout: blocks
// of 32 output rows, and in each, per 64 k, two 1 KB tiles of 16 rows (k / 4) x 16 columns
// (n) x 4 bytes (k % 4), zero-padded to whole blocks. A step multiplies 32 rows of x by a
// 32-row weight block: two A tiles times two B tiles into four C tiles. x is quantized
// into tile order too ([M / 16, K / 64, 16, 64]), so every tile load reads 1 KB in one
// piece: with rows of x K bytes apart the GEMM ran up to 1.9x slower.
// Threads split the weight blocks; x is taken in chunks that stay in L2 (kChunkBytes).
// Compilers without the AMX intrinsics (GCC < 11) build the module without this path:
// amx_w8a8_available() then says false and the VNNI GEMM serves large batches.
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/extension.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

using bf16 = at::BFloat16;

constexpr int64_t kTileK = 64;            // int8 k per tile row
constexpr int64_t kBlock = 32;            // rows of x and of the weight per step
constexpr int64_t kTileBytes = 16 * 64;   // one tile
constexpr int64_t kChunkBytes = 768 << 10;  // x rows per chunk: this much of L2 (2 MB here)

// Linux hands out the AMX register state only on request (arch_prctl, since 5.16).
constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;

// CPUID leaf 7 EDX: bit 22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8
bool cpu_has_amx(int unit_bit) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 24 & 1) && (d >> unit_bit & 1);
}

#ifdef MINIVLLM_HAVE_AMX
bool amx_permitted() {  // the permission is the process's; asked once
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}
#endif

#ifdef MINIVLLM_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8")

// Tiles 0-3: C (16 x 16 int32); 4, 5: A (16 rows of x x 64 k); 6, 7: B (16 x 64 bytes).

struct Gemm {
  const int8_t* xq;  // [Mp / 16, blocks_k, 16, 64]: A tiles, zeros past row M and k = K
  int64_t M, N, blocks_k;
  const float *xs, *scale;
  const int8_t* w;  // packed: [N / 32, blocks_k, 2, 16, 64]
  const bf16* bias;
  bf16* y;

  // C tiles of rows [m0, m0 + 32) x weight block nb, scaled, biased and rounded into y.
  // A whole block (32 columns) writes each row's 64 bytes in one store, both halves scaled
  // by one broadcast of xs[m]: on a 2-core Xeon (AMX) 5-8% off a 4096 x 4096 x 1024 call in a
  // stand-alone loop (a 512-token prefill did not move measurably). The epilogue and y's
  // writes are ~40% of such a call, and do not overlap the tile unit's work: run after the
  // next block's products were issued, or batched over four blocks, they cost the same;
  // written to an L1 scratch instead of y, 17% less (y's rows are 2N bytes apart: a cache
  // miss per 64-byte store; non-temporal stores, huge pages and prefetching y did not help).
  void store(const int32_t (&c)[4][16][16], int64_t m0, int64_t nb) const {
    const int64_t n0 = nb * kBlock, rows = std::min<int64_t>(kBlock, M - m0);
    if (N - n0 >= kBlock) {
      const __m512 s0 = _mm512_loadu_ps(scale + n0), s1 = _mm512_loadu_ps(scale + n0 + 16);
      const __m512 b0 = bias ? load_bf16x16(bias + n0) : _mm512_setzero_ps();
      const __m512 b1 = bias ? load_bf16x16(bias + n0 + 16) : _mm512_setzero_ps();
      for (int64_t mi = 0; mi < rows; ++mi) {
        const __m512 x = _mm512_set1_ps(xs[m0 + mi]);
        const int32_t* c0 = c[2 * (mi / 16)][mi % 16];
        const int32_t* c1 = c[2 * (mi / 16) + 1][mi % 16];
        __m512 v0 = scale_in_order(_mm512_cvtepi32_ps(_mm512_load_si512(c0)), x, s0);
        __m512 v1 = scale_in_order(_mm512_cvtepi32_ps(_mm512_load_si512(c1)), x, s1);
        if (bias) {
          v0 = _mm512_add_ps(v0, b0);
          v1 = _mm512_add_ps(v1, b1);
        }
        _mm512_storeu_si512(y + (m0 + mi) * N + n0, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
      }
      return;
    }
    for (int j = 0; j < 2; ++j) {  // the last, partial block: masked halves
      const int64_t h0 = n0 + 16 * j;
      if (h0 >= N) break;
      const __mmask16 live = N - h0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - h0)) - 1);
      const __m512 s = _mm512_maskz_loadu_ps(live, scale + h0);
      __m512 b = _mm512_setzero_ps();
      if (bias) {
        const __m256i raw = _mm256_maskz_loadu_epi16(live, bias + h0);
        b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      }
      for (int64_t mi = 0; mi < rows; ++mi) {
        const int64_t m = m0 + mi;
        const __m512 acc = _mm512_cvtepi32_ps(_mm512_load_si512(c[2 * (mi / 16) + j][mi % 16]));
        __m512 v = scale_in_order(acc, _mm512_set1_ps(xs[m]), s);
        if (bias) v = _mm512_add_ps(v, b);
        _mm256_mask_storeu_epi16(y + m * N + h0, live, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }

  // The last 16 rows or fewer of x (m0 on) times weight block wb: two C tiles, half the
  // products of a full step. A decode batch of up to 16 sequences is only this: on a 2-vCPU
  // Xeon its step's int8_w8a8 linears had spent half their tile products on zero rows.
  void run_half(const int8_t* x0, const int8_t* wb, int64_t m0, int64_t nb, int32_t (&c)[4][16][16]) const {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < blocks_k; ++kb) {
      _tile_loadd(4, x0 + kb * kTileBytes, 64);
      _tile_loadd(6, wb + kb * 2 * kTileBytes, 64);
      _tile_loadd(7, wb + kb * 2 * kTileBytes + kTileBytes, 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    store(c, m0, nb);
  }

  // Rows [m_begin, m_end) of x (whole 32-row steps, zero-padded) times weight blocks [b0, b1).
  // Tried, and no gain measurable here: running a block's epilogue after the next block's
  // products were issued (to overlap the tile unit), and splitting K so the weight block
  // stays in L1 (<= 10% in a stand-alone loop, inside this VM's spread).
  void run(int64_t m_begin, int64_t m_end, int64_t b0, int64_t b1) const {
    alignas(64) int32_t c[4][16][16];
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int8_t* wb = w + nb * blocks_k * 2 * kTileBytes;
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kBlock) {
        const int8_t* x0 = xq + m0 / 16 * blocks_k * kTileBytes;
        const int8_t* x1 = x0 + blocks_k * kTileBytes;
        if (M - m0 <= 16) {  // one tile of rows: the second A tile would hold zero padding
          run_half(x0, wb, m0, nb, c);
          continue;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < blocks_k; ++kb) {
          _tile_loadd(4, x0 + kb * kTileBytes, 64);
          _tile_loadd(5, x1 + kb * kTileBytes, 64);
          _tile_loadd(6, wb + kb * 2 * kTileBytes, 64);
          _tile_loadd(7, wb + kb * 2 * kTileBytes + kTileBytes, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbssd(1, 4, 7);
          _tile_dpbssd(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        store(c, m0, nb);
      }
    }
  }
};

void run_gemm(const Gemm& g, int64_t Mp) {
  const int64_t blocks_n = (g.N + kBlock - 1) / kBlock;
  const int64_t chunk = std::max(kBlock, kChunkBytes / (g.blocks_k * kTileK) / kBlock * kBlock);
  for (int64_t m = 0; m < Mp; m += chunk) {
    const int64_t m_end = std::min(Mp, m + chunk);
    at::parallel_for(0, blocks_n, 1, [&](int64_t b0, int64_t b1) {
      amx_load_tile_config();  // per thread: the configuration is thread state
      g.run(m, m_end, b0, b1);
      amx_release_tiles();
    });
  }
}

#pragma GCC pop_options
#endif  // MINIVLLM_HAVE_AMX

bool amx_unit_available(int unit_bit) {
#ifdef MINIVLLM_HAVE_AMX
  return cpu_has_amx(unit_bit) && amx_permitted();
#else
  return false;
#endif
}

}  // namespace

#ifdef MINIVLLM_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile")

void amx_load_tile_config() {
  struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  // a static: GCC 12 dropped the stores into a stack copy as dead (tiles of 0 rows: SIGILL)
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    return c;
  }();
  _tile_loadconfig(&cfg);
}

void amx_release_tiles() { _tile_release(); }

#pragma GCC pop_options
#endif  // MINIVLLM_HAVE_AMX

bool amx_w8a8_available() {
  static const bool ok = amx_unit_available(25);
  return ok;
}

bool amx_bf16_available() {
  static const bool ok = amx_unit_available(22);
  return ok;
}

torch::Tensor amx_w8a8_linear(torch::Tensor x, torch::Tensor packed, int64_t in_features,
                              torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(amx_w8a8_available(), "amx_w8a8_linear: this CPU (or kernel) does not offer AMX-INT8");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "amx_w8a8_linear: x must be bf16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 5 && packed.size(2) == 2 &&
                  packed.size(3) == 16 && packed.size(4) == 64 && packed.is_contiguous(),
              "amx_w8a8_linear: packed must be packing.pack_amx_w8a8's int8 [N/32, K/64, 2, 16, 64]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous(),
              "amx_w8a8_linear: scale must be float32 [N]");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scale.device().is_cpu(),
              "amx_w8a8_linear: tensors must be on the CPU");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0), blocks_k = packed.size(1);
  TORCH_CHECK(K > 0 && K == in_features && K % 16 == 0 && (K + kTileK - 1) / kTileK == blocks_k,
              "amx_w8a8_linear: x has K=", K, ", the weight ", in_features, " (a multiple of 16, in ",
              blocks_k, " packed blocks of 64)");
  TORCH_CHECK((N + kBlock - 1) / kBlock == packed.size(0), "amx_w8a8_linear: scale has N=", N,
              ", the packed weight ", packed.size(0), " blocks of 32 rows");
  const bf16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous() &&
                    bias->device().is_cpu(),
                "amx_w8a8_linear: bias must be bf16 [N]");
    b = bias->data_ptr<bf16>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t ldx = blocks_k * kTileK, Mp = (M + kBlock - 1) / kBlock * kBlock;
  // every row below M is written whole (its k past K from `row`'s zeros); only the padding
  // rows need zeros (filling all of xq took ~2% of a 512-token w8a8 prefill)
  auto xq = torch::empty({Mp / 16, blocks_k, 16, kTileK}, x.options().dtype(at::kChar));
  auto xs = torch::empty({M}, x.options().dtype(at::kFloat));
  const bf16* xp = x.data_ptr<bf16>();
  int8_t* q = xq.data_ptr<int8_t>();
  float* s = xs.data_ptr<float>();
  // each row is quantized whole, then its 64-k pieces go to their tiles' rows
  for (int64_t m = M; m < Mp; ++m) {
    int8_t* tiles = q + (m / 16 * blocks_k * 16 + m % 16) * kTileK;
    for (int64_t kb = 0; kb < blocks_k; ++kb) std::memset(tiles + kb * kTileBytes, 0, kTileK);
  }
  at::parallel_for(0, M, quantize_grain(K), [&](int64_t m0, int64_t m1) {
    std::vector<int8_t> row(ldx, 0);
    for (int64_t m = m0; m < m1; ++m) {
      s[m] = quantize_row_int8(xp + m * K, K, row.data());
      int8_t* tiles = q + (m / 16 * blocks_k * 16 + m % 16) * kTileK;
      for (int64_t kb = 0; kb < blocks_k; ++kb)
        std::memcpy(tiles + kb * kTileBytes, row.data() + kb * kTileK, kTileK);
    }
  });
#ifdef MINIVLLM_HAVE_AMX
  Gemm g{q, M, N, blocks_k, s, scale.data_ptr<float>(), packed.data_ptr<int8_t>(), b, y.data_ptr<bf16>()};
  run_gemm(g, Mp);
#endif
  return y;
}
