#!/usr/bin/env bash
# Install everything kvfork needs on a fresh Debian/Ubuntu machine, build it into .venv,
# and assemble the default model. Idempotent. Usage: scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# 1. System packages for building llama.cpp (CMake, C++ compiler, libclang for bindgen).
# bindgen (clang-sys) loads `libclang.so*` or `libclang-<version>.so*` from LIBCLANG_PATH or
# the usual library directories. `libclang-cpp.so*` (the C++ library shipped by some images)
# is not libclang and does not count.
have_libclang() {
  local dirs=("${LIBCLANG_PATH:-}") d f
  dirs+=(/usr/lib/llvm-*/lib /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64
         /usr/lib /usr/local/lib)
  for d in "${dirs[@]}"; do
    [ -n "$d" ] && [ -d "$d" ] || continue
    for f in "$d"/libclang.so* "$d"/libclang-[0-9]*.so*; do
      [ -e "$f" ] && return 0
    done
  done
  return 1
}
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v c++ >/dev/null || need+=(g++)
have_libclang || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  echo "setup: installing ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
command -v cargo >/dev/null || { echo "setup: Rust (cargo) is required: https://rustup.rs" >&2; exit 1; }

# 2. CPU features for llama.cpp, from this machine (never AMX: it crashes on some VMs).
# shellcheck source=scripts/cpu_flags.sh
source scripts/cpu_flags.sh

# 3. Python environment, the build, the default model.
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q ".[models,test,dev,ray,docs,server]"
.venv/bin/python -c "import kvfork; print('setup: default model at', kvfork.default_model_path())"
