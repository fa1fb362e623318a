"""Ctrl-C in ``kvcore simulate``: a large run shows progress at once and summarizes at once.

A behaviour check, not a benchmark: the bounds are generous (the machine may be slow and
loaded); the point is that nothing waits for the whole workload to be generated first.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from kvcore import cli
from kvcore.simulate.report import format_table as real_format_table
from kvcore.simulate.scheduler import Simulator

SMALL = ["--requests", "30", "--num-blocks", "700", "--max-model-len", "4096", "--no-progress"]


def _read(fd: int, until: float) -> bytes:
    """Reads what is available on ``fd`` until the monotonic time ``until`` (or EOF)."""
    got = b""
    while time.monotonic() < until:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other end closed (Linux reports EIO on a pty)
            break
        if not chunk:
            break
        got += chunk
    return got


def test_large_run_progress_then_ctrl_c_summary() -> None:
    # stderr is a pseudo-terminal, so the progress bar is drawn; stdout is a pipe.
    master, slave = pty.openpty()
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcore", "simulate", "--requests", "100000"],
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    try:
        seen = b""
        first: float | None = None
        while first is None and time.monotonic() - start < 20:
            seen += _read(master, time.monotonic() + 0.05)
            if b"100000" in seen:
                first = time.monotonic() - start
        assert first is not None, f"no progress within 20 s: {seen[-300:]!r}"
        # Generating the whole workload first took 25-60 s; interpreter start-up, imports and
        # the first steps take well under a second on an idle machine.
        assert first < 10, first
        seen += _read(master, start + max(2.0, first + 1.0))
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        seen += _read(master, time.monotonic() + 0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    text = out.decode()
    assert proc.returncode == 130, (text, seen[-500:])
    assert took < 10, took
    assert b"interrupted: summarizing" in seen and b"finished requests..." in seen, seen[-500:]
    assert "(interrupted: partial figures)" in text
    assert "prefix hit rate" in text
    assert "of 100000 requests finished" in text
    assert "100000 requests (synthetic chat, seed 0)" in text


def test_sigint_stops_after_the_current_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_step = Simulator.step
    calls = {"n": 0}

    def step(self: Simulator) -> None:
        calls["n"] += 1
        if calls["n"] == 25:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C in the middle of step 25
        real_step(self)

    monkeypatch.setattr(Simulator, "step", step)
    before = signal.getsignal(signal.SIGINT)
    rc = cli.main(["simulate", *SMALL, "--json"])
    captured = capsys.readouterr()
    assert rc == 130
    obj = json.loads(captured.out)
    assert obj["interrupted"] is True
    assert obj["steps"] == 25  # the step that was running when Ctrl-C came was completed
    assert obj["requests"] < obj["requests_total"] == 30
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(
        f"kvcore simulate: interrupted: summarizing {obj['requests']} finished request"
    )
    assert signal.getsignal(signal.SIGINT) is before  # restored


def _ctrl_c_while_summarizing(monkeypatch: pytest.MonkeyPatch, presses: int) -> None:
    """Makes the table formatting receive ``presses`` SIGINTs."""

    def format_table(summary: dict[str, Any], header: str = "") -> str:
        for _ in range(presses):
            signal.raise_signal(signal.SIGINT)
        return real_format_table(summary, header)

    monkeypatch.setattr(cli, "format_table", format_table)


def test_one_ctrl_c_while_summarizing_keeps_the_summary(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    _ctrl_c_while_summarizing(monkeypatch, 1)
    rc = cli.main(["simulate", *SMALL])
    out, err = capfd.readouterr()
    assert rc == 0
    assert "decisions checksum" in out
    assert err == (
        "kvcore simulate: still summarizing; press Ctrl-C again to quit without the summary\n"
    )


def test_two_ctrl_c_while_summarizing_quit(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    _ctrl_c_while_summarizing(monkeypatch, 2)
    before = signal.getsignal(signal.SIGINT)
    rc = cli.main(["simulate", *SMALL])
    out, err = capfd.readouterr()
    assert rc == 130
    assert "decisions checksum" not in out
    assert err.splitlines() == [
        "kvcore simulate: still summarizing; press Ctrl-C again to quit without the summary",
        "kvcore simulate: interrupted",
    ]
    assert signal.getsignal(signal.SIGINT) is before
