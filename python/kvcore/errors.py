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
    InvalidConfigError,
    InvariantViolationError,
    KvcoreError,
    MissingBlocksError,
    NoFreeBlocksError,
    UnsupportedError,
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
    "UnsupportedError",
]
