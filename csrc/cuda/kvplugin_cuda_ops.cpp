// Host side of kvplugin's CUDA ops: checks, errors, pointer tables, DMAs and the
// op registrations.  Compiled by the host compiler; the kernels are launched
// through the exception-free launchers of kvplugin_cuda.cu.
//
//   kvplugin::gather / kvplugin::scatter (schema in ../kvplugin_ops.cpp): CUDA
//     implementation.  Device slots are validated by a small kernel whose result
//     is read back (one synchronization) before anything moves.
//
// Ops for the transfer engine (vllm_kvplugin/transfer/cuda.py), defined here:
//
//   gather_multi(Tensor[] kv_layers, Tensor slots, int[] strides, int block_size,
//                int kernel_block_size, int num_blocks, Tensor(a!)[] outs,
//                int max_ctas=0) -> ()
//   scatter_multi(Tensor(a!)[] kv_layers, Tensor slots, ..., Tensor[] srcs,
//                 int max_ctas=0) -> ()
//     host slots [C, T], validated on the host (no device synchronization, so a
//     store can be queued behind the forward that writes its blocks); chunk
//     tensors [n_i, L, KV, T, H, D] with sum n_i = C, each on the cache's GPU
//     or in page-locked host memory (zero-copy through its device mapping).
//     max_ctas > 0 caps the grid.
//   scatter_blocks(Tensor(a!)[] kv_layers, Tensor blocks, Tensor spans, ..., Tensor[] srcs,
//                  int max_ctas=0, bool block_runs=False) -> int
//     scatter_multi with each chunk's place as host block ids [C, T / block_size] and
//     the token span [C, 2] written of it (a load's objects as vLLM allocated them:
//     the per-token offsets are computed here, not by the caller).  block_runs:
//     where every block is one dense run on the paged side (block_runs()) a kernel
//     of its own writes each run from the block's offset alone, no per-token table.
//     Returns 1 when that kernel ran, else 0.
//   dma_to_host(Tensor src, Tensor(a!)[] dsts) -> ()
//   dma_from_host(Tensor[] srcs, Tensor(a!) dst) -> ()
//     one cudaMemcpyAsync per run of adjacent host tensors, on the current
//     stream, between a contiguous device tensor and host tensors taken in order.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "../kvplugin_ops.h"
#include "kvplugin_cuda.h"

namespace kvplugin {
namespace {

using cuda_impl::MoveArgs;

struct Plan {
  int W;              // vector bytes
  int64_t vstride_b;  // paged bytes between the vectors of a row
  int64_t vpr;        // vectors per row
};

bool aligned(int64_t x, int W) { return (static_cast<uint64_t>(x) % static_cast<uint64_t>(W)) == 0; }

// Widest vector that every pointer and stride allows.
Plan plan_vectors(const Geometry& g, const std::vector<int64_t>& layer_ptrs,
                  const std::vector<int64_t>& chunk_ptrs) {
  if (g.s_dim == 1) {
    const int64_t row_bytes = g.D * g.esize;
    for (int W = 16; W >= g.esize; W /= 2) {
      bool ok = aligned(row_bytes, W);
      for (int64_t s : {g.s_block, g.s_sub, g.s_tok, g.s_head, g.s_kv})
        ok = ok && aligned(s * g.esize, W);
      for (int64_t p : layer_ptrs) ok = ok && aligned(p, W);
      for (int64_t p : chunk_ptrs) ok = ok && aligned(p, W);
      if (ok) return Plan{W, W, row_bytes / W};
    }
  }
  return Plan{static_cast<int>(g.esize), g.s_dim * g.esize, g.D};
}

// Copies host int64 values to the device on the current stream, through a
// page-locked buffer (the caching host allocator keeps it until the copy ran).
at::Tensor upload(const std::vector<int64_t>& values, const at::Device& device) {
  auto host = at::empty({static_cast<int64_t>(values.size())},
                        at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  return host.to(device, /*non_blocking=*/true);
}

std::vector<int64_t> layer_pointers(at::TensorList layers) {
  std::vector<int64_t> out;
  out.reserve(layers.size());
  for (const auto& t : layers) out.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
  return out;
}

void launch(const char* op, const Geometry& g, const Plan& plan, const at::Tensor& table,
            int64_t max_ctas, bool to_chunk) {
  const int64_t n_vec = g.L * g.KV * g.T * g.H * plan.vpr;
  TORCH_CHECK(n_vec < INT32_MAX && g.H < INT32_MAX && g.T < INT32_MAX, op,
              ": one chunk is too large for the CUDA kernel (", n_vec, " vectors of ", plan.W,
              " bytes)");
  const int64_t* base = table.data_ptr<int64_t>();
  MoveArgs a;
  a.layer_ptrs = reinterpret_cast<char* const*>(base);
  a.chunk_ptrs = reinterpret_cast<char* const*>(base + g.L);
  a.tok_off = base + g.L + g.C;
  a.s_head_b = g.s_head * g.esize;
  a.s_kv_b = g.s_kv * g.esize;
  a.vstride_b = plan.vstride_b;
  a.C = g.C;
  a.L = g.L;
  a.KV = g.KV;
  a.T = g.T;
  a.H = g.H;
  a.vpr = plan.vpr;
  a.vec_bytes = plan.W;
  a.max_ctas = max_ctas;
  C10_CUDA_CHECK(cuda_impl::launch_move(a, to_chunk, c10::cuda::getCurrentCUDAStream()));
}

void check_layers_on(const char* op, at::TensorList layers, const at::Device& device) {
  for (const auto& t : layers) {
    TORCH_CHECK(t.is_cuda() && t.device() == device, op, ": every layer must be on ", device,
                ", got ", t.device());
  }
}

// ----------------------------------------------------------- gather / scatter

template <bool kToChunk>
void move_cuda(const char* op, at::TensorList layers, const at::Tensor& slots,
               at::IntArrayRef strides, int64_t block_size, int64_t kernel_block_size,
               int64_t num_blocks, const at::Tensor& chunk) {
  const Geometry g = check_args(op, layers, slots, strides, block_size, kernel_block_size,
                                num_blocks, chunk);
  TORCH_CHECK(chunk.is_cuda(), op, ": chunk must be a CUDA tensor");
  check_layers_on(op, layers, chunk.device());
  c10::cuda::CUDAGuard guard(chunk.device());
  const int64_t n = g.C * g.T;
  if (n == 0 || chunk.numel() == 0) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // 1. validate the slots and compute per-token byte offsets (one small kernel),
  //    read the verdict back: nothing has moved yet
  auto opts = chunk.options().dtype(at::kLong);
  auto tok_off = at::empty({n}, opts);
  auto first_bad = at::full({1}, INT64_MAX, opts);
  C10_CUDA_CHECK(cuda_impl::launch_prepare(
      slots.data_ptr<int64_t>(), n, num_blocks * block_size, block_size, kernel_block_size,
      g.s_block * g.esize, g.s_sub * g.esize, g.s_tok * g.esize, tok_off.data_ptr<int64_t>(),
      first_bad.data_ptr<int64_t>(), stream));
  const int64_t bad = first_bad.item<int64_t>();
  if (bad != INT64_MAX) {
    const int64_t value = slots.reshape({-1}).select(0, bad).item<int64_t>();
    TORCH_CHECK(false, op, ": slot ", value, " at index ", bad, " is outside the cache (",
                num_blocks, " blocks of ", block_size, " tokens)");
  }

  // 2. pointer tables [layers L][chunks C][token offsets C*T] (offsets stay on the device)
  auto lp = layer_pointers(layers);
  std::vector<int64_t> cp(g.C);
  const int64_t chunk_bytes = g.L * g.KV * g.T * g.H * g.D * g.esize;
  char* base = static_cast<char*>(chunk.data_ptr());
  for (int64_t c = 0; c < g.C; ++c) cp[c] = reinterpret_cast<int64_t>(base + c * chunk_bytes);
  const Plan plan = plan_vectors(g, lp, cp);
  std::vector<int64_t> ptrs(lp);
  ptrs.insert(ptrs.end(), cp.begin(), cp.end());
  auto table = at::empty({g.L + g.C + n}, opts);
  table.narrow(0, 0, g.L + g.C).copy_(upload(ptrs, chunk.device()));
  table.narrow(0, g.L + g.C, n).copy_(tok_off);
  launch(op, g, plan, table, 0, kToChunk);
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

// ----------------------------------- gather_multi / scatter_multi / scatter_blocks

// The checks of check_args (same rules, same messages) for a list of chunk
// tensors (the callers check their host indices); plain integer work, no tensor
// allocation.
Geometry multi_geometry(const char* op, at::TensorList layers, at::IntArrayRef strides,
                        int64_t block_size, int64_t kernel_block_size, int64_t num_blocks,
                        at::TensorList chunks) {
  TORCH_CHECK(!chunks.empty(), op, ": no chunk tensors");
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
  Geometry g;
  g.C = C;
  g.L = first.size(1);
  g.KV = first.size(2);
  g.T = first.size(3);
  g.H = first.size(4);
  g.D = first.size(5);
  TORCH_CHECK(g.KV == 1 || g.KV == 2, op, ": KV dim must be 1 or 2, got ", g.KV);
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == g.L, op, ": ", layers.size(),
              " layers given for a chunk of L=", g.L);
  TORCH_CHECK(layers[0].is_cuda(), op, ": layers must be CUDA tensors");
  for (const auto& t : layers) {
    TORCH_CHECK(t.scalar_type() == first.scalar_type(), op, ": layer dtype ", t.scalar_type(),
                " != chunk dtype ", first.scalar_type());
    TORCH_CHECK(t.device() == layers[0].device(), op, ": layers on different devices");
  }
  g.esize = first.element_size();
  check_paged(op, layers, strides, block_size, kernel_block_size, num_blocks, g);
  return g;
}

// A host int64 [rows, cols] tensor of indices (slots, block ids, spans): checked
// before any value is read.
void check_host_index(const char* op, const char* name, const at::Tensor& t, int64_t rows,
                      int64_t cols) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor (validated on the host)");
  TORCH_CHECK(t.scalar_type() == at::kLong, op, ": ", name, " must be int64");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": ", name,
              " must be [", rows, ", ", cols, "], got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// Device-accessible address of a chunk tensor: the tensor itself on the cache's
// GPU, or the device mapping of page-locked host memory (zero-copy).
int64_t device_address(const char* op, const at::Tensor& t, const at::Device& device) {
  if (t.is_cuda()) {
    TORCH_CHECK(t.device() == device, op, ": chunk tensor on ", t.device(),
                " but the cache is on ", device);
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

// The pointer table's head (layers, then one pointer per chunk) and its vector
// plan; the caller appends its `tail` values (one paged byte offset per chunk
// token, -1: not moved; or the block-run kernel's block offsets and spans).
std::vector<int64_t> chunk_table(const char* op, at::TensorList layers, at::TensorList chunks,
                                 const Geometry& g, const at::Device& device, Plan* plan,
                                 int64_t tail) {
  std::vector<int64_t> table = layer_pointers(layers);
  table.reserve(g.L + g.C + tail);
  const int64_t chunk_bytes = g.L * g.KV * g.T * g.H * g.D * g.esize;
  for (const auto& t : chunks) {
    const int64_t addr = device_address(op, t, device);
    for (int64_t i = 0; i < t.size(0); ++i) table.push_back(addr + i * chunk_bytes);
  }
  const std::vector<int64_t> lp(table.begin(), table.begin() + g.L);
  const std::vector<int64_t> cp(table.begin() + g.L, table.end());
  *plan = plan_vectors(g, lp, cp);
  return table;
}

// Where every block of a layer is one dense run on the paged side (16-byte vectors
// everywhere, a token's heads' rows of D one after another, the block's tokens one
// after another across its kernel blocks): how scatter_blocks' block-run kernel walks
// it.  K and V either in separate regions (G = KV groups of P = H pieces, s_kv apart)
// or interleaved per head (vLLM 0.26's NHD: G = 1, P = 2H, kv_inner).  `use` false:
// the per-token kernel.
struct BlockRuns {
  bool use = false;
  int64_t G = 1, P = 1, s_g = 0;
  bool kv_inner = false;
};

BlockRuns block_runs(const Geometry& g, const Plan& plan, int64_t per) {
  BlockRuns r;
  // (and within the kernel's 32-bit indices: a block's vectors, a chunk's CTAs)
  if (plan.W != 16 || g.s_dim != 1 || g.block_size * g.KV * g.H * g.D * g.esize / 16 >= INT32_MAX ||
      g.L * g.KV * per >= INT32_MAX)
    return r;
  const int64_t row = g.KV * g.H * g.D;
  const bool whole_blocks = g.kbs == g.block_size || g.s_sub == g.kbs * g.s_tok;
  if (g.s_tok == g.H * g.D && (g.H == 1 || g.s_head == g.D) && whole_blocks) {
    r = BlockRuns{true, g.KV, g.H, g.s_kv, false};  // K and V apart (or MLA's one)
  } else if (g.KV == 2 && g.s_tok == row && g.s_head == 2 * g.D && g.s_kv == g.D && whole_blocks) {
    r = BlockRuns{true, 1, 2 * g.H, 0, true};  // K and V interleaved per head
  }
  return r;
}

// The paged byte offset of a token in slot v (0 <= v < num_blocks * block_size).
struct SlotOffsets {
  int64_t block_size, kbs, sb, ss, st;
  int64_t operator()(int64_t v) const {
    const int64_t b = v / block_size, t = v - b * block_size;
    const int64_t sub = t / kbs;
    return b * sb + sub * ss + (t - sub * kbs) * st;
  }
};

SlotOffsets slot_offsets(const Geometry& g, int64_t block_size, int64_t kernel_block_size) {
  return SlotOffsets{block_size, kernel_block_size, g.s_block * g.esize, g.s_sub * g.esize,
                     g.s_tok * g.esize};
}

template <bool kToChunk>
void move_multi(const char* op, at::TensorList layers, const at::Tensor& slots,
                at::IntArrayRef strides, int64_t block_size, int64_t kernel_block_size,
                int64_t num_blocks, at::TensorList chunks, int64_t max_ctas) {
  TORCH_CHECK(!layers.empty(), op, ": no layers");
  const Geometry g = multi_geometry(op, layers, strides, block_size, kernel_block_size,
                                    num_blocks, chunks);
  check_host_index(op, "slots", slots, g.C, g.T);
  const at::Device device = layers[0].device();
  c10::cuda::CUDAGuard guard(device);
  const int64_t n = g.C * g.T;
  if (n == 0 || g.L * g.KV * g.H * g.D == 0) return;

  // every slot checked on the host before anything is issued
  Plan plan;
  std::vector<int64_t> table = chunk_table(op, layers, chunks, g, device, &plan, n);
  const SlotOffsets offset = slot_offsets(g, block_size, kernel_block_size);
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t limit = num_blocks * block_size;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = s[i];
    TORCH_CHECK(v >= -1 && v < limit, op, ": slot ", v, " at index ", i,
                " is outside the cache (", num_blocks, " blocks of ", block_size, " tokens)");
    table.push_back(v < 0 ? -1 : offset(v));
  }
  launch(op, g, plan, upload(table, device), max_ctas, kToChunk);
}

// scatter_multi with each chunk's place given as block ids: chunk c's token t
// goes to slot blocks[c][t / block_size] * block_size + t % block_size when
// spans[c][0] <= t < spans[c][1], and nowhere otherwise.  Every block id that
// holds a moved token is checked before anything is issued.
int64_t scatter_blocks_cuda(at::TensorList kv_layers, const at::Tensor& blocks,
                         const at::Tensor& spans, at::IntArrayRef strides, int64_t block_size,
                         int64_t kernel_block_size, int64_t num_blocks, at::TensorList srcs,
                         int64_t max_ctas, bool block_runs_on) {
  const char* op = "kvplugin::scatter_blocks";
  TORCH_CHECK(!kv_layers.empty(), op, ": no layers");
  const Geometry g = multi_geometry(op, kv_layers, strides, block_size, kernel_block_size,
                                    num_blocks, srcs);
  TORCH_CHECK(block_size > 0 && g.T % block_size == 0, op, ": chunks of ", g.T,
              " tokens do not fill whole blocks of ", block_size);
  const int64_t per = g.T / block_size;
  check_host_index(op, "blocks", blocks, g.C, per);
  check_host_index(op, "spans", spans, g.C, 2);
  const at::Device device = kv_layers[0].device();
  c10::cuda::CUDAGuard guard(device);
  if (g.C * g.T == 0 || g.L * g.KV * g.H * g.D == 0) return 0;

  Plan plan;
  std::vector<int64_t> table = chunk_table(op, kv_layers, srcs, g, device, &plan, 0);
  const BlockRuns runs = block_runs_on ? block_runs(g, plan, per) : BlockRuns{};
  table.reserve(table.size() + (runs.use ? g.C * (per + 2) : g.C * g.T));
  // a token's offset is its block's plus its place in the block (no division per token)
  const SlotOffsets offset = slot_offsets(g, block_size, kernel_block_size);
  std::vector<int64_t> within(runs.use ? 0 : block_size);
  for (int64_t k = 0; k < static_cast<int64_t>(within.size()); ++k) within[k] = offset(k);
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* sp = spans.data_ptr<int64_t>();
  for (int64_t c = 0; c < g.C; ++c) {
    const int64_t lo = sp[2 * c], hi = sp[2 * c + 1];
    TORCH_CHECK(0 <= lo && lo <= hi && hi <= g.T, op, ": span [", lo, ", ", hi, ") of chunk ", c,
                " is not within its ", g.T, " tokens");
    for (int64_t j = 0, t = 0; j < per; ++j) {
      const int64_t end = t + block_size;
      const int64_t id = b[c * per + j];
      const bool used = t < hi && end > lo;
      TORCH_CHECK(!used || (id >= 0 && id < num_blocks), op, ": block ", id, " of chunk ", c,
                  " is outside the cache (", num_blocks, " blocks of ", block_size, " tokens)");
      const int64_t base = used ? offset(id * block_size) : -1;
      if (runs.use) {
        table.push_back(base);
        t = end;
      } else {
        for (int64_t k = 0; t < end; ++t, ++k) table.push_back(t < lo || t >= hi ? -1 : base + within[k]);
      }
    }
  }
  if (!runs.use) {
    launch(op, g, plan, upload(table, device), max_ctas, /*to_chunk=*/false);
    return 0;
  }
  table.insert(table.end(), sp, sp + 2 * g.C);
  const at::Tensor dev = upload(table, device);
  const int64_t* base = dev.data_ptr<int64_t>();
  cuda_impl::BlockRunArgs a;
  a.layer_ptrs = reinterpret_cast<char* const*>(base);
  a.chunk_ptrs = reinterpret_cast<char* const*>(base + g.L);
  a.block_off = base + g.L + g.C;
  a.spans = base + g.L + g.C + g.C * per;
  a.s_g_b = runs.s_g * g.esize;
  a.D_b = g.D * g.esize;
  a.C = g.C;
  a.L = g.L;
  a.KV = g.KV;
  a.T = g.T;
  a.H = g.H;
  a.G = runs.G;
  a.P = runs.P;
  a.per = per;
  a.block_size = block_size;
  a.kv_inner = runs.kv_inner;
  a.max_ctas = max_ctas;
  C10_CUDA_CHECK(cuda_impl::launch_block_runs(a, c10::cuda::getCurrentCUDAStream()));
  return 1;
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

// ------------------------------------------------------------------------ DMAs

template <bool kToHost>
void dma(const char* op, const at::Tensor& dev, at::TensorList hosts) {
  TORCH_CHECK(dev.is_cuda() && dev.is_contiguous(), op, ": device tensor must be contiguous CUDA");
  int64_t total = 0;
  for (const auto& h : hosts) {
    TORCH_CHECK(h.device().is_cpu() && h.is_contiguous(), op,
                ": host tensors must be contiguous CPU tensors");
    total += static_cast<int64_t>(h.nbytes());
  }
  TORCH_CHECK(total == static_cast<int64_t>(dev.nbytes()), op, ": host tensors hold ", total,
              " bytes, the device tensor ", dev.nbytes());
  c10::cuda::CUDAGuard guard(dev.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  char* d = static_cast<char*>(dev.data_ptr());
  size_t off = 0;
  const size_t n = hosts.size();
  for (size_t i = 0; i < n;) {
    char* h = static_cast<char*>(hosts[i].data_ptr());
    size_t bytes = hosts[i].nbytes();
    size_t j = i + 1;
    while (j < n && hosts[j].nbytes() > 0 && static_cast<char*>(hosts[j].data_ptr()) == h + bytes) {
      bytes += hosts[j].nbytes();
      ++j;
    }
    if (bytes > 0) {
      if (kToHost) {
        C10_CUDA_CHECK(cudaMemcpyAsync(h, d + off, bytes, cudaMemcpyDeviceToHost, stream));
      } else {
        C10_CUDA_CHECK(cudaMemcpyAsync(d + off, h, bytes, cudaMemcpyHostToDevice, stream));
      }
    }
    off += bytes;
    i = j;
  }
}

void dma_to_host_cuda(const at::Tensor& src, at::TensorList dsts) {
  dma<true>("kvplugin::dma_to_host", src, dsts);
}

void dma_from_host_cuda(at::TensorList srcs, const at::Tensor& dst) {
  dma<false>("kvplugin::dma_from_host", dst, srcs);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvplugin, m) {
  m.def(
      "gather_multi(Tensor[] kv_layers, Tensor slots, int[] strides, int block_size, "
      "int kernel_block_size, int num_blocks, Tensor(a!)[] outs, int max_ctas=0) -> ()");
  m.def(
      "scatter_multi(Tensor(a!)[] kv_layers, Tensor slots, int[] strides, int block_size, "
      "int kernel_block_size, int num_blocks, Tensor[] srcs, int max_ctas=0) -> ()");
  m.def(
      "scatter_blocks(Tensor(a!)[] kv_layers, Tensor blocks, Tensor spans, int[] strides, "
      "int block_size, int kernel_block_size, int num_blocks, Tensor[] srcs, int max_ctas=0, "
      "bool block_runs=False) -> int");
  m.def("dma_to_host(Tensor src, Tensor(a!)[] dsts) -> ()");
  m.def("dma_from_host(Tensor[] srcs, Tensor(a!) dst) -> ()");
}

TORCH_LIBRARY_IMPL(kvplugin, CUDA, m) {
  m.impl("gather", &gather_cuda);
  m.impl("scatter", &scatter_cuda);
  m.impl("gather_multi", &gather_multi_cuda);
  m.impl("scatter_multi", &scatter_multi_cuda);
  m.impl("scatter_blocks", &scatter_blocks_cuda);
  m.impl("dma_to_host", &dma_to_host_cuda);
  m.impl("dma_from_host", &dma_from_host_cuda);
}

}  // namespace kvplugin
