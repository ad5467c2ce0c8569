// What the two paged decode-attention kernels share (paged_attention.cpp: bf16 on
// AVX512-BF16; avx2_attention.cpp: fp32 on AVX2), with no ISA-specific code: how a row's
// context is cut into chunks, and the loop over (row, KV head) items that hands each
// item its chunks.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace paged_decode {

// The shapes of a decode call: q [B, Hq, D]; caches [Hkv, NB, BS, D]; block_tables
// [B, max_blocks] int64; seq_lens [B] int64. `check` validates them (dtypes: q's, and the
// caches' where they store another (avx2_attention.cpp's); contiguity,
// head_dim a multiple of `head_multiple` up to 256, Hq a multiple of Hkv) and makes the
// tables contiguous in place.
struct Shape {
  int64_t B, Hq, D, Hkv, NB, BS, G, max_blocks;

  static Shape check(torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     torch::Tensor& block_tables, torch::Tensor& seq_lens, at::ScalarType dtype,
                     int64_t head_multiple, c10::optional<at::ScalarType> cache_dtype = c10::nullopt) {
    const at::ScalarType cached = cache_dtype.value_or(dtype);
    TORCH_CHECK(q.scalar_type() == dtype, "q must be ", dtype);
    TORCH_CHECK(k_cache.scalar_type() == cached && v_cache.scalar_type() == cached, "the caches must be ", cached);
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
    q = q.contiguous();
    block_tables = block_tables.contiguous();
    seq_lens = seq_lens.contiguous();
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
    Shape s{q.size(0), q.size(1), q.size(2), k_cache.size(0), k_cache.size(1), k_cache.size(2), 0,
            block_tables.size(1)};
    TORCH_CHECK(s.D % head_multiple == 0 && s.D <= 256, "head_dim must be a multiple of ", head_multiple,
                ", at most 256");
    TORCH_CHECK(s.Hq % s.Hkv == 0, "query heads must be a multiple of KV heads");
    s.G = s.Hq / s.Hkv;
    return s;
  }
};

struct Chunk {
  int64_t row;  // first row in the head's [num_blocks * block_size, D] cache
  int n;        // tokens
};

// Tokens [begin, end) of a request as chunks of at most `chunk` tokens that do not cross
// block boundaries.
inline void make_chunks(const int64_t* blocks, int64_t begin, int64_t end, int64_t BS, int64_t chunk,
                        std::vector<Chunk>& out) {
  out.clear();
  for (int64_t t = begin; t < end;) {
    const int64_t b = t / BS, in_block = t - b * BS;
    const int64_t n = std::min<int64_t>({chunk, BS - in_block, end - t});
    out.push_back({blocks[b] * BS + in_block, static_cast<int>(n)});
    t += n;
  }
}

// The first chunk of the item a thread takes next (its KV head, and the chunk), so that an
// attend can fetch it ahead while it works on its own last chunk; head < 0: none.
struct Next {
  int64_t head = -1;
  Chunk chunk{0, 0};
};

// For every row b and KV head h, in parallel: attend(b, h, chunks, scratch, next) where row
// b has tokens to attend to (its last `window` ones when window > 0), else empty(b, h).
// Items run b-major, so a thread cuts each row's chunks once.
template <class Attend, class Empty>
void for_each_row_head(int64_t B, int64_t Hkv, const int64_t* seq_lens, const int64_t* block_tables,
                       int64_t max_blocks, int64_t BS, int64_t window, int64_t chunk, const Attend& attend,
                       const Empty& empty) {
  auto first_token = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0; };
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<Chunk> chunks, ahead;
    int64_t chunks_of = -1;  // the row `chunks` was made for
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const int64_t seq_len = seq_lens[b];
      if (seq_len <= 0) {  // nothing to attend to (not produced by the scheduler)
        empty(b, h);
        continue;
      }
      if (chunks_of != b) {
        make_chunks(block_tables + b * max_blocks, first_token(b), seq_len, BS, chunk, chunks);
        chunks_of = b;
      }
      Next next;
      if (i + 1 < end) {
        const int64_t nb = (i + 1) / Hkv;
        if (nb == b) {
          next = {(i + 1) % Hkv, chunks.front()};
        } else if (seq_lens[nb] > 0) {
          const int64_t first = first_token(nb);
          make_chunks(block_tables + nb * max_blocks, first, std::min(seq_lens[nb], first + chunk), BS, chunk, ahead);
          next = {0, ahead.front()};
        }
      }
      attend(b, h, chunks, scratch, next);
    }
  });
}

}  // namespace paged_decode
