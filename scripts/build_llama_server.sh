#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (for benchmarks/bench_serve.py) from source: the llama.cpp
# tree inside llama-cpp-python 0.3.36's sdist (llama-cpp-sys-2's vendored copy has no server
# sources). This CPU's instruction sets (scripts/cpu_flags.sh), never AMX (it crashes on some
# VMs); no web UI (nor its download). ~15 min on 2 cores for the CPU build.
#
# usage: scripts/build_llama_server.sh [--cuda] [--cuda-archs LIST] [--source PATH] [--jobs N]
#                                      [--print-cmake] [DIR]
#   DIR            where the source is unpacked (DIR/src) and built (DIR/build); default
#                  .peer-server. The binary's path is printed at the end: DIR/build/bin/llama-server
#   --cuda         the CUDA backend too (-DGGML_CUDA=ON; needs nvcc), every layer offloadable
#   --cuda-archs   CMAKE_CUDA_ARCHITECTURES (a CMake list, e.g. "90-real" or "80-real;90-real";
#                  implies --cuda); default: the local GPUs' own, from nvidia-smi's compute_cap
#                  (9.0 -> 90-real)
#   --source PATH  no pip download: llama-cpp-python 0.3.36's sdist (.tar.gz), the trimmed
#                  llama.cpp tree scripts/gpu_check/prepare.py makes (.tar.xz, llama.cpp/ inside),
#                  or a llama.cpp directory (or an unpacked sdist holding vendor/llama.cpp)
#   --jobs N       parallel compile jobs (default: nproc)
#   --print-cmake  print the CMake configure command this would run, and exit
# Relative paths are taken from the repository's root, where the script works.
# Without --source: the sdist is fetched with pip into DIR once (what `make peer-server` does).
# Resumable: running it again configures only when the command changed and lets the generator
# (Ninja when installed, else Makefiles; a configured DIR keeps its own) go on where it stopped.
# CMake's and the compiler's output go to DIR/build.log (its tail on stderr when a step fails).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '/^# usage:/,/^# Without --source/p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
DIR=.peer-server CUDA=0 ARCHS="" SOURCE="" JOBS="" PRINT=0
while [ $# -gt 0 ]; do
  case $1 in
    --cuda) CUDA=1 ;;
    --cuda-archs) ARCHS=${2:?--cuda-archs LIST}; CUDA=1; shift ;;
    --source) SOURCE=${2:?--source PATH}; shift ;;
    --jobs) JOBS=${2:?--jobs N}; shift ;;
    --print-cmake) PRINT=1 ;;
    -h | --help) usage ;;
    -*) echo "build_llama_server.sh: unknown option $1" >&2; usage ;;
    *) DIR=$1 ;;
  esac
  shift
done
BUILD=$DIR/build
BIN=$BUILD/bin/llama-server
LOG=$DIR/build.log
JOBS=${JOBS:-$(nproc)}
SDIST=llama_cpp_python-0.3.36.tar.gz

# Where the llama.cpp tree is (or will be, once unpacked into DIR/src) for SOURCE's kind.
case $SOURCE in
  "" | *.tar.gz | *.tgz) TREE=$DIR/src/vendor/llama.cpp ;;
  *.tar.xz) TREE=$DIR/src/llama.cpp ;;
  *) if [ -d "$SOURCE/vendor/llama.cpp" ]; then TREE=$SOURCE/vendor/llama.cpp; else TREE=$SOURCE; fi ;;
esac

args=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF)
source scripts/cpu_flags.sh # GGML_AVX... of this CPU; the AMX ones always OFF
for flag in GGML_AVX GGML_AVX2 GGML_FMA GGML_F16C GGML_BMI2 GGML_AVX512 GGML_AVX512_VNNI \
  GGML_AVX_VNNI GGML_AMX_TILE GGML_AMX_INT8 GGML_AMX_BF16; do
  args+=("-D$flag=${!flag:-OFF}")
done
if [ $CUDA = 1 ]; then
  if [ -z "$ARCHS" ]; then # 9.0 -> 90-real, one entry per distinct GPU model
    ARCHS=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
      | tr -d '. ' | grep -E '^[0-9]+$' | sort -u | sed 's/$/-real/' | paste -sd';' || true)
    [ -n "$ARCHS" ] || { echo "build_llama_server.sh: no GPU found by nvidia-smi: pass --cuda-archs" >&2; exit 1; }
  fi
  if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  fi
  args+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$ARCHS" -DGGML_CUDA_NCCL=OFF)
fi
# A build folder configured from another tree is started afresh (CMake refuses to switch);
# one configured from this tree keeps its generator (CMake refuses another too).
stale=0
if [ -f "$BUILD/CMakeCache.txt" ]; then
  home=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")
  [ "$home" = "$(realpath -m "$TREE")" ] || [ "$home" = "$(realpath -ms "$TREE")" ] || stale=1
fi
generator=()
if [ -f "$BUILD/CMakeCache.txt" ] && [ $stale = 0 ]; then
  :
elif command -v ninja >/dev/null; then
  generator=(-G Ninja)
fi
configure=(cmake -S "$TREE" -B "$BUILD" "${generator[@]}" "${args[@]}")
if [ $PRINT = 1 ]; then
  printf '%q ' "${configure[@]}" | sed 's/ $//'
  echo
  exit 0
fi

# The same configure command as the last complete build, and the binary there: nothing to do.
# (A binary built before this script recorded its command counts as done, as it always did.)
wanted=$(printf '%q ' "$TREE" "${args[@]}")
if [ -x "$BIN" ] && { [ ! -f "$BUILD/.configured" ] || [ "$(cat "$BUILD/.built" 2>/dev/null)" = "$wanted" ]; }; then
  echo "$BIN"
  exit 0
fi
if [ -n "$SOURCE" ] && [ ! -e "$SOURCE" ]; then
  echo "build_llama_server.sh: --source $SOURCE: no such file or directory" >&2
  exit 1
fi
[ $stale = 0 ] || rm -rf "$BUILD"
failed() { echo "build_llama_server.sh: $1 failed; the end of $LOG:" >&2; tail -n 40 "$LOG" >&2; exit 1; }
mkdir -p "$DIR"

# 1. The source, unpacked once into DIR/src (DIR/src/.unpacked says from which file).
from=""
if [ -f "$SOURCE" ]; then
  from=$(stat -c '%n %s %Y' "$SOURCE")
  [ "$(cat "$DIR/src/.unpacked" 2>/dev/null)" = "$from" ] || unpack=$SOURCE
elif [ -z "$SOURCE" ] && [ ! -f "$TREE/tools/server/CMakeLists.txt" ]; then
  [ -f "$DIR/$SDIST" ] || python3 -m pip download -q --no-deps --no-binary :all: \
    llama-cpp-python==0.3.36 -d "$DIR"
  unpack=$DIR/$SDIST
fi
if [ -n "${unpack:-}" ]; then
  rm -rf "$DIR/src" "$DIR/src.partial" && mkdir -p "$DIR/src.partial"
  case $unpack in
    *.tar.xz) tar -C "$DIR/src.partial" -xJf "$unpack" ;;
    *) tar -C "$DIR/src.partial" -xzf "$unpack" --strip-components=1 ;; # the sdist
  esac
  echo "$from" >"$DIR/src.partial/.unpacked"
  mv "$DIR/src.partial" "$DIR/src"
fi
if [ ! -f "$TREE/tools/server/CMakeLists.txt" ]; then
  echo "build_llama_server.sh: no $TREE/tools/server (llama-cpp-python 0.3.36's llama.cpp has it)" >&2
  exit 1
fi

# 2. Configure when the command changed (or never ran), then build: the generator resumes.
if [ ! -f "$BUILD/CMakeCache.txt" ] || [ "$(cat "$BUILD/.configured" 2>/dev/null)" != "$wanted" ]; then
  echo "== $(date -u +%H:%M:%SZ) ${configure[*]}" >>"$LOG"
  "${configure[@]}" >>"$LOG" 2>&1 || failed "cmake configure"
  echo "$wanted" >"$BUILD/.configured"
fi
echo "== $(date -u +%H:%M:%SZ) cmake --build $BUILD --target llama-server -j $JOBS" >>"$LOG"
cmake --build "$BUILD" --target llama-server -j "$JOBS" >>"$LOG" 2>&1 || failed "cmake --build"
echo "$wanted" >"$BUILD/.built"
echo "$BIN"
