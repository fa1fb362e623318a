"""Exceptions raised by kvcore's Python layer.

Every class subclasses :class:`kvcore.KvcoreError` and the built-in exception the reference raises
for the same misuse, so that a handler written for the reference keeps working (SPEC conventions:
"kvcore may raise a subclass of X, never a class that a handler for X misses"). Where the
reference ``assert``\\ s on input a caller could reasonably validate, kvcore raises a class that is
both an :class:`AssertionError` and a :class:`ValueError`.
"""

from __future__ import annotations

from kvcore._native import (
    ArgumentOverflowError,
    ArgumentTypeError,
    BlockIdError,
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    InvariantViolationError,
    KvcoreError,
    MissingBlocksError,
    NoFreeBlocksError,
)

__all__ = [
    "ArgumentOverflowError",
    "ArgumentTypeError",
    "BlockIdError",
    "BlockStateError",
    "DoubleFreeError",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvariantViolationError",
    "KvcoreError",
    "MissingBlocksError",
    "NoFreeBlocksError",
]


class InvalidConfigError(KvcoreError, ValueError, AssertionError):
    """An inconsistent KV cache configuration (block sizes, groups, specs).

    The reference asserts on most of these (COORD-2, COORD-7, COORD-9, SPEC-1) and raises
    ValueError on others (CFG-2, the retention interval); this class satisfies both handlers.
    """
