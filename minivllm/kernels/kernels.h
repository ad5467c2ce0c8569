// The kernels of minivllm's CPU extension, declared once for the files that call
// each other's (decode_layers.cpp) and for the Python bindings (gemv_bf16.cpp).
// All take and return bf16 tensors; see each definition for the layouts.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "avx512_int8.h"
#include "tensor_checks.h"

// AMX tile code compiles only where the compiler has the intrinsics (GCC >= 11); without
// them amx_*_available() say false and the AVX-512 / oneDNN paths serve.
#if __has_include(<amxtileintrin.h>)
#define MINIVLLM_HAVE_AMX 1
#endif

// exp(x) for 16 fp32 lanes: 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], with a
// degree-6 polynomial for 2^f (relative error ~2e-7, below bf16's resolution).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // exp(-87) ~ 0 in fp32; keeps 2^n finite
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// acc += a . b, in place: vdpbf16ps (pairs of bf16 products), pinned in its register by
// the asm as avx512_int8.h's dpbusd is (and why).
inline __m512 dpbf16(__m512 acc, __m512bh a, __m512bh b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}

// 16 bf16 values widened to fp32 (exact: bf16 is the top half of an fp32).
inline __m512 load_bf16x16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// fp32 -> bf16, round to nearest even (as at::BFloat16's constructor), stored.
inline void store_bf16x16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// fp32 rounded to the nearest bf16, kept as fp32.
inline __m512 round_bf16x16(__m512 v) {
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// scale_in_order (int8_w8a8's output scaling): avx512_int8.h

// Lane i of the result is the sum of the 16 lanes of v[i].
inline __m512 sum16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // each 128-bit lane j: [a_j0+a_j2, b_j0+b_j2, a_j1+a_j3, b_j1+b_j3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // each lane j: lane j's sums of v[4i .. 4i + 3]
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int EVEN = _MM_SHUFFLE(2, 0, 2, 0), ODD = _MM_SHUFFLE(3, 1, 3, 1);
  for (int i = 0; i < 2; ++i)  // pairs of 128-bit lanes added: [y0 l0+l1, y0 l2+l3, y1 l0+l1, y1 l2+l3]
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], EVEN),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], ODD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], EVEN), _mm512_shuffle_f32x4(z[0], z[1], ODD));
}

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor block_table, int64_t num_context, double scale,
                                int64_t window, bool allow_amx = true);
void write_kv_cache(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor argmax_bf16(torch::Tensor logits);
torch::Tensor watermark_argmax(torch::Tensor probs, torch::Tensor states, torch::Tensor keys);
// Quantized weights (quant_gemm.cpp, quant_w8a8.cpp; formats in minivllm/quantization/formats.py).
// kind: 1 int8_w8a16, 2 int4_w4a16, 3 fp8_w8a16, 4 int8_w8a8.
torch::Tensor quant_linear(torch::Tensor x, int64_t kind, torch::Tensor weight, torch::Tensor scale,
                           c10::optional<torch::Tensor> zero, c10::optional<torch::Tensor> wsum,
                           int64_t group_size, c10::optional<torch::Tensor> bias);
void dequantize_bf16(int64_t kind, torch::Tensor weight, torch::Tensor scale, c10::optional<torch::Tensor> zero,
                     int64_t group_size, torch::Tensor out);
torch::Tensor dequantized_linear(torch::Tensor x, int64_t kind, torch::Tensor weight, torch::Tensor scale,
                                 c10::optional<torch::Tensor> zero, int64_t group_size,
                                 c10::optional<torch::Tensor> bias);
void w8a8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
                 const torch::Tensor& wsum, const at::BFloat16* bias, torch::Tensor& y);
std::tuple<torch::Tensor, torch::Tensor> quantize_per_token_int8(torch::Tensor x);
// int4_w4a8 on AVX512-VNNI (int4_w4a8.cpp; groups of a multiple of 32 k), on
// packing.pack_vnni_w4a8's panels (a copy made at load), for every batch size.
torch::Tensor int4_w4a8_packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                      int64_t group_size, c10::optional<torch::Tensor> bias);
// One row of x (K % 16 == 0) as quantize_per_token_int8 does it: q, and the scale returned.
float quantize_row_int8(const at::BFloat16* x, int64_t K, int8_t* q);
// formats.quantize of a bf16 weight [N, K] into q, scale (and zero: asymmetric int4), bit for
// bit: kind 1 int8 (both int8 schemes' rows; wsum: int8_w8a8's row sums), 2 int4 (packed;
// groups of a multiple of 16 k), 3 fp8_w8a16 (per channel); a NaN's row or group: NaN scale.
void quantize_weight(torch::Tensor w, int64_t kind, int64_t group_size, torch::Tensor q, torch::Tensor scale,
                     c10::optional<torch::Tensor> zero, c10::optional<torch::Tensor> wsum);
// The packed copies of quantized weights that the GEMMs read, written into `out`
// (pack_weights.cpp): packing.pack_vnni_w8a8 [ceil(N / 32), K / 4, 32, 4], pack_amx_w8a8
// [ceil(N / 32), ceil(K / 64), 2, 16, 64] and pack_vnni_w4a8 (uint8 [ceil(N / 16), K / 8 * 64
// + groups * 128], from formats' int4 rows, scales and zero points, none where symmetric).
void pack_vnni_w8a8(torch::Tensor q, torch::Tensor out);
void pack_amx_w8a8(torch::Tensor q, torch::Tensor out);
void pack_vnni_w4a8(torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> zero, int64_t group_size,
                    torch::Tensor out);
// quantize_grain (parallel_for's grain for quantizing rows of x): avx512_int8.h
// int8_w8a8 on AMX-INT8 (amx_w8a8.cpp) on packing.pack_amx_w8a8's layout.
bool amx_w8a8_available();
// AMX-BF16 tiles usable here (CPU, compiler and the kernel's permission); prefill attention's
bool amx_bf16_available();
#ifdef MINIVLLM_HAVE_AMX
// Every AMX kernel's tile palette: 8 tiles of 16 rows x 64 bytes. The configuration is
// thread state: each thread loads it before its first tile op and releases it after.
void amx_load_tile_config();
void amx_release_tiles();
#endif
torch::Tensor amx_w8a8_linear(torch::Tensor x, torch::Tensor packed, int64_t in_features,
                              torch::Tensor scale, c10::optional<torch::Tensor> bias);
// Weight-only int8 / fp8 (per channel) and int4 (groups of a multiple of 128) on AMX-BF16
// tiles (amx_weight_only.cpp), on formats' rows; kinds as quant_linear's.
bool amx_weight_only_supports(int64_t kind, int64_t in_features, int64_t group_size);
torch::Tensor amx_weight_only_linear(torch::Tensor x, int64_t kind, torch::Tensor weight, torch::Tensor scale,
                                     c10::optional<torch::Tensor> zero, int64_t group_size,
                                     c10::optional<torch::Tensor> bias);
// int8_w8a8's GEMM on CPUs with AVX512-VNNI but no AMX (quant_w8a8.cpp), on packing.pack_vnni_w8a8's layout.
torch::Tensor vnni_w8a8_linear(torch::Tensor x, torch::Tensor packed, int64_t in_features, torch::Tensor scale,
                               torch::Tensor wsum, c10::optional<torch::Tensor> bias);
// int8_w8a8 on a prepacked copy in any of packing.PACKED_LAYOUTS (told apart by its form).
torch::Tensor w8a8_packed_linear(torch::Tensor x, torch::Tensor packed, int64_t in_features, torch::Tensor scale,
                                 torch::Tensor wsum, c10::optional<torch::Tensor> bias);
// DeepSeek sparse attention (dsa.cpp) and routed experts (moe.cpp); the references are
// minivllm/layers/attention/dsa.py and minivllm/layers/moe.py.
torch::Tensor dsa_indexer_topk(torch::Tensor index_q, torch::Tensor index_w, torch::Tensor key_rows,
                               torch::Tensor row_req, torch::Tensor positions, torch::Tensor keys,
                               c10::optional<torch::Tensor> host_keys, int64_t topk, double scale);
torch::Tensor sparse_mla_decode(torch::Tensor q_abs, torch::Tensor latent, torch::Tensor rows, int64_t kv_lora,
                                double scale);
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor weights,
                          torch::Tensor ids);
torch::Tensor moe_quant_experts(torch::Tensor x, torch::Tensor topk_weights, torch::Tensor topk_ids,
                                int64_t num_experts, int64_t kind, int64_t group_size, torch::Tensor w13,
                                torch::Tensor s13, c10::optional<torch::Tensor> z13,
                                c10::optional<torch::Tensor> ws13, torch::Tensor w2, torch::Tensor s2,
                                c10::optional<torch::Tensor> z2, c10::optional<torch::Tensor> ws2,
                                std::vector<torch::Tensor> packed13, std::vector<torch::Tensor> packed2,
                                int64_t max_kernel_rows);
torch::Tensor llama_decode_layers(torch::Tensor hidden, std::vector<torch::Tensor> weights,
                                  std::vector<torch::Tensor> packed, int64_t max_kernel_rows,
                                  std::vector<int64_t> quant_kinds, std::vector<torch::Tensor> quant,
                                  std::vector<int64_t> max_quant_rows, std::vector<torch::Tensor> kv_caches,
                                  std::vector<int64_t> windows,
                                  torch::Tensor final_norm, torch::Tensor positions,
                                  torch::Tensor slot_mapping, torch::Tensor block_tables,
                                  torch::Tensor seq_lens, torch::Tensor cos, torch::Tensor sin,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  double eps, double scale);
