"""A minimal progress bar on stderr (no dependency), shown only on a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Redraws one status line at most ten times a second.

    Args:
        total: Number of requests to finish.
        label: Text before the bar.
        enabled: Draw at all (callers pass False for ``--no-progress``); the bar is also off
            when the stream is not a terminal.
        stream: Where to draw (stderr by default).
    """

    def __init__(
        self, total: int, label: str, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.total = max(total, 1)
        self.label = label
        self._last = 0.0
        self._drawn = False

    def update(self, done: int, step: int, usage: float, force: bool = False) -> None:
        """Redraws the line if enough time has passed (or ``force``).

        Args:
            done: Finished requests.
            step: Steps executed.
            usage: Current pool usage in ``[0, 1]``.
            force: Draw regardless of the rate limit.
        """
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = min(width, done * width // self.total)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {done}/{self.total} requests  step {step}"
            f"  usage {100 * usage:5.1f}% "
        )
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erases the line so that the summary starts on a clean line."""
        if self.enabled and self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False
