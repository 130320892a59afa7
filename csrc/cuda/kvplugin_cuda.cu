// The CUDA kernels of kvplugin::gather / scatter (and of the transfer engine's
// gather_multi / scatter_multi / scatter_blocks).  Launchers only: argument checks, errors,
// pointer tables and op registration are in kvplugin_cuda_ops.cpp.
//
// One kernel serves both ops and both directions.  It walks the chunk side in
// memory order, in "vectors" of W bytes (W = 16 when the paged rows are dense,
// the head dim is a multiple of 16 bytes and every pointer/stride is 16-byte
// aligned; else the largest of 8, 4, 2, 1 that fits; element by element when
// the head dim is strided).  The paged byte offset of every chunk token is
// computed once per call (a tiny kernel for device slots, the host for host
// slots), so the copy kernel does three magic-number divisions per vector and
// no slot arithmetic.  Each thread issues 4 independent loads before its
// stores (streaming cache hints: the data is touched once).
//
// scatter_blocks has a kernel of its own where every block is one dense run on
// the paged side (vLLM 0.26's NHD with K and V interleaved per head, MLA): one CTA
// per (chunk, layer, block[, K/V]) writes the run in order from the block's offset
// alone, reading each vector from its head's row in the chunk.
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cassert>
#include <climits>
#include <cstdint>

#include <ATen/cuda/detail/IntegerDivider.cuh>

#include "kvplugin_cuda.h"

namespace kvplugin {
namespace cuda_impl {
namespace {

using Div = at::cuda::detail::IntDivider<unsigned int>;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

struct MoveParams {
  char* const* layer_ptrs;
  char* const* chunk_ptrs;
  const int64_t* tok_off;
  int64_t s_head_b, s_kv_b, vstride_b;
  int64_t C;
  uint32_t T;
  uint32_t n_vec;  // vectors per chunk
  uint32_t kv2;    // 1 when KV == 2
  Div vpr, H, Tdiv;
};

template <typename V, bool kToChunk>
__global__ void __launch_bounds__(kThreads) move_kernel(const MoveParams p) {
  const uint32_t tile = kThreads * kUnroll;
  for (int64_t c = blockIdx.y; c < p.C; c += gridDim.y) {
    char* const chunk = p.chunk_ptrs[c];
    const int64_t* const tok = p.tok_off + c * p.T;
    for (uint64_t base = static_cast<uint64_t>(blockIdx.x) * tile; base < p.n_vec;
         base += static_cast<uint64_t>(gridDim.x) * tile) {
      V val[kUnroll];
      V* dst[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        dst[k] = nullptr;
        const uint64_t i64 = base + static_cast<uint64_t>(k) * kThreads + threadIdx.x;
        if (i64 < p.n_vec) {
          const uint32_t i = static_cast<uint32_t>(i64);
          const auto rv = p.vpr.divmod(i);        // row, vector in the row
          const auto hr = p.H.divmod(rv.div);     // (l, kv, t), head
          const auto tr = p.Tdiv.divmod(hr.div);  // (l, kv), token
          const uint32_t kv = p.kv2 ? (tr.div & 1u) : 0u;
          const uint32_t l = p.kv2 ? (tr.div >> 1) : tr.div;
          const int64_t off = tok[tr.mod];
          if (off >= 0) {
            char* paged = p.layer_ptrs[l] + off + hr.mod * p.s_head_b + kv * p.s_kv_b +
                          static_cast<int64_t>(rv.mod) * p.vstride_b;
            char* canon = chunk + i64 * sizeof(V);
            const V* src = reinterpret_cast<const V*>(kToChunk ? paged : canon);
            dst[k] = reinterpret_cast<V*>(kToChunk ? canon : paged);
            val[k] = __ldcs(src);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (dst[k] != nullptr) __stcs(dst[k], val[k]);
      }
    }
  }
}

__global__ void prepare_kernel(const int64_t* __restrict__ slots, int64_t n, int64_t limit,
                               int64_t block_size, int64_t kbs, int64_t sb_b, int64_t ss_b,
                               int64_t st_b, int64_t* __restrict__ tok_off,
                               unsigned long long* __restrict__ first_bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = slots[i];
    if (s < -1 || s >= limit) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
      tok_off[i] = -1;
    } else if (s < 0) {
      tok_off[i] = -1;
    } else {
      const int64_t b = s / block_size;
      const int64_t t = s - b * block_size;
      const int64_t sub = t / kbs;
      tok_off[i] = b * sb_b + sub * ss_b + (t - sub * kbs) * st_b;
    }
  }
}

constexpr int kRunUnroll = 8;  // 8 loads in flight per thread before its stores

struct RunParams {
  char* const* layer_ptrs;
  char* const* chunk_ptrs;
  const int64_t* block_off;
  const int64_t* spans;
  int64_t s_g_b, D_b, T, C, B, H, KV;
  uint32_t segs, G, per;
  bool kv_inner;
  Div perdiv, row_vecs, piece_vecs;
};

// One CTA per (chunk, layer, K/V group, block): the block's moved tokens, one
// contiguous run on the paged side, written in order; each 16-byte vector read from
// its piece (a head's K or V row) in the chunk.
__global__ void __launch_bounds__(kThreads) block_runs_kernel(const RunParams p) {
  const int64_t vpr = p.row_vecs.divisor;
  for (int64_t c = blockIdx.y; c < p.C; c += gridDim.y) {
    const int64_t lo_c = p.spans[2 * c], hi_c = p.spans[2 * c + 1];
    for (uint32_t s = blockIdx.x; s < p.segs; s += gridDim.x) {
      const auto q = p.perdiv.divmod(s);  // (layer, group), block of the chunk
      const int64_t off = p.block_off[c * p.per + q.mod];
      const int64_t t0 = static_cast<int64_t>(q.mod) * p.B;
      const int64_t lo = lo_c > t0 ? lo_c - t0 : 0;
      const int64_t hi = hi_c - t0 < p.B ? hi_c - t0 : p.B;
      if (off < 0 || hi <= lo) continue;  // the same for the whole CTA
      const uint32_t g = q.div % p.G, l = q.div / p.G;
      const char* chunk = p.chunk_ptrs[c];
      uint4* dst = reinterpret_cast<uint4*>(p.layer_ptrs[l] + off + g * p.s_g_b);
      const uint32_t a = static_cast<uint32_t>(lo * vpr), b = static_cast<uint32_t>(hi * vpr);
      for (uint32_t v = a + threadIdx.x; v < b; v += kThreads * kRunUnroll) {
        uint4 val[kRunUnroll];
#pragma unroll
        for (int k = 0; k < kRunUnroll; ++k) {
          const uint32_t i = v + k * kThreads;
          if (i < b) {
            const auto tr = p.row_vecs.divmod(i);         // token in the block, vector in its row
            const auto pw = p.piece_vecs.divmod(tr.mod);  // piece, vector in the piece
            const int64_t h = p.kv_inner ? (pw.div >> 1) : pw.div;
            const int64_t kv = p.kv_inner ? (pw.div & 1u) : g;
            const int64_t row = ((l * p.KV + kv) * p.T + t0 + tr.div) * p.H + h;
            val[k] = __ldcs(reinterpret_cast<const uint4*>(chunk + row * p.D_b) + pw.mod);
          }
        }
#pragma unroll
        for (int k = 0; k < kRunUnroll; ++k) {
          const uint32_t i = v + k * kThreads;
          if (i < b) __stcs(dst + i, val[k]);
        }
      }
    }
  }
}

// The grid of a launch over C chunks of per_chunk CTAs each (y: chunks, x: a chunk's
// CTAs; both loop), at most max_ctas CTAs when max_ctas > 0.
dim3 chunk_grid(int64_t per_chunk, int64_t C, int64_t max_ctas) {
  int64_t gx = per_chunk;
  int64_t gy = std::min<int64_t>(C, 65535);
  if (max_ctas > 0) {
    gy = std::min<int64_t>(gy, max_ctas);
    gx = std::max<int64_t>(1, std::min<int64_t>(gx, max_ctas / gy));
  }
  return dim3(static_cast<unsigned>(std::min<int64_t>(gx, INT32_MAX)), static_cast<unsigned>(gy));
}

template <bool kToChunk>
cudaError_t launch(const MoveArgs& a, cudaStream_t stream) {
  const int64_t n_vec = a.L * a.KV * a.T * a.H * a.vpr;
  if (n_vec <= 0 || a.C <= 0) return cudaSuccess;
  if (n_vec >= INT32_MAX || a.T >= INT32_MAX || a.H >= INT32_MAX || a.vpr >= INT32_MAX)
    return cudaErrorInvalidValue;
  MoveParams p;
  p.layer_ptrs = a.layer_ptrs;
  p.chunk_ptrs = a.chunk_ptrs;
  p.tok_off = a.tok_off;
  p.s_head_b = a.s_head_b;
  p.s_kv_b = a.s_kv_b;
  p.vstride_b = a.vstride_b;
  p.C = a.C;
  p.T = static_cast<uint32_t>(a.T);
  p.n_vec = static_cast<uint32_t>(n_vec);
  p.kv2 = a.KV == 2 ? 1u : 0u;
  p.vpr = Div(static_cast<unsigned int>(a.vpr));
  p.H = Div(static_cast<unsigned int>(a.H));
  p.Tdiv = Div(static_cast<unsigned int>(a.T));
  const int64_t tile = kThreads * kUnroll;
  const dim3 grid = chunk_grid((n_vec + tile - 1) / tile, a.C, a.max_ctas);
  switch (a.vec_bytes) {
    case 16: move_kernel<uint4, kToChunk><<<grid, kThreads, 0, stream>>>(p); break;
    case 8: move_kernel<uint2, kToChunk><<<grid, kThreads, 0, stream>>>(p); break;
    case 4: move_kernel<unsigned int, kToChunk><<<grid, kThreads, 0, stream>>>(p); break;
    case 2: move_kernel<unsigned short, kToChunk><<<grid, kThreads, 0, stream>>>(p); break;
    case 1: move_kernel<unsigned char, kToChunk><<<grid, kThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_move(const MoveArgs& a, bool to_chunk, cudaStream_t stream) noexcept {
  return to_chunk ? launch<true>(a, stream) : launch<false>(a, stream);
}

cudaError_t launch_block_runs(const BlockRunArgs& a, cudaStream_t stream) noexcept {
  const int64_t segs = a.L * a.G * a.per;
  if (segs <= 0 || a.C <= 0) return cudaSuccess;
  const int64_t piece_vecs = a.D_b / 16, row_vecs = a.P * piece_vecs;
  if (a.D_b % 16 != 0 || piece_vecs <= 0 || segs >= INT32_MAX || a.per >= INT32_MAX ||
      a.G <= 0 || a.block_size * row_vecs >= INT32_MAX || (a.kv_inner && (a.KV != 2 || a.G != 1)))
    return cudaErrorInvalidValue;
  RunParams p;
  p.layer_ptrs = a.layer_ptrs;
  p.chunk_ptrs = a.chunk_ptrs;
  p.block_off = a.block_off;
  p.spans = a.spans;
  p.s_g_b = a.s_g_b;
  p.D_b = a.D_b;
  p.T = a.T;
  p.C = a.C;
  p.B = a.block_size;
  p.H = a.H;
  p.KV = a.KV;
  p.segs = static_cast<uint32_t>(segs);
  p.G = static_cast<uint32_t>(a.G);
  p.per = static_cast<uint32_t>(a.per);
  p.kv_inner = a.kv_inner;
  p.perdiv = Div(static_cast<unsigned int>(a.per));
  p.row_vecs = Div(static_cast<unsigned int>(row_vecs));
  p.piece_vecs = Div(static_cast<unsigned int>(piece_vecs));
  block_runs_kernel<<<chunk_grid(segs, a.C, a.max_ctas), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_prepare(const int64_t* slots, int64_t n, int64_t limit, int64_t block_size,
                           int64_t kbs, int64_t sb_b, int64_t ss_b, int64_t st_b, int64_t* tok_off,
                           int64_t* first_bad, cudaStream_t stream) noexcept {
  if (n <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 4096);
  prepare_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      slots, n, limit, block_size, kbs, sb_b, ss_b, st_b, tok_off,
      reinterpret_cast<unsigned long long*>(first_bad));
  return cudaGetLastError();
}

}  // namespace cuda_impl
}  // namespace kvplugin
