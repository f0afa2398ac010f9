#!/usr/bin/env bash
# Stage build: llama.cpp's CUDA backend as a loadable module (libggml-cuda.so) from the source
# the pinned llama-cpp-sys-2 vendors, with the CMake settings of the release workflow's cargo
# build (gpu_check/cmake_flags.py computes them from the repository and checks them against
# the configured CMakeCache.txt), compiled for this GPU's architecture only unless
# KVFORK_GPU_ARCHS says otherwise (`workflow`: the workflow's whole list; or a CMake list).
# Only the ggml-cuda target is built (with ggml-base): the module binds at run time to the
# wheel's own libggml-base. About 3.5 min on 16 cores for one architecture.
#
# Resumable: ninja picks up where a call's deadline stopped it. `--background` starts the
# build detached (setsid) and returns, so later calls can carry the other bundles meanwhile;
# a later foreground run waits for it. A module sent back by an earlier session (an input of
# kind `module`) is used as it is. Exit: 0 built, 3 not yet, 4 no source yet, 1 failed.
set -uo pipefail
source "$(dirname "$0")/common.sh"
B=$WORK/build
LOG=$B/build.log
mkdir -p "$B" "$WORK/module"
MODULE=$WORK/module/libggml-cuda.so

progress() { grep -o '^\[ *[0-9]*[/%][0-9]*\]*' "$LOG" 2>/dev/null | tail -n1; }
running() { [ -f "$B/pid" ] && kill -0 "$(cat "$B/pid")" 2>/dev/null; }
finish() { # the module is built: keep it, record what it is
  local built
  built=$(find "$B" -name libggml-cuda.so -newer "$B/flags.configured" | head -n1)
  [ -n "$built" ] || built=$(find "$B" -name libggml-cuda.so | head -n1)
  [ -n "$built" ] || return 1
  cp "$built" "$MODULE"
  strip --strip-unneeded "$MODULE" 2>/dev/null || true # as scripts/build_wheel.sh does
  {
    echo "- module: $(stat -c %s "$MODULE") bytes (stripped), sha256 $(sha256sum "$MODULE" | cut -c1-16)"
    echo "- llama-cpp-sys-2 $(meta llama_cpp_sys_2), nvcc $("$CUDACXX" --version | grep -o 'release [0-9.]*' | cut -d' ' -f2)"
    echo "- build: $(cat "$B/seconds" 2>/dev/null || echo '?') s on $(nproc) cores"
    cat "$B/compare.md"
  } >"$B/DONE"
}
fail() { echo "FAILED: $*" >"$B/FAILED"; }

gpu_archs() {
  case ${KVFORK_GPU_ARCHS:-} in
    workflow) echo "" ;; # the workflow's own list (cmake_flags leaves it as it is)
    "") local cap
      cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '. ')
      echo "${cap:-90}-real" ;;
    *) echo "$KVFORK_GPU_ARCHS" ;;
  esac
}

# build SECONDS: configure (once) and build the module; 0 no limit. 0 done, 3 cut, 1 failed.
build() {
  local limit=$1 src archs rc start
  src=$(inputs source) || { fail "no source"; return 1; }
  if [ ! -f "$WORK/src/.unpacked" ]; then
    rm -rf "$WORK/src" && mkdir -p "$WORK/src" && tar -C "$WORK/src" -xJf "$src" \
      && touch "$WORK/src/.unpacked" || { fail "unpacking $src"; return 1; }
  fi
  archs=$(gpu_archs)
  "$PY" -m gpu_check.cmake_flags flags --repo "$REPO" --build-dir "$B" --archs "$archs" >"$B/flags.txt"
  if ! "$PY" -m gpu_check.cmake_flags compare --repo "$REPO" --build-dir "$B" --archs "$archs" >"$B/compare.md"; then
    fail "the CMake settings differ from the workflow's: $(cat "$B/compare.md")"
    return 1
  fi
  if [ ! -f "$B/flags.configured" ] || ! cmp -s "$B/flags.txt" "$B/flags.configured"; then
    local flags generator=()
    mapfile -t flags <"$B/flags.txt"
    command -v ninja >/dev/null && generator=(-G Ninja) # else CMake's default, Makefiles
    echo "cmake -S $WORK/src/llama.cpp -B $B ${generator[*]} ${flags[*]}" >>"$LOG"
    cmake -S "$WORK/src/llama.cpp" -B "$B" "${generator[@]}" "${flags[@]}" >>"$LOG" 2>&1 \
      || { fail "cmake configure (build.log)"; return 1; }
    if ! "$PY" -m gpu_check.cmake_flags check-cache --repo "$REPO" --build-dir "$B" \
      --archs "$archs" "$B/CMakeCache.txt" >>"$B/compare.md"; then
      fail "CMakeCache.txt differs from the settings asked: $(cat "$B/compare.md")"
      return 1
    fi
    cp "$B/flags.txt" "$B/flags.configured"
  fi
  start=$(date +%s)
  if [ "$limit" -gt 0 ]; then
    timeout "$limit" cmake --build "$B" -j "$(nproc)" --target ggml-cuda >>"$LOG" 2>&1
  else
    cmake --build "$B" -j "$(nproc)" --target ggml-cuda >>"$LOG" 2>&1
  fi
  rc=$?
  echo $(($(cat "$B/seconds" 2>/dev/null || echo 0) + $(date +%s) - start)) >"$B/seconds"
  [ $rc = 124 ] && return 3
  [ $rc = 0 ] || { fail "cmake --build (exit $rc; build.log)"; return 1; }
  finish || { fail "no libggml-cuda.so after the build"; return 1; }
}

if [ "${1:-}" = --inner ]; then # the detached build
  build 0
  rm -f "$B/pid"
  exit 0
fi

if [ -f "$B/DONE" ]; then
  summary build <"$B/DONE"
  exit 0
fi
if [ -f "$B/FAILED" ]; then
  { cat "$B/FAILED"; echo "(remove $B/FAILED to try again)"; tail -n 30 "$LOG" 2>/dev/null; } | summary build
  exit 1
fi
mod=$(inputs module)
case $? in
  0) cp "$mod" "$MODULE"
    echo "- module: sent back by an earlier session ($(meta module.archs)), sha256 $(sha256sum "$MODULE" | cut -c1-16)" >"$B/DONE"
    summary build <"$B/DONE"
    exit 0 ;;
  4) echo "waiting: the CUDA module sent back earlier has not all arrived" | summary build
    exit 4 ;;
esac
if ! inputs source >/dev/null; then
  echo "waiting: the llama.cpp source has not arrived" | summary build
  exit 4
fi
if running; then
  if [ "${1:-}" = --background ]; then
    echo "running in the background: $(progress)" | summary build
    exit 3
  fi
  while running && [ "$(left)" -gt 5 ]; do sleep 5; done
  if running; then
    echo "running in the background: $(progress); continues during the next call" | summary build
    exit 3
  fi
  [ -f "$B/DONE" ] && { cp "$LOG" "$CALL/build.log"; summary build <"$B/DONE"; exit 0; }
  { cat "$B/FAILED" 2>/dev/null; tail -n 30 "$LOG"; } | summary build
  exit 1
fi
if [ "${1:-}" = --background ]; then
  setsid bash "$0" --inner </dev/null >>"$B/inner.log" 2>&1 &
  echo $! >"$B/pid"
  echo "started in the background (archs $(gpu_archs)); later calls carry the other bundles meanwhile" | summary build
  exit 3
fi
build "$(left)"
rc=$?
cp "$LOG" "$CALL/build.log" 2>/dev/null
case $rc in
  0) summary build <"$B/DONE" ;;
  3) echo "not finished: $(progress) when this call's time ran out; the next call goes on" | summary build ;;
  *) { cat "$B/FAILED"; tail -n 30 "$LOG"; } | summary build ;;
esac
exit $rc
