// Device side of kvplugin's CUDA ops: plain launchers, no torch types, no exceptions.
//
// The kernels live in kvplugin_cuda.cu (nvcc); everything that validates
// arguments, raises errors, builds pointer tables and registers ops lives in
// kvplugin_cuda_ops.cpp (host compiler), so no C++ exception ever unwinds
// through nvcc-compiled frames.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvplugin {
namespace cuda_impl {

// One gather/scatter launch.  Chunk side: C chunks of L*KV*T*H rows of `vpr`
// vectors of `vec_bytes` bytes, each chunk contiguous at chunk_ptrs[c].
// Paged side: layer_ptrs[l] + tok_off[c*T + t] + h*s_head_b + kv*s_kv_b +
// v*vstride_b; tok_off < 0 skips the token.
struct MoveArgs {
  char* const* layer_ptrs;  // device array [L]
  char* const* chunk_ptrs;  // device array [C] (device-accessible addresses)
  const int64_t* tok_off;   // device array [C * T], bytes
  int64_t s_head_b, s_kv_b, vstride_b;
  int64_t C, L, KV, T, H;
  int64_t vpr;        // vectors per row
  int vec_bytes;      // 16, 8, 4, 2 or 1
  int64_t max_ctas;   // 0 = as many as the work needs
};

// n_vec per chunk must be < 2^31 (checked by the caller).
cudaError_t launch_move(const MoveArgs& a, bool to_chunk, cudaStream_t stream) noexcept;

// One scatter_blocks launch where every block is one dense run on the paged side
// (block_runs() in kvplugin_cuda_ops.cpp): a block's tokens one after another, each
// token's P pieces of D bytes one after another, no per-token table.  Piece p of a
// token is head p and K/V `g` of its group (kv_inner false: K and V in separate
// regions, s_g_b apart, G == KV) or head p / 2 and K/V p % 2 (kv_inner true: a
// token's K and V interleaved per head, G == 1).  Chunk side: C chunks [L, KV, T, H,
// D bytes] at chunk_ptrs[c].  Block j of chunk c holds its tokens [j * block_size,
// (j + 1) * block_size); those in [spans[2c], spans[2c + 1]) go to layer_ptrs[l] +
// block_off[c * per + j] + g * s_g_b + (t - j * block_size) * P * D;
// block_off < 0: the block is not written.  D, every pointer and offset: multiples
// of 16 bytes.
struct BlockRunArgs {
  char* const* layer_ptrs;  // device array [L]
  char* const* chunk_ptrs;  // device array [C]
  const int64_t* block_off; // device array [C * per], bytes
  const int64_t* spans;     // device array [C * 2], tokens
  int64_t s_g_b, D_b;
  int64_t C, L, KV, T, H, G, P, per, block_size;
  bool kv_inner;
  int64_t max_ctas;         // 0 = as many as the work needs
};

cudaError_t launch_block_runs(const BlockRunArgs& a, cudaStream_t stream) noexcept;

// Validates n device slots (-1 <= s < limit) and writes byte offsets to tok_off
// (-1 for skipped or invalid slots); first_bad[0] receives the smallest invalid
// index (it must hold INT64_MAX before the launch).
cudaError_t launch_prepare(const int64_t* slots, int64_t n, int64_t limit, int64_t block_size,
                           int64_t kbs, int64_t sb_b, int64_t ss_b, int64_t st_b, int64_t* tok_off,
                           int64_t* first_bad, cudaStream_t stream) noexcept;

}  // namespace cuda_impl
}  // namespace kvplugin
