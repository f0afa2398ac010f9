#!/usr/bin/env bash
# Stage serve, the GPU serving anchor: llama.cpp's own `llama-server` built with CUDA
# (scripts/build_llama_server.sh --cuda: this GPU's architecture unless KVFORK_GPU_ARCHS names
# a list) from the `server-source` input (the llama.cpp tree of llama-cpp-python 0.3.36's
# sdist, trimmed by prepare.py), then benchmarks/bench_serve.py's shared and disjoint
# workloads: `kvfork serve` (the installed wheel with its kvfork_cuda module) against it, every
# layer offloaded in both (llama-server -ngl 99; kvfork serve offloads them all whenever its
# backend is a GPU), the default model, KVFORK_GPU_SERVE_ROUNDS rounds each (3), and any
# KVFORK_GPU_SERVE_VARIANTS (kvfork serve with other options, in the same rounds). The summary
# gives kvfork's throughput as a multiple of llama-server's against the CPU run's targets
# (shared >= 4x, disjoint >= 1.0x; gpu_check/serve.py) and bench_serve.py's tables.
#
# Resumable: the build goes on where a call's deadline stopped it (ninja); each workload is a
# step with its output and a marker. `--background` only starts the build detached, or says how
# it stands, and returns (run_stage.sh next runs it so while bundles are still to come, beside
# the module's build); a later foreground run waits for it. Exit: 0 done, 3 not yet, 4 inputs
# or stage install missing, 1 failed.
set -uo pipefail
source "$(dirname "$0")/common.sh"
SV=$WORK/serve
DIR=$SV/llama-server # build_llama_server.sh's folder: src/, build/, build.log
BIN=$DIR/build/bin/llama-server
LOG=$CALL/serve.log
ROUNDS=${KVFORK_GPU_SERVE_ROUNDS:-3}
mode=${1:-}
mkdir -p "$SV"

running() { [ -f "$SV/pid" ] && kill -0 "$(cat "$SV/pid")" 2>/dev/null; }
progress() { # ninja's last [done/total]
  local p
  p=$(grep -o '^\[ *[0-9]*[/%][0-9]*\]*' "$DIR/build.log" 2>/dev/null | tail -n1)
  echo "${p:-configuring}"
}
log_build() { # the build log's end, into this call's serve.log
  [ -f "$DIR/build.log" ] || return 0
  { echo "== llama-server's build.log, last $1 lines"; tail -n "$1" "$DIR/build.log"; } >>"$LOG"
}
fail() {
  echo "FAILED: $*" >"$SV/FAILED"
  { cat "$SV/FAILED"; echo "(remove $SV/FAILED to try again)"; } | summary serve
  exit 1
}
src=$(inputs server-source)
case $? in
  0) ;;
  5) fail "the plan has no server-source: prepare.sh --stages ...,serve" ;;
  *) [ "$mode" = --background ] && exit 4
    echo "waiting: llama-server's source has not arrived" | summary serve
    exit 4 ;;
esac
args=(--cuda --source "$src" --jobs "$(nproc)")
case ${KVFORK_GPU_ARCHS:-} in "" | workflow) ;; *) args+=(--cuda-archs "$KVFORK_GPU_ARCHS") ;; esac

# build SECONDS (0: no limit): 0 built (SV/built.md says what), 3 cut, 1 failed (SV/FAILED).
build() {
  local limit=$1 rc start devices
  start=$(date +%s)
  if [ "$limit" -gt 0 ]; then
    timeout "$limit" "$REPO/scripts/build_llama_server.sh" "${args[@]}" "$DIR" >/dev/null 2>>"$SV/build.err"
  else
    "$REPO/scripts/build_llama_server.sh" "${args[@]}" "$DIR" >/dev/null 2>>"$SV/build.err"
  fi
  rc=$?
  echo $(($(cat "$SV/seconds" 2>/dev/null || echo 0) + $(date +%s) - start)) >"$SV/seconds"
  [ $rc = 124 ] && return 3
  if [ $rc != 0 ] || [ ! -x "$BIN" ]; then
    echo "FAILED: llama-server's build (exit $rc): $(tail -n 3 "$SV/build.err")" >"$SV/FAILED"
    return 1
  fi
  devices=$(timeout 120 "$BIN" --list-devices 2>&1 | grep -E '^ *CUDA[0-9]+:' | sed 's/^ *//' | paste -sd';')
  if [ -z "$devices" ]; then
    echo "FAILED: llama-server --list-devices names no CUDA device" >"$SV/FAILED"
    return 1
  fi
  {
    echo "- llama-server: $("$BIN" --version 2>&1 | grep -m1 '^version'), from $(meta server_sdist)," \
      "CUDA archs $(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$DIR/build/CMakeCache.txt")," \
      "built in $(cat "$SV/seconds") s on $(nproc) cores; devices: $devices"
    echo "- both servers: every layer on the GPU (llama-server -ngl 99 --parallel 16; kvfork serve" \
      "on its CUDA backend), 2 threads, default model $(meta models.default), $ROUNDS rounds"
  } >"$SV/built.md"
}

if [ "$mode" = --inner ]; then # the detached build
  build 0
  rm -f "$SV/pid"
  exit 0
fi
if [ -f "$SV/DONE" ]; then
  summary serve <"$SV/DONE"
  exit 0
fi
if [ -f "$SV/FAILED" ]; then
  { cat "$SV/FAILED"; echo "(remove $SV/FAILED to try again)"; } | summary serve
  log_build 60
  exit 1
fi

# 1. llama-server, built once (in the background while bundles are still to come).
if [ ! -f "$SV/built.md" ]; then
  if running; then
    if [ "$mode" = --background ]; then
      echo "llama-server: building in the background, $(progress)" | summary serve
      exit 3
    fi
    while running && [ "$(left)" -gt 5 ]; do sleep 2; done
    if running; then
      echo "llama-server: building in the background, $(progress); continues during the next call" | summary serve
      exit 3
    fi
  elif [ "$mode" = --background ]; then
    setsid bash "$0" --inner </dev/null >>"$SV/inner.log" 2>&1 &
    echo $! >"$SV/pid"
    echo "llama-server: building in the background; later calls carry the other bundles meanwhile" | summary serve
    exit 3
  fi
  if [ -f "$SV/FAILED" ]; then # the background build failed
    { cat "$SV/FAILED"; tail -n 20 "$SV/build.err"; } | summary serve
    log_build 60
    exit 1
  fi
  if [ ! -f "$SV/built.md" ]; then
    if [ "$(left)" -lt 30 ]; then
      echo "llama-server: $(progress) built; $(left) s left in this call: the next call goes on" | summary serve
      exit 3
    fi
    build "$(left)"
    rc=$?
    log_build 30
    case $rc in
      0) ;;
      3) echo "llama-server: $(progress) built when this call's time ran out; the next call goes on" | summary serve
        exit 3 ;;
      *) { cat "$SV/FAILED"; tail -n 20 "$SV/build.err"; } | summary serve
        log_build 60
        exit 1 ;;
    esac
  fi
fi
if [ "$mode" = --background ]; then # built; the workloads wait for the other inputs
  { cat "$SV/built.md"; echo "waiting: the bundles still to come"; } | summary serve
  exit 3
fi

# 2. bench_serve.py, one workload a step.
wait_for() { { cat "$SV/built.md"; echo "waiting: $*"; } | summary serve; exit 4; }
[ -f "$WORK/install/DONE" ] || wait_for "stage install"
inputs model >/dev/null || wait_for "the default model"
KVFORK_MODEL=$INPUTS/$(meta models.default)
export KVFORK_MODEL KVFORK_CACHE_DIR=$WORK/cache
# step NAME SECONDS CMD...: runs CMD (stdout SV/NAME.txt, stderr SV/NAME.log) unless done
step() {
  local name=$1 need=$2
  shift 2
  [ -f "$SV/$name.done" ] && return 0
  if [ "$(left)" -lt "$need" ]; then
    echo "$name: $(left) s left, under $need: next call" >>"$LOG"
    return 3
  fi
  echo "== $name: $*" >>"$LOG"
  timeout "$(left)" "$@" >"$SV/$name.txt" 2>"$SV/$name.log"
  local rc=$?
  cat "$SV/$name.log" "$SV/$name.txt" >>"$LOG"
  [ $rc = 124 ] && return 3
  echo "$rc" >"$SV/$name.done"
  return 0
}
cd "$WORK" || exit 1
# KVFORK_GPU_SERVE_VARIANTS: more kvfork servers to compare in the same rounds, each NAME=ARGS,
# separated by ';' (e.g. "no-warmup=--warmup off").
# KVFORK_GPU_SERVE_CLIENT: the bursts' client, raw (bare connections: default) or openai (whose
# parsing of the chunks takes longer than a GPU server's steps; BENCHMARKS §26).
CLIENT=${KVFORK_GPU_SERVE_CLIENT:-raw}
variants=()
IFS=';' read -ra named <<<"${KVFORK_GPU_SERVE_VARIANTS:-}"
for v in "${named[@]}"; do [ -n "$v" ] && variants+=(--kvfork-variant "$v"); done
rc=0
for load in shared disjoint; do
  step "$load" 150 "$PY" "$REPO/benchmarks/bench_serve.py" --only "$load" --rounds "$ROUNDS" \
    --llama-server "$BIN" --example-server "" --gpu-layers 99 --client "$CLIENT" "${variants[@]}" \
    || { rc=3; break; }
done
failed=""
for load in shared disjoint; do
  [ -f "$SV/$load.done" ] && [ "$(cat "$SV/$load.done")" != 0 ] && failed="$failed $load"
done
[ -n "$failed" ] && rc=1
{
  cat "$SV/built.md"
  case $rc in
    1) echo "- FAILED:$failed (remove $SV/NAME.done to run one again)" ;;
    3) echo "- not finished: the next call goes on with the remaining workloads" ;;
  esac
  echo
  "$PY" -m gpu_check.serve report --dir "$SV"
} >"$SV/summary.md"
[ $rc = 0 ] && cp "$SV/summary.md" "$SV/DONE"
summary serve <"$SV/summary.md"
exit $rc
