#!/usr/bin/env bash
# Smoke test of the built wheels as users install them: each goes into a fresh virtual
# environment (outside the source tree, so nothing can be imported from it) and is exercised
# there. Usage: scripts/wheel-smoke.sh [DIST]   (DIST defaults to dist/, filled by `make wheel`)
#
# - kvcore: a venv with nothing else in it; `import kvcore`, `kvcore --version`, a small
#   `kvcore simulate --json`, and the README's Python example (tests/readme_example.py).
# - kvcore-kernels: a venv that sees the system's site-packages for torch and Triton (a multi-GB
#   download otherwise); the package itself must come from the wheel: import it and run the
#   plain-torch reference of the cache write on the CPU.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dist=$(cd "${1:-$repo/dist}" && pwd)
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

shopt -s nullglob
wheels=("$dist"/kvcore-*-abi3-manylinux*_x86_64.whl "$dist"/kvcore-*-abi3-manylinux*_aarch64.whl)
kernel_wheels=("$dist"/kvcore_kernels-*-py3-none-any.whl)
[ ${#wheels[@]} -eq 1 ] || { echo "wheel-smoke: expected one abi3 manylinux kvcore wheel in $dist, found ${#wheels[@]}" >&2; exit 1; }
[ ${#kernel_wheels[@]} -eq 1 ] || { echo "wheel-smoke: expected one kvcore_kernels wheel in $dist" >&2; exit 1; }
case "${wheels[0]}" in
  *manylinux_2_17_*|*manylinux2014_*) ;;
  *) echo "wheel-smoke: ${wheels[0]##*/} is not a manylinux2014 (glibc 2.17) wheel" >&2; exit 1 ;;
esac
echo "wheel-smoke: ${wheels[0]##*/}"

"$PY" -m venv "$work/venv"
v="$work/venv/bin"
"$v/python" -m pip install -q --disable-pip-version-check "${wheels[0]}"
"$v/python" - <<'PY'
import sys
from importlib.metadata import files, version

import kvcore
import kvcore._native

assert kvcore.__file__.startswith(sys.prefix), f"kvcore imported from {kvcore.__file__}"
assert kvcore.__version__ == version("kvcore"), (kvcore.__version__, version("kvcore"))
licenses = [f for f in files("kvcore") or [] if f.name == "LICENSE"]
assert licenses, "the wheel carries no LICENSE file"
print(f"wheel-smoke: import kvcore {kvcore.__version__} from the venv, LICENSE in the wheel")
PY
got=$("$v/kvcore" --version)
[ "$got" = "kvcore $("$v/python" -c 'import kvcore; print(kvcore.__version__)')" ] || { echo "wheel-smoke: kvcore --version printed '$got'" >&2; exit 1; }
echo "wheel-smoke: $got"
"$v/kvcore" simulate --requests 30 --json > simulate.json
"$v/python" -c '
import json
s = json.load(open("simulate.json"))
assert s["backend"] == "kvcore" and s["requests"] == 30 and not s["interrupted"], s
assert s["steps"] > 0 and 0 < s["prefix_hit_rate"] <= 1, s
print("wheel-smoke: kvcore simulate --requests 30 --json ok")'
"$v/python" "$repo/tests/readme_example.py" "$repo/README.md" > readme.out
grep -q BlockStored readme.out || { echo "wheel-smoke: README example printed no events" >&2; cat readme.out >&2; exit 1; }
echo "wheel-smoke: README example ran"

"$PY" -m venv --system-site-packages "$work/kvenv"
k="$work/kvenv/bin"
"$k/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "${kernel_wheels[0]}"
"$k/python" - <<'PY'
import sys
from importlib.metadata import version

import torch

import kvcore_kernels
from kvcore_kernels import reference

assert kvcore_kernels.__file__.startswith(sys.prefix), kvcore_kernels.__file__
assert kvcore_kernels.__version__ == version("kvcore-kernels")
num_blocks, block_size, heads, head_size = 4, 16, 2, 8
key = torch.randn(5, heads, head_size)
value = torch.randn(5, heads, head_size)
kc = torch.zeros(num_blocks, block_size, heads, head_size)
vc = torch.zeros_like(kc)
slots = torch.tensor([16, 17, -1, 40, 3])
reference.reshape_and_cache(key, value, kc, vc, slots)
for t, s in enumerate(slots.tolist()):
    if s >= 0:
        assert torch.equal(kc[s // block_size, s % block_size], key[t])
        assert torch.equal(vc[s // block_size, s % block_size], value[t])
assert int((kc != 0).any(dim=(2, 3)).sum()) == 4
print(f"wheel-smoke: kvcore_kernels {kvcore_kernels.__version__} from the venv, reference cache write ok")
PY
echo "wheel-smoke: all passed"
