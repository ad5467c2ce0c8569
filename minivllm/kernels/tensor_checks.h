// Argument checks that kernels of both families share (no ISA-specific code).
#pragma once

#include <torch/extension.h>

#include <vector>

// `t` is a contiguous `dtype` tensor of `shape`, else `op`'s error naming it.
inline void check_tensor(const char* op, const torch::Tensor& t, const char* name, at::ScalarType dtype,
                         const std::vector<int64_t>& shape) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.sizes() == c10::IntArrayRef(shape), op, ": ",
              name, " must be a contiguous ", c10::toString(dtype), " ", c10::IntArrayRef(shape));
}
