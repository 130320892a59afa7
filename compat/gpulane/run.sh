#!/usr/bin/env bash
# The GPU lane, on the H200 (device tool), from the repo root, with .gpulane carried:
#
#   bash compat/gpulane/run.sh [pytest args]
#
# After env.sh (vLLM 0.26.0's GPU wheel unpacked, the kernels built), runs tests/gpu: the CUDA
# kernels and transfer engine against the layout reference, and real vLLM engines on the GPU
# with the connector (tests/gpu/test_vllm_gpu_lane.py). Logs and a JUnit file go to $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
python3 -c "import vllm, torch, vllm_kvplugin.ops as o; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0), o.info().describe())"
python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -o addopts="" --junitxml="$O/gpu-junit.xml" "$@" 2>&1 \
    | tee "$O/gpu-tests.log" | grep -E "passed|failed|error|GPU LANE|^FAILED|^ERROR" | tail -40
echo "done in $(( $(date +%s) - t0 )) s"
