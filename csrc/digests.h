// Shared between the CPU and CUDA kernels of kvplugin::segment_digests.
#pragma once

#include <ATen/ATen.h>

namespace kvplugin {

// Checks data (uint8 [R, N], contiguous) and segment_bytes (a positive multiple
// of 64); returns the segments per row, max(1, ceil(N / segment_bytes)).
int64_t check_digest_args(const at::Tensor& data, int64_t segment_bytes);

}  // namespace kvplugin
