# kvfork: one entry per job. `make demo` (set-up + main job), `make test` (whole suite).
SHELL := bash
PY := .venv/bin/python

.PHONY: setup demo test test-rust test-python test-vulkan soak asan lint fmt docs bench peer peer-server bench-serve \
	bench-checkpoints wheel test-wheel

setup:
	scripts/setup.sh

demo: setup
	$(PY) -m kvfork demo

# Everything: set-up (idempotent), Rust tests (no Python), Python tests on the real model,
# and the documentation build (strict: a broken reference in a docstring fails it).
test: setup
	$(MAKE) test-rust test-python docs

test-rust:
	source scripts/cpu_flags.sh && KVFORK_MODEL=$$($(PY) -c 'import kvfork; print(kvfork.default_model_path())') \
	  cargo test --release --workspace --exclude kvfork-python

test-python:
	$(PY) -m pytest tests -q

# The Python suite on the Vulkan backend with the shared models' layers offloaded (needs Vulkan
# headers >= 1.3.275 and glslc; CI runs it on Mesa's CPU driver lavapipe with
# GGML_VK_VISIBLE_DEVICES=0, since llama.cpp skips CPU-type devices otherwise).
test-vulkan: setup
	$(PY) -m pip install -q "maturin>=1.9.4,<2.0"
	source scripts/cpu_flags.sh && VIRTUAL_ENV=$(CURDIR)/.venv $(PY) -m maturin develop --release --features vulkan
	KVFORK_TEST_GPU_LAYERS=$${KVFORK_TEST_GPU_LAYERS:-99} $(PY) -m pytest tests -q

# The release wheel (abi3, every x86-64 CPU level, llama.cpp's CPU variants chosen at run time)
# and the sdist, into dist/; then that wheel installed with no compiler on PATH (demo, bad
# inputs, a generation) and the sdist built into a wheel. Not in `make test` (slow builds).
wheel:
	scripts/build_wheel.sh

test-wheel:
	scripts/test_wheel.sh

# Long runs (not in `make test`): the full soak, a longer randomized state-machine fuzz, and
# 5,000 chaos requests against a real server (its memory flat).
soak: setup
	KVFORK_SOAK=1 KVFORK_FUZZ_EXAMPLES=200 KVFORK_FUZZ_STEPS=50 KVFORK_FUZZ_RANDOM=1 \
	KVFORK_CHAOS_REQUESTS=5000 \
	  $(PY) -m pytest tests/robustness/test_soak.py tests/robustness/test_fuzz.py \
	  tests/robustness/test_serve_chaos.py -q -s

# The Rust tests under AddressSanitizer (nightly toolchain).
asan: setup
	scripts/asan.sh

lint:
	cargo fmt --all -- --check
	source scripts/cpu_flags.sh && cargo clippy --release --workspace --all-targets -- -D warnings
	# The release wheel's build (abi3: pyo3 binds the limited API only).
	source scripts/cpu_flags.sh && cargo clippy --release -p kvfork-python --features abi3 -- -D warnings
	$(PY) scripts/check_cycles.py crates/kvfork-core/src crates/kvfork/src crates/kvfork-python/src python/kvfork
	$(PY) -m ruff check python tests benchmarks examples scripts
	$(PY) -m ruff format --check python tests benchmarks examples scripts
	$(PY) -m mypy --strict python/kvfork examples tests scripts
	$(PY) -m mypy.stubtest kvfork._native --allowlist stubtest-allowlist.txt
	$(PY) scripts/stub_docs.py --check
	$(PY) scripts/api_docs.py --check

fmt:
	cargo fmt --all
	$(PY) -m ruff format python tests benchmarks examples scripts

# The documentation site (mkdocs, after `make setup`): the pages of docs/, plain Markdown
# (the API reference, docs/api.md, is generated from the sources by scripts/api_docs.py).
docs:
	$(PY) -m mkdocs build --strict -d site

# Benchmarks (not tests): tables recorded in BENCHMARKS.md. `make bench PEER=1` first installs
# the peer (llama-cpp-python, `make peer`) so bench_store.py has its peer column.
bench: setup $(if $(PEER),peer)
	$(PY) benchmarks/bench_store.py
	$(PY) benchmarks/bench_sampling.py

peer:
	scripts/peer_venv.sh

# The servers bench_serve.py compares with: llama.cpp's llama-server built from source, and
# llama-cpp-python's example server (from the same sdist) in the peer's venv.
peer-server: peer
	scripts/build_llama_server.sh
	.venv-peer/bin/python -m pip install -q fastapi uvicorn openai safetensors websockets

bench-serve: setup peer-server
	$(PY) benchmarks/bench_serve.py --rounds 2

# Recurrent-state checkpoints on a random-weight model of LFM2-350M's shape (written once,
# ~780 MB, under ~/.cache/kvfork-bench).
bench-checkpoints: setup
	$(PY) benchmarks/bench_checkpoints.py
