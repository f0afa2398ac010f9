#!/usr/bin/env bash
# Stage install: the kvfork wheel and the test suite's wheels into WORK/site (pip, no index,
# no dependencies: each one the suite needs is among them, numpy aside, the image's), the
# CUDA module beside them as the `kvfork_cuda` companion package (what `pip install
# kvfork[cuda]` gives), then `kvfork.system_info()` must name cuda. KVFORK_GPU_OVERLAY=1 also
# copies the working tree's python/kvfork/*.py over the wheel's (Python-only changes since
# the wheel was built). Exit: 0 installed, 4 inputs missing, 1 failed.
set -uo pipefail
source "$(dirname "$0")/common.sh"
I=$WORK/install
LOG=$CALL/install.log
mkdir -p "$I"
if [ -f "$I/DONE" ]; then
  summary install <"$I/DONE"
  exit 0
fi
wait_for() { echo "waiting: $*" | summary install; exit 4; }
wheel=$(inputs wheel) || wait_for "the kvfork wheel"
deps=$(inputs deps)
case $? in 0 | 5) ;; *) wait_for "test-wheels.tar" ;; esac
if [ ! -f "$WORK/module/libggml-cuda.so" ] && mod=$(inputs module); then
  mkdir -p "$WORK/module" && cp "$mod" "$WORK/module/libggml-cuda.so" # sent back earlier
fi
[ -f "$WORK/module/libggml-cuda.so" ] || wait_for "the CUDA module (stage build)"

rm -rf "$SITE" "$I/wheels"
mkdir -p "$I/wheels"
[ -n "$deps" ] && tar -C "$I/wheels" -xf "$deps"
shopt -s nullglob
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
  "$wheel" "$I"/wheels/*.whl >"$LOG" 2>&1; then
  { echo "FAILED: pip install (install.log)"; tail -n 20 "$LOG"; } | summary install
  exit 1
fi
mkdir -p "$SITE/kvfork_cuda"
cp "$WORK/module/libggml-cuda.so" "$SITE/kvfork_cuda/"
echo '"""llama.cpp'"'"'s CUDA backend for kvfork, built by scripts/gpu_check (not imported)."""' \
  >"$SITE/kvfork_cuda/__init__.py"
overlay=""
if [ "${KVFORK_GPU_OVERLAY:-0}" = 1 ]; then
  (cd "$REPO/python" && find kvfork -name '*.py' -exec cp --parents {} "$SITE/" \;)
  overlay="; python/kvfork/*.py of the working tree copied over the wheel's"
fi
cd "$WORK" || exit 1
if ! "$PY" -c 'import json, kvfork; print(json.dumps(kvfork.system_info(), default=str))' \
  >"$I/system_info.json" 2>>"$LOG"; then
  { echo "FAILED: import kvfork / system_info()"; tail -n 20 "$LOG"; } | summary install
  exit 1
fi
backend=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["backend"])' "$I/system_info.json")
{
  echo "- wheel: $(basename "$wheel")$overlay"
  echo "- test wheels: $(ls "$I"/wheels/*.whl 2>/dev/null | wc -l) (numpy: the image's, $("$PY" -c 'import numpy; print(numpy.__version__)'))"
  echo "- system_info: $(cat "$I/system_info.json")"
} >"$I/summary.md"
if [ "$backend" != cuda ]; then
  { echo "FAILED: backend is $backend, not cuda"; cat "$I/summary.md"; } | summary install
  exit 1
fi
cp "$I/summary.md" "$I/DONE"
summary install <"$I/DONE"
