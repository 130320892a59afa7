# Sourced by run.sh and bench.sh on the H200 (device tool), from the repo root, with .gpulane
# carried: unpacks vLLM 0.26.0 (GPU wheel) and friends into /tmp/site, gives the checkout an
# entry point, sets the environment and builds the plugin's kernels in place (CUDA for sm_90,
# with the system gcc: the image's default compiler wrapper builds extensions in which any C++
# exception aborts the process). Sets ROOT, O (the output folder) and t0.
ROOT="$(pwd)"
O="${OUT:-/tmp/gpulane-out}"
mkdir -p "$O" /tmp/site
t0=$(date +%s)
(cd .gpulane && sha256sum -c --quiet SHA256) || { echo "payload checksum mismatch"; exit 1; }
if ! cmp -s .gpulane/SHA256 /tmp/site/.payload-sha256; then  # a warm machine keeps it unpacked
    xz -dc .gpulane/site.tar.xz | tar -xf - -C /tmp/site || exit 1
    cp .gpulane/SHA256 /tmp/site/.payload-sha256
fi
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
# The kernels: a build carried in .gpulane/kernels/ is used when its key matches (the sources, the
# build script, torch, nvcc and the arch list); else they are built (25-45 s on a fresh machine)
# and the library is left in $O as _C-<key>.so: put it into .gpulane/kernels/ for later calls.
export TORCH_CUDA_ARCH_LIST=9.0
EXT="vllm_kvplugin/_C$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
KEY=$( { cat csrc/*.cpp csrc/*.h csrc/cuda/* benchmarks/build_ext.py 2>/dev/null; echo "$TORCH_CUDA_ARCH_LIST";
         python3 -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null \
             || python3 -c 'import torch; print(torch.__version__)'; "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" --version | tail -2; } \
       | sha256sum | cut -c1-16)
if [ -f ".gpulane/kernels/_C-$KEY.so" ]; then
    cp ".gpulane/kernels/_C-$KEY.so" "$EXT" && echo "kernels: the carried build $KEY" > "$O/build.log"
else
    CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 \
        python3 benchmarks/build_ext.py > "$O/build.log" 2>&1 || { tail -30 "$O/build.log"; exit 1; }
    cp "$EXT" "$O/_C-$KEY.so" && { strip --strip-unneeded "$O/_C-$KEY.so" 2>/dev/null || true; }
fi
echo "built in $(( $(date +%s) - t0 )) s (kernels $KEY)"
