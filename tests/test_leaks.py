"""Leak check: a million mixed pool and manager operations leave the resident set flat.

One process runs rounds of a fixed mix over a ``kvcore.BlockPool`` and a
``kvcore.KVCacheManager`` (one full-attention group, then full + sliding window): allocation
with eviction, caching with events, lookups, touches, frees, evictions and resets on the pool;
request creation and hashing, prefix lookups, admissions with hits, decode steps with
appended tokens (a few of them bools, kept as objects by the token buffer), finishes and
preemptions on the manager; and, in every round, calls that are refused (too many blocks,
ids outside the pool, bad arguments), so that error paths are exercised as often as the others.
A batch call counts once per block it handles (``get_new_blocks(8)`` is 8 operations).

After a warm-up (a tenth of the operations), the resident set size (``/proc/self/statm``) is
measured; after the rest it must not have grown by more than :data:`MAX_GROWTH` bytes. The
bound is on memory, not time.
"""

from __future__ import annotations

import gc
import os
import random
from typing import Any, cast

import pytest
from pool_helpers import PoolRequest

import kvcore
from kvcore import hashing
from kvcore.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.manager import KVCacheManager
from kvcore.specs import FullAttentionSpec, SlidingWindowSpec

TOTAL_OPS = 1_000_000
WARMUP_OPS = TOTAL_OPS // 10
MAX_GROWTH = 4 * 1024 * 1024
"""Allowed RSS growth after the warm-up: far below what a per-operation leak of even a few
bytes would cost over 900k operations, above allocator and interpreter noise."""

STATM = "/proc/self/statm"


def rss_bytes() -> int:
    """The current resident set size."""
    with open(STATM) as f:
        resident = int(f.read().split()[1])
    return resident * os.sysconf("SC_PAGE_SIZE")


class Workload:
    """The operation mix; :meth:`round` runs one round and returns its operation count."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        hbs = 4
        self.hbs = hbs
        self.pool = kvcore.BlockPool(64, True, hbs, True)
        self.requests = [
            PoolRequest([self.rng.randrange(8) for _ in range(40)], hash_block_size=hbs)
            for _ in range(8)
        ]
        spec = FullAttentionSpec(block_size=hbs, num_kv_heads=1, head_size=8, dtype="float16")
        swa = SlidingWindowSpec(
            block_size=hbs, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=16
        )
        hashing.init_none_hash(hashing.sha256)
        self.hasher = hashing.get_request_block_hasher(hbs, hashing.sha256)
        self.managers: list[KVCacheManager] = []
        for groups in ([spec], [spec, swa]):
            cfg = KVCacheConfig(
                96, [], [KVCacheGroupSpec([f"l{i}"], g) for i, g in enumerate(groups)]
            )
            self.managers.append(
                KVCacheManager(
                    cfg,
                    max_model_len=128,
                    scheduler_block_size=hbs,
                    hash_block_size=hbs,
                    enable_kv_cache_events=True,
                    log_stats=True,
                )
            )
        self.prefixes = [[self.rng.randrange(50) for _ in range(24)] for _ in range(3)]
        self.next_id = 0

    # -- pool --------------------------------------------------------------------------------

    def pool_round(self) -> int:
        pool, rng, ops = self.pool, self.rng, 0
        held: list[list[int]] = []
        for req in self.requests:
            n = rng.randrange(1, 9)
            if n > pool.get_num_free_blocks():
                break
            blocks = pool.get_new_blocks(n)
            ops += n
            full = min(n, len(req.block_hashes))
            pool.cache_full_blocks(req, blocks, 0, full, self.hbs, rng.randrange(2))
            ops += 1
            held.append(blocks)
        for req in self.requests:
            for h in req.block_hashes[:4]:
                pool.get_cached_block(h, [0, 1])
                ops += 1
        touched = [b for blocks in held[:2] for b in blocks]
        pool.touch(touched)
        pool.free_blocks(touched[::-1])
        ops += 2 * len(touched)
        for blocks in held:
            pool.free_blocks(blocks[::-1])
            ops += len(blocks)
        pool.evict_blocks({rng.randrange(64) for _ in range(4)})
        ops += 4
        ops += self.refusals()
        pool.take_events()
        if rng.random() < 0.2:
            pool.reset_prefix_cache()
            pool.take_events()
            ops += 1
        ops += 3
        return ops

    def refusals(self) -> int:
        """Calls the pool refuses, with every kind of argument error."""
        pool = self.pool
        calls: list[Any] = [
            lambda: pool.get_new_blocks(10**30),
            lambda: pool.get_new_blocks(-1),
            lambda: pool.get_new_blocks(cast(int, 1.5)),
            lambda: pool.touch([2**63]),
            lambda: pool.free_blocks([0, 64]),
            lambda: pool.evict_blocks([1, -1]),
            lambda: pool.get_cached_block(b"\x00" * 32, [2**32]),
            lambda: pool.cache_full_blocks(self.requests[0], [1], 0, 1, 3, 0),
        ]
        for call in calls:
            with pytest.raises(kvcore.KvcoreError):
                call()
        return len(calls)

    # -- manager -----------------------------------------------------------------------------

    def request(self) -> kvcore.Request:
        rng = self.rng
        self.next_id += 1
        prompt = list(rng.choice(self.prefixes)) + [
            rng.randrange(50) for _ in range(rng.randrange(1, 12))
        ]
        return kvcore.Request(f"r{self.next_id}", prompt, max_tokens=8, block_hasher=self.hasher)

    def manager_round(self, m: KVCacheManager) -> int:
        rng, ops = self.rng, 0
        running: list[kvcore.Request] = []
        for _ in range(6):
            r = self.request()
            ops += 1
            hits, n = m.get_computed_blocks(r)
            ops += 1
            out = m.allocate_slots(r, r.num_tokens - n, n, hits)
            ops += 1
            if out is None:
                continue
            r.num_computed_tokens = r.num_tokens
            running.append(r)
        for _ in range(8):
            for r in running:
                r.append_output_token_ids(True if rng.random() < 0.05 else rng.randrange(50))
                ops += 1
                if m.allocate_slots(r, 1) is not None:
                    r.num_computed_tokens = r.num_tokens
                ops += 1
            m.take_events()
            m.take_new_block_ids()
            m.make_prefix_cache_stats()
            ops += 3
        for r in running[:2]:
            with pytest.raises(kvcore.KvcoreError):
                m.allocate_slots(r, -1)
            with pytest.raises(kvcore.KvcoreError):
                m.allocate_slots(r, 1, num_lookahead_tokens=cast(int, 1.5))
            ops += 2
        if running:
            m.get_num_common_prefix_blocks(running[0].request_id)
            ops += 1
        for r in running:
            if rng.random() < 0.3:
                m.block_pool.free_blocks(m.pop_blocks_for_free(r)[::-1])
            else:
                m.free(r)
            ops += 1
        m.take_events()
        if rng.random() < 0.1:
            m.reset_prefix_cache()
            m.take_events()
            ops += 1
        return ops

    def round(self) -> int:
        return self.pool_round() + sum(self.manager_round(m) for m in self.managers)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(STATM), reason="needs /proc/self/statm (Linux)")
def test_a_million_operations_keep_rss_flat() -> None:
    """RSS after 10^6 mixed operations is within MAX_GROWTH of RSS after the warm-up."""
    work = Workload(0)
    done = 0
    while done < WARMUP_OPS:
        done += work.round()
    gc.collect()
    base = rss_bytes()
    peak_growth = 0
    while done < TOTAL_OPS:
        for _ in range(50):
            done += work.round()
        gc.collect()
        peak_growth = max(peak_growth, rss_bytes() - base)
    for m in work.managers:
        m.block_pool.check_invariants()
    work.pool.check_invariants()
    assert done >= TOTAL_OPS
    assert peak_growth < MAX_GROWTH, (
        f"RSS grew by {peak_growth / 2**20:.1f} MiB over {done - WARMUP_OPS} operations "
        f"after the warm-up (limit {MAX_GROWTH / 2**20:.0f} MiB)"
    )
