#!/usr/bin/env bash
# Installs the reference implementation, vLLM at the version below (the one place it is pinned),
# into the current Python environment: just enough to import its KV-cache manager and scheduler
# (vllm.v1.core.*) on a CPU-only machine, for kvcore's differential tests and benchmarks.
#
# vLLM's wheel pins CUDA builds of torch and friends; it is installed without its dependency
# list, and the pure-Python packages its import chain needs are installed instead. pip would
# then report the unmet pins ("vllm 0.25.1 requires torch==..., but you have torch ..."): they
# are expected and harmless here (only the KV-cache and scheduler modules are imported), so the
# report is switched off (--no-warn-conflicts).
#
# Usage: scripts/install-reference.sh            (PYTHON=python3.11 to choose the interpreter)
#        scripts/install-reference.sh --version  (prints the pinned version)
set -euo pipefail
VLLM_VERSION=0.25.1
if [ "${1:-}" = "--version" ]; then echo "$VLLM_VERSION"; exit 0; fi
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts "$@"; }

if "$PY" -c "import sys, vllm.v1.core.kv_cache_manager as _, vllm; sys.exit(vllm.__version__ != '$VLLM_VERSION')" \
    >/dev/null 2>&1; then
  echo "reference: vLLM $VLLM_VERSION already importable"; exit 0
fi
"$PY" -c 'import torch' 2>/dev/null || { echo "reference: install torch first (pip install torch)" >&2; exit 1; }
echo "reference: installing vLLM $VLLM_VERSION (without its CUDA pins) and its import chain..."
pip_install regex cachetools psutil numpy requests tqdm blake3 py-cpuinfo \
  transformers msgspec pyzmq cbor2 pydantic typing_extensions filelock cloudpickle pyyaml \
  prometheus_client pybase64 xxhash aiohttp openai-harmony openai pillow uvloop einops \
  'llguidance<1.8.0,>=1.7.0' 'xgrammar<1.0.0,>=0.2.1'
pip_install --no-deps "vllm==$VLLM_VERSION"
"$PY" -c 'import vllm.v1.core.kv_cache_manager, vllm.v1.core.block_pool, vllm; print("reference: vLLM", vllm.__version__, "importable")'
