# Sourced by run_stage.sh and the stage scripts, on the GPU machine: where things are, the
# call's time budget, and the summary helper.
#
# KVFORK_GPU_WORK   the work folder (default /tmp/kvfork-gpu; survives between the calls of a
#                   session while the machine stays warm)
# KVFORK_GPU_BUDGET_S  seconds a call may spend on its stages (default 540 of a 600 s call)
# KVFORK_GPU_PYTHON the Python (default python3: the image's, 3.12)
# OUT               where the summaries and logs go (set by the device tool; else WORK/out)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${KVFORK_GPU_WORK:-/tmp/kvfork-gpu}
INPUTS=$WORK/inputs
SITE=$WORK/site
SUMMARIES=$WORK/summaries
CALL=$WORK/call # this call's logs (emptied by run_stage.sh)
OUTDIR=${OUT:-$WORK/out}
PY=${KVFORK_GPU_PYTHON:-python3}
export PYTHONPATH="$SITE:$REPO/scripts"
export KVFORK_GPU_DEADLINE=${KVFORK_GPU_DEADLINE:-$(($(date +%s) + ${KVFORK_GPU_BUDGET_S:-540}))}
mkdir -p "$WORK" "$SUMMARIES" "$CALL"

# CUDA: nvcc for the build, its runtime libraries (libcudart, libcublas) for the module.
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$NVCC" ]; then
  CUDA_HOME=${CUDA_HOME:-$(cd "$(dirname "$NVCC")/.." && pwd)}
  export CUDACXX=${CUDACXX:-$NVCC} CUDA_HOME
  export PATH="$CUDA_HOME/bin:$PATH"
  export LD_LIBRARY_PATH="$CUDA_HOME/lib64:$CUDA_HOME/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

left() { echo $((KVFORK_GPU_DEADLINE - $(date +%s))); }

# summary STAGE: stdin becomes STAGE's summary (the latest replaces the earlier), printed too.
summary() {
  local n
  case $1 in receive) n=1 ;; build) n=2 ;; install) n=3 ;; test) n=4 ;; bench) n=5 ;; *) n=6 ;; esac
  { echo "## $1 ($(date -u +%H:%M:%SZ))"; cat; echo; } >"$SUMMARIES/$n-$1.md"
  cat "$SUMMARIES/$n-$1.md"
}

# inputs KIND: the received inputs of that kind, one a line. Status 4: not all arrived yet;
# 5: the plan has none of that kind.
inputs() { "$PY" -m gpu_check.bundles paths --work "$WORK" "$1"; }

# meta KEY: a value from the plan's manifest (prepare.py's `meta`).
meta() {
  "$PY" -c 'import json, sys; v = json.load(open(sys.argv[1]))["meta"]
for k in sys.argv[2].split("."): v = v.get(k, "") if isinstance(v, dict) else ""
print(" ".join(v) if isinstance(v, list) else v)' "$WORK/manifest.json" "$1" 2>/dev/null
}
