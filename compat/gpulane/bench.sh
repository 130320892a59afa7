#!/usr/bin/env bash
# Benchmarks on the H200 with vLLM 0.26 (GPU wheel) on the machine, from the repo root, with
# .gpulane carried; results in $OUT:
#   bash compat/gpulane/bench.sh xfer   transfers, vLLM's swap_blocks side by side (gpu-xfer.json)
#   bash compat/gpulane/bench.sh ttft   cold vs warm TTFT, vLLM's OffloadingConnector side by side (gpu-ttft.json)
#   bash compat/gpulane/bench.sh serving  throughput of 32 concurrent streams, 0% and 80% reuse (gpu-serving.json)
#   bash compat/gpulane/bench.sh hash   the host's hashes of a hit, alone and beside the link (host-hash.json)
#   bash compat/gpulane/bench.sh profile  the connector's hooks on vLLM's thread in warm hits (load-profile.json)
#   bash compat/gpulane/bench.sh digest  a hit's verification on the device vs the host's (gpu-digest.json)
#   bash compat/gpulane/bench.sh loadhost  a hit's load after its allocation: host pieces, the scatter kernel (gpu-load-host.json)
#   bash compat/gpulane/bench.sh linkwake  a hit's copy after an idle link, woken, hot, read by digests (gpu-link-wake.json)
# Arguments after the first go to the benchmark (e.g. ttft --modes vllm-apc,kvplugin,kvplugin-hash8).
set -uo pipefail
what="${1:-xfer}"
shift || true
source "$(dirname "$0")/env.sh"
case "$what" in
    xfer) python3 benchmarks/gpu_xfer.py --no-sweep --out "$O/gpu-xfer.json" "$@" 2>&1 | tee "$O/bench.log" | tail -60 ;;
    ttft) python3 benchmarks/gpu_ttft.py --out "$O/gpu-ttft.json" "$@" 2>&1 | tee "$O/ttft.log" | tail -40 ;;
    serving) python3 benchmarks/gpu_serving.py --out "$O/gpu-serving.json" "$@" 2>&1 | tee "$O/serving.log" | tail -20 ;;
    hash) python3 benchmarks/host_hash.py --out "$O/host-hash.json" "$@" 2>&1 | tee "$O/hash.log" | tail -20 ;;
    profile) python3 benchmarks/load_profile.py --out "$O/load-profile.json" "$@" 2>&1 | tee "$O/profile.log" | tail -40 ;;
    digest) python3 benchmarks/gpu_digest.py --out "$O/gpu-digest.json" "$@" 2>&1 | tee "$O/digest.log" | tail -20 ;;
    linkwake) python3 benchmarks/gpu_link_wake.py --out "$O/gpu-link-wake.json" "$@" 2>&1 | tee "$O/linkwake.log" | tail -20 ;;
    loadhost) python3 benchmarks/gpu_load_host.py --out "$O/gpu-load-host.json" "$@" 2>&1 | tee "$O/loadhost.log" | tail -20 ;;
    *) echo "usage: bench.sh xfer|ttft|serving|hash|profile|digest|loadhost|linkwake"; exit 2 ;;
esac
echo "done in $(( $(date +%s) - t0 )) s"
