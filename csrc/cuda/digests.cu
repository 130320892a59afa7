// kvplugin::segment_digests on CUDA: the XXH3-64 of each segment of rows of
// bytes already on the device (schema and contract: ../digests.cpp).
//
// Four threads hash one segment, each two of XXH3's eight lanes (a lane reads
// its own 8 bytes of a stripe and its pair's), so one 128-bit load per thread
// and stripe and a warp's loads cover 8 segments' stripes whole; the first of
// the four merges the lanes (warp shuffles).  Runs on the current stream.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../digests.h"
#include "../xxh3.h"

namespace kvplugin {
namespace {

constexpr int kThreads = 128;

__global__ void segment_digests_kernel(const uint8_t* __restrict__ data, int64_t rows, int64_t n,
                                       int64_t seg, int64_t segs, int64_t* __restrict__ out) {
  const int64_t sid = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 2;
  const int t = threadIdx.x & 3;
  const bool live = sid < rows * segs;
  uint64_t a0 = 0, a1 = 0, len = 0;
  const uint8_t* p = data;
  if (live) {
    const int64_t r = sid / segs, k = sid % segs;
    p = data + r * n + k * seg;
    const int64_t left = n - k * seg;  // > 0 but for the one segment of an empty row
    len = static_cast<uint64_t>(left < 0 ? 0 : (left < seg ? left : seg));
    if (len > 240)
      xxh3::long_pair(p, len, t, (reinterpret_cast<uintptr_t>(p) & 15) == 0, a0, a1);
  }
  uint64_t acc[8];
  const int quad = (threadIdx.x & 31) & ~3;
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // every thread of the warp takes part
    acc[2 * j] = __shfl_sync(0xffffffffu, a0, quad + j);
    acc[2 * j + 1] = __shfl_sync(0xffffffffu, a1, quad + j);
  }
  if (live && t == 0)
    out[sid] = static_cast<int64_t>(len > 240 ? xxh3::merge(acc, len) : xxh3::hash64(p, len));
}

at::Tensor segment_digests_cuda(const at::Tensor& data, int64_t segment_bytes) {
  const int64_t segs = check_digest_args(data, segment_bytes);
  TORCH_CHECK(data.is_cuda(), "segment_digests: data must be on a CUDA device");
  const c10::cuda::CUDAGuard guard(data.device());
  const int64_t rows = data.size(0), n = data.size(1);
  at::Tensor out = at::empty({rows, segs}, data.options().dtype(at::kLong));
  const int64_t threads = rows * segs * 4;
  if (threads == 0) return out;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "segment_digests: ", rows * segs, " segments is too many");
  segment_digests_kernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                           at::cuda::getCurrentCUDAStream()>>>(
      data.data_ptr<uint8_t>(), rows, n, segment_bytes, segs, out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvplugin, CUDA, m) { m.impl("segment_digests", &segment_digests_cuda); }

}  // namespace kvplugin
