#!/usr/bin/env bash
# The GPU check, on the GPU machine (CUDA, CMake, ninja, Python 3.12; no Rust, no network).
# usage: scripts/gpu_check/run_stage.sh next|receive|build|install|serve|test|bench|export|status
#
# Every call first takes in the bundles it carries (stage_receive.sh), then runs STAGE. `next`
# runs each planned stage not done yet, in order (build, install, serve, test, bench; serve
# only when prepare.sh's --stages named it; KVFORK_GPU_BENCH_FIRST=1 puts bench before
# test), until this call's budget (KVFORK_GPU_BUDGET_S,
# 540 s of a 600 s call) is spent or a stage waits for inputs; while bundles are still to
# come, the builds (the module's, and llama-server's for serve) run detached so that the next
# calls can carry them meanwhile; serve runs before the suite and the benchmarks, so that no
# build runs beside their timings. State lives in KVFORK_GPU_WORK (/tmp/kvfork-gpu), which
# lasts while the machine stays warm between calls. $OUT gets summary.md (every stage's latest
# summary and the verdict: done, continue, waiting, FAILED) and the logs of the stages this
# call ran.
# Exit: 0 done; 3 continue (call again, carrying nothing new); 4 waiting for bundles; 1 failed.
set -uo pipefail
source "$(dirname "$0")/common.sh"
stage=${1:?usage: run_stage.sh next|receive|build|install|serve|test|bench|export|status}
rm -rf "$CALL" && mkdir -p "$CALL"
VERDICT="verdict: ?"

publish() {
  mkdir -p "$OUTDIR"
  {
    echo "# kvfork GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), stage \`$stage\`"
    echo
    echo "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n1);" \
      "$("$PY" --version 2>&1); $(nproc) cores; call budget ${KVFORK_GPU_BUDGET_S:-540} s, $(left) s left"
    echo
    echo "$VERDICT"
    echo
    cat "$SUMMARIES"/*.md 2>/dev/null
  } >"$OUTDIR/summary.md"
  [ -f "$WORK/build/build.log" ] && [ -f "$WORK/build/pid" ] && cp "$WORK/build/build.log" "$CALL/build.log"
  for log in "$CALL"/*.log; do
    [ -f "$log" ] && tail -c 8000000 "$log" >"$OUTDIR/$(basename "$log")"
  done
  echo "$VERDICT"
}
trap publish EXIT

"$HERE/stage_receive.sh"
received=$?
planned=$(meta stages)
missing=$("$PY" -m gpu_check.bundles status --work "$WORK" 2>/dev/null | grep -c MISSING)

verdict() { # exit code of the last stage -> the call's verdict line and exit code
  case $1 in
    0) VERDICT="verdict: done" ;;
    3) VERDICT="verdict: continue (call again; carry only the bundles still MISSING, if any)" ;;
    4) VERDICT="verdict: waiting for bundles (send the ones listed as MISSING)" ;;
    *) VERDICT="verdict: FAILED (stage $2)" ;;
  esac
  return "$1"
}

case $stage in
  receive | status)
    [ "$stage" = status ] && "$PY" -m gpu_check.bundles status --work "$WORK"
    if [ $received != 0 ]; then
      verdict 1 receive
    elif [ "$missing" = 0 ]; then
      verdict 0 receive
    else
      verdict 4 receive
    fi
    exit $? ;;
  build | install | serve | test | bench | export)
    "$HERE/stage_$stage.sh"
    verdict $? "$stage"
    exit $? ;;
  next) ;;
  *) echo "run_stage.sh: unknown stage $stage" >&2; exit 2 ;;
esac

[ $received = 1 ] && [ ! -f "$WORK/manifest.json" ] && { verdict 1 receive; exit 1; }
rc=0
case " $planned " in
  *" serve "*) [ "$missing" != 0 ] && "$HERE/stage_serve.sh" --background ;; # llama-server's build
esac
# KVFORK_GPU_BENCH_FIRST=1: the benchmarks before the suite (a session short of device time).
order="build install serve test bench"
[ "${KVFORK_GPU_BENCH_FIRST:-0}" = 1 ] && order="build install serve bench test"
for s in $order; do
  case " $planned " in *" $s "*) ;; *) continue ;; esac
  if { [ "$s" = build ] || [ "$s" = serve ]; } && [ "$missing" != 0 ]; then
    "$HERE/stage_$s.sh" --background # builds only; the rest waits for the inputs
  else
    "$HERE/stage_$s.sh"
  fi
  rc=$?
  [ $rc = 0 ] || break
done
[ $rc = 3 ] && [ "$missing" != 0 ] && rc=4
verdict $rc "$s"
exit $?
