#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (for benchmarks/bench_serve.py) from source: the llama.cpp
# tree inside llama-cpp-python 0.3.36's sdist (llama-cpp-sys-2's vendored copy has no server
# sources). This CPU's instruction sets, never AMX (it crashes on some VMs). ~15 min on 2 cores.
# Usage: scripts/build_llama_server.sh [DIR]   (default .peer-server; prints the binary's path)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.peer-server}
BIN="$DIR/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$DIR"
if [ ! -d "$DIR/src" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$DIR"
  mkdir -p "$DIR/src"
  tar -xzf "$DIR"/llama_cpp_python-0.3.36.tar.gz -C "$DIR/src" --strip-components=1
fi
source scripts/cpu_flags.sh
args=(-DGGML_NATIVE=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
      -DLLAMA_BUILD_WEBUI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
      -DCMAKE_BUILD_TYPE=Release)
for flag in GGML_AVX GGML_AVX2 GGML_FMA GGML_F16C GGML_BMI2 GGML_AVX512 GGML_AVX512_VNNI \
  GGML_AVX_VNNI GGML_AMX_TILE GGML_AMX_INT8 GGML_AMX_BF16; do
  args+=("-D$flag=${!flag:-OFF}")
done
cmake -S "$DIR/src/vendor/llama.cpp" -B "$DIR/build" "${args[@]}" >/dev/null
cmake --build "$DIR/build" --target llama-server -j "$(nproc)" >/dev/null
echo "$BIN"
