#!/usr/bin/env bash
# Stage receive: takes in the bundles this call carries (.gpu-check/bundle-NN): each part's
# sha256 checked, an input reassembled (and its whole sha256 checked) once all its parts have
# arrived, over as many calls as that takes. Idempotent; run_stage.sh runs it on every call.
set -uo pipefail
source "$(dirname "$0")/common.sh"
out=$("$PY" -m gpu_check.bundles receive --work "$WORK" --from "$REPO/.gpu-check" 2>&1)
rc=$?
echo "$out" | summary receive
exit $rc
