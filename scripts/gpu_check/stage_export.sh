#!/usr/bin/env bash
# Stage export: sends the built CUDA module back through $OUT, as parts of 15 MiB with a
# manifest (at most 4 parts a call: run it again while it says more remain). Here, in a later
# session, `scripts/gpu_check/prepare.sh --module DIR...` (the folders the calls returned)
# bundles that module instead of the source, and stage build uses it as it is.
# Exit: 0 every part out, 3 more remain, 4 no module yet.
set -uo pipefail
source "$(dirname "$0")/common.sh"
if [ ! -f "$WORK/build/DONE" ] || [ ! -f "$WORK/module/libggml-cuda.so" ]; then
  echo "waiting: no module built yet (stage build)" | summary export
  exit 4
fi
archs=$(grep -o 'CMAKE_CUDA_ARCHITECTURES=[^ ,]*' "$WORK/build/DONE" | head -n1 | cut -d= -f2)
meta_json=$("$PY" -c 'import json, sys; print(json.dumps({"llama_cpp_sys_2": sys.argv[1], "archs": sys.argv[2], "plan": sys.argv[3]}))' \
  "$(meta llama_cpp_sys_2)" "${archs:-?}" "$(meta repo)")
"$PY" -m gpu_check.bundles export --work "$WORK" --file "$WORK/module/libggml-cuda.so" \
  --out "$OUTDIR" --meta "$meta_json" | summary export
exit "${PIPESTATUS[0]}"
