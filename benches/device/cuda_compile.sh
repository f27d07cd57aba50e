#!/usr/bin/env bash
# The CUDA compile lane, for a machine with no GPU: build dgr's llama.cpp libraries with the
# CUDA backend for one GPU architecture, and report the build's wall and CPU time and what it
# made. A compiled lane is not a certified one: nothing here runs a kernel.
#
#   bash benches/device/cuda_compile.sh [ARCH]      # ARCH: CMAKE_CUDA_ARCHITECTURES, 90 (H100/H200) by default
#
# What it needs: nvcc and the CUDA runtime headers (a CUDA toolkit, or PyPI's nvidia-cuda-nvcc,
# nvidia-cuda-runtime, nvidia-cuda-cccl and nvidia-cuda-crt wheels laid out as one), found as
# $CUDACXX, on PATH or under /usr/local/cuda*. cuBLAS, when that toolkit has none, is fetched
# from PyPI (nvidia-cublas for CUDA 13, nvidia-cublas-cu12 for 12) into the work folder.
#
# The toolkit this builds against is assembled in $DGR_CUDA_LANE_DIR (default
# ~/.cache/dgr/cuda-lane): links to the toolkit, plus cuBLAS, plus an empty libcuda stub. The
# stub only satisfies cmake's lookup of the driver library: the build makes static archives,
# which link nothing, and a real run takes libcuda from the GPU's driver.
set -euo pipefail
arch="${1:-90}"
cd "$(dirname "$0")/../.."
work="${DGR_CUDA_LANE_DIR:-$HOME/.cache/dgr/cuda-lane}"

nvcc="${CUDACXX:-$(command -v nvcc || true)}"
if [ -z "$nvcc" ]; then nvcc=$(ls /usr/local/cuda*/bin/nvcc 2>/dev/null | sort -V | tail -1 || true); fi
if [ -z "$nvcc" ]; then
  echo "[cuda-compile] no nvcc: set CUDACXX, or install a CUDA toolkit (or PyPI's nvidia-cuda-nvcc)" >&2
  exit 2
fi
# nvcc may be a wrapper script: ask it where its install is (nvcc.profile's TOP)
top=$("$nvcc" -dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
toolkit=$(cd "${top:-$(dirname "$(readlink -f "$nvcc")")/..}" && pwd)
major=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
echo "[cuda-compile] nvcc $("$nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p') in $toolkit, architecture sm_$arch" >&2

root="$work/toolkit-$major"
rm -rf "$root" && mkdir -p "$root/lib/stubs" "$root/include"
ln -s "$toolkit/bin" "$root/bin"
ln -s "$toolkit/nvvm" "$root/nvvm" 2>/dev/null || true
ln -s lib "$root/lib64"
for f in "$toolkit"/include/*; do ln -s "$f" "$root/include/"; done
for f in "$toolkit"/lib/* "$toolkit"/lib64/*; do
  [ -e "$f" ] && [ ! -e "$root/lib/$(basename "$f")" ] && ln -s "$f" "$root/lib/"
done
if [ -d "$toolkit/targets" ]; then ln -s "$toolkit/targets" "$root/targets"; fi

cuda_flags=""
if [ ! -e "$root/include/cublas_v2.h" ]; then
  case "$major" in
    12) pkg=nvidia-cublas-cu12; sub=nvidia/cublas ;;
    *) pkg="nvidia-cublas==$major.*"; sub="nvidia/cu$major" ;;
  esac
  if [ ! -d "$work/cublas-$major/$sub" ]; then
    echo "[cuda-compile] this toolkit has no cuBLAS: fetching $pkg from PyPI ..." >&2
    rm -rf "$work/wheels-$major" "$work/cublas-$major"
    python -m pip download -q --no-deps -d "$work/wheels-$major" "$pkg" >&2
    python -m zipfile -e "$work"/wheels-"$major"/*.whl "$work/cublas-$major"
  fi
  for f in "$work/cublas-$major/$sub"/include/*; do ln -sf "$f" "$root/include/"; done
  # nvcc adds its own install's include folder, not this one: name cuBLAS's headers to it
  cuda_flags="-I$work/cublas-$major/$sub/include"
  for f in "$work/cublas-$major/$sub"/lib/*; do
    ln -sf "$f" "$root/lib/"
    base=$(basename "$f"); ln -sf "$f" "$root/lib/${base%%.so.*}.so"  # the unversioned name the linker looks for
  done
fi
: > "$work/stub.c"
cc -shared -o "$root/lib/stubs/libcuda.so" "$work/stub.c"

export DGR_BACKEND=cuda CUDACXX="$root/bin/nvcc" DGR_BUILD_JOBS="${DGR_BUILD_JOBS:-$(nproc)}"
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$arch -DCUDAToolkit_ROOT=$root -DCUDA_cuda_driver_LIBRARY=$root/lib/stubs/libcuda.so"
if [ -n "$cuda_flags" ]; then CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_CUDA_FLAGS=$cuda_flags"; fi
cached=""
if python -m dgr.vendor status 2>/dev/null | grep -Eq '^built +True'; then
  cached=" (cached: this build was already made; remove $(python -m dgr.vendor path) for a cold one)"
fi
echo "[cuda-compile] building with $DGR_BUILD_JOBS jobs on $(nproc) cores ..." >&2
times_file=$(mktemp)
/usr/bin/env time -f "%e %U %S" -o "$times_file" python -m dgr.vendor build
read -r wall user sys < "$times_file"; rm -f "$times_file"
build="$(python -m dgr.vendor path)/build"
cuda_lib=$(find "$build" -name 'libggml-cuda.a' | head -1)
echo
echo "| CUDA compile lane | value |"
echo "|---|---|"
echo "| nvcc | $("$nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p') |"
echo "| architecture | sm_$arch |"
echo "| cores, jobs | $(nproc), $DGR_BUILD_JOBS |"
echo "| wall | ${wall} s$cached |"
echo "| CPU (user + sys) | $(python -c "print(round($user + $sys))") s |"
echo "| libggml-cuda.a | $(du -m "$cuda_lib" | cut -f1) MiB |"
echo "| build folder | $(du -sm "$build" | cut -f1) MiB |"
