"""Helpers shared by the CLI tests: running ``kvcore`` in-process and refusing its work."""

from __future__ import annotations

import pytest

from kvcore import cli


class WorkStarted(AssertionError):
    """Raised by the stand-ins of the work: the error should have come before."""


def refuse_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes building a backend or a simulator fail the test (the ``no_work`` fixture)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise WorkStarted("work started before the mistake was reported")

    monkeypatch.setattr(cli, "make_backend", refuse)
    monkeypatch.setattr(cli, "Simulator", refuse)


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Runs ``kvcore ARGV`` in-process; returns the exit status, stdout and stderr."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code) if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def check_one_line(rc: int, out: str, err: str, prefix: str, *fragments: str) -> None:
    """Exit 2, nothing on stdout, one line on stderr starting with ``prefix``."""
    assert rc == 2, err
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(prefix), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
