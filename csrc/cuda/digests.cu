// kvplugin::segment_digests on CUDA: the XXH3-64 of each segment of rows of
// bytes already on the device (schema and contract: ../digests.cpp).
//
// One warp hashes one segment: 8 groups of 4 threads, a group's thread t takes lanes 2t and
// 2t+1 of XXH3's eight.  The groups sum 8 blocks at once, each its own (one 128-bit load per
// thread and stripe, 16 in flight), and every group folds the 8 sums in order (warp shuffles):
// a segment's 256 blocks are 32 rounds of loads, not 256 (a thread per pair of lanes walking
// its segment's blocks one after the other left the last digest ~0.8 ms behind its bytes,
// latency-bound).  Group 0 then merges the lanes.  Runs on the current stream.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../digests.h"
#include "../xxh3.h"

namespace kvplugin {
namespace {

constexpr int kThreads = 128;
constexpr int kWarp = 32;
constexpr int kGroups = kWarp / 4;  // blocks summed at once per segment

__global__ void segment_digests_kernel(const uint8_t* __restrict__ data, int64_t rows, int64_t n,
                                       int64_t seg, int64_t segs, int64_t* __restrict__ out) {
  // sid, live and len are the same across a warp: its branches below are uniform
  const int64_t sid = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp, group = lane / 4, t = lane % 4;
  const bool live = sid < rows * segs;
  uint64_t a0 = 0, a1 = 0, len = 0;
  const uint8_t* p = data;
  if (live) {
    const int64_t r = sid / segs, k = sid % segs;
    p = data + r * n + k * seg;
    const int64_t left = n - k * seg;  // > 0 but for the one segment of an empty row
    len = static_cast<uint64_t>(left < 0 ? 0 : (left < seg ? left : seg));
  }
  if (live && len > 240) {
    uint64_t key[2 * xxh3::kStripesPerBlock], ks0, ks1;
    xxh3::pair_secret(t, key, ks0, ks1);
    const bool aligned16 = (reinterpret_cast<uintptr_t>(p) & 15) == 0;
    a0 = xxh3::init_lane(2 * t);
    a1 = xxh3::init_lane(2 * t + 1);
    const uint64_t blocks = xxh3::whole_blocks(len);
    for (uint64_t first = 0; first < blocks; first += kGroups) {
      uint64_t s0 = 0, s1 = 0;
      const uint64_t b = first + group;
      if (b < blocks) xxh3::block_sums(p + b * xxh3::kBlock + 16 * t, aligned16, key, s0, s1);
      const int m = static_cast<int>(blocks - first < kGroups ? blocks - first : kGroups);
      for (int j = 0; j < m; ++j) {  // in block order, the same in every group
        a0 = xxh3::scramble(a0 + __shfl_sync(0xffffffffu, s0, 4 * j + t), ks0);
        a1 = xxh3::scramble(a1 + __shfl_sync(0xffffffffu, s1, 4 * j + t), ks1);
      }
    }
    if (group == 0) xxh3::tail_pair(p, len, t, a0, a1);
  }
  uint64_t acc[8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // every thread of the warp takes part
    acc[2 * j] = __shfl_sync(0xffffffffu, a0, j);
    acc[2 * j + 1] = __shfl_sync(0xffffffffu, a1, j);
  }
  if (live && lane == 0)
    out[sid] = static_cast<int64_t>(len > 240 ? xxh3::merge(acc, len) : xxh3::hash64(p, len));
}

at::Tensor segment_digests_cuda(const at::Tensor& data, int64_t segment_bytes) {
  const int64_t segs = check_digest_args(data, segment_bytes);
  TORCH_CHECK(data.is_cuda(), "segment_digests: data must be on a CUDA device");
  const c10::cuda::CUDAGuard guard(data.device());
  const int64_t rows = data.size(0), n = data.size(1);
  at::Tensor out = at::empty({rows, segs}, data.options().dtype(at::kLong));
  const int64_t threads = rows * segs * kWarp;
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
