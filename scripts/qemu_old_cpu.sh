#!/usr/bin/env bash
# The release wheel on CPUs older than this one, under qemu-user (Debian's `qemu-user`):
# import, system_info() and a short generation with each CPU model named (default: Nehalem,
# SSE4.2 and no AVX; qemu64, plain x86-64 v1). Each must pick a CPU variant the emulated CPU
# runs and generate; an instruction it lacks would end the run with SIGILL.
#
# Usage: scripts/qemu_old_cpu.sh [cpu ...]   (after `make wheel`; KVFORK_WHEEL_VENV reuses a
# venv where the wheel and the `models` extra are installed)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v qemu-x86_64 >/dev/null || {
  echo "qemu_old_cpu: needs qemu-x86_64 (apt-get install qemu-user)" >&2; exit 1; }
venv=${KVFORK_WHEEL_VENV:-}
if [ -z "$venv" ]; then
  whl=$(ls dist/kvfork-*.whl | head -n1)
  venv=$(mktemp -d)/venv
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "$whl[models]"
fi
# The model path is resolved natively (assembling the cached file is no CPU test).
model=$("$venv/bin/python" -c 'import kvfork; print(kvfork.default_model_path())')
# The venv's python is a link to the system's; qemu-user runs that binary with the venv's
# sys.prefix (pyvenv.cfg is found next to the link).
status=0
for cpu in "${@:-Nehalem qemu64}"; do
  for c in $cpu; do
    echo "qemu_old_cpu: -cpu $c"
    start=$(date +%s)
    if qemu-x86_64 -cpu "$c" "$venv/bin/python" - "$model" <<'PY'
import sys
import kvfork

info = kvfork.system_info()
print("  cpu_variant:", info["cpu_variant"], "-", info["cpu_variant_reason"])
print("  host_cpu_features:", info["host_cpu_features"])
ctx = kvfork.create_context_sync(sys.argv[1], n_ctx=128)
b = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0))
b.prefill_sync(ctx.tokenize("The capital of France is"))
text = "".join(t.text for t in b.generate_sync(max_tokens=6))
print("  generated:", repr(text))
assert text.strip()
PY
    then echo "  ok ($(($(date +%s) - start)) s)"
    else rc=$?; echo "  FAILED (exit $rc)"; status=1
    fi
  done
done
exit $status
