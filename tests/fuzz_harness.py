"""The comparison rules of the differential API fuzzer (``test_fuzz_api``).

Every fuzzed call runs on kvcore and on the reference with the same arguments. :func:`judge`
decides whether the two outcomes agree:

- both return: the caller compares the values and then the whole state;
- both raise: kvcore's exception must be an instance of the reference's class (SPEC
  conventions: "kvcore may raise a subclass of X, never a class that a handler for X misses"),
  except that for an argument outside the reference's documented domain (a documented
  deviation, named by the caller) kvcore's ``KvcoreError`` may differ from whatever the
  reference happened to raise on it;
- only kvcore raises: allowed only with a :class:`kvcore.KvcoreError`, and only where the
  reference corrupted itself on the input or the call is outside the reference's documented
  domain (the caller names the reason: a documented deviation);
- only the reference raises: always a divergence.

A ``pyo3_runtime.PanicException`` (a Rust panic that crossed into Python) is a failure
wherever it appears; it derives from ``BaseException``, so :func:`attempt` lets it through.

Whenever kvcore raises, the reference is restored from the deep copy the caller took before
the call (the reference is not atomic: it may have changed some state before raising, or
corrupted itself), and kvcore's state must be exactly what it was before the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kvcore

__all__ = ["Divergence", "Outcome", "attempt", "judge", "sort_removed_runs"]


class Divergence(AssertionError):
    """kvcore and the reference disagreed on a call."""


@dataclass
class Outcome:
    """What a call did: its return value, or the exception it raised."""

    value: Any = None
    exc: Exception | None = None

    def __repr__(self) -> str:
        if self.exc is not None:
            return f"raised {type(self.exc).__name__}({self.exc})"
        return f"returned {self.value!r}"


def attempt(fn: Callable[[], Any]) -> Outcome:
    """Runs ``fn``, catching any ``Exception`` (a panic is a ``BaseException`` and escapes)."""
    try:
        return Outcome(fn())
    except Exception as e:
        return Outcome(exc=e)


def _is_panic(exc: BaseException | None) -> bool:
    return exc is not None and type(exc).__name__ == "PanicException"


def judge(what: str, k: Outcome, r: Outcome, deviation: str | None, ref_corrupt: bool) -> str:
    """Classifies a pair of outcomes, raising :class:`Divergence` when they disagree.

    Args:
        what: The call, for messages.
        k: kvcore's outcome.
        r: The reference's outcome.
        deviation: Why kvcore may refuse this call although the reference accepts it (a
            documented deviation), or None.
        ref_corrupt: Whether the reference's state is corrupt after the call.

    Returns:
        ``"ok"`` (both returned), ``"both"`` (both raised) or ``"stricter"`` (only kvcore
        raised, with a documented reason).
    """
    if _is_panic(k.exc):
        raise Divergence(f"{what}: Rust panic crossed into Python: {k.exc!r}")
    if k.exc is None and r.exc is None:
        return "ok"
    if k.exc is None:
        raise Divergence(f"{what}: the reference {r}, kvcore {k}")
    if r.exc is None:
        if not isinstance(k.exc, kvcore.KvcoreError):
            raise Divergence(
                f"{what}: kvcore {k} (not a KvcoreError), the reference {r}"
                + (f" [documented: {deviation}]" if deviation else "")
            )
        if deviation is None and not ref_corrupt:
            raise Divergence(f"{what}: kvcore {k}, the reference {r} (no documented reason)")
        return "stricter"
    if not isinstance(k.exc, type(r.exc)):
        if deviation is not None and isinstance(k.exc, kvcore.KvcoreError):
            # An argument outside the reference's domain: the reference fails on it
            # incidentally (or on another argument first); kvcore names it.
            return "both"
        raise Divergence(
            f"{what}: kvcore {k} is not a {type(r.exc).__name__}; the reference {r}"
            + (f" [documented: {deviation}]" if deviation else "")
        )
    return "both"


def sort_removed_runs(events: list[Any]) -> list[Any]:
    """Sorts each run of consecutive ``BlockRemoved`` events (alias removal order is set
    order in the reference, unspecified by SPEC POOL-6)."""
    out: list[Any] = []
    run: list[Any] = []
    for e in events:
        if e[0] == "BlockRemoved":
            run.append(e)
            continue
        out.extend(sorted(run, key=repr))
        run = []
        out.append(e)
    out.extend(sorted(run, key=repr))
    return out
