#!/usr/bin/env bash
# The GPU lane, on the H200 (device tool), from the repo root, with .gpulane carried:
#
#   bash compat/gpulane/run.sh [pytest args]
#
# Unpacks vLLM 0.26.0 (GPU wheel) and friends into /tmp/site, builds the plugin's kernels in
# place (CUDA for sm_90, with the system gcc: the image's default compiler wrapper builds
# extensions in which any C++ exception aborts the process), then runs tests/gpu: the CUDA
# kernels and transfer engine against the layout reference, and real vLLM engines on the GPU
# with the connector (tests/gpu/test_vllm_gpu_lane.py). Logs and a JUnit file go to $OUT.
set -uo pipefail
ROOT="$(pwd)"
O="${OUT:-/tmp/gpulane-out}"
mkdir -p "$O" /tmp/site
t0=$(date +%s)
(cd .gpulane && sha256sum -c SHA256) || { echo "payload checksum mismatch"; exit 1; }
xz -dc .gpulane/site.tar.xz | tar -xf - -C /tmp/site || exit 1
echo "unpacked in $(( $(date +%s) - t0 )) s"
# the checkout runs from PYTHONPATH; a dist-info beside the payload gives vLLM the plugin's entry
# point as a pip install would (TP workers and child processes find the connector through it)
DI=/tmp/site/vllm_kvplugin-0.1.0.dist-info
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: vllm-kvplugin\nVersion: 0.1.0\n' > "$DI/METADATA"
printf '[vllm.general_plugins]\nkvplugin = vllm_kvplugin.plugin:register\n' > "$DI/entry_points.txt"
export PYTHONPATH="/tmp/site:$ROOT" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
       VLLM_CACHE_ROOT=/tmp/gl-cache/vllm VLLM_KVPLUGIN_CACHE=/tmp/gl-cache/kvplugin \
       TRITON_CACHE_DIR=/tmp/gl-cache/triton SETUPTOOLS_SCM_PRETEND_VERSION=0.1.0
CC=/usr/bin/gcc CXX=/usr/bin/g++ TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
    python3 benchmarks/build_ext.py > "$O/build.log" 2>&1 || { tail -30 "$O/build.log"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
python3 -c "import vllm, torch, vllm_kvplugin.ops as o; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0), o.info().describe())"
python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -o addopts="" --junitxml="$O/gpu-junit.xml" "$@" 2>&1 \
    | tee "$O/gpu-tests.log" | grep -E "passed|failed|error|GPU LANE|^FAILED|^ERROR" | tail -40
echo "done in $(( $(date +%s) - t0 )) s"
