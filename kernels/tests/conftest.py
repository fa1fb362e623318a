"""Test harness of kvcore-kernels: Triton's CPU interpreter plus fixes for its known defects.

`TRITON_INTERPRET=1` must be set before the kernels are defined (Triton reads it when `@triton.jit`
runs), so it is set here, before anything imports `kvcore_kernels`.

Interpreter defects are patched by `kvk_interpreter_patches` (see there); the kernels do not
depend on the patches.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
# Triton 3.9 warns when this is unset; FMA fusion is what the GPU build uses.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

_TESTS_DIR = Path(__file__).resolve().parent
for _path in (_TESTS_DIR.parent, _TESTS_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# A module imported before this file ran would hold compiled (non-interpreted) kernels.
for _name in [m for m in sys.modules if m == "kvcore_kernels" or m.startswith("kvcore_kernels.")]:
    del sys.modules[_name]

import kvk_interpreter_patches  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

kvk_interpreter_patches.apply()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
