# kvcore's one task runner: CI calls these targets verbatim.
PY ?= python3
PIP := $(PY) -m pip
SHARED ?= ../shared
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help install install-dev install-reference demo test test-rust test-python lint fmt bench clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

install: ## Build and install kvcore (release build of the Rust core)
	$(PIP) install -q 'maturin>=1.7,<2'
	$(PIP) install -q -e .

install-dev: install ## Install kvcore, kvcore-kernels, torch and the test tools
	$(PIP) install -q torch
	$(PIP) install -q -e '.[test,bench,plot]' 'ruff' 'mypy' 'pytest-benchmark' 'typing_extensions>=4.15'
	$(PIP) install -q -e ./kernels

install-reference: install-dev ## Install the reference (vLLM 0.25.1) for differential tests and benches
	PYTHON=$(PY) bash $(SHARED)/reference/install-vllm-reference.sh

demo: install ## Install kvcore and run the main job on the default workload
	$(PY) -m kvcore simulate

test: install-reference test-rust test-python ## Install everything and run the whole test suite

test-rust: ## Rust unit, property and doc tests
	cargo test --workspace --exclude kvcore-py

test-python: ## Python tests (kvcore, kernels under the Triton interpreter, differential)
	$(PY) -m pytest tests kernels/tests -q

lint: install-dev ## rustfmt, clippy, ruff, mypy --strict and stubtest
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(PY) -m ruff check python tests benches kernels
	$(PY) -m ruff format --check python tests benches kernels
	$(PY) -m mypy
	MYPYPATH=python $(PY) -m mypy --strict tests
	MYPYPATH=python $(PY) -m mypy --strict benches
	cd kernels && $(PY) -m mypy
	$(PY) -m mypy.stubtest kvcore._native

fmt: ## Format Rust and Python sources
	cargo fmt --all
	$(PY) -m ruff format python tests benches kernels
	$(PY) -m ruff check --fix python tests benches kernels

bench: install-reference ## Benchmarks against the reference (ratios), off by default in tests
	$(PY) -m pytest benches -q --benchmark-only --benchmark-columns=mean,median,rounds -p no:cacheprovider

clean: ## Remove build outputs
	cargo clean
	rm -rf dist build .pytest_cache .mypy_cache .ruff_cache
