"""Many threads share one ``KVCacheManager`` and one pool; a request's properties re-enter it.

Eight threads each play their own stream of requests against one manager (prefix lookups,
admissions, decode steps, frees, with events on and, in one thread, event draining), while a
busy-loop process keeps the CPU loaded and the interpreter switches threads as often as it can.
No call may fail spuriously (no ``RuntimeError("Already borrowed")``, no ``NoFreeBlocksError``
or invariant error from a race between a capacity check and its allocation), and at the end
every block is back in the free queue and the invariants hold. One full-attention group and a
hybrid configuration (full + sliding window) are covered.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from pool_helpers import tiny_switch_interval

from kvcore import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    PrefixCacheStats,
    Request,
    SlidingWindowSpec,
)
from kvcore.hashing import get_request_block_hasher, init_none_hash, sha256

ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
NUM_THREADS = 8
REQUESTS_PER_THREAD = 150


def _spin() -> None:  # pragma: no cover - runs in the busy-loop process
    while True:
        pass


@contextmanager
def busy_cpu_and_tiny_switch_interval() -> Iterator[None]:
    """A busy-loop process beside the test, and thread switches as often as possible."""
    spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        with tiny_switch_interval():
            yield
    finally:
        spinner.terminate()
        spinner.join()


def make_manager(hybrid: bool) -> KVCacheManager:
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=4, **ATTN))]
    if hybrid:
        groups.append(
            KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=4, sliding_window=16, **ATTN))
        )
    return KVCacheManager(
        KVCacheConfig(72 if hybrid else 40, [], groups),
        max_model_len=512,
        scheduler_block_size=4,
        hash_block_size=4,
        enable_kv_cache_events=True,
    )


class Worker:
    def __init__(self, mgr: KVCacheManager, seed: int, stems: list[list[int]]) -> None:
        self.mgr = mgr
        self.rng = random.Random(seed)
        self.seed = seed
        self.stems = stems
        self.hasher = get_request_block_hasher(4, sha256)
        self.errors: list[BaseException] = []
        self.admitted = 0
        self.refused = 0

    def admit(self, i: int) -> Request | None:
        rng, mgr = self.rng, self.mgr
        prompt = list(rng.choice(self.stems)) + [
            rng.randrange(1000) for _ in range(rng.randrange(1, 30))
        ]
        req = Request(f"t{self.seed}-{i}", prompt, block_hasher=self.hasher)
        hits, n = mgr.get_computed_blocks(req)
        if mgr.allocate_slots(req, len(prompt) - n, n, hits) is None:
            self.refused += 1
            return None
        self.admitted += 1
        req.num_computed_tokens = len(prompt)
        return req

    def step(self, live: list[Request]) -> None:
        """One decode step for each live request; a request that does not fit is freed."""
        for req in list(live):
            req.append_output_token_ids(self.rng.randrange(1000))
            if self.mgr.allocate_slots(req, 1) is None:
                self.refused += 1
                self.mgr.free(req)
                live.remove(req)
            else:
                req.num_computed_tokens += 1

    def run(self, start: threading.Barrier) -> None:
        live: list[Request] = []
        try:
            start.wait()
            for i in range(REQUESTS_PER_THREAD):
                req = self.admit(i)
                if req is not None:
                    live.append(req)
                self.step(live)
                if len(live) > 3 or (live and self.rng.random() < 0.3):
                    self.mgr.free(live.pop(self.rng.randrange(len(live))))
                if self.seed == 0:
                    self.mgr.take_events()
            for req in live:
                self.mgr.free(req)
        except BaseException as e:  # reported by the main thread
            self.errors.append(e)


@pytest.mark.parametrize("hybrid", [False, True], ids=["single", "hybrid"])
def test_threads_share_one_manager(hybrid: bool) -> None:
    init_none_hash(sha256)
    mgr = make_manager(hybrid)
    stem_rng = random.Random(3)
    stems = [[stem_rng.randrange(1000) for _ in range(stem_rng.randrange(0, 40))] for _ in range(5)]
    workers = [Worker(mgr, seed, stems) for seed in range(NUM_THREADS)]
    start = threading.Barrier(NUM_THREADS)
    threads = [threading.Thread(target=w.run, args=(start,)) for w in workers]
    with busy_cpu_and_tiny_switch_interval():
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    errors = [e for w in workers for e in w.errors]
    assert errors == [], errors[:3]
    assert sum(w.admitted for w in workers) > NUM_THREADS * REQUESTS_PER_THREAD // 10
    assert sum(w.refused for w in workers) > 0  # the pool ran full: capacity checks raced
    pool: Any = mgr.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    mgr.take_events()
    assert mgr.reset_prefix_cache()


class ReentrantRequest:
    """A duck-typed request whose every attribute read calls into the manager and its pool."""

    def __init__(self, inner: Request, mgr: KVCacheManager) -> None:
        self._inner = inner
        self._mgr = mgr
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        mgr = self._mgr
        pool: Any = mgr.block_pool
        pool.get_num_free_blocks()
        pool.get_all_free_block_ids()
        mgr.get_block_ids("somebody-else")
        _ = mgr.usage
        self.calls += 1
        return getattr(self._inner, name)


@pytest.mark.parametrize("append_first", [True, False], ids=["append-first", "allocate-first"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["single", "hybrid"])
def test_reentrant_request_is_served_like_a_plain_one(hybrid: bool, append_first: bool) -> None:
    """A request whose properties call the manager and the pool mid-call is served, with the
    same blocks and events as a plain request (nothing is held while request code runs).

    Decoding with the token appended before the call, as vLLM's scheduler does, and after it
    (as a benchmark loop may): then a call caches the block the previous call's token filled,
    with the request's cached blocks one behind its computed tokens."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)
    results = []
    for wrap in (False, True):
        mgr = make_manager(hybrid)
        log: list[Any] = []
        for i, prompt in enumerate([list(range(30)), [*range(30), 7, 8], list(range(50, 75))]):
            inner = Request(f"r{i}", prompt, block_hasher=hasher)
            req: Any = ReentrantRequest(inner, mgr) if wrap else inner
            hits, n = mgr.get_computed_blocks(req)
            new = mgr.allocate_slots(req, len(prompt) - n, n, hits)
            assert new is not None
            inner.num_computed_tokens = len(prompt)
            for _ in range(9):
                if append_first:
                    inner.append_output_token_ids(1)
                assert mgr.allocate_slots(req, 1) is not None
                inner.num_computed_tokens += 1
                if not append_first:
                    inner.append_output_token_ids(1)
            log.append((n, mgr.get_block_ids(inner.request_id)))
            if i == 1:
                mgr.free(req)
            if wrap:
                assert req.calls > 0
        log.append([type(e).__name__ for e in mgr.take_events()])
        pool: Any = mgr.block_pool
        pool.check_invariants()
        results.append(log)
    assert results[0] == results[1]


class YieldingStats(PrefixCacheStats):
    """Stats whose ``record`` lets other threads run halfway through."""

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        self.requests += 1
        time.sleep(0)
        self.queries += num_tokens
        self.hits += num_hits


class YieldingStatsManager(KVCacheManager):
    _stats_class = YieldingStats


def test_stats_lookups_never_land_in_stats_handed_back() -> None:
    """Lookups from many threads while another hands the stats back step after step: every
    lookup is counted exactly once, and stats already handed back never change (the swap waits
    for a recording that let the GIL go halfway)."""
    init_none_hash(sha256)
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=4, **ATTN))]
    mgr = YieldingStatsManager(
        KVCacheConfig(40, [], groups),
        max_model_len=512,
        scheduler_block_size=4,
        hash_block_size=4,
        log_stats=True,
    )
    hasher = get_request_block_hasher(4, sha256)
    lookups_per_thread, threads = 300, 4
    done = threading.Event()
    errors: list[BaseException] = []
    handed: list[tuple[YieldingStats, tuple[int, int, int]]] = []

    def lookups(seed: int) -> None:
        try:
            for i in range(lookups_per_thread):
                mgr.get_computed_blocks(
                    Request(f"s{seed}-{i}", list(range(9)), block_hasher=hasher)
                )
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    def swapper() -> None:
        try:
            while not done.is_set():
                stats = mgr.make_prefix_cache_stats()
                assert isinstance(stats, YieldingStats)
                handed.append((stats, (stats.requests, stats.queries, stats.hits)))
                time.sleep(0)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    with busy_cpu_and_tiny_switch_interval():
        swap = threading.Thread(target=swapper)
        swap.start()
        workers = [threading.Thread(target=lookups, args=(s,)) for s in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        done.set()
        swap.join()
    assert not errors
    for stats, seen in handed:
        assert (stats.requests, stats.queries, stats.hits) == seen
    last = mgr.make_prefix_cache_stats()
    assert last is not None
    total = sum(s.requests for s, _ in handed) + last.requests
    assert total == lookups_per_thread * threads
    assert sum(s.queries for s, _ in handed) + last.queries == 9 * total
