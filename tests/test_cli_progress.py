"""The progress bar of ``kvcore simulate``: tqdm when installed, a plain line otherwise, and
nothing unless stderr is a terminal (nor with ``--json``)."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from kvcore.simulate import progress
from kvcore.simulate.progress import PlainProgress, Progress, TqdmProgress, make_progress


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def drive(bar: Progress) -> None:
    bar.update(3, 17, 0.25)
    bar.close()


def test_not_a_terminal_shows_nothing() -> None:
    stream = io.StringIO()
    bar = make_progress(10, "kvcore", stream=stream)
    assert type(bar) is Progress
    drive(bar)
    assert stream.getvalue() == ""


def test_disabled_shows_nothing_even_on_a_terminal() -> None:
    stream = FakeTerminal()
    bar = make_progress(10, "kvcore", enabled=False, stream=stream)
    drive(bar)
    assert stream.getvalue() == ""


def test_tqdm_bar() -> None:
    pytest.importorskip("tqdm")
    stream = FakeTerminal()
    bar = make_progress(10, "kvcore", stream=stream)
    assert isinstance(bar, TqdmProgress)
    bar.update(3, 17, 0.25)
    text = stream.getvalue()
    assert "kvcore" in text and "3/10" in text and "requests" in text
    assert "step 17" in text and "usage 25.0%" in text
    bar.close()


def test_plain_fallback_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now fails
    stream = FakeTerminal()
    bar = make_progress(10, "kvcore", stream=stream)
    assert isinstance(bar, PlainProgress)
    bar.update(3, 17, 0.25)
    assert stream.getvalue() == (
        "\rkvcore [#########.....................] 3/10 requests  step 17  usage  25.0% "
    )
    bar.update(4, 18, 0.25)  # within the refresh interval: not redrawn
    assert "4/10" not in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\r\033[K")


def test_redraws_are_rate_limited() -> None:
    clock = {"now": 100.0}
    stream = FakeTerminal()
    bar = PlainProgress(10, "kvcore", stream, clock=lambda: clock["now"])
    for i in range(5):
        bar.update(i, i, 0.0)
    assert stream.getvalue().count("\r") == 1
    clock["now"] += 2 * progress.REFRESH_S
    bar.update(7, 9, 0.0)
    assert stream.getvalue().count("\r") == 2 and "7/10" in stream.getvalue()


def _stderr_on_a_terminal(*args: str) -> tuple[int, bytes]:
    """Runs ``kvcore simulate ARGS`` with stderr on a pseudo-terminal."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcore", "simulate", *args],
        stdout=subprocess.DEVNULL,
        stderr=slave,
    )
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.05)
            if ready:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return rc, seen


SMALL = ["--requests", "30", "--num-blocks", "700", "--max-model-len", "4096"]


def test_cli_progress_only_on_a_terminal_and_not_with_json() -> None:
    rc, seen = _stderr_on_a_terminal(*SMALL)
    assert rc == 0
    assert b"/30" in seen and b"requests" in seen
    rc, seen = _stderr_on_a_terminal(*SMALL, "--json")
    assert rc == 0
    assert seen == b""
