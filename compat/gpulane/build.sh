#!/usr/bin/env bash
# Build the GPU lane's payload here (network + a python3.12): vLLM 0.26.0's GPU wheel and the
# packages the H200 image lacks, installed into one tree, pruned to fit one 64 MiB transfer.
#
#   bash compat/gpulane/build.sh          -> .gpulane/site.tar.xz + .gpulane/SHA256 (git-ignored)
#
# On the device, compat/gpulane/run.sh unpacks it to /tmp/site and runs the GPU lane.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY312="${PY312:-}"
if [ -z "$PY312" ]; then
  for c in /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do [ -x "$c" ] && { PY312="$c"; break; }; done
fi
[ -n "$PY312" ] || { echo "need a python3.12 (PY312=...)"; exit 1; }
WORK="${GPULANE_WORK:-/tmp/gpulane-build}"
OUT="$ROOT/.gpulane"
mkdir -p "$WORK/wheels" "$OUT"
grep -qx '/.gpulane/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.gpulane/' >> "$ROOT/.git/info/exclude"
plat=()
for t in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 any; do plat+=(--platform "$t"); done
grep -v '^\s*#' "$HERE/wheels.txt" | grep -v '^\s*$' > "$WORK/req.txt"
"$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$WORK/wheels" -r "$WORK/req.txt"
STAGE="$WORK/site"
rm -rf "$STAGE"
"$PY312" -m pip install -q --no-deps --no-compile --no-index --target "$STAGE" "$WORK"/wheels/*.whl
V="$STAGE/vllm"
rm -rf "$STAGE/bin" "$V/vllm-rs" "$V/third_party/deep_gemm" "$V/third_party/fmha_sm100"
rm -f "$V/vllm_flash_attn/_vllm_fa2_C.abi3.so"  # FA3 serves sm_90
for so in _C _moe_C; do  # sm_90 code only (the MoE ops: the tiny Qwen3-Next of the GDN hybrid test)
  python3 "$HERE/prune_fatbin.py" "$V/${so}_stable_libtorch.abi3.so" "$WORK/$so.pruned" 90
  mv "$WORK/$so.pruned" "$V/${so}_stable_libtorch.abi3.so"
done
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=2026-01-01 -C "$STAGE" -cf - . \
    | xz -9 -T2 -c > "$OUT/site.tar.xz"
(cd "$OUT" && sha256sum site.tar.xz > SHA256)
ls -la "$OUT"
