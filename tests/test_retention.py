"""Cache control (issue 15), rule by rule: retention priorities and TTLs, pins, invalidation
while requests run, router-exact events; and the reference's behaviour with all of it off.

Eviction order is observed from outside: which cached prefixes stop hitting (a lookup of a
fresh request), the block ids a new request is handed (``allocate_slots`` takes free blocks in
eviction order, POOL-5) and the ``BlockRemoved`` events. Time is a :class:`FakeClock`. Each
rule runs with one full-attention group; the rules about order and invalidation also on a
hybrid configuration (full attention + sliding window).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, cast

import pytest
from retention_helpers import BS, FakeClock, Harness, LoRA, ext, tokens

import kvcore
from kvcore.errors import ArgumentTypeError, InvalidArgumentError, InvalidConfigError
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcore.request import Request

pytestmark = pytest.mark.usefixtures("hash_seed")


@pytest.fixture(params=["single"])
def single(request: pytest.FixtureRequest) -> str:
    """The single full-attention group."""
    path: str = request.param
    return path


@pytest.fixture(params=["single", "hybrid"])
def path(request: pytest.FixtureRequest) -> str:
    """One full-attention group, and full attention + sliding window."""
    p: str = request.param
    return p


def only(order: Sequence[int], ids: Sequence[int]) -> list[int]:
    """``order`` restricted to ``ids`` (the relative eviction order of those blocks)."""
    keep = set(ids)
    return [b for b in order if b in keep]


def rev(ids: Sequence[int]) -> list[int]:
    return list(reversed(ids))


# --------------------------------------------------------------------------------------------
# Request attributes


def test_request_retention_attributes() -> None:
    """kvcore.Request takes both keywords and stores them; None by default."""
    h = Harness()
    r = h.request("a", tokens(1, 20))
    assert r.retention_priority is None
    assert r.retention_ttl_s is None
    r = Request("b", [1, 2, 3], retention_priority=7, retention_ttl_s=2.5)
    assert r.retention_priority == 7
    assert r.retention_ttl_s == 2.5


BAD_VALUES: list[tuple[str, Any, type[Exception]]] = [
    ("retention_priority", -1, InvalidArgumentError),
    ("retention_priority", 101, InvalidArgumentError),
    ("retention_priority", 10**30, InvalidArgumentError),
    ("retention_ttl_s", -1.0, InvalidArgumentError),
    ("retention_ttl_s", -1e-9, InvalidArgumentError),
    ("retention_ttl_s", float("nan"), InvalidArgumentError),
    ("retention_ttl_s", float("inf"), InvalidArgumentError),
    # Wrong types (CC-2: ArgumentTypeError, a KvcoreError and TypeError).
    ("retention_priority", 50.0, ArgumentTypeError),
    ("retention_priority", "50", ArgumentTypeError),
    ("retention_ttl_s", "1.0", ArgumentTypeError),
]


@pytest.mark.parametrize(("attr", "value", "exc"), BAD_VALUES, ids=lambda v: repr(v))
def test_bad_retention_values_refused_before_anything_changes(
    single: str, attr: str, value: Any, exc: type[Exception]
) -> None:
    """Out of range, NaN or negative values raise InvalidArgumentError (a ValueError), wrong
    types ArgumentTypeError (a TypeError), both KvcoreErrors, from the constructor or from
    free(); a refused free changes nothing (CC-2)."""
    h = Harness(single, 8)
    try:
        bad = h.request("x", tokens(9, 20), **{attr: value})
    except exc as e:
        assert isinstance(e, kvcore.KvcoreError)
    else:
        assert h.admit(bad)
        before = (h.block_ids(bad), h.free_ids(), h.num_free())
        h.events()
        with pytest.raises(exc) as info:
            h.mgr.free(bad)
        assert isinstance(info.value, kvcore.KvcoreError)
        assert (h.block_ids(bad), h.free_ids(), h.num_free()) == before
        assert h.events() == []
        setattr(bad, attr, None)
        h.free(bad)
    # A request whose value was accepted, changed to the bad value before its free.
    r = h.run("r", tokens(1, 40))
    try:
        setattr(r, attr, value)
    except exc:
        return
    before = (h.block_ids(r), h.free_ids(), h.num_free())
    with pytest.raises(exc):
        h.mgr.free(r)
    assert (h.block_ids(r), h.free_ids(), h.num_free()) == before
    setattr(r, attr, None)
    h.free(r)
    assert h.num_free() == 7
    h.check()


@pytest.mark.parametrize(("priority", "ttl"), [(0, None), (100, None), (50, 0.0), (None, 1e9)])
def test_edge_retention_values_accepted(single: str, priority: int | None, ttl: float) -> None:
    h = Harness(single, 8)
    r = h.run("a", tokens(1, 40), priority=priority, ttl=ttl)
    h.free(r)
    assert h.num_free() == 7
    assert h.hits(tokens(1, 40)) == 32


# --------------------------------------------------------------------------------------------
# Eviction order with priorities


def test_lowest_priority_evicted_first(single: str) -> None:
    """Priority beats LRU: freed A (90), B (10), C (none = 50) are evicted B, C, A, each
    request's blocks in the reference's order (tail first)."""
    h = Harness(single, 7)
    a = h.run("a", tokens(1, 32), priority=90)
    b = h.run("b", tokens(2, 32), priority=10)
    c = h.run("c", tokens(3, 32))
    ids = {r.request_id: h.group_ids(r) for r in (a, b, c)}
    for r in (a, b, c):
        h.free(r)
    h.events()
    order = h.evicted_order()
    assert order == rev(ids["b"]) + rev(ids["c"]) + rev(ids["a"])
    removed = h.removed(h.events())
    assert removed == rev(h.hashes(b)) + rev(h.hashes(c)) + rev(h.hashes(a))
    h.check()


def test_low_priority_prefix_stops_hitting_first(path: str) -> None:
    """A flood that needs exactly one request's worth of blocks takes the lowest level's."""
    h = Harness(path, 1 + 3 * 2 * (2 if path == "hybrid" else 1))
    per_req = 2 * h.num_groups
    reqs = [
        h.run("hi", tokens(1, 32), priority=80),
        h.run("lo", tokens(2, 32), priority=20),
        h.run("mid", tokens(3, 32), priority=50),
    ]
    for r in reqs:
        h.free(r)
    assert h.num_free() == 3 * per_req
    want = {"hi": 32, "lo": 32, "mid": 32}
    for name, seed in (("lo", 10), ("mid", 11), ("hi", 12)):
        fl = h.flood(f"flood-{name}", per_req, seed)
        assert fl is not None
        want[name] = 0
        for r, prompt in zip(reqs, (tokens(1, 32), tokens(2, 32), tokens(3, 32)), strict=True):
            assert h.hits(prompt) == want[r.request_id], (name, r.request_id)
        h.check()


def test_lru_within_a_priority(single: str) -> None:
    h = Harness(single, 9)
    c = h.run("c", tokens(3, 32), priority=70)
    a = h.run("a", tokens(1, 32), priority=30)
    b = h.run("b", tokens(2, 32), priority=30)
    d = h.run("d", tokens(4, 32), priority=70)
    ids = {r.request_id: h.group_ids(r) for r in (a, b, c, d)}
    for r in (c, a, b, d):
        h.free(r)
    assert h.evicted_order() == rev(ids["a"]) + rev(ids["b"]) + rev(ids["c"]) + rev(ids["d"])


def test_uncached_blocks_evicted_before_any_cached_block(single: str) -> None:
    """A request's partial last block has no hash: it goes to the front (POOL-10), whatever
    the priority, ahead of a lower priority's cached blocks."""
    h = Harness(single, 6)
    a = h.run("a", tokens(1, 40), priority=100)
    b = h.run("b", tokens(2, 32), priority=0)
    a_ids, b_ids = h.group_ids(a), h.group_ids(b)
    h.free(a)
    h.free(b)
    assert h.evicted_order() == [a_ids[2], *rev(b_ids), *rev(a_ids[:2])]


def test_hit_then_free_moves_blocks_up_and_down(single: str) -> None:
    """The same prefix freed at 90, retaken and freed at 10, is evicted before a 50 block;
    retaken and freed at 90 again, after it."""
    for second, before_mid in ((10, True), (90, False)):
        h = Harness(single, 8)
        mid = h.run("mid", tokens(3, 32), priority=50)
        mid_ids = h.group_ids(mid)
        h.free(mid)
        a = h.run("a", tokens(1, 32), priority=90)
        a_ids = h.group_ids(a)
        h.free(a)
        b = h.run("b", tokens(1, 32) + tokens(2, 16), priority=second)
        b_ids = h.group_ids(b)
        assert b_ids[:2] == a_ids  # the hit
        h.free(b)
        order = only(h.evicted_order(), b_ids + mid_ids)
        if before_mid:
            assert order == rev(b_ids) + rev(mid_ids)
        else:
            assert order == rev(mid_ids) + rev(b_ids)


@pytest.mark.parametrize(("first", "last"), [(10, 90), (90, 10)])
def test_shared_blocks_take_the_priority_of_the_last_freer(
    single: str, first: int, last: int
) -> None:
    """Blocks two requests share reach the free queue when the second frees them, at the
    second request's priority; the first request's own blocks keep the first's."""
    h = Harness(single, 10)
    mid = h.run("mid", tokens(5, 32), priority=50)
    mid_ids = h.group_ids(mid)
    h.free(mid)
    a = h.run("a", tokens(1, 48), priority=first)
    b = h.run("b", tokens(1, 32) + tokens(4, 16), priority=last)
    a_ids, b_ids = h.group_ids(a), h.group_ids(b)
    assert a_ids[:2] == b_ids[:2]
    h.free(a)
    assert h.ref_cnts(a_ids[:2]) == [1, 1]
    h.free(b)
    order = only(h.evicted_order(), a_ids + b_ids + mid_ids)
    a_own, b_all = [a_ids[2]], rev(b_ids)
    if first < last:  # a's tail (10), mid (50), then b's blocks with the shared ones (90)
        assert order == a_own + rev(mid_ids) + b_all
    else:  # b's blocks with the shared ones (10), mid (50), a's tail (90)
        assert order == b_all + rev(mid_ids) + a_own


def test_hybrid_priority_order_by_group() -> None:
    """Full attention + sliding window: floods take the lower level's blocks (both groups)
    before the higher's, and the events name the hashes of both groups."""
    h = Harness("hybrid", 1 + 8)
    hi = h.run("hi", tokens(1, 32), priority=75)
    lo = h.run("lo", tokens(2, 32), priority=25)
    hi_ids, lo_ids = h.block_ids(hi), h.block_ids(lo)
    assert len(hi_ids) == len(lo_ids) == 4
    h.free(hi)
    h.free(lo)
    h.events()
    f1 = h.flood("f1", 4, 10)
    assert f1 is not None
    assert sorted(h.block_ids(f1)) == sorted(lo_ids)
    ev = h.events()
    for g in (0, 1):
        assert sorted(h.removed(ev, g)) == sorted(h.hashes(lo))
    assert h.hits(tokens(1, 32)) == 32 and h.hits(tokens(2, 32)) == 0
    f2 = h.flood("f2", 4, 11)
    assert f2 is not None and sorted(h.block_ids(f2)) == sorted(hi_ids)
    h.check()


# --------------------------------------------------------------------------------------------
# TTL of freed blocks (fake clock)


@pytest.mark.parametrize("now", [5.0, 11.0])
def test_expired_blocks_go_to_the_front(single: str, now: float) -> None:
    """A (100, TTL 10 s) freed at 0, B (0) freed at 1: before 10 s B goes first; after, A's
    expired blocks are next to evict, ahead of every priority."""
    clock = FakeClock()
    h = Harness(single, 5, clock=clock)
    a = h.run("a", tokens(1, 32), priority=100, ttl=10.0)
    b = h.run("b", tokens(2, 32), priority=0)
    a_ids, b_ids = h.group_ids(a), h.group_ids(b)
    h.free(a)
    clock.advance(1)
    h.free(b)
    clock.t = now
    order = h.evicted_order()
    if now < 10:
        assert order == rev(b_ids) + rev(a_ids)
    else:
        assert sorted(order[:2]) == sorted(a_ids) and order[2:] == rev(b_ids)


def test_earliest_expired_evicted_first(single: str) -> None:
    clock = FakeClock()
    h = Harness(single, 9, clock=clock)
    a = h.run("a", tokens(1, 32), priority=100, ttl=10.0)  # expires at 10
    b = h.run("b", tokens(2, 32), priority=90, ttl=3.0)  # freed at 2: expires at 5
    c = h.run("c", tokens(3, 32), priority=0)
    d = h.run("d", tokens(4, 32), priority=100, ttl=100.0)  # not expired
    ids = {r.request_id: h.group_ids(r) for r in (a, b, c, d)}
    h.free(a)
    clock.advance(2)
    h.free(b)
    clock.advance(1)
    h.free(c)
    h.free(d)
    clock.t = 20.0
    order = h.evicted_order()
    assert sorted(order[0:2]) == sorted(ids["b"])
    assert sorted(order[2:4]) == sorted(ids["a"])
    assert order[4:] == rev(ids["c"]) + rev(ids["d"])


@pytest.mark.parametrize(("now", "a_first"), [(12.0, False), (16.0, True)])
def test_ttl_counts_from_the_free(single: str, now: float, a_first: bool) -> None:
    """A request with a 5 s TTL that ran from 0 to 10 keeps its level until 15."""
    clock = FakeClock()
    h = Harness(single, 5, clock=clock)
    a = h.run("a", tokens(1, 32), priority=100, ttl=5.0)
    b = h.run("b", tokens(2, 32), priority=0)
    a_ids, b_ids = h.group_ids(a), h.group_ids(b)
    clock.t = 10.0
    h.free(a)
    h.free(b)
    clock.t = now
    order = h.evicted_order()
    if a_first:
        assert sorted(order[:2]) == sorted(a_ids) and order[2:] == rev(b_ids)
    else:
        assert order == rev(b_ids) + rev(a_ids)


def test_zero_ttl_expires_at_once(single: str) -> None:
    clock = FakeClock()
    h = Harness(single, 5, clock=clock)
    a = h.run("a", tokens(1, 32), priority=100, ttl=0.0)
    b = h.run("b", tokens(2, 32), priority=0)
    a_ids, b_ids = h.group_ids(a), h.group_ids(b)
    h.free(a)
    h.free(b)
    clock.advance(0.5)
    order = h.evicted_order()
    assert sorted(order[:2]) == sorted(a_ids) and order[2:] == rev(b_ids)


def test_no_ttl_never_expires(single: str) -> None:
    clock = FakeClock()
    h = Harness(single, 5, clock=clock)
    a = h.run("a", tokens(1, 32), priority=100)
    b = h.run("b", tokens(2, 32), priority=0)
    a_ids, b_ids = h.group_ids(a), h.group_ids(b)
    h.free(a)
    h.free(b)
    clock.advance(1e9)
    assert h.evicted_order() == rev(b_ids) + rev(a_ids)


def test_retaken_block_drops_its_ttl(single: str) -> None:
    """A's blocks (100, TTL 5) are hit at 1 by B (100, no TTL) and freed at 2: at 10 they
    have B's level and no TTL, so C (0) goes first."""
    clock = FakeClock()
    h = Harness(single, 8, clock=clock)
    a = h.run("a", tokens(1, 32), priority=100, ttl=5.0)
    h.free(a)
    clock.t = 1.0
    b = h.run("b", tokens(1, 32) + tokens(2, 16), priority=100)
    b_ids = h.group_ids(b)
    clock.t = 2.0
    h.free(b)
    clock.t = 3.0
    c = h.run("c", tokens(3, 32), priority=0)
    c_ids = h.group_ids(c)
    h.free(c)
    clock.t = 10.0
    assert only(h.evicted_order(), b_ids + c_ids) == rev(c_ids) + rev(b_ids)


def test_ttl_expiry_in_hybrid() -> None:
    clock = FakeClock()
    h = Harness("hybrid", 9, clock=clock)
    a = h.run("a", tokens(1, 32), priority=100, ttl=4.0)
    b = h.run("b", tokens(2, 32), priority=0)
    a_ids = h.block_ids(a)
    h.free(a)
    h.free(b)
    clock.t = 3.0
    f = h.flood("f1", 4, 10)
    assert f is not None and h.hits(tokens(1, 32)) == 32 and h.hits(tokens(2, 32)) == 0
    h.free(f)
    clock.t = 5.0
    f = h.flood("f2", 4, 11)
    assert f is not None and sorted(h.block_ids(f)) == sorted(a_ids)
    assert h.hits(tokens(1, 32)) == 0


# --------------------------------------------------------------------------------------------
# Pins


def test_pin_needs_hash_fn(single: str) -> None:
    h = Harness(single, 8, hash_fn=False)
    h.run("a", tokens(1, 32))
    with pytest.raises(InvalidConfigError):
        h.mgr.pin_prefix(tokens(1, 32))
    assert h.mgr.num_pinned_blocks == 0


def test_pin_counts_cached_leading_full_blocks(single: str) -> None:
    h = Harness(single, 11)
    mgr: Any = h.mgr
    assert mgr.pin_prefix(tokens(1, 40)) == 0
    assert mgr.pin_prefix([]) == 0
    assert mgr.num_pinned_blocks == 0
    a = h.run("a", tokens(1, 40))
    a_ids = h.group_ids(a)
    assert mgr.pin_prefix(tokens(1, 15)) == 0
    assert mgr.pin_prefix(tokens(1, 40)) == 2  # the partial third block is not pinned
    assert mgr.num_pinned_blocks == 2
    assert mgr.pin_prefix(tokens(1, 20)) == 1  # already pinned: refreshed
    assert mgr.pin_prefix(tokens(1, 40) + tokens(2, 32)) == 2  # stops at the first miss
    assert mgr.pin_prefix(tokens(2, 32)) == 0
    assert mgr.num_pinned_blocks == 2
    h.free(a)
    # Pinned blocks count as used.
    assert h.num_free() == 10 - 2
    assert all(n > 0 for n in h.ref_cnts(a_ids[:2]))
    assert set(a_ids[:2]).isdisjoint(h.free_ids())
    assert a_ids[2] in h.free_ids()
    assert h.hits(tokens(1, 40)) == 32
    assert h.mgr.usage == pytest.approx(2 / 10)
    h.check()


def test_pins_survive_a_flood(path: str) -> None:
    """Floods of every free block, over and over: the pinned prefix never stops hitting and no
    BlockRemoved names its hashes."""
    clock = FakeClock()
    h = Harness(path, 1 + 20, clock=clock)
    mgr: Any = h.mgr
    p = h.run("p", tokens(1, 48), priority=0, ttl=0.0)
    assert mgr.pin_prefix(tokens(1, 48)) == 3
    pinned = mgr.num_pinned_blocks
    assert pinned == 3 * h.num_groups
    h.free(p)
    h.events()
    rng = random.Random(7)
    for i in range(12):
        n = h.num_free() // h.num_groups * h.num_groups
        fl = h.flood(f"f{i}", rng.randrange(h.num_groups, n + 1, h.num_groups), 100 + i)
        assert fl is not None
        clock.advance(rng.choice((0.5, 3.0, 60.0)))
        ev = h.events()
        assert set(h.removed(ev)).isdisjoint(h.hashes(p))
        assert h.hits(tokens(1, 48)) == 48
        h.free(fl)
        assert mgr.num_pinned_blocks == pinned
        h.check()
    # One request that needs every non-pinned block fits, and one more block does not.
    n = h.num_free() // h.num_groups * h.num_groups
    assert n == 20 - pinned
    assert h.flood("last", n + h.num_groups, 500) is None
    assert h.flood("all", n, 501) is not None
    assert h.hits(tokens(1, 48)) == 48


@pytest.mark.parametrize("must_fit", [False, True])
def test_admission_refuses_rather_than_evict_pinned(single: str, must_fit: bool) -> None:
    h = Harness(single, 11)
    mgr: Any = h.mgr
    p = h.run("p", tokens(1, 48))
    p_ids = h.group_ids(p)
    assert mgr.pin_prefix(tokens(1, 48)) == 3
    h.free(p)
    assert h.num_free() == 7
    h.events()
    big = h.request("big", tokens(2, 8 * BS))
    assert not h.admit(big, full_sequence_must_fit=must_fit)
    assert h.events() == []
    assert h.num_free() == 7 and h.hits(tokens(1, 48)) == 48
    fits = h.request("fits", tokens(3, 7 * BS))
    assert h.admit(fits, full_sequence_must_fit=must_fit)
    assert set(h.group_ids(fits)).isdisjoint(p_ids)
    assert h.num_free() == 0
    # A decode step that needs a block is refused too, one by one or in a batch.
    assert mgr.allocate_slots_batch([fits], [1]) == []
    assert not h.decode(fits, [1])
    assert h.hits(tokens(1, 48)) == 48
    h.check()


def test_pin_bound(single: str) -> None:
    """int(0.5 * 11) = 5 blocks may be pinned; a pin past it raises and pins nothing."""
    h = Harness(single, 11)
    mgr: Any = h.mgr
    a = h.run("a", tokens(1, 48))
    b = h.run("b", tokens(2, 48))
    assert mgr.pin_prefix(tokens(1, 48)) == 3
    with pytest.raises(InvalidArgumentError):
        mgr.pin_prefix(tokens(2, 48))
    assert mgr.num_pinned_blocks == 3
    h.free(a)
    h.free(b)
    assert h.num_free() == 7  # b's blocks were not pinned
    assert mgr.pin_prefix(tokens(2, 32)) == 2
    assert mgr.num_pinned_blocks == 5
    assert mgr.pin_prefix(tokens(1, 48), ttl_s=30.0) == 3  # a refresh pins nothing new
    with pytest.raises(InvalidArgumentError):
        mgr.pin_prefix(tokens(2, 48))
    assert mgr.num_pinned_blocks == 5
    assert h.num_free() == 5
    assert mgr.unpin_prefix(tokens(1, 16)) == 1
    assert mgr.pin_prefix(tokens(2, 48)) == 3
    assert mgr.num_pinned_blocks == 5
    h.check()


@pytest.mark.parametrize(
    ("num_blocks", "fraction", "bound"), [(16, 0.25, 4), (10, 0.0, 0), (9, 1.0, 9)]
)
def test_pin_bound_fraction(single: str, num_blocks: int, fraction: float, bound: int) -> None:
    h = Harness(single, num_blocks, max_pinned_fraction=fraction)
    mgr: Any = h.mgr
    n = min(bound, num_blocks - 1)
    if n:
        h.run("a", tokens(1, n * BS))
        assert mgr.pin_prefix(tokens(1, n * BS)) == n
        assert mgr.num_pinned_blocks == n
    if num_blocks - 1 > n:
        h.run("b", tokens(2, BS))
        with pytest.raises(InvalidArgumentError):
            mgr.pin_prefix(tokens(2, BS))
    assert mgr.num_pinned_blocks == n
    assert mgr.pin_prefix(tokens(3, BS)) == 0  # nothing cached: nothing to pin


def test_pin_takes_every_copy(single: str) -> None:
    """Duplicates (MAP-1): the pin holds every cached copy, and the bound counts copies."""
    h = Harness(single, 11)
    mgr: Any = h.mgr
    a = h.run("a", tokens(1, 48))
    b = h.run("b", tokens(1, 48), use_hits=False)
    a_ids, b_ids = h.group_ids(a), h.group_ids(b)
    assert set(a_ids).isdisjoint(b_ids)
    with pytest.raises(InvalidArgumentError):
        mgr.pin_prefix(tokens(1, 48))  # 6 copies > 5
    assert mgr.num_pinned_blocks == 0
    assert mgr.pin_prefix(tokens(1, 32)) == 2
    assert mgr.num_pinned_blocks == 4
    h.free(a)
    h.free(b)
    assert h.num_free() == 6
    order = h.evicted_order()
    assert set(order).isdisjoint(a_ids[:2] + b_ids[:2])
    assert h.hits(tokens(1, 32)) == 32
    assert mgr.unpin_prefix(tokens(1, 32)) == 2
    assert mgr.num_pinned_blocks == 0
    assert h.num_free() == 4
    h.check()


def test_pin_uses_salt_and_lora(single: str) -> None:
    h = Harness(single, 11)
    mgr: Any = h.mgr
    lora = LoRA("adapter", 3)
    h.run("s", tokens(1, 32), cache_salt="salt")
    h.run("l", tokens(2, 32), lora_request=lora)
    assert mgr.pin_prefix(tokens(1, 32)) == 0
    assert mgr.pin_prefix(tokens(1, 32), cache_salt="other") == 0
    assert mgr.pin_prefix(tokens(1, 32), cache_salt="salt") == 2
    assert mgr.pin_prefix(tokens(2, 32)) == 0
    assert mgr.pin_prefix(tokens(2, 32), lora_request=LoRA("other", 4)) == 0
    assert mgr.pin_prefix(tokens(2, 32), lora_request=lora) == 2
    assert mgr.num_pinned_blocks == 4
    assert mgr.unpin_prefix(tokens(1, 32)) == 0
    assert mgr.unpin_prefix(tokens(1, 32), cache_salt="salt") == 2
    assert mgr.unpin_prefix(tokens(2, 32), lora_request=lora) == 2
    assert mgr.num_pinned_blocks == 0


def test_pin_ttl_and_refresh(single: str) -> None:
    clock = FakeClock()
    h = Harness(single, 11, clock=clock)
    mgr: Any = h.mgr
    a = h.run("a", tokens(1, 32))
    assert mgr.pin_prefix(tokens(1, 32), ttl_s=10.0) == 2
    h.free(a)
    clock.t = 8.0
    assert mgr.pin_prefix(tokens(1, 32), ttl_s=10.0) == 2  # now until 18
    clock.t = 15.0
    assert mgr.num_pinned_blocks == 2 and h.num_free() == 8
    clock.t = 19.0
    assert mgr.num_pinned_blocks == 0
    assert h.num_free() == 10
    assert h.hits(tokens(1, 32)) == 32  # released, still cached
    h.check()


def test_pin_without_ttl_has_no_limit(single: str) -> None:
    clock = FakeClock()
    h = Harness(single, 11, clock=clock)
    mgr: Any = h.mgr
    h.free(h.run("a", tokens(1, 32)))
    assert mgr.pin_prefix(tokens(1, 32), ttl_s=5.0) == 2
    assert mgr.pin_prefix(tokens(1, 32)) == 2  # refresh to no limit
    clock.advance(1e7)
    assert mgr.num_pinned_blocks == 2
    assert h.flood("f", 9, 50) is None
    assert h.hits(tokens(1, 32)) == 32


def test_expired_pin_is_released_to_the_tail_at_50(single: str) -> None:
    clock = FakeClock()
    h = Harness(single, 1 + 8, clock=clock)
    mgr: Any = h.mgr
    p = h.run("p", tokens(1, 32), priority=100)
    p_ids = h.group_ids(p)
    assert mgr.pin_prefix(tokens(1, 32), ttl_s=5.0) == 2
    h.free(p)
    lo = h.run("lo", tokens(2, 32), priority=10)
    hi = h.run("hi", tokens(3, 32), priority=90)
    mid = h.run("mid", tokens(4, 32))
    ids = {r.request_id: h.group_ids(r) for r in (lo, hi, mid)}
    ids["p"] = p_ids
    for r in (lo, hi, mid):
        h.free(r)
    clock.t = 6.0
    order = h.evicted_order()
    assert order[:4] == rev(ids["lo"]) + rev(ids["mid"])
    assert sorted(order[4:6]) == sorted(ids["p"])
    assert order[6:] == rev(ids["hi"])


def test_expired_pin_is_counted_at_the_next_call(single: str) -> None:
    """num_pinned_blocks is the count now; the pool's free count and usage follow at the next
    allocate_slots or pin_prefix, where deadlines are applied (CC-3)."""
    for call in ("pinned", "allocate", "pin"):
        clock = FakeClock()
        h = Harness(single, 11, clock=clock)
        mgr: Any = h.mgr
        h.free(h.run("p", tokens(1, 32)))
        assert mgr.pin_prefix(tokens(1, 32), ttl_s=5.0) == 2
        assert h.num_free() == 8
        clock.t = 6.0
        if call == "pinned":
            assert mgr.num_pinned_blocks == 0
        elif call == "allocate":
            fl = h.flood("f", 1, 40)
            assert fl is not None
            h.free(fl)
        else:
            assert mgr.pin_prefix(tokens(2, 32)) == 0
        assert mgr.num_pinned_blocks == 0
        assert h.num_free() == 10
        assert mgr.usage == 0.0


def test_unpin_returns_blocks_to_the_tail_at_50(single: str) -> None:
    h = Harness(single, 1 + 8)
    mgr: Any = h.mgr
    hi = h.run("hi", tokens(3, 32), priority=90)
    lo = h.run("lo", tokens(2, 32), priority=10)
    p = h.run("p", tokens(1, 32), priority=0)
    assert mgr.pin_prefix(tokens(1, 32)) == 2
    mid = h.run("mid", tokens(4, 32))
    ids = {r.request_id: h.group_ids(r) for r in (p, lo, hi, mid)}
    for r in (hi, lo, p, mid):
        h.free(r)
    assert h.num_free() == 6
    assert mgr.unpin_prefix(tokens(1, 32)) == 2
    assert mgr.num_pinned_blocks == 0 and h.num_free() == 8
    order = h.evicted_order()
    assert order[:4] == rev(ids["lo"]) + rev(ids["mid"])
    assert sorted(order[4:6]) == sorted(ids["p"])
    assert order[6:] == rev(ids["hi"])


def test_unpin_part_of_a_pinned_prefix(single: str) -> None:
    """unpin_prefix releases every pin on the cached leading blocks of the prefix (CC-5):
    after the head of a pinned prefix is released, unpinning the whole prefix releases the
    rest."""
    h = Harness(single, 11)
    mgr: Any = h.mgr
    h.free(h.run("a", tokens(1, 48)))
    assert mgr.unpin_prefix(tokens(1, 48)) == 0
    assert mgr.pin_prefix(tokens(1, 48)) == 3
    assert mgr.unpin_prefix(tokens(1, 32)) == 2
    assert mgr.num_pinned_blocks == 1
    assert h.num_free() == 9
    assert mgr.unpin_prefix(tokens(1, 48)) == 1  # the third block's pin
    assert mgr.num_pinned_blocks == 0 and h.num_free() == 10
    assert mgr.pin_prefix(tokens(1, 48)) == 3
    assert mgr.num_pinned_blocks == 3
    assert mgr.unpin_prefix(tokens(1, 48)) == 3
    assert mgr.num_pinned_blocks == 0 and h.num_free() == 10
    h.check()


def test_unpin_while_a_request_holds_the_blocks(single: str) -> None:
    h = Harness(single, 1 + 6)
    mgr: Any = h.mgr
    a = h.run("a", tokens(1, 32), priority=10)
    a_ids = h.group_ids(a)
    assert mgr.pin_prefix(tokens(1, 32)) == 2
    assert mgr.unpin_prefix(tokens(1, 32)) == 2
    assert h.ref_cnts(a_ids) == [1, 1]  # still the request's
    assert h.num_free() == 4
    mid = h.run("mid", tokens(2, 32))
    mid_ids = h.group_ids(mid)
    h.free(mid)
    h.free(a)
    assert only(h.evicted_order(), a_ids + mid_ids) == rev(a_ids) + rev(mid_ids)


def test_pinned_blocks_hit_by_a_request_stay_pinned(single: str) -> None:
    h = Harness(single, 11)
    mgr: Any = h.mgr
    p = h.run("p", tokens(1, 32))
    p_ids = h.group_ids(p)
    assert mgr.pin_prefix(tokens(1, 32)) == 2
    h.free(p)
    b = h.run("b", tokens(1, 32) + tokens(2, 20), priority=0)
    assert h.group_ids(b)[:2] == p_ids
    h.free(b)
    assert mgr.num_pinned_blocks == 2
    assert set(h.evicted_order()).isdisjoint(p_ids)
    assert h.hits(tokens(1, 32)) == 32


def test_reset_prefix_cache_releases_pins_when_it_can(single: str) -> None:
    h = Harness(single, 11)
    mgr: Any = h.mgr
    running = h.run("a", tokens(1, 40))
    h.free(h.run("p", tokens(2, 32)))
    assert mgr.pin_prefix(tokens(2, 32)) == 2
    h.events()
    assert mgr.reset_prefix_cache() is False  # a request holds blocks: pins stay
    assert mgr.num_pinned_blocks == 2 and h.hits(tokens(2, 32)) == 32
    assert h.events() == []
    h.free(running)
    assert mgr.reset_prefix_cache() is True
    assert mgr.num_pinned_blocks == 0
    assert h.num_free() == 10
    assert h.hits(tokens(2, 32)) == 0 and h.hits(tokens(1, 32)) == 0
    assert h.events() == [AllBlocksCleared()]
    h.check()


# --------------------------------------------------------------------------------------------
# Invalidation while requests run


def test_invalidate_with_running_requests_then_continue(path: str) -> None:
    h = Harness(path, 41)
    mgr: Any = h.mgr
    a = h.run("a", tokens(1, 40))  # running
    a_blocks = mgr.get_block_ids("a")
    h.free(h.run("b", tokens(2, 32)))  # free, cached
    h.free(h.run("p", tokens(3, 32)))
    assert mgr.pin_prefix(tokens(3, 32)) == 2
    h.events()
    assert mgr.invalidate_prefix_cache() is None
    assert h.events() == [AllBlocksCleared()]
    assert mgr.num_pinned_blocks == 0
    for prompt in (tokens(1, 40), tokens(2, 32), tokens(3, 32)):
        assert h.hits(prompt) == 0
    assert mgr.get_block_ids("a") == a_blocks
    assert h.num_free() == 40 - len(h.block_ids(a))
    h.check()
    # The running request continues; its later full blocks are cached again as usual.
    assert h.decode(a, tokens(4, 30))  # 70 tokens: blocks 2 and 3 become full
    ev = h.events()
    for g in range(h.num_groups):
        assert h.stored(ev, g) == h.hashes(a)[2:4], g
        parents = [
            e.parent_block_hash for e in ev if isinstance(e, BlockStored) and e.group_idx == g
        ]
        assert parents == [h.hashes(a)[1]], g
    assert h.hits(list(a.all_token_ids)) == 0  # its first blocks were cached before
    assert h.decode(a, tokens(5, 20))
    h.free(a)
    assert h.hits(list(a.all_token_ids)) == 0
    # A new request computes the prefix again, and then it hits.
    d = h.run("d", list(a.all_token_ids))
    assert h.hits(list(a.all_token_ids)) == len(a.all_token_ids) // BS * BS
    h.free(d)
    e = h.run("e", tokens(2, 32))
    assert h.hits(tokens(2, 32)) == 32
    h.free(e)
    assert mgr.reset_prefix_cache() is True
    h.check()


def test_invalidate_during_a_chunked_prefill(path: str) -> None:
    h = Harness(path, 41)
    mgr: Any = h.mgr
    r = h.request("a", tokens(1, 64))
    assert mgr.allocate_slots(r, 32) is not None
    r.num_computed_tokens = 32
    mgr.invalidate_prefix_cache()
    assert h.hits(tokens(1, 64)) == 0
    assert mgr.allocate_slots(r, 32) is not None
    r.num_computed_tokens = 64
    assert h.hits(tokens(1, 64)) == 0
    h.free(r)
    assert h.hits(tokens(1, 64)) == 0
    h.check()


@pytest.mark.parametrize("exact", [False, True])
def test_invalidated_hashes_are_not_removed_again(single: str, exact: bool) -> None:
    """After AllBlocksCleared no BlockRemoved names a hash cached before it: the blocks that
    were free became plain, and the running request's old blocks are no longer cached."""
    h = Harness(single, 21, exact_router_events=exact)
    mgr: Any = h.mgr
    a = h.run("a", tokens(1, 40))
    b = h.run("b", tokens(2, 32))
    h.free(b)
    old = set(h.hashes(a)) | set(h.hashes(b))
    mgr.invalidate_prefix_cache()
    assert h.events()[-1] == AllBlocksCleared()
    assert h.decode(a, tokens(4, 30))
    new = set(h.hashes(a)[2:4])
    h.free(a)
    h.evicted_order()
    removed = set(h.removed(h.events()))
    assert removed.isdisjoint(old)
    assert new <= removed


def test_invalidate_without_events(single: str) -> None:
    h = Harness(single, 11, events=False)
    mgr: Any = h.mgr
    h.free(h.run("a", tokens(1, 32)))
    mgr.invalidate_prefix_cache()
    assert h.events() == []
    assert h.hits(tokens(1, 32)) == 0
    assert h.num_free() == 10


def test_invalidate_releases_pins_of_running_requests(single: str) -> None:
    h = Harness(single, 11)
    mgr: Any = h.mgr
    a = h.run("a", tokens(1, 32))
    assert mgr.pin_prefix(tokens(1, 32)) == 2
    mgr.invalidate_prefix_cache()
    assert mgr.num_pinned_blocks == 0
    assert h.ref_cnts(h.group_ids(a)) == [1, 1]
    h.free(a)
    assert h.num_free() == 10
    assert mgr.pin_prefix(tokens(1, 32)) == 0


# --------------------------------------------------------------------------------------------
# Router-exact events


@pytest.mark.parametrize("exact", [False, True])
def test_events_with_duplicate_copies(single: str, exact: bool) -> None:
    """Two copies of each hash: exact events announce the first and retract the last; the
    default keeps the reference's one event per copy (EVT-3)."""
    h = Harness(single, 1 + 4, exact_router_events=exact)
    a = h.run("a", tokens(1, 32))
    hs = h.hashes(a)
    assert h.stored(h.events()) == hs
    b = h.run("b", tokens(1, 32), use_hits=False)
    ev = h.events()
    assert h.stored(ev) == ([] if exact else hs)
    h.free(a)
    h.free(b)
    f1 = h.flood("f1", 2, 10)  # evicts a's copies (freed first)
    assert f1 is not None
    assert h.removed(h.events()) == ([] if exact else rev(hs))
    assert h.hits(tokens(1, 32)) == 32
    f2 = h.flood("f2", 2, 11)  # evicts the last copies
    assert f2 is not None
    assert h.removed(h.events()) == rev(hs)
    assert h.hits(tokens(1, 32)) == 0


def test_exact_events_for_new_keys_between_duplicates(path: str) -> None:
    """One caching call whose new keys are not contiguous (new, duplicate, new): the exact
    events name just the new ones, each run with its own parent (CC-8)."""
    h = Harness(path, 41, exact_router_events=True)
    a = h.run("a", tokens(1, 48))
    g0 = h.group_ids(a, 0)
    h.mgr.evict_blocks({g0[0], g0[2]})  # group 0 keeps only the middle hash cached
    ev = h.events()
    assert h.removed(ev, 0) == [h.hashes(a)[0], h.hashes(a)[2]]
    b = h.run("b", tokens(1, 48), use_hits=False)
    ev = h.events()
    hs = h.hashes(b)
    assert h.stored(ev, 0) == [hs[0], hs[2]]
    parents = [e.parent_block_hash for e in ev if isinstance(e, BlockStored) and e.group_idx == 0]
    assert parents == [None, hs[1]]
    for g in range(1, h.num_groups):
        assert h.stored(ev, g) == []
    h.free(b)
    h.free(a)
    h.check()


def test_exact_events_with_a_running_copy(single: str) -> None:
    """Evicting a copy while another copy is held, or hitting a held copy, says nothing."""
    h = Harness(single, 1 + 7, exact_router_events=True)
    a = h.run("a", tokens(1, 32))
    b = h.run("b", tokens(1, 32), use_hits=False)
    h.free(b)
    h.events()
    assert h.flood("f", 4, 10) is not None  # evicts b's last block; a's copies are held
    assert h.removed(h.events()) == []
    h.free(a)
    c = h.run("c", tokens(1, 32) + tokens(2, 4))  # hits a's copies, evicts b's other block
    ev = h.events()
    assert h.stored(ev) == [] and h.removed(ev) == []
    h.free(c)
    h.check()


def test_exact_events_store_again_after_invalidation(single: str) -> None:
    h = Harness(single, 21, exact_router_events=True)
    mgr: Any = h.mgr
    a = h.run("a", tokens(1, 32))
    h.events()
    mgr.invalidate_prefix_cache()
    assert h.events() == [AllBlocksCleared()]
    d = h.run("d", tokens(1, 32))  # computed again while a still holds its old copies
    assert h.stored(h.events()) == h.hashes(a)
    h.free(a)
    h.free(d)
    h.evicted_order()
    assert sorted(h.removed(h.events())) == sorted(h.hashes(d))


class Router:
    """A router's view: per group, the hashes it was told are cached."""

    def __init__(self) -> None:
        self.known: dict[int, set[int]] = {}

    def apply(self, events: Sequence[Any]) -> None:
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.known.clear()
                continue
            g = self.known.setdefault(e.group_idx or 0, set())
            for hsh in e.block_hashes:
                if isinstance(e, BlockStored):
                    assert hsh not in g, f"stored twice: {hsh:#x}"
                    g.add(hsh)
                else:
                    assert isinstance(e, BlockRemoved)
                    assert hsh in g, f"removed but not stored: {hsh:#x}"
                    g.discard(hsh)

    def view(self) -> set[tuple[int, int]]:
        return {(g, hsh) for g, s in self.known.items() for hsh in s}


def cached_view(h: Harness) -> set[tuple[int, int]]:
    """(group, hash) of every block cached in the pool now."""
    out: set[tuple[int, int]] = set()
    for key in h.keys(range(h.num_blocks)):
        if key is not None:
            out.add((int.from_bytes(key[-4:], "big"), ext(key[:-4])))
    return out


def test_exact_events_keep_a_router_exact(path: str) -> None:
    """A seeded workload with shared prefixes, duplicates, frees, floods and evict_blocks:
    after every call the router's view is exactly the set of cached (group, hash)."""
    h = Harness(path, 1 + 24, exact_router_events=True)
    router = Router()
    rng = random.Random(3)
    prefixes = [tokens(1, 48), tokens(2, 32), tokens(1, 32) + tokens(3, 16)]
    running: list[Request] = []
    for i in range(150):
        op = rng.random()
        if op < 0.45:
            prompt = rng.choice(prefixes) + tokens(10 + i, rng.randrange(0, 40))
            r = h.request(f"r{i}", prompt, priority=rng.choice((None, 0, 50, 100)))
            if h.admit(r, use_hits=rng.random() < 0.7):
                running.append(r)
        elif op < 0.8 and running:
            h.free(running.pop(rng.randrange(len(running))))
        elif op < 0.9 and running:
            r = rng.choice(running)
            if not h.decode(r, tokens(500 + i, rng.randrange(1, 20))):
                running.remove(r)
                h.free(r)
        else:
            h.mgr.evict_blocks({rng.randrange(1, h.num_blocks) for _ in range(3)})
        router.apply(h.events())
        assert router.view() == cached_view(h), i
        h.check()


# --------------------------------------------------------------------------------------------
# Features off: the reference's behaviour


def test_defaults_without_new_arguments(single: str) -> None:
    """A manager built without the new keywords works as before: no pins, reference order."""
    h = Harness(single, 7, legacy=True)
    a = h.run("a", tokens(1, 32))
    b = h.run("b", tokens(2, 32))
    a_ids, b_ids = h.group_ids(a), h.group_ids(b)
    h.free(a)
    h.free(b)
    assert h.free_ids()[-4:] == rev(a_ids) + rev(b_ids)
    assert h.evicted_order()[-4:] == rev(a_ids) + rev(b_ids)
    assert h.mgr.num_pinned_blocks == 0


class _TickingClock:
    """A clock that moves on at every read: with no TTL in use, time must not matter."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.25
        return self.t


def _features_off_side(priority: int | None) -> Any:
    """kvcore's differential side built with every new argument given, switched off."""
    import functools

    from difftrace import KvcoreSide, TraceConfig, _build_config, _manager_kwargs

    from kvcore import config as kconfig
    from kvcore import hashing
    from kvcore import specs as kspecs
    from kvcore.manager import KVCacheManager

    class Side(KvcoreSide):
        def __init__(self, cfg: TraceConfig) -> None:
            super().__init__(cfg)
            self.manager = KVCacheManager(
                _build_config(cfg, kspecs, kconfig, "float16"),
                **_manager_kwargs(cfg),
                hash_fn=hashing.get_hash_fn_by_name(cfg.hash_fn),
                clock=_TickingClock(),
                max_pinned_fraction=0.5,
                exact_router_events=False,
            )
            if priority is not None:
                cast(Any, self)._request_cls = functools.partial(
                    self._request_cls, retention_priority=priority, retention_ttl_s=None
                )

    return Side


@pytest.mark.reference
@pytest.mark.parametrize(
    ("name", "priority"),
    [
        ("full", None),
        ("full-xxhash", 50),
        ("hybrid-full-swa", None),
        ("hybrid-full-swa", 50),
    ],
)
def test_features_off_match_the_reference(name: str, priority: int | None) -> None:
    """With no TTL, no pins and one priority level (none given, or 50 for all), a seeded
    trace of admissions, frees, preemptions and evictions gives the reference's results,
    events and free-list order after every call (the differential harness)."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    from difftrace import CONFIGS, run_trace

    cfg = next(c for c in CONFIGS if c.name == name)
    d = run_trace(cfg, 1, 150, kv_side=_features_off_side(priority))
    assert d.counts.get("free", 0) > 5
    assert d.counts.get("BlockRemoved", 0) > 0


@pytest.mark.reference
@pytest.mark.parametrize("mapped", [False, True])
def test_vllm_priority_maps_to_retention(
    mapped: bool, monkeypatch: pytest.MonkeyPatch, make_reference_request: Any
) -> None:
    """KVCORE_VLLM_RETENTION_FROM_PRIORITY=1: a vLLM request's priority p (lower = more
    important) becomes retention priority clamp(50 - p, 0, 100); unset, vLLM requests (no
    retention attributes) all count as 50 and LRU decides."""
    pytest.importorskip("vllm.v1.request")
    import kvcore.vllm
    from kvcore.config import KVCacheConfig, KVCacheGroupSpec
    from kvcore.specs import FullAttentionSpec

    if mapped:
        monkeypatch.setenv("KVCORE_VLLM_RETENTION_FROM_PRIORITY", "1")
    else:
        monkeypatch.delenv("KVCORE_VLLM_RETENTION_FROM_PRIORITY", raising=False)
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    hasher = kvcore.vllm.get_request_block_hasher(BS, sha256)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype="float16")
    mgr = kvcore.vllm.KVCacheManager(
        KVCacheConfig(1 + 6, [], [KVCacheGroupSpec(["l"], spec)]),
        max_model_len=1024,
        scheduler_block_size=BS,
        hash_block_size=BS,
    )
    reqs = []
    for rid, seed, prio in (("important", 1, -200), ("default", 2, 0), ("background", 3, 30)):
        r = make_reference_request(rid, tokens(seed, 32), block_hasher=hasher, priority=prio)
        assert mgr.allocate_slots(r, 32) is not None
        reqs.append((r, list(mgr.get_block_ids(rid)[0])))
    for r, _ in reqs:
        mgr.free(r)
    drain = make_reference_request("drain", tokens(9, 6 * BS), block_hasher=hasher)
    got = mgr.allocate_slots(drain, 6 * BS)
    assert got is not None
    order = list(got.get_block_ids()[0])
    (_, imp), (_, dflt), (_, bg) = reqs
    if mapped:  # background 20, default 50, important clamp(250) = 100
        assert order == rev(bg) + rev(dflt) + rev(imp)
    else:
        assert order == rev(imp) + rev(dflt) + rev(bg)


@pytest.mark.reference
def test_duck_typed_requests_carry_retention_attributes(make_reference_request: Any) -> None:
    """A vLLM Request (no retention attributes: priority 50) and one given them by hand."""
    pytest.importorskip("vllm.v1.request")
    from vllm.utils.hashing import sha256

    import kvcore.vllm

    hasher = kvcore.vllm.get_request_block_hasher(BS, sha256)
    h = Harness("single", 1 + 6)
    reqs = []
    for rid, seed, prio in (("plain", 1, None), ("low", 2, 5), ("high", 3, 95)):
        r = make_reference_request(rid, tokens(seed, 32), block_hasher=hasher)
        assert not hasattr(r, "retention_priority")
        if prio is not None:
            r.retention_priority = prio
            r.retention_ttl_s = None
        assert h.mgr.allocate_slots(r, 32) is not None
        reqs.append((r, h.group_ids(r)))
    for r, _ in reqs:
        h.mgr.free(r)
    (_, plain), (_, low), (_, high) = reqs
    assert h.evicted_order() == rev(low) + rev(plain) + rev(high)
