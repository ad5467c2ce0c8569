// The packed copies of quantized weights that our GEMMs read, made once at load: the layouts
// of quantization/packing.py (each function there says what goes where), byte for byte
// (tests/test_pack_weights.py). The torch ops they replace permute whole copies at ~1 G
// bytes a second: ~3 s of a Qwen3-4B int8_w8a8 or int4_w4a8 load.
//
//  pack_vnni_w8a8: int8 [N, K] -> [ceil(N / 32), K / 4, 32, 4]: panel p's step k4 holds the
//                  4 k of its 32 rows (zeros past N), a 4-byte word each.
//  pack_amx_w8a8:  int8 [N, K] -> [ceil(N / 32), ceil(K / 64), 2, 16, 64]: block b, k-block kb,
//                  half j holds, as tile row i, the words of k 64kb + 4i .. + 3 of rows
//                  32b + 16j + c (c < 16); zeros past N and K.
//  pack_vnni_w4a8: formats' int4 rows (uint8 [N, K / 2], chunks of 32 k: byte j = q[j] |
//                  q[16 + j] << 4) -> per panel of 16 rows, per 8 k, 64 bytes, byte 4i + j =
//                  q[n, 8s + j] | q[n, 8s + 4 + j] << 4; then the panel's scales and zero
//                  points as float32 [groups, 16] (symmetric: 8; rows past N: zeros).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tensor_checks.h"

namespace {

constexpr int64_t kInt4Chunk = 32;      // formats.INT4_CHUNK
constexpr float kInt4SymmetricZero = 8;  // formats.INT4_SYMMETRIC_ZERO

inline int32_t word_at(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// One int4 row in formats' chunk layout -> its K values, one a byte.
void unpack_int4_row(const uint8_t* packed, int64_t K, uint8_t* values) {
  for (int64_t c = 0; c < K / kInt4Chunk; ++c) {
    const uint8_t* in = packed + c * kInt4Chunk / 2;
    uint8_t* out = values + c * kInt4Chunk;
    for (int64_t j = 0; j < kInt4Chunk / 2; ++j) {
      out[j] = in[j] & 0xF;
      out[kInt4Chunk / 2 + j] = in[j] >> 4;
    }
  }
}

}  // namespace

void pack_vnni_w8a8(torch::Tensor q, torch::Tensor out) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && q.size(1) % 4 == 0,
              "pack_vnni_w8a8: q must be a contiguous int8 [N, K], K % 4 == 0");
  const int64_t N = q.size(0), K = q.size(1), panels = (N + 31) / 32;
  check_tensor("pack_vnni_w8a8", out, "out", at::kChar, {panels, K / 4, 32, 4});
  const int8_t* src = q.data_ptr<int8_t>();
  int32_t* dst = reinterpret_cast<int32_t*>(out.data_ptr<int8_t>());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int32_t* panel = dst + p * (K / 4) * 32;
      const int64_t rows = std::min<int64_t>(32, N - 32 * p);
      for (int64_t k4 = 0; k4 < K / 4; ++k4)
        for (int64_t c = 0; c < 32; ++c) panel[k4 * 32 + c] = c < rows ? word_at(src + (32 * p + c) * K + 4 * k4) : 0;
    }
  });
}

void pack_amx_w8a8(torch::Tensor q, torch::Tensor out) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && q.size(1) % 4 == 0,
              "pack_amx_w8a8: q must be a contiguous int8 [N, K], K % 4 == 0");
  const int64_t N = q.size(0), K = q.size(1), blocks = (N + 31) / 32, blocks_k = (K + 63) / 64;
  check_tensor("pack_amx_w8a8", out, "out", at::kChar, {blocks, blocks_k, 2, 16, 64});
  const int8_t* src = q.data_ptr<int8_t>();
  int32_t* dst = reinterpret_cast<int32_t*>(out.data_ptr<int8_t>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t kb = 0; kb < blocks_k; ++kb) {
        int32_t* tiles = dst + (b * blocks_k + kb) * 2 * 16 * 16;  // [j][i][c] words
        const int64_t words = std::min<int64_t>(16, K / 4 - 16 * kb);
        for (int64_t r = 0; r < 32; ++r) {  // r = 16j + c
          const int64_t n = 32 * b + r;
          int32_t* col = tiles + (r / 16) * 256 + r % 16;
          for (int64_t i = 0; i < 16; ++i)
            col[16 * i] = n < N && i < words ? word_at(src + n * K + 64 * kb + 4 * i) : 0;
        }
      }
  });
}

void pack_vnni_w4a8(torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> zero, int64_t group_size,
                    torch::Tensor out) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous(),
              "pack_vnni_w4a8: q must be formats' contiguous uint8 int4 rows [N, K / 2]");
  const int64_t N = q.size(0), K = 2 * q.size(1);
  TORCH_CHECK(K % kInt4Chunk == 0 && group_size > 0 && K % group_size == 0,
              "pack_vnni_w4a8: K=", K, " must be a multiple of 32 and of the group size ", group_size);
  const int64_t groups = K / group_size, panels = (N + 15) / 16, weight_bytes = K / 8 * 64;
  check_tensor("pack_vnni_w4a8", scale, "scale", at::kFloat, {N, groups});
  if (zero.has_value()) check_tensor("pack_vnni_w4a8", *zero, "zero", at::kFloat, {N, groups});
  check_tensor("pack_vnni_w4a8", out, "out", at::kByte, {panels, weight_bytes + groups * 128});
  const uint8_t* src = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.has_value() ? zero->data_ptr<float>() : nullptr;
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> values(K);
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* panel = dst + p * (weight_bytes + groups * 128);
      float* scales = reinterpret_cast<float*>(panel + weight_bytes);
      float* zeros = scales + groups * 16;
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t n = 16 * p + i;
        if (n < N) {
          unpack_int4_row(src + n * K / 2, K, values.data());
        } else {
          std::fill(values.begin(), values.end(), 0);
        }
        for (int64_t s = 0; s < K / 8; ++s) {
          uint32_t lo, hi;  // values < 16: the shifted high word stays within its bytes
          std::memcpy(&lo, values.data() + 8 * s, 4);
          std::memcpy(&hi, values.data() + 8 * s + 4, 4);
          const uint32_t word = lo | hi << 4;
          std::memcpy(panel + s * 64 + 4 * i, &word, 4);
        }
        for (int64_t g = 0; g < groups; ++g) {
          scales[g * 16 + i] = n < N ? sp[n * groups + g] : 0.f;
          zeros[g * 16 + i] = n < N ? (zp ? zp[n * groups + g] : kInt4SymmetricZero) : 0.f;
        }
      }
    }
  });
}
