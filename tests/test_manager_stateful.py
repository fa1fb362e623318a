"""Model-based test of KVCacheManager: random admissions, decodes, preemptions and frees.

A trivially correct model tracks which tokens every block holds and which live request holds
which blocks. After every step the pool's own invariants hold, every non-null block is either
free or held, reference counts equal the number of holders, no block is held twice by one
request, and every prefix hit holds exactly the tokens of the request that hits it
(MAP-1/2, POOL-2/5/9/10, STM-2..8, ALLOC-*, MGR-7/20).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import cbor2
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from kvcore.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.manager import KVCacheManager
from kvcore.request import Request, RequestStatus, append_output_token_ids_batch
from kvcore.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

BS = 16
NONE_HASH = hashlib.sha256(cbor2.dumps("0")).digest()
ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 64, "dtype": "float16"}
PREFIXES = [list(range(1, 49)), list(range(1, 33)) + [7] * 16, [5] * 40, list(range(200, 264))]


def hasher(req: Any) -> list[bytes]:
    start = len(req.block_hashes) * BS
    parent = req.block_hashes[-1] if req.block_hashes else NONE_HASH
    out: list[bytes] = []
    while start + BS <= req.num_tokens:
        payload = (parent, tuple(req.all_token_ids[start : start + BS]), None)
        parent = hashlib.sha256(cbor2.dumps(payload)).digest()
        out.append(parent)
        start += BS
    return out


class ManagerMachine(RuleBasedStateMachine):
    """Drives one manager; subclasses choose the groups."""

    SPECS: tuple[KVCacheSpec, ...] = (FullAttentionSpec(block_size=BS, **ATTN),)
    NUM_BLOCKS = 24

    def __init__(self) -> None:
        super().__init__()
        groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(self.SPECS)]
        self.mgr = self._build(groups)
        self.pool: Any = self.mgr.block_pool
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.content: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def _build(self, groups: list[KVCacheGroupSpec]) -> KVCacheManager:
        return KVCacheManager(
            KVCacheConfig(self.NUM_BLOCKS, [], groups),
            max_model_len=256,
            scheduler_block_size=BS,
            hash_block_size=BS,
            max_num_batched_tokens=128,
            enable_kv_cache_events=True,
        )

    # -- model helpers ---------------------------------------------------------------------

    def _record_content(self, r: Request) -> None:
        """Blocks fully covered by computed tokens now hold those tokens."""
        tokens = r.all_token_ids
        for group in self.mgr.get_block_ids(r.request_id):
            for i, b in enumerate(group):
                if b == 0 or (i + 1) * BS > r.num_computed_tokens:
                    continue
                self.content[b] = tuple(tokens[i * BS : (i + 1) * BS])

    def _held(self) -> Counter[int]:
        held: Counter[int] = Counter()
        for rid in self.running:
            for group in self.mgr.get_block_ids(rid):
                for b in group:
                    if b != 0:
                        held[b] += 1
        return held

    def _admit(self, r: Request) -> None:
        hit, n = self.mgr.get_computed_blocks(r)
        assert n % BS == 0 and n < r.num_tokens
        for group in hit.get_block_ids():
            for i, b in enumerate(group):
                if b != 0:
                    want = tuple(r.all_token_ids[i * BS : (i + 1) * BS])
                    assert self.content.get(b) == want, (b, i)
        free_before = self.pool.get_num_free_blocks()
        held_before = set(self._held())
        out = self.mgr.allocate_slots(r, r.num_tokens - n, n, hit)
        if out is None:
            assert r.request_id not in self.running
            # A failed allocation may only have freed skipped blocks (ALLOC-6).
            assert self.pool.get_num_free_blocks() >= free_before
            self.waiting.append(r)
            return
        for group in out.get_block_ids():
            for b in group:
                assert b != 0 and b not in held_before, b
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
        self.running[r.request_id] = r
        self._record_content(r)

    # -- rules ------------------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=40))
    def admit_new(self, prefix: list[int], suffix: list[int]) -> None:
        self.next_id += 1
        r = Request(f"r{self.next_id}", prefix + suffix, block_hasher=hasher)
        self._admit(r)

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        r = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        self._admit(r)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), k=st.integers(1, 20))
    def decode(self, data: st.DataObject, k: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        r = self.running[rid]
        if r.num_tokens + k > 250:
            self._finish(rid)
            return
        r.append_output_token_ids([(r.num_tokens + j) % 5 for j in range(k)])
        out = self.mgr.allocate_slots(r, k)
        if out is None:
            self._preempt(rid)
            return
        r.num_computed_tokens += k
        self._record_content(r)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def decode_batch(self, data: st.DataObject) -> None:
        """A step's decode through the batch calls; the request that does not fit is preempted."""
        rids = data.draw(st.permutations(sorted(self.running)))
        reqs = [self.running[rid] for rid in rids if self.running[rid].num_tokens < 240]
        append_output_token_ids_batch(reqs, [r.num_tokens % 5 for r in reqs])
        got = self.mgr.allocate_slots_batch(reqs, [1] * len(reqs))
        assert len(got) <= len(reqs)
        for r in reqs[: len(got)]:
            r.num_computed_tokens += 1
            self._record_content(r)
        for r in reqs[len(got) :]:
            self._preempt(r.request_id)

    def _preempt(self, rid: str) -> None:
        r = self.running.pop(rid)
        self.mgr.free(r)
        r.status = RequestStatus.PREEMPTED
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.waiting.append(r)

    def _finish(self, rid: str) -> None:
        r = self.running.pop(rid)
        self.mgr.free(r)
        r.status = RequestStatus.FINISHED_STOPPED

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._preempt(data.draw(st.sampled_from(sorted(self.running))))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(data.draw(st.sampled_from(sorted(self.running))))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def pop_and_free_later(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        r = self.running.pop(rid)
        blocks = self.mgr.pop_blocks_for_free(r)
        self.pool.free_blocks(blocks[::-1])

    @rule(ids=st.sets(st.integers(1, NUM_BLOCKS - 1), max_size=4))
    def evict(self, ids: set[int]) -> None:
        self.mgr.evict_blocks(ids)

    @rule()
    def reset(self) -> None:
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self._held())

    @rule()
    def step(self) -> None:
        self.mgr.take_events()
        self.mgr.take_new_block_ids()
        self.mgr.new_step_starts()

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check_invariants()
        held = self._held()
        total = self.pool.num_gpu_blocks - 1
        assert self.pool.get_num_free_blocks() + len(held) == total
        free = set(self.pool.get_all_free_block_ids())
        assert free.isdisjoint(held)
        ids = sorted(held)
        assert list(self.pool.get_ref_cnts(ids)) == [held[b] for b in ids]
        for rid in self.running:
            for group in self.mgr.get_block_ids(rid):
                real = [b for b in group if b != 0]
                assert len(real) == len(set(real)), (rid, group)


ManagerMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_full_attention_manager = ManagerMachine.TestCase


class HybridMachine(ManagerMachine):
    """Full attention plus a sliding window (blocks leave the window and are freed)."""

    SPECS = (
        FullAttentionSpec(block_size=BS, **ATTN),
        SlidingWindowSpec(block_size=BS, sliding_window=32, **ATTN),
    )
    NUM_BLOCKS = 40


HybridMachine.TestCase.settings = ManagerMachine.TestCase.settings
test_hybrid_manager = HybridMachine.TestCase
