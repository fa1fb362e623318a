"""Model-based test of ``kvcore.BlockPool``: random operation sequences (hypothesis stateful)
against a trivially correct pure-Python model of SPEC §2–4.

The model keeps the free queue as a list, reference counts in a list, the prefix-cache index as
a dict of key -> list of blocks in insertion order, primary keys and alias keys per block, and
the events it expects. After every step the machine compares the free list order, every
reference count, every primary key and its token count, the lookup of every key ever stored,
the drained events, and runs ``check_invariants()``.

Rejected calls (too many blocks, double frees, promotions that are not promotions) are part of
the sequences: the model predicts the exception and that nothing changed.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pool_helpers import PoolRequest, event_fields, ext

from kvcore import BlockPool, DoubleFreeError, InvalidArgumentError, NoFreeBlocksError
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored

HBS = 2
NUM_GROUPS = 2


class Unordered:
    """A run of events whose order the SPEC leaves open (alias removals, POOL-6)."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events


class PoolModel:
    """A direct transcription of SPEC §2–4 over plain lists and dicts."""

    def __init__(self, n: int, caching: bool, hbs: int, events: bool) -> None:
        self.n = n
        self.caching = caching
        self.hbs = hbs
        self.events_on = events
        self.queue = list(range(1, n))
        self.ref = [0] * n
        self.primary: dict[int, tuple[bytes, int]] = {}
        self.aliases: dict[int, list[bytes]] = {}
        self.index: dict[bytes, list[int]] = {}
        self.events: list[Any] = []
        self.seen_keys: set[bytes] = set()

    # -- index (MAP-*)
    def _insert(self, key: bytes, blk: int, num_tokens: int) -> None:
        """POOL-31."""
        if self.primary.get(blk, (None, 0))[0] == key or blk in self.index.get(key, []):
            return
        if blk in self.primary:
            self.aliases.setdefault(blk, []).append(key)
        else:
            self.primary[blk] = (key, num_tokens)
        self.index.setdefault(key, []).append(blk)
        self.seen_keys.add(key)

    def _pop(self, key: bytes, blk: int) -> bool:
        """MAP-4."""
        blocks = self.index.get(key)
        if blocks is None or blk not in blocks:
            return False
        blocks.remove(blk)
        if not blocks:
            del self.index[key]
        return True

    def _remove_keys(self, blk: int) -> None:
        """POOL-6: primary first, then aliases (in an unspecified order)."""
        primary = self.primary.pop(blk, None)
        aliases = self.aliases.pop(blk, [])
        if primary is not None and self._pop(primary[0], blk) and self.events_on:
            self.events.append(_removed(primary[0]))
        gone = [_removed(k) for k in aliases if self._pop(k, blk)]
        if gone and self.events_on:
            self.events.append(Unordered(gone))

    # -- operations
    def get_new_blocks(self, n: int) -> list[int]:
        if n > len(self.queue):
            raise NoFreeBlocksError
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            if self.caching:
                self._remove_keys(b)
            self.ref[b] = 1
        return out

    def touch(self, ids: list[int]) -> None:
        for b in ids:
            if self.ref[b] == 0 and b != 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def free_blocks(self, ids: list[int]) -> None:
        counts: dict[int, int] = {}
        for b in ids:
            counts[b] = counts.get(b, 0) + 1
            if b != 0 and counts[b] > self.ref[b]:
                raise DoubleFreeError
        unhashed: list[int] = []
        hashed: list[int] = []
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0 and b != 0:
                (hashed if b in self.primary else unhashed).append(b)
        self.queue = unhashed + self.queue + hashed

    def cache_full_blocks(
        self,
        req: PoolRequest,
        blocks: list[int],
        num_cached: int,
        num_full: int,
        bs: int,
        gid: int,
        mask: list[bool] | None,
    ) -> None:
        if num_cached >= num_full:
            return
        new = blocks[num_cached:num_full]
        k = bs // self.hbs
        fine = req.block_hashes
        view = [fine[(i + 1) * k - 1] for i in range(len(fine) // k)]
        assert len(view) >= num_full and (mask is None or len(mask) == len(new))
        todo = []
        for i, blk in enumerate(new):
            if blk == 0 or (mask is not None and not mask[i]):
                continue
            covered = (num_cached + i + 1) * bs
            if blk in self.primary and self.primary[blk][1] >= covered:
                raise InvalidArgumentError
            todo.append((i, blk, covered))
        stored = []
        for i, blk, covered in todo:
            if blk in self.primary:
                self._remove_keys(blk)
            self._insert(view[num_cached + i] + gid.to_bytes(4, "big"), blk, covered)
            stored.append(view[num_cached + i])
        if self.events_on:
            parent = ext(view[num_cached - 1]) if num_cached else None
            self.events.append(
                BlockStored(
                    block_hashes=[ext(h) for h in stored],
                    parent_block_hash=parent,
                    token_ids=req.all_token_ids[num_cached * bs : num_full * bs],
                    block_size=bs,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None] * len(stored) or None,
                    group_idx=gid,
                )
            )

    def cache_partial_block(
        self, req: PoolRequest, blk: int, num_tokens: int, gid: int, bs: int
    ) -> bytes | None:
        if blk == 0:
            return None
        m = num_tokens // self.hbs
        h = req.block_hashes[m - 1]
        key = h + gid.to_bytes(4, "big")
        already = self.primary.get(blk, (None, 0))[0] == key or blk in self.index.get(key, [])
        if not already and blk in self.primary and self.primary[blk][1] < num_tokens:
            self._remove_keys(blk)
        self._insert(key, blk, num_tokens)
        if self.events_on and not already:
            start = (m - 1) * self.hbs
            self.events.append(
                BlockStored(
                    block_hashes=[ext(h)],
                    parent_block_hash=ext(req.block_hashes[m - 2]) if m > 1 else None,
                    token_ids=req.all_token_ids[start:num_tokens],
                    block_size=num_tokens - start,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None],
                    group_idx=gid,
                )
            )
        return key

    def evict_blocks(self, ids: list[int]) -> None:
        for b in ids:
            self._remove_keys(b)

    def reset_prefix_cache(self) -> bool:
        if self.n - len(self.queue) != 1:
            return False
        self.index.clear()
        self.primary.clear()
        self.aliases.clear()
        if self.events_on:
            self.events.append(AllBlocksCleared())
        return True

    def usage(self) -> float:
        return 0 if self.n == 1 else 1.0 - len(self.queue) / (self.n - 1)


def _removed(key: bytes) -> BlockRemoved:
    return BlockRemoved([ext(key[:-4])], "GPU", int.from_bytes(key[-4:], "big"))


def assert_events_match(actual: list[Any], expected: list[Any]) -> None:
    pos = 0
    for e in expected:
        if isinstance(e, Unordered):
            got = actual[pos : pos + len(e.events)]
            assert sorted(map(repr, got)) == sorted(map(repr, e.events))
            pos += len(e.events)
        else:
            assert pos < len(actual), ("missing event", e)
            assert event_fields(actual[pos]) == event_fields(e)
            pos += 1
    assert pos == len(actual), ("unexpected events", actual[pos:])


tokens = st.lists(st.integers(0, 2), min_size=0, max_size=14)


class PoolMachine(RuleBasedStateMachine):
    """Drives a kvcore pool and the model with the same calls."""

    pool: BlockPool
    model: PoolModel
    requests: list[PoolRequest]
    held: list[int]

    @initialize(
        n=st.integers(1, 12),
        caching=st.booleans(),
        events=st.booleans(),
        prompts=st.lists(tokens, min_size=1, max_size=4),
    )
    def init(self, n: int, caching: bool, events: bool, prompts: list[list[int]]) -> None:
        self.pool = BlockPool(n, caching, HBS, events)
        self.model = PoolModel(n, caching, HBS, events)
        self.requests = [PoolRequest(p, hash_block_size=HBS) for p in prompts]
        self.held = []  # one entry per reference taken (get_new_blocks or touch)

    @rule(data=st.data())
    def get_new_blocks(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, self.model.n))
        try:
            expected = self.model.get_new_blocks(n)
        except NoFreeBlocksError:
            try:
                self.pool.get_new_blocks(n)
            except NoFreeBlocksError:
                return
            raise AssertionError("kvcore did not reject get_new_blocks") from None
        assert self.pool.get_new_blocks(n) == expected
        self.held.extend(expected)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.integers(0, self.model.n - 1), max_size=4))
        self.model.touch(ids)
        self.pool.touch(ids)
        self.held.extend(ids)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def free_held(self, data: st.DataObject) -> None:
        order = data.draw(st.permutations(range(len(self.held))))
        k = data.draw(st.integers(1, len(self.held)))
        picked = sorted(order[:k])
        ids = [self.held[i] for i in picked]
        if data.draw(st.booleans()):
            ids.reverse()
        self.model.free_blocks(ids)
        self.pool.free_blocks(ids)
        for i in reversed(picked):
            del self.held[i]

    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        """Free more references than are held: rejected, nothing changes."""
        b = data.draw(st.integers(1, self.model.n - 1)) if self.model.n > 1 else 0
        ids = [b] * (self.model.ref[b] + 1)
        if b == 0:
            self.model.free_blocks(ids)
            self.pool.free_blocks(ids)
            return
        try:
            self.model.free_blocks(ids)
        except DoubleFreeError:
            pass
        else:
            raise AssertionError("model accepted a double free")
        try:
            self.pool.free_blocks(ids)
        except DoubleFreeError:
            return
        raise AssertionError("kvcore accepted a double free")

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.requests))
        k = data.draw(st.sampled_from([1, 2]))
        bs = HBS * k
        view_len = len(req.block_hashes) // k
        num_full = data.draw(st.integers(0, view_len))
        num_cached = data.draw(st.integers(0, max(num_full, 0)))
        pool_ids = [*sorted(set(self.held)), 0]
        blocks = data.draw(
            st.lists(st.sampled_from(pool_ids), min_size=num_full, max_size=num_full)
        )
        mask = data.draw(
            st.none()
            | st.lists(
                st.booleans(), min_size=num_full - num_cached, max_size=num_full - num_cached
            )
        )
        gid = data.draw(st.integers(0, NUM_GROUPS - 1))
        try:
            self.model.cache_full_blocks(req, blocks, num_cached, num_full, bs, gid, mask)
        except InvalidArgumentError:
            try:
                self.pool.cache_full_blocks(req, blocks, num_cached, num_full, bs, gid, mask)
            except InvalidArgumentError:
                return
            raise AssertionError("kvcore accepted a non-promotion") from None
        self.pool.cache_full_blocks(req, blocks, num_cached, num_full, bs, gid, mask)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def cache_partial_block(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.requests))
        num_hashes = len(req.block_hashes)
        if num_hashes == 0:
            return
        k = data.draw(st.sampled_from([2, 3]))
        bs = HBS * k
        choices = [m * HBS for m in range(1, num_hashes + 1) if (m * HBS) % bs]
        if not choices:
            return
        num_tokens = data.draw(st.sampled_from(choices))
        blk = data.draw(st.sampled_from([*sorted(set(self.held)), 0]))
        gid = data.draw(st.integers(0, NUM_GROUPS - 1))
        expected = self.model.cache_partial_block(req, blk, num_tokens, gid, bs)
        assert self.pool.cache_partial_block(req, blk, num_tokens, gid, bs) == expected

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.integers(0, self.model.n - 1), max_size=3, unique=True))
        self.model.evict_blocks(ids)
        self.pool.evict_blocks(ids)

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.pool.reset_prefix_cache() == self.model.reset_prefix_cache()

    @invariant()
    def same_state(self) -> None:
        pool, model = self.pool, self.model
        pool.check_invariants()
        assert pool.get_all_free_block_ids() == model.queue
        assert pool.get_num_free_blocks() == len(model.queue)
        assert pool.get_usage() == model.usage()
        ids = range(model.n)
        assert pool.get_ref_cnts(ids) == model.ref
        assert pool.get_block_hashes(ids) == [
            model.primary[b][0] if b in model.primary else None for b in ids
        ]
        assert [pool.blocks[b].block_hash_num_tokens for b in ids] == [
            model.primary[b][1] if b in model.primary else None for b in ids
        ]
        for key in model.seen_keys:
            found = pool.get_cached_block(key[:-4], [int.from_bytes(key[-4:], "big")])
            blocks = model.index.get(key)
            assert found == ([blocks[0]] if blocks else None), key.hex()
        for req in self.requests:
            for gids in ([0], [0, 1]):
                hit = pool.longest_cached_prefix(req.block_hashes, 100, gids)
                loop: list[list[int]] = [[] for _ in gids]
                for h in req.block_hashes:
                    keys = [h + g.to_bytes(4, "big") for g in gids]
                    if not all(model.index.get(k) for k in keys):
                        break
                    for out, k in zip(loop, keys, strict=True):
                        out.append(model.index[k][0])
                assert hit == loop
        assert_events_match(pool.take_events(), model.events)
        model.events.clear()


PoolMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolMachine = PoolMachine.TestCase
