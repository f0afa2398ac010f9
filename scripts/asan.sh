#!/usr/bin/env bash
# The Rust tests (kvfork-core, and the engine on the real model) under AddressSanitizer.
# Needs a nightly toolchain with rust-src: `rustup toolchain install nightly --component rust-src`.
# llama.cpp's C++ is not instrumented; kvfork's Rust (and std, rebuilt) is.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cpu_flags.sh
export KVFORK_MODEL=${KVFORK_MODEL:-$(.venv/bin/python -c 'import kvfork; print(kvfork.default_model_path())')}
export RUSTFLAGS="-Zsanitizer=address -C target-feature=+avx2,+fma,+f16c,+bmi2"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export CARGO_TARGET_DIR=${ASAN_TARGET_DIR:-target/asan}
cargo +nightly test -Zbuild-std --target "$(rustc -vV | sed -n 's/^host: //p')" --release \
  -p kvfork-core -p kvfork
