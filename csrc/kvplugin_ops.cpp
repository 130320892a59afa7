// kvplugin::gather / kvplugin::scatter: the op schema and the CPU kernel.
//
// Both ops move KV between vLLM's paged cache (one strided view per layer) and
// canonical chunks laid out as out[C, L, KV, T, H, D] (contiguous).  The paged
// side is described by six element strides
//     [block, sub, tok, head, kv, dim]
// where `block` is a manager block, `sub` a kernel block inside it (kernel-block
// splitting: block_size = r * kernel_block_size) and `tok` a token inside the
// kernel block.  slots[c, t] is the manager-block slot of chunk token t
// (block_id * block_size + offset) or -1: that token is skipped (left untouched
// on both sides), which gives partial first/last blocks and partial chunks.
//
// Every slot is validated before the first byte moves: an out-of-range slot is
// an error and nothing is written.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "kvplugin_ops.h"

namespace kvplugin {

void check_paged(const char* op, at::TensorList layers, at::IntArrayRef strides,
                 int64_t block_size, int64_t kernel_block_size, int64_t num_blocks,
                 Geometry& g) {
  TORCH_CHECK(strides.size() == 6, op,
              ": strides must be [block, sub, tok, head, kv, dim], got ",
              strides.size(), " values");
  TORCH_CHECK(kernel_block_size > 0 && block_size > 0 &&
                  block_size % kernel_block_size == 0,
              op, ": block_size ", block_size,
              " must be a positive multiple of kernel_block_size ",
              kernel_block_size);
  TORCH_CHECK(num_blocks > 0, op, ": num_blocks must be > 0, got ", num_blocks);
  g.s_block = strides[0];
  g.s_sub = strides[1];
  g.s_tok = strides[2];
  g.s_head = strides[3];
  g.s_kv = strides[4];
  g.s_dim = strides[5];
  g.block_size = block_size;
  g.kbs = kernel_block_size;
  g.num_blocks = num_blocks;
  // Every address the op can touch must lie inside each layer's storage: a
  // wrong descriptor is an error here, never a stray write.
  for (int64_t st : strides) {
    TORCH_CHECK(st >= 0, op, ": negative stride ", st, " in ", strides);
  }
  const int64_t r = block_size / kernel_block_size;
  const int64_t reach = (num_blocks - 1) * g.s_block + (r - 1) * g.s_sub +
                        (kernel_block_size - 1) * g.s_tok + (g.H - 1) * g.s_head +
                        (g.KV - 1) * g.s_kv + (g.D - 1) * g.s_dim;
  for (const auto& t : layers) {
    const int64_t avail =
        static_cast<int64_t>(t.storage().nbytes()) / g.esize - t.storage_offset();
    TORCH_CHECK(reach < avail, op, ": strides ", strides, " reach element ", reach,
                " but the layer holds ", avail, " elements from its start");
  }
}

Geometry check_args(const char* op, at::TensorList layers,
                    const at::Tensor& slots, at::IntArrayRef strides,
                    int64_t block_size, int64_t kernel_block_size,
                    int64_t num_blocks, const at::Tensor& chunk) {
  TORCH_CHECK(chunk.dim() == 6, op, ": chunk must be [C, L, KV, T, H, D], got ",
              chunk.sizes());
  TORCH_CHECK(chunk.is_contiguous(), op, ": chunk must be contiguous");
  Geometry g;
  g.C = chunk.size(0);
  g.L = chunk.size(1);
  g.KV = chunk.size(2);
  g.T = chunk.size(3);
  g.H = chunk.size(4);
  g.D = chunk.size(5);
  g.esize = chunk.element_size();
  TORCH_CHECK(g.KV == 1 || g.KV == 2, op, ": KV dim must be 1 or 2, got ", g.KV);
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == g.L, op, ": ",
              layers.size(), " layers given for a chunk of L=", g.L);
  TORCH_CHECK(slots.scalar_type() == at::kLong, op, ": slots must be int64");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == g.C && slots.size(1) == g.T,
              op, ": slots must be [C, T] = [", g.C, ", ", g.T, "], got ",
              slots.sizes());
  TORCH_CHECK(slots.is_contiguous(), op, ": slots must be contiguous");
  TORCH_CHECK(slots.device() == chunk.device(), op,
              ": slots and chunk must be on the same device");
  for (const auto& t : layers) {
    TORCH_CHECK(t.scalar_type() == chunk.scalar_type(), op, ": layer dtype ",
                t.scalar_type(), " != chunk dtype ", chunk.scalar_type());
    TORCH_CHECK(t.device() == chunk.device(), op, ": layer on ", t.device(),
                " but chunk on ", chunk.device());
  }
  check_paged(op, layers, strides, block_size, kernel_block_size, num_blocks, g);
  return g;
}

namespace {

// Validate every slot on the host before anything moves.
void check_slots_cpu(const char* op, const int64_t* s, int64_t n,
                     const Geometry& g) {
  const int64_t limit = g.num_blocks * g.block_size;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(s[i] >= -1 && s[i] < limit, op, ": slot ", s[i], " at index ", i,
                " is outside the cache (", g.num_blocks, " blocks of ",
                g.block_size, " tokens)");
  }
}

// Element offset of (slot, head 0, kv 0, dim 0) inside a layer view.
inline int64_t token_offset(int64_t slot, const Geometry& g) {
  const int64_t block = slot / g.block_size;
  const int64_t t = slot % g.block_size;
  return block * g.s_block + (t / g.kbs) * g.s_sub + (t % g.kbs) * g.s_tok;
}

template <bool kToChunk>
void move_cpu(const char* op, const std::vector<char*>& layer_ptrs,
              const at::Tensor& slots, char* chunk, const Geometry& g) {
  const int64_t* s = slots.data_ptr<int64_t>();
  check_slots_cpu(op, s, g.C * g.T, g);
  const int64_t row_bytes = g.D * g.esize;
  const bool dense_rows = (g.s_dim == 1);
  // one work item = one (chunk, layer, token): H*KV rows of D elements
  at::parallel_for(0, g.C * g.L * g.T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i % g.T;
      const int64_t l = (i / g.T) % g.L;
      const int64_t c = i / (g.T * g.L);
      const int64_t slot = s[c * g.T + t];
      if (slot < 0) continue;
      char* base = layer_ptrs[l] + token_offset(slot, g) * g.esize;
      for (int64_t kv = 0; kv < g.KV; ++kv) {
        for (int64_t h = 0; h < g.H; ++h) {
          char* paged = base + (h * g.s_head + kv * g.s_kv) * g.esize;
          char* canon =
              chunk + (((((c * g.L + l) * g.KV + kv) * g.T + t) * g.H + h) * g.D) *
                          g.esize;
          if (dense_rows) {
            if (kToChunk)
              std::memcpy(canon, paged, row_bytes);
            else
              std::memcpy(paged, canon, row_bytes);
          } else {
            for (int64_t d = 0; d < g.D; ++d) {
              char* p = paged + d * g.s_dim * g.esize;
              char* q = canon + d * g.esize;
              if (kToChunk)
                std::memcpy(q, p, g.esize);
              else
                std::memcpy(p, q, g.esize);
            }
          }
        }
      }
    }
  });
}

std::vector<char*> layer_pointers(at::TensorList layers) {
  std::vector<char*> ptrs;
  ptrs.reserve(layers.size());
  for (const auto& t : layers) ptrs.push_back(static_cast<char*>(t.data_ptr()));
  return ptrs;
}

void gather_cpu(at::TensorList kv_layers, const at::Tensor& slots,
                at::IntArrayRef strides, int64_t block_size,
                int64_t kernel_block_size, int64_t num_blocks,
                const at::Tensor& out) {
  auto g = check_args("kvplugin::gather", kv_layers, slots, strides, block_size,
                      kernel_block_size, num_blocks, out);
  move_cpu<true>("kvplugin::gather", layer_pointers(kv_layers), slots,
                 static_cast<char*>(out.data_ptr()), g);
}

void scatter_cpu(at::TensorList kv_layers, const at::Tensor& slots,
                 at::IntArrayRef strides, int64_t block_size,
                 int64_t kernel_block_size, int64_t num_blocks,
                 const at::Tensor& src) {
  auto g = check_args("kvplugin::scatter", kv_layers, slots, strides, block_size,
                      kernel_block_size, num_blocks, src);
  move_cpu<false>("kvplugin::scatter", layer_pointers(kv_layers), slots,
                  static_cast<char*>(src.data_ptr()), g);
}

}  // namespace

TORCH_LIBRARY(kvplugin, m) {
  m.def(
      "gather(Tensor[] kv_layers, Tensor slots, int[] strides, int block_size, "
      "int kernel_block_size, int num_blocks, Tensor(a!) out) -> ()");
  m.def(
      "scatter(Tensor(a!)[] kv_layers, Tensor slots, int[] strides, int "
      "block_size, int kernel_block_size, int num_blocks, Tensor src) -> ()");
}

TORCH_LIBRARY_IMPL(kvplugin, CPU, m) {
  m.impl("gather", &gather_cpu);
  m.impl("scatter", &scatter_cpu);
}

// Which kernels this build carries, read by vllm_kvplugin.ops.
extern "C" int kvplugin_has_cuda_kernel() {
#ifdef KVPLUGIN_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

}  // namespace kvplugin

extern "C" {
// A plain extension module: importing it runs the registrations above.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr,
                                          -1, nullptr};
  PyObject* m = PyModule_Create(&module_def);
  if (m != nullptr) {
    PyModule_AddIntConstant(m, "HAS_CUDA_KERNEL",
                            kvplugin::kvplugin_has_cuda_kernel());
  }
  return m;
}
}
