# kvcore's one task runner: CI calls these targets verbatim.
PY ?= python3
PIP := $(PY) -m pip
# The reference vLLM is installed without its CUDA pins, so pip's dependency report would list
# them after every install; they are expected (scripts/install-reference.sh says why).
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_NO_WARN_CONFLICTS := 1
export PIP_ROOT_USER_ACTION := ignore
FUZZ_SECONDS ?= 180
DIST ?= dist

.PHONY: help install install-dev install-reference demo test test-rust test-python test-wheel \
	wheel lint fmt bench fuzz clean install-router

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

install: ## Build and install kvcore (release build of the Rust core)
	$(PIP) install -q 'maturin>=1.7,<2'
	$(PIP) install -q -e .

install-dev: install ## Install kvcore, kvcore-kernels, torch and the test tools
	$(PIP) install -q torch
	$(PIP) install -q -e '.[test,bench,plot,progress]' 'ruff' 'mypy' 'pytest-benchmark' 'typing_extensions>=4.15'
	$(PIP) install -q -e ./kernels

install-reference: install-dev ## Install the reference (vLLM, version pinned in scripts/install-reference.sh)
	PYTHON=$(PY) bash scripts/install-reference.sh

install-router: ## Install the Dynamo KV indexer the router test feeds (own venv, .venv-dynamo/)
	PYTHON=$(PY) bash scripts/install-dynamo.sh

demo: install ## Install kvcore and run the main job on the default workload
	$(PY) -m kvcore simulate

test: install-reference install-router test-rust test-python test-wheel ## Install everything and run the whole test suite

test-rust: ## Rust unit, property and doc tests
	cargo test --workspace --exclude kvcore-py

test-python: ## Python tests (kvcore, kernels under the Triton interpreter, differential, API fuzzer)
	$(PY) -m pytest tests kernels/tests -q

wheel: ## Build the abi3 manylinux2014 wheel and sdist of kvcore and of kvcore-kernels into dist/
	$(PIP) install -q 'maturin>=1.7,<2' ziglang build
	rm -rf $(DIST)
	$(PY) -m maturin build --release --zig --compatibility manylinux2014 --out $(DIST) --quiet
	$(PY) -m maturin sdist --out $(DIST)
	$(PY) -m build --sdist --wheel --outdir $(DIST) kernels > /dev/null

test-wheel: wheel ## Install the built wheels into fresh virtual environments and smoke-test them
	PYTHON=$(PY) bash scripts/wheel-smoke.sh $(DIST)

lint: install-dev ## rustfmt, clippy, rustdoc, ruff, mypy --strict and stubtest
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS='-D warnings' cargo doc --workspace --no-deps --document-private-items
	$(PY) -m ruff check python tests benches kernels conftest.py
	$(PY) -m ruff format --check python tests benches kernels conftest.py
	$(PY) -m mypy
	MYPYPATH=python $(PY) -m mypy --strict tests
	$(PY) -m mypy --strict conftest.py
	MYPYPATH=python:tests $(PY) -m mypy --strict benches
	cd kernels && $(PY) -m mypy
	$(PY) -m mypy.stubtest kvcore._native

fmt: ## Format Rust and Python sources
	cargo fmt --all
	$(PY) -m ruff format python tests benches kernels conftest.py
	$(PY) -m ruff check --fix python tests benches kernels conftest.py

bench: install-reference ## Benchmarks against the reference (ratios), off by default in tests
	$(PY) -m pytest benches -q --benchmark-only --benchmark-columns=mean,median,rounds -p no:cacheprovider

fuzz: ## cargo-fuzz targets over the core, FUZZ_SECONDS each (installs cargo-fuzz and nightly if missing)
	bash fuzz/run.sh $(FUZZ_SECONDS)

clean: ## Remove build outputs
	cargo clean
	rm -rf $(DIST) build .pytest_cache .mypy_cache .ruff_cache
