#!/usr/bin/env bash
# A GPU companion wheel (`kvfork-cuda` or `kvfork-vulkan`) from a `make wheel` build that had
# the GPU feature on: `KVFORK_WHEEL_FEATURES=cuda make wheel && scripts/build_gpu_wheel.sh cuda`.
#
# Why a companion wheel and not a bigger kvfork wheel: the CUDA module is hundreds of MB (one
# kernel image per GPU architecture), more than a CPU user should download and more than PyPI
# takes per file by default, and each GPU runtime has its own dependencies. The companion holds
# only `kvfork_<gpu>/libggml-<gpu>.so`; `pip install kvfork[cuda]` pulls it in at exactly
# kvfork's version (the module binds to the libggml-base of the same llama.cpp build), and
# kvfork loads it at run time when its runtime is present (CPU otherwise; see
# python/kvfork/_backends.py).
#
# CUDA's runtime libraries come from NVIDIA's wheels (nvidia-cuda-runtime-cu12,
# nvidia-cublas-cu12), found through the module's RUNPATH; the driver's libcuda.so.1 and the
# Vulkan loader libvulkan.so.1 come from the system. The kvfork wheel this build also leaves in
# dist/ is not published: the CPU job's wheel is (the same llama.cpp, without the GPU module).
set -euo pipefail
cd "$(dirname "$0")/.."
gpu=${1:?usage: scripts/build_gpu_wheel.sh cuda|vulkan}
case "$gpu" in cuda|vulkan) ;; *) echo "build_gpu_wheel: cuda or vulkan" >&2; exit 1 ;; esac
export PATH="$PWD/.venv-wheel-tools/bin:$PATH"
version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])' 2>/dev/null \
  || sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)
whl=$(ls dist/kvfork-*.whl | head -n1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

wheel unpack -d "$work/cpu" "$whl" >/dev/null
module=$(ls "$work"/cpu/kvfork-*/kvfork/ggml/libggml-"$gpu".so)
name=kvfork_$gpu
tree="$work/$name-$version"
mkdir -p "$tree/$name" "$tree/$name-$version.dist-info"
cp "$module" "$tree/$name/"
cat >"$tree/$name/__init__.py" <<EOF
"""llama.cpp's ${gpu} backend for kvfork, loaded by kvfork at run time (not imported)."""
EOF
requires=""
if [ "$gpu" = cuda ]; then
  requires=$'Requires-Dist: nvidia-cuda-runtime-cu12\nRequires-Dist: nvidia-cublas-cu12\n'
  # NVIDIA's wheels install into site-packages/nvidia/<component>/lib.
  patchelf --set-rpath '$ORIGIN/../nvidia/cuda_runtime/lib:$ORIGIN/../nvidia/cublas/lib:$ORIGIN/../kvfork/ggml' \
    "$tree/$name/libggml-$gpu.so"
else
  patchelf --set-rpath '$ORIGIN/../kvfork/ggml' "$tree/$name/libggml-$gpu.so"
fi
cat >"$tree/$name-$version.dist-info/METADATA" <<EOF
Metadata-Version: 2.1
Name: kvfork-$gpu
Version: $version
Summary: llama.cpp's $gpu backend for kvfork (pip install kvfork[$gpu])
License: MIT OR Apache-2.0
Requires-Python: >=3.10
Requires-Dist: kvfork==$version
${requires}
EOF
cat >"$tree/$name-$version.dist-info/WHEEL" <<EOF
Wheel-Version: 1.0
Generator: kvfork scripts/build_gpu_wheel.sh
Root-Is-Purelib: false
Tag: py3-none-linux_$(uname -m)
EOF
wheel pack -d "$work/packed" "$tree" >/dev/null
# Libraries that come from elsewhere stay external: the driver, the Vulkan loader, NVIDIA's
# wheels, and kvfork's own libggml-base (already loaded when the module is).
auditwheel repair -w dist \
  --exclude libcuda.so.1 --exclude libvulkan.so.1 \
  --exclude 'libcudart.so.*' --exclude 'libcublas.so.*' --exclude 'libcublasLt.so.*' \
  --exclude 'libggml-base.so.*' --exclude 'libggml.so.*' \
  "$work"/packed/*.whl
auditwheel show dist/kvfork_"$gpu"-*.whl
