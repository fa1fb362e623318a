#!/usr/bin/env bash
# Installs the KV-aware router that tests/test_router_dynamo.py feeds with kvcore's ZMQ events:
# NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, from the PyPI package
# ai-dynamo-runtime at the version below, the one place it is pinned) in a virtual environment
# of its own, apart from kvcore's (it needs nothing of kvcore's and runs as a subprocess).
#
# The venv is .venv-dynamo/ at the repository root (git ignores .venv*/), or $KVCORE_DYNAMO_VENV.
# Idempotent: an existing venv with the pinned version is left as it is. The last line printed
# is the venv's python, the interpreter the tests start the indexer with.
#
# Usage: scripts/install-dynamo.sh            (PYTHON=python3.12 to choose the interpreter, >= 3.10)
#        scripts/install-dynamo.sh --version  (prints the pinned version)
#        scripts/install-dynamo.sh --python   (prints the venv's python path, installs nothing)
set -euo pipefail
DYNAMO_VERSION=1.6.1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${KVCORE_DYNAMO_VENV:-$ROOT/.venv-dynamo}
VPY=$VENV/bin/python
case "${1:-}" in
  --version) echo "$DYNAMO_VERSION"; exit 0 ;;
  --python) echo "$VPY"; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--version|--python]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}

installed() {
  [ -x "$VPY" ] && "$VPY" - "$DYNAMO_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
import dynamo.indexer.main  # noqa: F401  (the standalone indexer's entry point)
sys.exit(version("ai-dynamo-runtime") != sys.argv[1])
EOF
}

if installed; then
  echo "router: Dynamo KV indexer (ai-dynamo-runtime $DYNAMO_VERSION) already installed"
  echo "$VPY"; exit 0
fi
echo "router: installing ai-dynamo-runtime $DYNAMO_VERSION into $VENV..."
[ -x "$VPY" ] || "$PY" -m venv "$VENV"
"$VPY" -m pip install -q --disable-pip-version-check "ai-dynamo-runtime==$DYNAMO_VERSION"
installed || { echo "router: ai-dynamo-runtime $DYNAMO_VERSION is not importable in $VENV" >&2; exit 1; }
"$VPY" -m dynamo.indexer --help >/dev/null
echo "router: Dynamo KV indexer (ai-dynamo-runtime $DYNAMO_VERSION) installed"
echo "$VPY"
