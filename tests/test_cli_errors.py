"""Mistakes in ``kvcore`` arguments: one line on stderr naming the flag, exit 2, before any work.

Most cases run ``kvcore.cli.main`` in-process with the work itself (building a backend, running
a simulation) replaced by a failure, so that a message that only came after some work would
fail the test; a few run the real command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import check_one_line, refuse_work, run_main

DATA = Path(__file__).parent / "data"
GOOD_TRACE = str(DATA / "trace_good.jsonl")


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes building a backend or a simulator fail the test."""
    refuse_work(monkeypatch)


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        # --plot: a writable file of a supported type, checked before the run.
        (["--plot", "missing/dir/usage.png"], ["directory 'missing/dir' does not exist"]),
        (["--plot", "missing/dir/usage.txt"], [".png, .pdf or .svg", "'missing/dir/usage.txt'"]),
        (["--plot", "usage.txt"], ["expected a file name ending in .png, .pdf or .svg"]),
        (["--plot", ""], ["got ''"]),
        (["--plot", "   "], ["got '   '"]),
        (["--plot"], ["expected one argument"]),
        # Integers: the limit is in the flag's parser and in the message.
        (["--num-blocks", "abc"], ["expected an integer >= 2, got 'abc'"]),
        (["--num-blocks", "1"], ["expected an integer >= 2, got '1'"]),
        (["--num-blocks", "2.5"], ["expected an integer >= 2, got '2.5'"]),
        (["--num-blocks", str(2**31 + 1)], ["expected an integer <= 2**31"]),
        (["--requests", "abc"], ["expected an integer >= 1, got 'abc'"]),
        (["--requests", "0"], ["expected an integer >= 1"]),
        (["--requests", "-5"], ["expected an integer >= 1"]),
        (["--requests", str(2**31)], ["expected an integer <= 2**31 - 1"]),
        (["--seed", "x"], ["expected an integer >= 0, got 'x'"]),
        (["--seed", "-1"], ["expected an integer >= 0"]),
        (["--seed", str(2**32)], ["expected an integer <= 2**32 - 1"]),
        (["--block-size", "0"], ["expected an integer >= 1"]),
        (["--block-size", str(2**40)], ["expected an integer <= 2**31 - 1"]),
        (["--sliding-window", "0", "--model", "hybrid-swa"], ["expected an integer >= 1"]),
        (["--max-model-len", "1"], ["expected an integer >= 2"]),
        (["--max-model-len", str(2**63)], ["expected an integer <= 2**31 - 1"]),
        (["--max-num-batched-tokens", "0"], ["expected an integer >= 1"]),
        (["--max-num-seqs", "many"], ["expected an integer >= 1, got 'many'"]),
        # Numbers: finite, inside the interval the help states.
        (["--arrival-rate", "0"], ["expected a number in (0, 64], got '0'"]),
        (["--arrival-rate", "65"], ["expected a number in (0, 64]"]),
        (["--arrival-rate", "nan"], ["expected a number in (0, 64]"]),
        (["--arrival-rate", "fast"], ["expected a number in (0, 64], got 'fast'"]),
        (["--watermark", "1"], ["expected a number in [0, 1), got '1'"]),
        (["--watermark", "-0.1"], ["expected a number in [0, 1)"]),
        (["--watermark", "inf"], ["expected a number in [0, 1)"]),
        # Choices.
        (["--hash", "md5"], ["invalid choice: 'md5'", "sha256"]),
        (["--model", "moe"], ["invalid choice: 'moe'"]),
        (["--backend", "vllm"], ["invalid choice: 'vllm'"]),
        (["--compare", "kvcore"], ["invalid choice: 'kvcore'", "reference"]),
        # Files.
        (["--trace", "missing.jsonl"], ["cannot read 'missing.jsonl': No such file or directory"]),
        (["--trace", ""], ["expected a file name, got ''"]),
        (["--trace", str(DATA)], ["Is a directory"]),
    ],
)
def test_bad_flag_value(
    capsys: pytest.CaptureFixture[str], args: list[str], fragments: list[str]
) -> None:
    flag = args[0]
    check_one_line(
        *run_main(capsys, "simulate", *args), f"kvcore simulate: error: {flag}: ", *fragments
    )


def test_num_blocks_message_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_main(capsys, "simulate", "--num-blocks", "abc")
    assert (rc, out) == (2, "")
    assert err == "kvcore simulate: error: --num-blocks: expected an integer >= 2, got 'abc'\n"


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("args", "flag", "fragment"),
    [
        (["--trace", GOOD_TRACE, "--requests", "5"], "--requests", "not with --trace"),
        (["--trace", GOOD_TRACE, "--arrival-rate", "2"], "--arrival-rate", "not with --trace"),
        (["--sliding-window", "64"], "--sliding-window", "only used by --model hybrid-swa"),
        (["--max-model-len", "32"], "--max-model-len", "expected an integer >= 64"),
        (["--backend", "reference", "--compare", "reference"], "--compare reference", "kvcore"),
    ],
)
def test_flags_that_do_not_go_together(
    capsys: pytest.CaptureFixture[str], args: list[str], flag: str, fragment: str
) -> None:
    check_one_line(
        *run_main(capsys, "simulate", *args), f"kvcore simulate: error: {flag}: ", fragment
    )


@pytest.mark.usefixtures("no_work")
def test_plot_path_is_a_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = tmp_path / "usage.png"
    folder.mkdir()
    check_one_line(
        *run_main(capsys, "simulate", "--plot", str(folder)),
        "kvcore simulate: error: --plot: ",
        "is a directory",
    )


@pytest.mark.usefixtures("no_work")
def test_plot_parent_is_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    check_one_line(
        *run_main(capsys, "simulate", "--plot", str(tmp_path / "file" / "usage.svg")),
        "kvcore simulate: error: --plot: ",
        "is not a directory",
    )


@pytest.mark.usefixtures("no_work")
def test_plot_directory_not_writable(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    if os.geteuid() == 0:
        # root writes anywhere (as in CI): the folder is reported unwritable as for a user.
        real_access = os.access

        def access(path: Any, mode: int, **kwargs: Any) -> bool:
            if Path(path) == folder and mode & os.W_OK:
                return False
            return real_access(path, mode, **kwargs)

        monkeypatch.setattr(os, "access", access)
    try:
        check_one_line(
            *run_main(capsys, "simulate", "--plot", str(folder / "usage.png")),
            "kvcore simulate: error: --plot: ",
            "permission denied",
        )
    finally:
        folder.chmod(0o700)


@pytest.mark.usefixtures("no_work")
def test_plot_without_matplotlib(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    check_one_line(
        *run_main(capsys, "simulate", "--plot", str(tmp_path / "usage.png")),
        "kvcore simulate: error: --plot: needs matplotlib",
        "pip install",
    )


@pytest.mark.usefixtures("no_work")
def test_cache_too_small_is_reported_before_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_main(capsys, "simulate", "--requests", "5", "--num-blocks", "2")
    check_one_line(rc, out, err, "kvcore simulate: error: the KV cache cannot hold even one")
    assert "--num-blocks 2 leaves only 1 usable block (block 0" in err
    assert "usable blocks" not in err


@pytest.mark.usefixtures("no_work")
def test_trace_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"arrival": 0, "prompt": [1], "output_len": 1}\n\xff\xfe\n')
    check_one_line(
        *run_main(capsys, "simulate", "--trace", str(binary)),
        f"kvcore simulate: error: {binary}:2: ",
        "not UTF-8",
    )
    big = tmp_path / "big.jsonl"
    big.write_text(f'{{"arrival": {2**40}, "prompt": [1], "output_len": 1}}\n')
    check_one_line(
        *run_main(capsys, "simulate", "--trace", str(big)),
        f"kvcore simulate: error: {big}:1: field 'arrival': ",
        "< 2**31",
    )


def test_unknown_arguments_are_named_by_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    check_one_line(
        *run_main(capsys, "simulate", "--num-block", "5", "--colour"),
        "kvcore simulate: error: ",
        "unrecognized arguments",
        "--colour",
    )
    check_one_line(
        *run_main(capsys, "bench", "--slow"),
        "kvcore bench: error: unrecognized arguments: --slow",
    )
    check_one_line(*run_main(capsys), "kvcore: error: ", "COMMAND")
    check_one_line(*run_main(capsys, "simulat"), "kvcore: error: COMMAND: invalid choice")


def test_reference_backend_missing_is_one_line() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['vllm'] = None\n"
        "from kvcore.cli import main\n"
        "sys.exit(main(['simulate', '--requests', '5', '--backend', 'reference']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    check_one_line(
        proc.returncode,
        proc.stdout,
        proc.stderr,
        "kvcore simulate: error: --backend reference: the reference (vLLM 0.25.1) is not installed",
        "scripts/install-reference.sh from a kvcore checkout",
    )


def test_help_states_every_limit(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_main(capsys, "simulate", "--help")
    assert rc == 0
    text = " ".join(out.split())
    limits = {
        "--trace": "a readable file",
        "--requests": "[1, 2**31 - 1]",
        "--arrival-rate": "(0, 64]",
        "--seed": "[0, 2**32 - 1]",
        "--num-blocks": "[2, 2**31]",
        "--block-size": "[1, 2**31 - 1]",
        "--sliding-window": "only with it",
        "--max-model-len": "at least 64 for the synthetic workload",
        "--max-num-batched-tokens": "[1, 2**31 - 1]",
        "--max-num-seqs": "[1, 2**31 - 1]",
        "--watermark": "[0, 1)",
        "--compare": "must be installed",
        "--plot": "(.png, .pdf or .svg) in an existing writable directory",
    }
    for flag, limit in limits.items():
        start = text.index(f" {flag} ", text.index("options:"))
        entry = text[start : start + 300]
        assert limit in entry, (flag, entry)
    assert "Ctrl-C" in text and "130" in text


def test_plot_mistake_with_a_large_run_fails_at_once() -> None:
    # A large workload would take minutes: the bad path must be reported before it starts.
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcore",
            "simulate",
            "--requests",
            "100000",
            "--plot",
            "missing/dir/usage.png",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    elapsed = time.monotonic() - start
    check_one_line(
        proc.returncode,
        proc.stdout,
        proc.stderr,
        "kvcore simulate: error: --plot: cannot write 'missing/dir/usage.png': directory",
    )
    assert elapsed < 30, elapsed
