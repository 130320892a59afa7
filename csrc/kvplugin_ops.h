// Shared between the CPU and CUDA kernels of kvplugin::gather / scatter.
#pragma once

#include <ATen/ATen.h>

namespace kvplugin {

// Sizes of the canonical chunk side and strides (in elements) of the paged side.
struct Geometry {
  int64_t C, L, KV, T, H, D;
  int64_t s_block, s_sub, s_tok, s_head, s_kv, s_dim;
  int64_t block_size, kbs, num_blocks;
  int64_t esize;
};

// Fills the paged-side fields of g (strides, block sizes; g.H, g.KV, g.D and
// g.esize must be set) and checks that every address they reach lies inside
// each layer's storage; throws naming the op and the offending value.
void check_paged(const char* op, at::TensorList layers, at::IntArrayRef strides,
                 int64_t block_size, int64_t kernel_block_size, int64_t num_blocks,
                 Geometry& g);

// Validates the arguments of both ops (shapes, dtypes, devices); throws with a
// message naming the op and the offending value.
Geometry check_args(const char* op, at::TensorList layers,
                    const at::Tensor& slots, at::IntArrayRef strides,
                    int64_t block_size, int64_t kernel_block_size,
                    int64_t num_blocks, const at::Tensor& chunk);

}  // namespace kvplugin
