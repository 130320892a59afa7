#!/usr/bin/env bash
# GPU transfer benchmark on the H200 with vLLM 0.26's own swap_blocks side by side:
#   bash compat/gpulane/bench.sh   (carry .gpulane; results in $OUT/gpu-xfer.json)
set -uo pipefail
ROOT="$(pwd)"; O="${OUT:-/tmp/gpulane-out}"; mkdir -p "$O" /tmp/site
(cd .gpulane && sha256sum -c SHA256) >/dev/null || { echo "payload checksum mismatch"; exit 1; }
xz -dc .gpulane/site.tar.xz | tar -xf - -C /tmp/site || exit 1
export PYTHONPATH="/tmp/site:$ROOT" PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
CC=/usr/bin/gcc CXX=/usr/bin/g++ TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
    python3 benchmarks/build_ext.py > "$O/build.log" 2>&1 || { tail -30 "$O/build.log"; exit 1; }
python3 benchmarks/gpu_xfer.py --no-sweep --out "$O/gpu-xfer.json" 2>&1 | tee "$O/bench.log" | tail -60
