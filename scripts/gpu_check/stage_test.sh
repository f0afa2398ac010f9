#!/usr/bin/env bash
# Stage test: the whole pytest suite on the installed wheel with every layer of the shared
# models offloaded (KVFORK_TEST_GPU_LAYERS=99), in chunks of test files (gpu_check/chunks.py),
# three at a time (the models are small: the GPU and 16 cores hold three suites); a call runs
# chunks while time is left, the next call goes on with the rest. Ray's tests skip
# (ray is not sent: 65 MB). Exit: 0 every chunk done (failures are in the summary), 3 chunks
# remain, 4 inputs missing. KVFORK_GPU_TEST_FIRST="tests/a.py tests/b.py": those files first (the
# chunks are fixed by a machine's first test call).
set -uo pipefail
source "$(dirname "$0")/common.sh"
T=$WORK/test
mkdir -p "$T"
wait_for() { echo "waiting: $*" | summary test; exit 4; }
[ -f "$WORK/install/DONE" ] || wait_for "stage install"
inputs model >/dev/null || wait_for "the models"
export KVFORK_TEST_GPU_LAYERS=${KVFORK_TEST_GPU_LAYERS:-99}
export KVFORK_MODEL=$INPUTS/$(meta models.default)
export KVFORK_CHAT_MODEL=$INPUTS/$(meta models.chat)
export KVFORK_CACHE_DIR=$WORK/cache
"$PY" -m gpu_check.chunks run --repo "$REPO" --work "$T" --deadline "$KVFORK_GPU_DEADLINE" \
  --files-per-chunk "${KVFORK_GPU_TEST_CHUNK:-3}" --jobs "${KVFORK_GPU_TEST_JOBS:-3}" --min-left "${KVFORK_GPU_TEST_MIN_LEFT:-150}" \
  --first "${KVFORK_GPU_TEST_FIRST:-}" \
  >>"$CALL/test.log" 2>&1
rc=$?
{
  echo "KVFORK_TEST_GPU_LAYERS=$KVFORK_TEST_GPU_LAYERS; models $(basename "$KVFORK_MODEL"), $(basename "$KVFORK_CHAT_MODEL")"
  "$PY" -m gpu_check.chunks summary --work "$T"
} | summary test
exit $rc
