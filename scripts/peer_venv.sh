#!/usr/bin/env bash
# Install the peer (llama-cpp-python, pinned) into .venv-peer for the benchmarks that compare
# against it. Built from source with this CPU's instruction sets and without AMX (ggml's
# native build turns AMX on where the CPU has it, and its AMX kernels crash on these VMs).
set -euo pipefail
cd "$(dirname "$0")/.."
PEER_VERSION=0.3.36
if .venv-peer/bin/python -c "import llama_cpp, numpy, sys; sys.exit(llama_cpp.__version__ != '$PEER_VERSION')" 2>/dev/null; then
  exit 0
fi
source scripts/cpu_flags.sh
cmake_args="-DGGML_NATIVE=OFF"
for flag in GGML_AVX GGML_AVX2 GGML_FMA GGML_F16C GGML_BMI2 GGML_AVX512 GGML_AVX512_VNNI \
  GGML_AVX_VNNI GGML_AMX_TILE GGML_AMX_INT8 GGML_AMX_BF16; do
  cmake_args+=" -D$flag=${!flag:-OFF}"
done
python3 -m venv .venv-peer
echo "building llama-cpp-python $PEER_VERSION (several minutes): $cmake_args"
CMAKE_ARGS="$cmake_args" .venv-peer/bin/pip install -q --no-cache-dir \
  "llama-cpp-python==$PEER_VERSION" numpy
