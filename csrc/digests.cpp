// kvplugin::segment_digests: the schema and the CPU kernel.
//
//     segment_digests(Tensor data, int segment_bytes) -> Tensor
//
// data: uint8 [R, N], contiguous (R chunk payloads of N bytes).  The result is
// int64 [R, S], S = max(1, ceil(N / segment_bytes)): the XXH3-64 (xxh3.h) of
// bytes [k * segment_bytes, min(N, (k + 1) * segment_bytes)) of each row, its
// bits as int64.  The payload digest of a chunk is the XXH3-64 of a row's S
// values as little-endian u64 (vllm_kvplugin/chunk/format.py); the CUDA kernel
// (cuda/digests.cu) hashes bytes already copied to the device.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "digests.h"
#include "xxh3.h"

namespace kvplugin {

int64_t check_digest_args(const at::Tensor& data, int64_t segment_bytes) {
  TORCH_CHECK(data.scalar_type() == at::kByte, "segment_digests: data must be uint8, got ",
              data.scalar_type());
  TORCH_CHECK(data.dim() == 2, "segment_digests: data must be [R, N], got ", data.sizes());
  TORCH_CHECK(data.is_contiguous(), "segment_digests: data must be contiguous");
  TORCH_CHECK(segment_bytes > 0 && segment_bytes % 64 == 0,
              "segment_digests: segment_bytes must be a positive multiple of 64, got ",
              segment_bytes);
  const int64_t n = data.size(1);
  return n == 0 ? 1 : (n + segment_bytes - 1) / segment_bytes;
}

namespace {

at::Tensor segment_digests_cpu(const at::Tensor& data, int64_t segment_bytes) {
  const int64_t segs = check_digest_args(data, segment_bytes);
  const int64_t rows = data.size(0), n = data.size(1);
  at::Tensor out = at::empty({rows, segs}, data.options().dtype(at::kLong));
  const uint8_t* base = data.data_ptr<uint8_t>();
  int64_t* o = out.data_ptr<int64_t>();
  // rows in parallel: a call of one row (a payload hashed by one of the plugin's hashing
  // threads, which call this op at once from several Python threads) runs on its caller's
  // thread, never in the intra-op pool
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t k = 0; k < segs; ++k) {
        const int64_t len = std::min(segment_bytes, n - k * segment_bytes);
        o[r * segs + k] = static_cast<int64_t>(xxh3::hash64_host(
            base + r * n + k * segment_bytes, static_cast<uint64_t>(std::max<int64_t>(0, len))));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvplugin, m) {
  m.def("segment_digests(Tensor data, int segment_bytes) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvplugin, CPU, m) { m.impl("segment_digests", &segment_digests_cpu); }

}  // namespace kvplugin
