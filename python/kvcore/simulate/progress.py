"""The progress bar of ``kvcore simulate`` on stderr.

It is drawn with `tqdm <https://tqdm.github.io/>`_ when that is installed (the ``progress``
extra: ``pip install 'kvcore[progress]'``), else as one plain status line. Either way it is
shown only when the stream is a terminal, and at most about ten times a second.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

REFRESH_S = 0.1
"""Least time between two redraws."""


class Progress:
    """A progress display that shows nothing (the base of the real ones).

    Args:
        total: Number of requests to finish.
        label: Text before the bar (the backend's name).
        stream: Where to draw.
        clock: Seconds, for the rate limit (``time.monotonic``).
    """

    def __init__(
        self, total: int, label: str, stream: TextIO, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream
        self._clock = clock
        self._last = float("-inf")

    def update(self, done: int, step: int, usage: float) -> None:
        """Shows the state if the last redraw is old enough.

        Args:
            done: Finished requests.
            step: Steps executed.
            usage: Current pool usage in ``[0, 1]``.
        """
        now = self._clock()
        if now - self._last < REFRESH_S:
            return
        self._last = now
        self._draw(done, step, usage)

    def _draw(self, done: int, step: int, usage: float) -> None:
        """Redraws (nothing here)."""

    def close(self) -> None:
        """Removes the display so that what follows starts on a clean line."""


class PlainProgress(Progress):
    """One status line redrawn in place: ``label [####....] done/total requests ...``."""

    WIDTH = 30

    def __init__(
        self, total: int, label: str, stream: TextIO, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(total, label, stream, clock)
        self._drawn = False

    def _draw(self, done: int, step: int, usage: float) -> None:
        filled = min(self.WIDTH, done * self.WIDTH // self.total)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {done}/{self.total} requests  step {step}"
            f"  usage {100 * usage:5.1f}% "
        )
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False


class TqdmProgress(Progress):
    """A ``tqdm`` bar: finished requests out of the total, rate, ETA, step and usage.

    Args:
        total: Number of requests to finish.
        label: Text before the bar.
        stream: Where to draw.
        tqdm_class: The ``tqdm.tqdm`` class.
    """

    def __init__(self, total: int, label: str, stream: TextIO, tqdm_class: Any) -> None:
        super().__init__(total, label, stream)
        # tqdm draws nothing on a terminal of unknown size (a bare pseudo-terminal says 0 x 0):
        # give it a fixed size there instead of following the terminal's.
        columns, lines = _size(stream)
        known = columns > 0 and lines > 0
        self._bar: Any = tqdm_class(
            total=total,
            desc=label,
            unit=" requests",
            file=stream,
            leave=False,
            dynamic_ncols=known,
            ncols=None if known else columns or 100,
            nrows=None if known else lines or 24,
            mininterval=REFRESH_S,
        )

    def _draw(self, done: int, step: int, usage: float) -> None:
        bar = self._bar
        bar.set_postfix_str(f"step {step}, usage {100 * usage:.1f}%", refresh=False)
        if done > bar.n:
            bar.update(done - bar.n)
        bar.refresh()

    def close(self) -> None:
        self._bar.close()


def _size(stream: TextIO) -> tuple[int, int]:
    """Columns and lines of the terminal behind ``stream`` (0 where unknown)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        return 0, 0
    return size.columns, size.lines


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def make_progress(
    total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None
) -> Progress:
    """The progress display for one run.

    Args:
        total: Number of requests to finish.
        label: Text before the bar.
        enabled: Show anything at all (False for ``--no-progress`` and ``--json``).
        stream: Where to draw (stderr by default); nothing is shown unless it is a terminal.

    Returns:
        A :class:`TqdmProgress` when ``tqdm`` can be imported, else a :class:`PlainProgress`;
        a silent :class:`Progress` when disabled or not on a terminal.
    """
    out = stream if stream is not None else sys.stderr
    if not enabled or not _is_terminal(out):
        return Progress(total, label, out)
    try:
        tqdm_class = importlib.import_module("tqdm").tqdm
    except ImportError:
        return PlainProgress(total, label, out)
    return TqdmProgress(total, label, out, tqdm_class)
