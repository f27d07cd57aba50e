#!/usr/bin/env bash
# One device lane end to end: build dgr with BACKEND (every core, the local GPU's architecture
# only), then certify and measure it on the backend's first device (benches/device_lane.py),
# the table printed last. Meant for a machine with the device, within 8 minutes on one GPU:
#
#   bash benches/device/lane.sh cuda              # SmolLM2 and the 7B-shaped qwen2
#   bash benches/device/lane.sh vulkan --tiny     # lavapipe: the tiny model, a few tokens
#
# Arguments after BACKEND go to benches/device_lane.py. Offline machines (no package
# registry): put dgr's Python dependencies as wheels in $DGR_WHEELS (pip download -d DIR
# '.[test]' on a machine with one), and the prepared llama.cpp source (python -m dgr.vendor
# pack FILE: 11 MiB, checked against the manifest's prepared.tree_sha256) in
# $DGR_VENDOR_ARCHIVE; both are then installed from there.
set -euo pipefail
backend="${1:?usage: lane.sh BACKEND [device_lane.py args]}"; shift
cd "$(dirname "$0")/../.."
export DGR_BACKEND="$backend" DGR_BUILD_JOBS="${DGR_BUILD_JOBS:-$(nproc)}"
case "$backend" in
  cuda) export CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=native}"; prefix=CUDA ;;
  vulkan) export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}"; prefix=Vulkan ;;
  rocm) prefix=ROCm ;;
  metal) prefix=MTL ;;
  *) echo "lane.sh: BACKEND is cuda, vulkan, rocm or metal, not $backend" >&2; exit 2 ;;
esac
t0=$(date +%s)
pip_args=(-q -e .)
if [ -n "${DGR_WHEELS:-}" ]; then pip_args=(--no-index --find-links "$DGR_WHEELS" "${pip_args[@]}"); fi
echo "[lane] building dgr with the $backend backend ($DGR_BUILD_JOBS jobs) ..." >&2
python -m pip install "${pip_args[@]}" >&2
python -m dgr.vendor status >&2
echo "[lane] built in $(( $(date +%s) - t0 )) s" >&2
python -m dgr devices >&2
device=$(python -c "import dgr, sys
d = [x['name'] for x in dgr.devices() if x['name'].startswith('$prefix')]
print(d[0] if d else '')")
if [ -z "$device" ]; then echo "[lane] the $backend build sees no device" >&2; exit 1; fi
exec python benches/device_lane.py --device "$device" "$@"
