# kvfork: one entry per job. `make demo` (set-up + main job), `make test` (whole suite).
SHELL := bash
PY := .venv/bin/python

.PHONY: setup demo test test-rust test-python soak asan lint fmt bench peer

setup:
	scripts/setup.sh

demo: setup
	$(PY) -m kvfork demo

# Everything: set-up (idempotent), Rust tests (no Python), Python tests on the real model.
test: setup
	$(MAKE) test-rust test-python

test-rust:
	source scripts/cpu_flags.sh && KVFORK_MODEL=$$($(PY) -c 'import kvfork; print(kvfork.default_model_path())') \
	  cargo test --release --workspace --exclude kvfork-python

test-python:
	$(PY) -m pytest tests -q

# Long runs (not in `make test`): the full soak and a longer randomized state-machine fuzz.
soak: setup
	KVFORK_SOAK=1 KVFORK_FUZZ_EXAMPLES=200 KVFORK_FUZZ_STEPS=50 KVFORK_FUZZ_RANDOM=1 \
	  $(PY) -m pytest tests/test_soak.py tests/test_fuzz.py -q -s

# The Rust tests under AddressSanitizer (nightly toolchain).
asan: setup
	scripts/asan.sh

lint:
	cargo fmt --all -- --check
	source scripts/cpu_flags.sh && cargo clippy --release --workspace --all-targets -- -D warnings
	$(PY) -m ruff check python tests benchmarks examples
	$(PY) -m ruff format --check python tests benchmarks examples
	$(PY) -m mypy --strict python/kvfork examples tests
	$(PY) -m mypy.stubtest kvfork._native --allowlist stubtest-allowlist.txt

fmt:
	cargo fmt --all
	$(PY) -m ruff format python tests benchmarks examples

# Benchmarks (not tests): tables recorded in BENCHMARKS.md. `make bench PEER=1` first installs
# the peer (llama-cpp-python, `make peer`) so bench_store.py has its peer column.
bench: setup $(if $(PEER),peer)
	$(PY) benchmarks/bench_store.py
	$(PY) benchmarks/bench_sampling.py

peer:
	scripts/peer_venv.sh
