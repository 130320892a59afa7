// kvplugin::gather / kvplugin::scatter: the CUDA kernel, plus two ops the
// transfer engine uses (kvplugin::gather_multi / kvplugin::scatter_multi).
//
// Same contract as the CPU kernel in ../kvplugin_ops.cpp: the chunk side is
// out[C, L, KV, T, H, D] (contiguous); the paged side is one base pointer per
// layer plus six element strides [block, sub, tok, head, kv, dim]; slots[c, t]
// is block_id * block_size + offset, or -1 (token skipped on both sides).
// Every slot is validated before anything moves: an out-of-range slot raises
// and nothing is written.
//
// One kernel serves both ops and both directions.  It walks the chunk side in
// memory order, in "vectors" of W bytes (W = 16 when the paged rows are dense,
// the head dim is a multiple of 16 bytes and every pointer/stride is 16-byte
// aligned; else the largest of 8, 4, 2, 1 that fits; element by element when
// the head dim is strided).  The paged offset of every chunk token is computed
// once, before the launch (a tiny kernel for kvplugin::gather/scatter, which
// also validates; on the host for the *_multi ops, whose slots live on the
// host), so the copy kernel does three fast integer divisions per vector and
// no slot arithmetic.
//
// kvplugin::gather_multi / scatter_multi (internal to the transfer engine):
//   gather_multi(Tensor[] kv_layers, Tensor slots, int[] strides, int block_size,
//                int kernel_block_size, int num_blocks, Tensor(a!)[] outs,
//                int max_ctas) -> ()
// take host slots [C, T] (validated on the host: no device sync, so a store
// can be queued behind the forward that writes the blocks) and a list of chunk
// tensors [n_i, L, KV, T, H, D] with sum n_i = C, each either on the cache's
// GPU or in page-locked host memory (zero-copy: the kernel reads/writes host
// memory over the link through its device mapping).  max_ctas > 0 caps the
// grid (a zero-copy copy runs at link speed; it need not hold every SM).
#include <ATen/ATen.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>
#include <vector>

#include "../kvplugin_ops.h"

namespace kvplugin {
namespace {

using Div = at::cuda::detail::IntDivider<unsigned int>;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

struct MoveParams {
  char* const* layer_ptrs;   // [L] device array of layer base pointers
  char* const* chunk_ptrs;   // [C] device array of chunk pointers (device-accessible)
  const int64_t* tok_off;    // [C * T] byte offset of (slot, head 0, kv 0, dim 0), -1 = skip
  int64_t s_head_b, s_kv_b;  // paged strides in bytes
  int64_t vstride_b;         // bytes between consecutive vectors of a row on the paged side
  int64_t C;
  uint32_t T;
  uint32_t n_vec;  // vectors per chunk: L * KV * T * H * vpr
  uint32_t kv2;    // 1 when KV == 2
  Div vpr, H, Tdiv;
};

template <typename V>
__device__ __forceinline__ V load_stream(const V* p) {
  return __ldcs(p);
}
template <typename V>
__device__ __forceinline__ void store_stream(V* p, const V& v) {
  __stcs(p, v);
}

// One thread moves kUnroll vectors per tile: all loads first, then all stores,
// so several independent 16-byte loads are in flight per thread.
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
          const auto rv = p.vpr.divmod(i);      // row, vector in row
          const auto hr = p.H.divmod(rv.div);   // (l, kv, t), head
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
            val[k] = load_stream(src);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (dst[k] != nullptr) store_stream(dst[k], val[k]);
      }
    }
  }
}

// Validates device slots and turns them into byte offsets (kvplugin::gather/scatter).
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

struct Plan {
  int W;              // vector bytes
  int64_t vstride_b;  // paged bytes between vectors of a row
  int64_t vpr;        // vectors per row
};

bool aligned(uint64_t x, int W) { return (x % static_cast<uint64_t>(W)) == 0; }

// Widest vector that every pointer and stride allows.
Plan plan_vectors(const Geometry& g, const std::vector<int64_t>& layer_ptrs,
                  const std::vector<int64_t>& chunk_ptrs) {
  if (g.s_dim == 1) {
    const int64_t row_bytes = g.D * g.esize;
    for (int W = 16; W >= g.esize; W /= 2) {
      bool ok = aligned(row_bytes, W);
      for (int64_t s : {g.s_block, g.s_sub, g.s_tok, g.s_head, g.s_kv})
        ok = ok && aligned(static_cast<uint64_t>(s * g.esize), W);
      for (int64_t p : layer_ptrs) ok = ok && aligned(static_cast<uint64_t>(p), W);
      for (int64_t p : chunk_ptrs) ok = ok && aligned(static_cast<uint64_t>(p), W);
      if (ok) return Plan{W, W, row_bytes / W};
    }
  }
  return Plan{static_cast<int>(g.esize), g.s_dim * g.esize, g.D};
}

template <bool kToChunk>
void launch_move(const Geometry& g, const Plan& plan, char* const* layer_ptrs_dev,
                 char* const* chunk_ptrs_dev, const int64_t* tok_off_dev, int64_t max_ctas,
                 cudaStream_t stream) {
  const int64_t n_vec = g.L * g.KV * g.T * g.H * plan.vpr;
  TORCH_CHECK(n_vec < INT32_MAX && g.T < INT32_MAX && plan.vpr < INT32_MAX && g.H < INT32_MAX,
              "kvplugin: one chunk is too large for the CUDA kernel (", n_vec, " vectors)");
  MoveParams p;
  p.layer_ptrs = layer_ptrs_dev;
  p.chunk_ptrs = chunk_ptrs_dev;
  p.tok_off = tok_off_dev;
  p.s_head_b = g.s_head * g.esize;
  p.s_kv_b = g.s_kv * g.esize;
  p.vstride_b = plan.vstride_b;
  p.C = g.C;
  p.T = static_cast<uint32_t>(g.T);
  p.n_vec = static_cast<uint32_t>(n_vec);
  p.kv2 = g.KV == 2 ? 1u : 0u;
  p.vpr = Div(static_cast<unsigned int>(plan.vpr));
  p.H = Div(static_cast<unsigned int>(g.H));
  p.Tdiv = Div(static_cast<unsigned int>(g.T));
  const int64_t tile = kThreads * kUnroll;
  int64_t gx = (n_vec + tile - 1) / tile;
  int64_t gy = std::min<int64_t>(g.C, 65535);
  if (max_ctas > 0) {
    gy = std::min<int64_t>(gy, max_ctas);
    gx = std::max<int64_t>(1, std::min<int64_t>(gx, max_ctas / gy));
  }
  gx = std::min<int64_t>(gx, INT32_MAX);
  dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  switch (plan.W) {
#define KVP_CASE(W_, T_)                                                  \
  case W_:                                                                \
    move_kernel<T_, kToChunk><<<grid, kThreads, 0, stream>>>(p);          \
    break;
    KVP_CASE(16, uint4)
    KVP_CASE(8, uint2)
    KVP_CASE(4, unsigned int)
    KVP_CASE(2, unsigned short)
    KVP_CASE(1, unsigned char)
#undef KVP_CASE
    default:
      TORCH_CHECK(false, "kvplugin: unsupported vector width ", plan.W);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::vector<int64_t> layer_pointers(at::TensorList layers) {
  std::vector<int64_t> out;
  out.reserve(layers.size());
  for (const auto& t : layers) out.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
  return out;
}

// Copies host int64 values to the device on the current stream, through a
// page-locked buffer (the caching host allocator keeps it until the copy ran).
at::Tensor upload(const std::vector<int64_t>& values, const at::Device& device) {
  auto host = at::empty({static_cast<int64_t>(values.size())},
                        at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  return host.to(device, /*non_blocking=*/true);
}

void check_layers_on(const char* op, at::TensorList layers, const at::Device& device) {
  for (const auto& t : layers) {
    TORCH_CHECK(t.is_cuda() && t.device() == device, op, ": every layer must be on ", device,
                ", got ", t.device());
  }
}

// ---------------------------------------------------------------- gather / scatter

template <bool kToChunk>
void move_cuda(const char* op, at::TensorList layers, const at::Tensor& slots,
               at::IntArrayRef strides, int64_t block_size, int64_t kernel_block_size,
               int64_t num_blocks, const at::Tensor& chunk) {
  auto g = check_args(op, layers, slots, strides, block_size, kernel_block_size, num_blocks,
                      chunk);
  TORCH_CHECK(chunk.is_cuda(), op, ": chunk must be a CUDA tensor");
  check_layers_on(op, layers, chunk.device());
  c10::cuda::CUDAGuard guard(chunk.device());
  const int64_t n = g.C * g.T;
  if (n == 0 || chunk.numel() == 0) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // 1. validate the slots and compute per-token byte offsets (one tiny kernel)
  auto opts = chunk.options().dtype(at::kLong);
  auto tok_off = at::empty({n}, opts);
  auto first_bad = at::full({1}, INT64_MAX, opts);
  {
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 4096);
    prepare_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        slots.data_ptr<int64_t>(), n, num_blocks * block_size, block_size, kernel_block_size,
        g.s_block * g.esize, g.s_sub * g.esize, g.s_tok * g.esize, tok_off.data_ptr<int64_t>(),
        reinterpret_cast<unsigned long long*>(first_bad.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t bad = first_bad.item<int64_t>();  // synchronizes: nothing moved yet
  if (bad != INT64_MAX) {
    const int64_t value = slots.reshape({-1})[bad].item<int64_t>();
    TORCH_CHECK(false, op, ": slot ", value, " at index ", bad, " is outside the cache (",
                num_blocks, " blocks of ", block_size, " tokens)");
  }

  // 2. pointer tables: [layers L][chunks C]
  auto lp = layer_pointers(layers);
  std::vector<int64_t> cp(g.C);
  const int64_t chunk_bytes = g.L * g.KV * g.T * g.H * g.D * g.esize;
  char* base = static_cast<char*>(chunk.data_ptr());
  for (int64_t c = 0; c < g.C; ++c) cp[c] = reinterpret_cast<int64_t>(base + c * chunk_bytes);
  const Plan plan = plan_vectors(g, lp, cp);
  std::vector<int64_t> table(lp);
  table.insert(table.end(), cp.begin(), cp.end());
  auto dev_table = upload(table, chunk.device());
  auto ptrs = reinterpret_cast<char* const*>(dev_table.data_ptr<int64_t>());
  launch_move<kToChunk>(g, plan, ptrs, ptrs + g.L, tok_off.data_ptr<int64_t>(), 0, stream);
}

void gather_cuda(at::TensorList kv_layers, const at::Tensor& slots, at::IntArrayRef strides,
                 int64_t block_size, int64_t kernel_block_size, int64_t num_blocks,
                 const at::Tensor& out) {
  move_cuda<true>("kvplugin::gather", kv_layers, slots, strides, block_size, kernel_block_size,
                  num_blocks, out);
}

void scatter_cuda(at::TensorList kv_layers, const at::Tensor& slots, at::IntArrayRef strides,
                  int64_t block_size, int64_t kernel_block_size, int64_t num_blocks,
                  const at::Tensor& src) {
  move_cuda<false>("kvplugin::scatter", kv_layers, slots, strides, block_size, kernel_block_size,
                   num_blocks, src);
}

// ------------------------------------------------------- gather_multi / scatter_multi

// Device-accessible address of a chunk tensor: the tensor itself on the cache's
// GPU, or the device mapping of page-locked host memory (zero-copy).
int64_t device_address(const char* op, const at::Tensor& t, const at::Device& device) {
  if (t.is_cuda()) {
    TORCH_CHECK(t.device() == device, op, ": chunk tensor on ", t.device(), " but the cache is on ",
                device);
    return reinterpret_cast<int64_t>(t.data_ptr());
  }
  TORCH_CHECK(t.device().is_cpu(), op, ": chunk tensors must be CUDA or page-locked CPU tensors");
  cudaPointerAttributes attr;
  C10_CUDA_CHECK(cudaPointerGetAttributes(&attr, t.data_ptr()));
  TORCH_CHECK(attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr, op,
              ": host chunk tensor is not page-locked and mapped for the device (zero-copy "
              "needs pinned memory)");
  return reinterpret_cast<int64_t>(attr.devicePointer);
}

template <bool kToChunk>
void move_multi(const char* op, at::TensorList layers, const at::Tensor& slots,
                at::IntArrayRef strides, int64_t block_size, int64_t kernel_block_size,
                int64_t num_blocks, at::TensorList chunks, int64_t max_ctas) {
  TORCH_CHECK(!layers.empty(), op, ": no layers");
  TORCH_CHECK(!chunks.empty(), op, ": no chunk tensors");
  TORCH_CHECK(layers[0].is_cuda(), op, ": layers must be CUDA tensors");
  TORCH_CHECK(slots.device().is_cpu(), op, ": slots must be a CPU tensor (validated on the host)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), op,
              ": slots must be contiguous int64");
  const at::Device device = layers[0].device();
  const auto& first = chunks[0];
  TORCH_CHECK(first.dim() == 6, op, ": chunk tensors must be [n, L, KV, T, H, D], got ",
              first.sizes());
  int64_t C = 0;
  for (const auto& t : chunks) {
    TORCH_CHECK(t.dim() == 6 && t.sizes().slice(1).equals(first.sizes().slice(1)), op,
                ": chunk tensors disagree: ", t.sizes(), " vs ", first.sizes());
    TORCH_CHECK(t.is_contiguous(), op, ": chunk tensors must be contiguous");
    TORCH_CHECK(t.scalar_type() == first.scalar_type(), op, ": chunk dtypes differ");
    C += t.size(0);
  }
  // Reuse the shared checks on a meta stand-in of the concatenated chunks.
  auto meta = at::TensorOptions().device(at::kMeta).dtype(first.scalar_type());
  std::vector<at::Tensor> meta_layers;
  meta_layers.reserve(layers.size());
  for (const auto& t : layers) {
    TORCH_CHECK(t.device() == device, op, ": layers on different devices");
    TORCH_CHECK(t.scalar_type() == first.scalar_type(), op, ": layer dtype ", t.scalar_type(),
                " != chunk dtype ", first.scalar_type());
    meta_layers.push_back(at::empty({0}, meta));
  }
  auto chunk_meta = at::empty({C, first.size(1), first.size(2), first.size(3), first.size(4),
                               first.size(5)}, meta);
  auto g = check_args(op, meta_layers, slots.to(at::kMeta), strides, block_size,
                      kernel_block_size, num_blocks, chunk_meta);
  c10::cuda::CUDAGuard guard(device);
  const int64_t n = g.C * g.T;
  if (n == 0 || chunk_meta.numel() == 0) return;

  // validate on the host and compute byte offsets: no device synchronization
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t limit = num_blocks * block_size;
  auto lp = layer_pointers(layers);
  std::vector<int64_t> cp;
  cp.reserve(C);
  const int64_t chunk_bytes = g.L * g.KV * g.T * g.H * g.D * g.esize;
  for (const auto& t : chunks) {
    const int64_t addr = device_address(op, t, device);
    for (int64_t i = 0; i < t.size(0); ++i) cp.push_back(addr + i * chunk_bytes);
  }
  const Plan plan = plan_vectors(g, lp, cp);
  std::vector<int64_t> table(lp);
  table.insert(table.end(), cp.begin(), cp.end());
  table.resize(g.L + g.C + n);
  int64_t* tok = table.data() + g.L + g.C;
  const int64_t sb = g.s_block * g.esize, ss = g.s_sub * g.esize, st = g.s_tok * g.esize;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = s[i];
    TORCH_CHECK(v >= -1 && v < limit, op, ": slot ", v, " at index ", i,
                " is outside the cache (", num_blocks, " blocks of ", block_size, " tokens)");
    if (v < 0) {
      tok[i] = -1;
    } else {
      const int64_t b = v / block_size, t = v % block_size;
      tok[i] = b * sb + (t / kernel_block_size) * ss + (t % kernel_block_size) * st;
    }
  }
  auto dev_table = upload(table, device);
  auto ptrs = reinterpret_cast<char* const*>(dev_table.data_ptr<int64_t>());
  launch_move<kToChunk>(g, plan, ptrs, ptrs + g.L,
                        dev_table.data_ptr<int64_t>() + g.L + g.C, max_ctas,
                        c10::cuda::getCurrentCUDAStream());
}

void gather_multi_cuda(at::TensorList kv_layers, const at::Tensor& slots,
                       at::IntArrayRef strides, int64_t block_size, int64_t kernel_block_size,
                       int64_t num_blocks, at::TensorList outs, int64_t max_ctas) {
  move_multi<true>("kvplugin::gather_multi", kv_layers, slots, strides, block_size,
                   kernel_block_size, num_blocks, outs, max_ctas);
}

void scatter_multi_cuda(at::TensorList kv_layers, const at::Tensor& slots,
                        at::IntArrayRef strides, int64_t block_size, int64_t kernel_block_size,
                        int64_t num_blocks, at::TensorList srcs, int64_t max_ctas) {
  move_multi<false>("kvplugin::scatter_multi", kv_layers, slots, strides, block_size,
                    kernel_block_size, num_blocks, srcs, max_ctas);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvplugin, m) {
  m.def(
      "gather_multi(Tensor[] kv_layers, Tensor slots, int[] strides, int block_size, "
      "int kernel_block_size, int num_blocks, Tensor(a!)[] outs, int max_ctas=0) -> ()");
  m.def(
      "scatter_multi(Tensor(a!)[] kv_layers, Tensor slots, int[] strides, int block_size, "
      "int kernel_block_size, int num_blocks, Tensor[] srcs, int max_ctas=0) -> ()");
}

TORCH_LIBRARY_IMPL(kvplugin, CUDA, m) {
  m.impl("gather", &gather_cuda);
  m.impl("scatter", &scatter_cuda);
  m.impl("gather_multi", &gather_multi_cuda);
  m.impl("scatter_multi", &scatter_multi_cuda);
}

}  // namespace kvplugin
