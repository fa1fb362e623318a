"""Hypothesis strategies of awkward argument values for the API fuzzer (``test_fuzz_api``).

Every strategy mixes plausible values (small ints, ids of the pool, known hashes) with the
values a careless or hostile caller hands over: negative and huge ints on both sides of every
machine boundary (2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30), ``bool`` (an ``int``
subclass), floats, ``None``, strings, bytes of odd lengths, empty and over-long lists and
duplicates. Values that name something only known while a sequence runs (a block the caller
holds, a hash of a request) are drawn as small tokens and resolved by the fuzzer then, so that
hypothesis can shrink a failing sequence without making it meaningless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st

HUGE_INTS: tuple[int, ...] = (
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    10**30,
)
"""Ints at and beyond the 32- and 64-bit boundaries."""

NEGATIVE_INTS: tuple[int, ...] = (-1, -2, -(2**31), -(2**63), -(2**63) - 1, -(2**64), -(10**30))
"""Negative ints, from -1 to far beyond the 64-bit range."""

NON_INTS: tuple[Any, ...] = (None, 1.5, 0.0, float("nan"), "3", b"\x01", [], ())
"""Values of the wrong type for an int argument."""


@dataclass(frozen=True)
class Free:
    """Resolved to the pool's current free count plus ``delta``."""

    delta: int


@dataclass(frozen=True)
class Held:
    """Resolved to the ``k``-th block id currently held (ref count above 0), if any."""

    k: int


@dataclass(frozen=True)
class KnownHash:
    """Resolved to the ``k``-th hash the sequence has produced so far, if any."""

    k: int


def special_ints() -> st.SearchStrategy[int]:
    """Boundary ints: huge, negative, 0 and 1."""
    return st.sampled_from((0, 1, *HUGE_INTS, *NEGATIVE_INTS))


def counts(limit: int = 8) -> st.SearchStrategy[Any]:
    """A count argument: mostly small ints, often boundaries, sometimes the wrong type."""
    return st.one_of(
        st.integers(0, limit),
        st.integers(0, limit),
        special_ints(),
        st.booleans(),
        st.sampled_from(NON_INTS),
    )


def id_values(n: int) -> st.SearchStrategy[Any]:
    """A block id: in range (often), just outside, huge, negative, a bool or not an int."""
    return st.one_of(
        st.integers(0, max(n - 1, 0)),
        st.integers(0, max(n - 1, 0)),
        st.builds(Held, st.integers(0, 7)),
        st.builds(Held, st.integers(0, 7)),
        st.sampled_from((n, n + 1, -n - 1)),
        special_ints(),
        st.booleans(),
        st.sampled_from(NON_INTS),
    )


def id_lists(n: int) -> st.SearchStrategy[list[Any]]:
    """Lists of block ids: empty, short, over-long, with duplicates."""
    item = id_values(n)
    return st.one_of(
        st.lists(item, max_size=4),
        st.lists(item, max_size=4),
        st.lists(st.builds(Held, st.integers(0, 7)), max_size=6),
        st.lists(item, min_size=n, max_size=n + 8),
        st.lists(st.integers(0, max(n - 1, 0)), max_size=3).map(lambda xs: xs + xs),
    )


def containers() -> st.SearchStrategy[str]:
    """How a list argument is passed: a list, a tuple or a one-shot iterator."""
    return st.sampled_from(("list", "list", "tuple", "iter", "none", "int"))


def wrap(kind: str, items: list[Any]) -> Any:
    """``items`` as a list, tuple or iterator (a fresh one per call), or a non-iterable."""
    if kind == "tuple":
        return tuple(items)
    if kind == "iter":
        return iter(list(items))
    if kind == "none":
        return None
    if kind == "int":
        return 5
    return list(items)


def hash_bytes() -> st.SearchStrategy[Any]:
    """A block hash: known ones, random digests of 16/32 bytes, odd lengths, wrong types."""
    return st.one_of(
        st.builds(KnownHash, st.integers(0, 15)),
        st.builds(KnownHash, st.integers(0, 15)),
        st.binary(min_size=32, max_size=32),
        st.binary(min_size=16, max_size=16),
        st.sampled_from((b"", b"\x00", b"\xff" * 33, b"\xab" * 100)),
        st.sampled_from((None, "abc", 0, bytearray(b"\x00" * 32))),
    )


def group_ids() -> st.SearchStrategy[Any]:
    """A KV cache group id: 0, 1, boundaries of u32 and beyond, bools and non-ints."""
    return st.one_of(
        st.integers(0, 1),
        st.integers(0, 1),
        st.integers(0, 1),
        st.sampled_from((2**32 - 1, 2**32, -1, 2**63, 10**30)),
        st.booleans(),
        st.sampled_from((None, 1.5, "0")),
    )


def request_ids() -> st.SearchStrategy[str]:
    """Request ids: a few short ones (so that they collide), non-ASCII and lone surrogates."""
    return st.one_of(
        st.sampled_from(("a", "b", "c", "d")),
        st.sampled_from(("a", "b", "c", "d")),
        st.sampled_from(("", "é", "\u4e2d\u6587", "\U0001f600", "\ud800", "a\udfffb", "\x00")),
        st.text(max_size=4),
    )


def token_values() -> st.SearchStrategy[Any]:
    """Token ids: small ints (so that prefixes repeat), boundaries, bools."""
    return st.one_of(
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(0, 50000),
        st.sampled_from((-1, 2**31, 2**63 - 1)),
        st.booleans(),
    )


def hashable_objects() -> st.SearchStrategy[Any]:
    """Objects the hash functions accept (or refuse): nested tuples and lists of scalars."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        special_ints(),
        st.floats(allow_nan=False),
        st.text(max_size=6),
        st.sampled_from(("\ud800", "a\udc80")),
        st.binary(max_size=40),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).map(tuple),
            st.lists(inner, max_size=4),
        ),
        max_leaves=12,
    )
