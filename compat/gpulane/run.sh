#!/usr/bin/env bash
# The GPU lane, on the H200 (device tool), from the repo root, with .gpulane carried:
#
#   bash compat/gpulane/run.sh [pytest args]
#
# After env.sh (vLLM 0.26.0's GPU wheel unpacked, the kernels built or taken from a matching build
# carried in .gpulane/kernels/: a call that built them leaves _C-<key>.so in $OUT, to be copied
# there; it saves 25-45 s of every fresh machine), runs tests/gpu: the CUDA
# kernels and transfer engine against the layout reference, and real vLLM engines on the GPU
# with the connector (tests/gpu/test_vllm_gpu_lane.py). Logs and a JUnit file go to $OUT.
# The whole lane takes about 6 min on a warm H100 and more on a fresh machine (unpacking, the
# kernels' build, torch.compile's first run). Under the device's 10-minute limit per call, run
# it in three calls: `-k "not vllm_gpu_lane"`, `-k "vllm_gpu_lane and (seed_method or idle or gdn)"`
# and `-k "vllm_gpu_lane and not (seed_method or idle or gdn)"` (on a fresh H100, `-k
# vllm_gpu_lane` alone ran 12 of its 18 tests in the 480 s after its 55 s of set-up).
# The log names each test as it starts (-v), so a run that a time limit ends shows where it was,
# and each line begins with the seconds since set-up began (a test's line is written when it
# ends: the difference to the line before is its time, also for a run cut short); a test stuck
# for 4 minutes dumps every thread's stack into the log (faulthandler_timeout).
set -uo pipefail
source "$(dirname "$0")/env.sh"
python3 -c "import vllm, torch, vllm_kvplugin.ops as o; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0), o.info().describe())"
python3 -m pytest tests/gpu -m gpu -v -p no:cacheprovider -o addopts="" -o faulthandler_timeout=240 --junitxml="$O/gpu-junit.xml" "$@" 2>&1 \
    | while IFS= read -r line; do printf '%4d %s\n' "$(( $(date +%s) - t0 ))" "$line"; done \
    | tee "$O/gpu-tests.log" | grep -E "passed|failed|error|GPU LANE| FAILED| ERROR" | tail -40
echo "done in $(( $(date +%s) - t0 )) s"
