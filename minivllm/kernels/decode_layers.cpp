// Every decoder layer of a Llama-family model for one decode step, in one call.
//
// At batch 1 a decode step is ~40 ms of weight streaming and, when driven from
// Python, another ~5 ms of per-op overhead: 28 layers x ~60 Python-level calls
// (views, splits, metadata lookups, kernel launches). Here the same kernels run
// in the same order from C++, so the per-op cost is a few microseconds and the
// numbers are bitwise those of the per-layer path (tests/test_kernels.py checks).
//
// The layer: x -> RMSNorm -> QKV (+bias) -> [q/k RMSNorm per head] -> rotary ->
// write k, v to the paged cache -> paged attention -> O -> add & RMSNorm -> gate/up
// -> SiLU-and-mul -> down; the residual stream is carried in bf16 as in the
// Python path. A linear may be quantized (quant_gemm.cpp's formats): each has a kind,
// 0 for bf16, and its scales and the like.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"

namespace {

// Per layer, in this order (an empty tensor stands for "none"):
enum Slot { IN_NORM, QKV_W, QKV_B, Q_NORM, K_NORM, O_W, O_B, POST_NORM, GATE_UP_W, GATE_UP_B, DOWN_W, DOWN_B, NUM_SLOTS };

c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  if (t.numel() == 0) return c10::nullopt;
  return t;
}

// cache: [2, Hkv, num_blocks, block_size, D]; src: [B, Hkv, D] rows with row stride `stride`.
void write_cache(torch::Tensor& cache, int which, const at::BFloat16* src, int64_t row_stride,
                 const int64_t* slots, int64_t B, int64_t Hkv, int64_t D) {
  const int64_t slots_per_head = cache.size(2) * cache.size(3);
  at::BFloat16* base = cache.data_ptr<at::BFloat16>() + which * Hkv * slots_per_head * D;
  // split past 4 rows: a decode batch's rows land in cache lines that are cold (mostly
  // read for ownership from memory), which one thread waited out alone. The slots must be
  // distinct (the scheduler's are), or two threads would write the same row.
  at::parallel_for(0, B, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t h = 0; h < Hkv; ++h)
        std::memcpy(base + (h * slots_per_head + slots[b]) * D, src + b * row_stride + h * D,
                    D * sizeof(at::BFloat16));
  });
}

// y = x W^T + b on a oneDNN-prepacked weight (see layers/cpu_linear.py), through the
// dispatcher: the op has no public C++ entry point.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.numel() ? c10::IValue(bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One linear layer's weight as the step reads it: bf16 (kind 0, with its oneDNN-packed
// copy or an empty tensor), or quantized (quant_linear's kinds) with [scale, zero, wsum,
// packed] in `quant` (empty tensors for none; packed: int8_w8a8's copy in one of
// packing.PACKED_LAYOUTS, or int4_w4a8's panels, packing.pack_vnni_w4a8).
struct Linear {
  const torch::Tensor& w;
  const torch::Tensor& bias;
  const torch::Tensor& packed;
  int64_t kind;
  const torch::Tensor* quant;
};

// The weight-streaming kernels up to their row limits; past them a GEMM: oneDNN's on bf16's
// packed copy (or on its plain weight where the model has none; max_kernel_rows is then
// cpu_linear.py's limit for plain weights), ours on int8_w8a8's and int4_w4a8's (whose
// limit is 0: every batch), and for the weight-only schemes, as QuantizedLinearMethod.apply does, dequantized_linear up
// to kernel_limits.max_dequantized_rows
// (int4, block-scaled fp8), then oneDNN's on the weight dequantized to bf16.
// max_quant_rows[kind]: kernel_limits.max_kernel_rows, block-scaled fp8's (kind 3 with a 2-D
// scale) at index FP8_BLOCKS_ROWS; then the two dequantized_linear limits, then the rows up
// to which the weight-only kinds run on AMX-BF16 tiles where the kernel takes a layer
// (amx_weight_only.cpp; 0 on CPUs without AMX), then for kinds 1-3 the rows quant_linear
// keeps before it on such a layer (kernel_limits.AMX_MAX_STREAMING_ROWS); a layer it does
// not take (int4 in groups of 64, say) keeps its kind's own limit, as in the Python path.
// layers/fused_decode.py's indices, past the kinds:
constexpr int64_t FP8_BLOCKS_ROWS = 6, INT4_DEQUANTIZED_ROWS = 7, FP8_BLOCKS_DEQUANTIZED_ROWS = 8,
                  AMX_WEIGHT_ONLY_ROWS = 9, AMX_STREAMING_ROWS = 10;  // + kind - 1
torch::Tensor linear(const torch::Tensor& x, const Linear& l, int64_t max_kernel_rows,
                     const std::vector<int64_t>& max_quant_rows) {
  if (l.kind == 0) {
    if (x.size(0) > max_kernel_rows)
      return l.packed.numel() ? packed_linear(x, l.packed, l.bias) : at::linear(x, l.w, maybe(l.bias));
    return gemv_bf16(x, l.w, maybe(l.bias));
  }
  const torch::Tensor *scale = l.quant, *zero = l.quant + 1, *wsum = l.quant + 2, *packed = l.quant + 3;
  // int4's and block-scaled fp8's scale: [N, K / G]
  const int64_t group_size = scale->dim() == 2 ? x.size(1) / scale->size(1) : 0;
  const bool fp8_blocks = l.kind == 3 && group_size > 0;
  const bool amx = l.kind <= 3 && !fp8_blocks && max_quant_rows[AMX_WEIGHT_ONLY_ROWS] > 0 &&
                   amx_weight_only_supports(l.kind, x.size(1), group_size);
  const int64_t streamed = amx ? max_quant_rows[AMX_STREAMING_ROWS + l.kind - 1]
                               : max_quant_rows[fp8_blocks ? FP8_BLOCKS_ROWS : l.kind];
  if (x.size(0) > streamed) {
    // x's K, not the rows' (int8_w8a8 on VNNI panels keeps none: packing.drop_rows)
    if (l.kind == 4) return w8a8_packed_linear(x, *packed, x.size(1), *scale, *wsum, maybe(l.bias));
    if (l.kind == 5) return int4_w4a8_packed_linear(x, *packed, scale->size(0), group_size, maybe(l.bias));
    if (amx && x.size(0) <= max_quant_rows[AMX_WEIGHT_ONLY_ROWS])
      return amx_weight_only_linear(x, l.kind, l.w, *scale, maybe(*zero), group_size, maybe(l.bias));
    const int64_t dequantized = l.kind == 2 ? max_quant_rows[INT4_DEQUANTIZED_ROWS]
                                : fp8_blocks ? max_quant_rows[FP8_BLOCKS_DEQUANTIZED_ROWS]
                                             : 0;
    if (x.size(0) <= dequantized)
      return dequantized_linear(x, l.kind, l.w, *scale, maybe(*zero), group_size, maybe(l.bias));
    auto dense = torch::empty({scale->size(0), x.size(1)}, x.options());
    dequantize_bf16(l.kind, l.w, *scale, maybe(*zero), group_size, dense);
    return at::linear(x, dense, maybe(l.bias));
  }
  return quant_linear(x, l.kind, l.w, *scale, maybe(*zero), maybe(*wsum), group_size, maybe(l.bias));
}

}  // namespace

// Writes the step's keys and values into a layer's paged cache [2, Hkv, NB, BS, D]:
// k, v: [T, Hkv, D] (rows may be strided views into the fused qkv output); slots: [T].
// Replaces two index_copy_ calls on transposed views (~0.25 ms a layer at 128 tokens).
void write_kv_cache(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16 && kv_cache.is_contiguous() && kv_cache.dim() == 5,
              "kv_cache: contiguous bf16 [2, Hkv, NB, BS, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slots: int64");
  const int64_t T = k.size(0), Hkv = kv_cache.size(1), D = kv_cache.size(4);
  for (const auto& t : {k, v}) {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.dim() == 3 && t.size(0) == T && t.size(1) == Hkv &&
                    t.size(2) == D && t.stride(2) == 1 && t.stride(1) == D,
                "k, v: bf16 [T, Hkv, D] with each row's heads contiguous");
  }
  TORCH_CHECK(slot_mapping.numel() == T, "one slot per token");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  write_cache(kv_cache, 0, k.data_ptr<at::BFloat16>(), k.stride(0), slots, T, Hkv, D);
  write_cache(kv_cache, 1, v.data_ptr<at::BFloat16>(), v.stride(0), slots, T, Hkv, D);
}

// hidden: [B, H] embeddings of the step's tokens; returns the final-normed hidden [B, H].
torch::Tensor llama_decode_layers(torch::Tensor hidden, std::vector<torch::Tensor> weights,
                                  std::vector<torch::Tensor> packed, int64_t max_kernel_rows,
                                  std::vector<int64_t> quant_kinds, std::vector<torch::Tensor> quant,
                                  std::vector<int64_t> max_quant_rows, std::vector<torch::Tensor> kv_caches,
                                  std::vector<int64_t> windows,
                                  torch::Tensor final_norm, torch::Tensor positions,
                                  torch::Tensor slot_mapping, torch::Tensor block_tables,
                                  torch::Tensor seq_lens, torch::Tensor cos, torch::Tensor sin,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  double eps, double scale) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * NUM_SLOTS, "weights: 12 per layer");
  TORCH_CHECK(static_cast<int64_t>(packed.size()) == L * 4, "packed: qkv, o, gate_up, down per layer");
  TORCH_CHECK(static_cast<int64_t>(quant_kinds.size()) == L * 4, "quant_kinds: one per linear");
  TORCH_CHECK(static_cast<int64_t>(quant.size()) == L * 16, "quant: scale, zero, wsum, packed per linear");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == L, "one window per layer");
  // one per formats.KERNEL_KIND, then block-scaled fp8's, then int4's and block-scaled
  // fp8's dequantized_linear limits, then the weight-only kinds' on AMX tiles and before them
  TORCH_CHECK(static_cast<int64_t>(max_quant_rows.size()) == AMX_STREAMING_ROWS + 3,
              "max_quant_rows: one per quant kind 0-5, block-scaled fp8's, int4's and block-scaled "
              "fp8's dequantized_linear limits, the AMX weight-only rows and kinds 1-3's streaming rows before them");
  for (int64_t kind : quant_kinds)
    TORCH_CHECK(kind >= 0 && kind <= 5, "quant_kinds: 0 (bf16) to 5 (int4_w4a8), got ", kind);
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.dim() == 2, "hidden: bf16 [B, H]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slots: int64");
  const int64_t B = hidden.size(0), D = head_dim;
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  torch::Tensor h, residual;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights.data() + l * NUM_SLOTS;
    if (l == 0) {
      residual = hidden.contiguous().clone();
      h = rms_norm(residual, w[IN_NORM], eps);
    } else {
      h = fused_add_rms_norm(h, residual, w[IN_NORM], eps);
    }
    const torch::Tensor* pk = packed.data() + l * 4;  // empty tensors where not packed
    auto lin = [&](int i, Slot weight, Slot bias) {  // linear i of the layer: qkv, o, gate_up, down
      return Linear{w[weight], w[bias], pk[i], quant_kinds[l * 4 + i], quant.data() + (l * 4 + i) * 4};
    };
    const Linear qkv_proj = lin(0, QKV_W, QKV_B), o_proj = lin(1, O_W, O_B);
    const Linear gate_up_proj = lin(2, GATE_UP_W, GATE_UP_B), down_proj = lin(3, DOWN_W, DOWN_B);
    torch::Tensor qkv = linear(h, qkv_proj, max_kernel_rows, max_quant_rows);  // [B, q + 2 kv]
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({B, num_heads, D});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, D});
    if (w[Q_NORM].numel()) q = rms_norm(q, w[Q_NORM], eps);
    if (w[K_NORM].numel()) k = rms_norm(k, w[K_NORM], eps);
    rotary_inplace(q, positions, cos, sin);
    rotary_inplace(k, positions, cos, sin);
    torch::Tensor& cache = kv_caches[l];
    write_cache(cache, 0, k.data_ptr<at::BFloat16>(), k.stride(0), slots, B, num_kv_heads, D);
    write_cache(cache, 1, qkv.data_ptr<at::BFloat16>() + q_size + kv_size, qkv.stride(0), slots, B,
                num_kv_heads, D);
    torch::Tensor attn = paged_attention_decode(q, cache[0], cache[1], block_tables, seq_lens, scale,
                                                windows[l]);
    torch::Tensor o = linear(attn.view({B, q_size}), o_proj, max_kernel_rows, max_quant_rows);
    h = fused_add_rms_norm(o, residual, w[POST_NORM], eps);
    torch::Tensor act = silu_and_mul(linear(h, gate_up_proj, max_kernel_rows, max_quant_rows));
    h = linear(act, down_proj, max_kernel_rows, max_quant_rows);
  }
  return fused_add_rms_norm(h, residual, final_norm, eps);
}
