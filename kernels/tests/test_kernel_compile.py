"""Every kernel variant compiles for sm_90 (H100/H200) with Triton's GPU compiler, no GPU needed.

Catches errors the interpreter does not raise (types, layouts, unsupported ops, register
allocation by ptxas). Runs in a subprocess because this session's kernels are interpreted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "kvk_compile_sm90.py"


# Expected variants per group (the merge kernel of the split path counts separately).
GROUPS = {"cache": 3, "attention": 7, "split": 4}


@pytest.mark.parametrize("group", list(GROUPS))
def test_variants_compile_for_sm90(group: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(SCRIPT), group],
        env=env,
        capture_output=True,
        text=True,
        timeout=250,
        check=False,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) == GROUPS[group], report
    if group == "split":
        assert any("(merge)" in line for line in lines), report
