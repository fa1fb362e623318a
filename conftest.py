"""Repository-wide pytest hook: under ``CI=true`` a skipped test is a failed test.

Tests skip when something they need is missing on a developer's machine (the reference vLLM,
torch, pyzmq, matplotlib...). CI installs all of it, so there a skip means an install step is
broken or missing: the test is reported as failed, with the skip's reason, instead of passing
silently. This file sits at the repository root so it covers ``tests/``, ``kernels/tests/`` and
``benches/`` alike.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """Turns a skip into a failure when running in CI (xfail results are left alone)."""
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (something CI must install is missing): {reason}"
