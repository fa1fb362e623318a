"""``kvcore --version`` and ``kvcore.__version__`` come from the package metadata."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

import kvcore
from kvcore import cli


def test_version_attribute_is_the_metadata_version() -> None:
    assert kvcore.__version__ == metadata.version("kvcore")
    assert kvcore.__version__ != "0+unknown"


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"kvcore {metadata.version('kvcore')}\n"


def test_version_flag_of_the_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvcore", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0
    assert proc.stdout == f"kvcore {metadata.version('kvcore')}\n"
    assert proc.stderr == ""


def test_version_without_metadata() -> None:
    # A source tree that was never installed has no metadata: the fallback version.
    code = (
        "from importlib import metadata\n"
        "def missing(name):\n"
        "    raise metadata.PackageNotFoundError(name)\n"
        "metadata.version = missing\n"
        "import kvcore\n"
        "print(kvcore.__version__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "0+unknown\n"
