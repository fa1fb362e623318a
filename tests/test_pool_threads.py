"""Several Python threads share one ``kvcore.BlockPool``.

Each thread plays a stream of requests: it looks up its prefix, touches the hits, allocates the
rest, caches the full blocks (with events on, which calls back into Python for the token ids
and extra keys, so the GIL can switch threads in the middle of a call), and frees its blocks
in reverse order. The switch interval is made tiny to force interleavings. At the end every
block must be back in the free queue with a zero count, nothing leaked, the invariants hold
and the prefix cache can be reset.

The pool reads everything it needs from Python (the request's hashes, token ids and extra keys)
before it takes hold of its state, and runs no Python code while holding it, so a thread
switch in the middle of a call can never make another thread's call fail. The test counts any
``RuntimeError("Already [mutably] borrowed")`` as a refusal and requires none.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from pool_helpers import LoRARequest, PoolRequest, tiny_switch_interval

from kvcore import BlockPool, NoFreeBlocksError

T = TypeVar("T")

NUM_THREADS = 6
ROUNDS = 150


class Worker:
    def __init__(self, pool: BlockPool, seed: int, stems: list[list[int]], bs: int) -> None:
        self.pool = pool
        self.rng = random.Random(seed)
        self.stems = stems
        self.bs = bs
        self.refusals = 0
        self.allocated = 0
        self.hits = 0
        self.errors: list[BaseException] = []

    def call(self, fn: Callable[[], T]) -> T:
        """Runs ``fn``, retrying while the pool is busy in another thread."""
        while True:
            try:
                return fn()
            except RuntimeError as e:
                if str(e) not in ("Already borrowed", "Already mutably borrowed"):
                    raise
                self.refusals += 1

    def one_request(self) -> None:
        rng, pool, bs = self.rng, self.pool, self.bs
        tokens = list(rng.choice(self.stems)) + [
            rng.randrange(1000) for _ in range(rng.randrange(40))
        ]
        lora = LoRARequest("lora", 1) if rng.random() < 0.3 else None
        req = PoolRequest(tokens, hash_block_size=bs, lora_request=lora, salt=b"l" if lora else b"")
        max_hit = max(len(tokens) - 1, 0) // bs
        hit = self.call(lambda: pool.longest_cached_prefix(req.block_hashes, max_hit, [0]))[0]
        self.call(lambda: pool.touch(hit))
        self.hits += len(hit)
        need = -(-len(tokens) // bs) - len(hit)
        try:
            new = self.call(lambda: pool.get_new_blocks(need))
        except NoFreeBlocksError:
            self.call(lambda: pool.free_blocks(hit[::-1]))
            return
        self.allocated += len(new)
        blocks = hit + new
        num_full = len(tokens) // bs
        self.call(lambda: pool.cache_full_blocks(req, blocks, len(hit), num_full, bs, 0))
        if rng.random() < 0.2:
            self.call(lambda: pool.evict_blocks([rng.randrange(pool.num_gpu_blocks)]))
        if rng.random() < 0.3:
            self.call(pool.take_events)
        self.call(lambda: pool.free_blocks(blocks[::-1]))

    def run(self) -> None:
        try:
            for _ in range(ROUNDS):
                self.one_request()
        except BaseException as e:  # reported by the main thread
            self.errors.append(e)


@pytest.mark.parametrize("events", [True, False])
def test_threads_share_one_pool(events: bool) -> None:
    bs = 8
    pool = BlockPool(64, True, bs, events)
    stem_rng = random.Random(7)
    stems = [[stem_rng.randrange(1000) for _ in range(stem_rng.randrange(0, 48))] for _ in range(4)]
    workers = [Worker(pool, seed, stems, bs) for seed in range(NUM_THREADS)]
    threads = [threading.Thread(target=w.run) for w in workers]
    with tiny_switch_interval():
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
    assert not any(t.is_alive() for t in threads)
    errors: list[Any] = [e for w in workers for e in w.errors]
    assert errors == []
    assert sum(w.refusals for w in workers) == 0
    assert sum(w.allocated for w in workers) > NUM_THREADS * ROUNDS
    assert sum(w.hits for w in workers) > 0
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 63
    assert sorted(pool.get_all_free_block_ids()) == list(range(1, 64))
    assert pool.get_ref_cnts(range(64)) == [0] * 64
    events_left = pool.take_events()
    assert (events_left != []) == events or not events_left
    assert pool.reset_prefix_cache() is True
    assert pool.get_block_hashes(range(64)) == [None] * 64


def test_reentrant_call_from_a_request_callback_is_served() -> None:
    """The pool reads everything it needs from the request before it takes its lock, so a
    request property that calls back into the pool mid-call is served normally, and the outer
    call still completes with the pool consistent."""
    pool = BlockPool(8, True, 4, True)
    seen: list[BaseException] = []

    class Reentrant(PoolRequest):
        @property
        def all_token_ids(self) -> list[int]:
            try:
                pool.touch([5])
            except RuntimeError as e:
                seen.append(e)
            return self.token_ids

    req = Reentrant(list(range(8)), hash_block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    assert seen == []
    assert pool.get_ref_cnts([5]) == [1]
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [blocks[1]]
    assert len(pool.take_events()) == 1
    pool.check_invariants()
