"""Model-based test of cache control (issue 15) mixed with the usual manager operations.

Hypothesis drives one manager (fake clock, events on) through admissions with retention
priorities and TTLs, decodes, preemptions, frees, clock moves, pins and unpins with TTLs,
invalidation while requests run, prefix-cache resets and explicit evictions. A model keeps
which blocks are pinned until when (every cached copy of the pinned prefix's leading hashes
at pin time), which blocks were cached before an invalidation, and what every block holds.
After every step:

- the pool's own invariants hold (``check_invariants``);
- nothing pinned is ever evicted: every pinned block is still cached under its hash with a
  reference count above 0 and out of the free queue, and a lookup of each pinned prefix hits
  at least its pinned blocks;
- ``num_pinned_blocks`` is the model's count, reference counts are the holders' (plus the pin),
  ``get_num_free_blocks`` is every block neither held nor pinned;
- no lookup hits a block cached before an invalidation, and every hit holds the request's
  tokens;
- with ``exact_router_events``, a router fed the events knows exactly the cached hashes.

Examples per machine: ``KVCORE_FUZZ_EXAMPLES`` scaled down (default 25 examples of 30 steps).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from retention_helpers import BS, FakeClock, Harness, ext

from kvcore.errors import InvalidArgumentError
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcore.request import Request, RequestStatus, append_output_token_ids_batch

PREFIXES = [list(range(1, 49)), list(range(1, 33)) + [7] * 16, [5] * 48, list(range(200, 264))]
PRIORITIES = st.sampled_from([None, None, 0, 10, 50, 90, 100])
REQUEST_TTLS = st.sampled_from([None, None, 0.0, 1.5, 4.5, 30.5])
PIN_TTLS = st.sampled_from([None, 2.5, 7.5, 30.5])
"""Pin deadlines fall on x.5 and the clock on whole seconds: no expiry is ever exactly now."""

EXAMPLES = max(5, int(os.environ.get("KVCORE_FUZZ_EXAMPLES", "500")) // 20)


class RetentionMachine(RuleBasedStateMachine):
    """One manager and its model; subclasses choose the path and the event mode."""

    PATH = "single"
    NUM_BLOCKS = 24
    EXACT = False

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.h = Harness(
            self.PATH,
            self.NUM_BLOCKS,
            clock=self.clock,
            exact_router_events=self.EXACT,
            max_model_len=256,
        )
        self.mgr: Any = self.h.mgr
        self.groups = range(self.h.num_groups)
        self.bound = int(0.5 * self.NUM_BLOCKS)
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.content: dict[int, tuple[int, ...]] = {}
        self.pins: dict[int, tuple[bytes, float]] = {}  # block -> (key, deadline)
        self.stale: dict[int, bytes] = {}  # block -> the key it had at an invalidation
        self.pinned_prefixes: set[tuple[int, int]] = set()  # (prefix index, blocks)
        self.known: dict[int, set[int]] = {}  # the router's view, per group
        self.next_id = 0

    # -- model helpers ---------------------------------------------------------------------

    @staticmethod
    def key(h: bytes, gid: int) -> bytes:
        return h + gid.to_bytes(4, "big")

    def keys(self) -> list[bytes | None]:
        return self.h.keys(range(self.NUM_BLOCKS))

    def live(self, keys: list[bytes | None], b: int) -> bytes | None:
        """Block b's key if it is cached (not a leftover from before an invalidation)."""
        k = keys[b]
        if k is None or self.stale.get(b) == k:
            return None
        return k

    def copies(self, keys: list[bytes | None], key: bytes) -> set[int]:
        return {b for b in range(1, self.NUM_BLOCKS) if self.live(keys, b) == key}

    def prefix_hashes(self, idx: int, nblocks: int) -> list[bytes]:
        r = self.h.request("hash-probe", PREFIXES[idx][: nblocks * BS])
        return list(r.block_hashes)

    def held(self) -> Counter[int]:
        held: Counter[int] = Counter()
        for rid in self.running:
            for group in self.mgr.get_block_ids(rid):
                for b in group:
                    if b != 0:
                        held[b] += 1
        return held

    def expire_pins(self) -> None:
        now = self.clock.t
        for b in [b for b, (_, deadline) in self.pins.items() if deadline < now]:
            del self.pins[b]

    def record_content(self, r: Request) -> None:
        tokens = r.all_token_ids
        for group in self.mgr.get_block_ids(r.request_id):
            for i, b in enumerate(group):
                if b != 0 and (i + 1) * BS <= r.num_computed_tokens:
                    self.content[b] = tuple(tokens[i * BS : (i + 1) * BS])

    def new_blocks(self, out: Any) -> None:
        """Blocks handed out fresh: whatever they held before the invalidation is gone."""
        for group in out.get_block_ids():
            for b in group:
                self.stale.pop(b, None)

    def admit(self, r: Request, use_hits: bool) -> None:
        if use_hits:
            hit, n = self.mgr.get_computed_blocks(r)
            assert n % BS == 0 and n < r.num_tokens
            keys = self.keys()
            for group in hit.get_block_ids():
                for i, b in enumerate(group):
                    if b == 0:
                        continue
                    assert self.live(keys, b) is not None, f"hit {b}, cached before invalidation"
                    assert self.content.get(b) == tuple(r.all_token_ids[i * BS : (i + 1) * BS])
        else:
            hit, n = None, 0
        held_before = set(self.held())
        out = self.mgr.allocate_slots(r, r.num_tokens - n, n, hit)
        if out is None:
            self.waiting.append(r)
            return
        for group in out.get_block_ids():
            for b in group:
                assert b != 0 and b not in held_before and b not in self.pins, b
        self.new_blocks(out)
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
        self.running[r.request_id] = r
        self.record_content(r)

    def release(self, rid: str, preempt: bool) -> None:
        r = self.running.pop(rid)
        self.mgr.free(r)
        if preempt:
            r.status = RequestStatus.PREEMPTED
            r.num_computed_tokens = 0
            r.num_preemptions += 1
            self.waiting.append(r)
        else:
            r.status = RequestStatus.FINISHED_STOPPED

    # -- the usual operations --------------------------------------------------------------

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        suffix=st.lists(st.integers(0, 3), max_size=40),
        priority=PRIORITIES,
        ttl=REQUEST_TTLS,
        use_hits=st.booleans(),
    )
    def admit_new(
        self,
        prefix: int,
        suffix: list[int],
        priority: int | None,
        ttl: float | None,
        use_hits: bool,
    ) -> None:
        self.next_id += 1
        prompt = PREFIXES[prefix] + suffix
        r = self.h.request(f"r{self.next_id}", prompt, priority=priority, ttl=ttl)
        self.admit(r, use_hits)

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        r = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        self.admit(r, True)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), k=st.integers(1, 24))
    def decode(self, data: st.DataObject, k: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        r = self.running[rid]
        if r.num_tokens + k > 250:
            self.release(rid, preempt=False)
            return
        r.append_output_token_ids([(r.num_tokens + j) % 5 for j in range(k)])
        out = self.mgr.allocate_slots(r, k)
        if out is None:
            self.release(rid, preempt=True)
            return
        for group in out.get_block_ids():
            assert not set(group) & set(self.pins), group
        self.new_blocks(out)
        r.num_computed_tokens += k
        self.record_content(r)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def decode_batch(self, data: st.DataObject) -> None:
        """A step's decode through allocate_slots_batch; who does not fit is preempted."""
        rids = data.draw(st.permutations(sorted(self.running)))
        reqs = [self.running[rid] for rid in rids if self.running[rid].num_tokens < 240]
        append_output_token_ids_batch(reqs, [r.num_tokens % 5 for r in reqs])
        got = self.mgr.allocate_slots_batch(reqs, [1] * len(reqs))
        assert len(got) <= len(reqs)
        for r, ids in zip(reqs, got, strict=False):
            for group in ids or ():
                assert not set(group) & set(self.pins), group
                for b in group:
                    self.stale.pop(b, None)
            r.num_computed_tokens += 1
            self.record_content(r)
        for r in reqs[len(got) :]:
            self.release(r.request_id, preempt=True)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        self.release(data.draw(st.sampled_from(sorted(self.running))), preempt)

    @rule(dt=st.sampled_from([1.0, 2.0, 5.0, 20.0]))
    def advance_clock(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule(ids=st.sets(st.integers(1, 63), max_size=4))
    def evict(self, ids: set[int]) -> None:
        ids = {b for b in ids if b < self.NUM_BLOCKS and b not in self.pins}
        self.mgr.evict_blocks(ids)

    @rule()
    def reset(self) -> None:
        self.expire_pins()
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.held())
        if ok:
            self.pins.clear()
            self.stale.clear()

    @rule()
    def step(self) -> None:
        self.mgr.take_new_block_ids()
        self.mgr.new_step_starts()

    # -- cache control ---------------------------------------------------------------------

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), nblocks=st.integers(1, 4), ttl=PIN_TTLS)
    def pin(self, prefix: int, nblocks: int, ttl: float | None) -> None:
        self.expire_pins()
        hashes = self.prefix_hashes(prefix, nblocks)
        keys = self.keys()
        new: set[int] = set()
        leading = []
        for g in self.groups:
            n = 0
            for hsh in hashes:
                c = self.copies(keys, self.key(hsh, g))
                if not c:
                    break
                new |= c
                n += 1
            leading.append(n)
        deadline = math.inf if ttl is None else self.clock.t + ttl
        if len(set(self.pins) | new) > self.bound:
            before = self.mgr.num_pinned_blocks
            try:
                self.mgr.pin_prefix(PREFIXES[prefix][: nblocks * BS], ttl_s=ttl)
            except InvalidArgumentError:
                assert self.mgr.num_pinned_blocks == before
                return
            raise AssertionError(f"pinned past the bound: {len(set(self.pins) | new)}")
        got = self.mgr.pin_prefix(PREFIXES[prefix][: nblocks * BS], ttl_s=ttl)
        assert got == leading[0]  # counted in the full-attention group (CC-5)
        for b in new:
            k = keys[b]
            assert k is not None
            self.pins[b] = (k, deadline)
        self.pinned_prefixes.add((prefix, nblocks))

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), nblocks=st.integers(1, 4))
    def unpin(self, prefix: int, nblocks: int) -> None:
        """Walks the leading hashes up to the first with no cached copy, releases every pin on
        their copies and counts the hashes that had one (CC-5)."""
        self.expire_pins()
        hashes = self.prefix_hashes(prefix, nblocks)
        keys = self.keys()
        released = []
        for g in self.groups:
            n = 0
            for hsh in hashes:
                copies = self.copies(keys, self.key(hsh, g))
                if not copies:
                    break
                pinned = copies & set(self.pins)
                for b in pinned:
                    del self.pins[b]
                n += bool(pinned)
            released.append(n)
        got = self.mgr.unpin_prefix(PREFIXES[prefix][: nblocks * BS])
        assert got == released[0]  # group 0 is full attention in every configuration

    @rule()
    def invalidate(self) -> None:
        self.mgr.invalidate_prefix_cache()
        keys = self.keys()
        self.stale = {b: k for b, k in enumerate(keys) if k is not None}
        self.pins.clear()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def events_keep_a_router(self) -> None:
        for e in self.mgr.take_events():
            if isinstance(e, AllBlocksCleared):
                self.known.clear()
                continue
            known = self.known.setdefault(e.group_idx or 0, set())
            for hsh in e.block_hashes:
                if isinstance(e, BlockStored):
                    assert not (self.EXACT and hsh in known), f"stored again: {hsh:#x}"
                    known.add(hsh)
                else:
                    assert isinstance(e, BlockRemoved)
                    assert not self.EXACT or hsh in known, f"removed, not stored: {hsh:#x}"
                    if self.EXACT:
                        known.discard(hsh)
        if self.EXACT:
            keys = self.keys()
            cached: dict[int, set[int]] = {}
            for b in range(1, self.NUM_BLOCKS):
                k = self.live(keys, b)
                if k is not None:
                    cached.setdefault(int.from_bytes(k[-4:], "big"), set()).add(ext(k[:-4]))
            view = {g: s for g, s in self.known.items() if s}
            assert view == cached

    @invariant()
    def nothing_pinned_is_evicted(self) -> None:
        self.expire_pins()
        assert self.mgr.num_pinned_blocks == len(self.pins)
        keys = self.keys()
        pinned = sorted(self.pins)
        refs = self.h.ref_cnts(pinned)
        free = set(self.h.free_ids())
        for b, n in zip(pinned, refs, strict=True):
            k, _ = self.pins[b]
            assert keys[b] == k, f"pinned block {b} lost its key"
            assert n > 0 and b not in free, b
        for idx, nblocks in self.pinned_prefixes:
            hashes = self.prefix_hashes(idx, nblocks)
            run = 0
            for hsh in hashes:
                if not all(
                    any(key == self.key(hsh, g) for key, _ in self.pins.values())
                    for g in self.groups
                ):
                    break
                run += 1
            if run:
                assert self.h.hits(PREFIXES[idx][: nblocks * BS]) >= run * BS, (idx, nblocks)

    @invariant()
    def pool_is_consistent(self) -> None:
        self.h.check()
        held = self.held()
        pinned = set(self.pins)
        used = set(held) | pinned
        assert self.h.num_free() == self.NUM_BLOCKS - 1 - len(used)
        free = set(self.h.free_ids())
        assert free.isdisjoint(used)
        ids = sorted(used)
        for b, n in zip(ids, self.h.ref_cnts(ids), strict=True):
            if b in pinned:
                assert n >= held[b] and n > 0, (b, n, held[b])
            else:
                assert n == held[b], (b, n, held[b])
        for rid in self.running:
            for group in self.mgr.get_block_ids(rid):
                real = [b for b in group if b != 0]
                assert len(real) == len(set(real)), (rid, group)


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

RetentionMachine.TestCase.settings = SETTINGS
test_single = RetentionMachine.TestCase


class ExactNativeMachine(RetentionMachine):
    EXACT = True


ExactNativeMachine.TestCase.settings = SETTINGS
test_native_exact_events = ExactNativeMachine.TestCase


class HybridMachine(RetentionMachine):
    PATH = "hybrid"
    NUM_BLOCKS = 40


HybridMachine.TestCase.settings = SETTINGS
test_hybrid = HybridMachine.TestCase


class ExactHybridMachine(HybridMachine):
    EXACT = True


ExactHybridMachine.TestCase.settings = SETTINGS
test_hybrid_exact_events = ExactHybridMachine.TestCase
