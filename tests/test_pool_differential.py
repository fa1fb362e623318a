"""Differential test of ``kvcore.BlockPool`` against the reference ``BlockPool`` (vLLM 0.25.1).

Seeded random operation sequences, shaped like what the managers do (prefix lookups and
touches of cached blocks, allocation with eviction, caching with masks and null blocks, partial
entries when the block size exceeds the hash block size, frees in reverse or random order,
evictions, resets, lookups and rejected over-allocation), are applied to both pools. Blocks are
ints for kvcore and the reference's ``KVCacheBlock`` objects (``ref.blocks[i]``) for the
reference. After every step the test compares the returned ids, the free list front to back,
every reference count (the null block's included, BLK-3), every primary key and its token
count, the number of index keys and every key's first block, and the events field by field.
Requests carry LoRA, cache salt and multimodal items in some sequences so the events' extra
keys are compared too.

Run with ``pytest -m reference``; skipped when the reference is not installed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from fuzz_harness import sort_removed_runs
from pool_helpers import (
    LoRARequest,
    MMFeature,
    PlaceholderRange,
    PoolRequest,
    event_fields,
)

import kvcore

pytestmark = pytest.mark.reference

ref_block_pool = pytest.importorskip("vllm.v1.core.block_pool")

ENV_INT_HASHES = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


class Pair:
    """A kvcore pool and a reference pool driven with the same calls."""

    def __init__(self, n: int, caching: bool, hbs: int, events: bool) -> None:
        self.n = n
        self.k = kvcore.BlockPool(n, caching, hbs, events)
        self.r = ref_block_pool.BlockPool(n, caching, hbs, events)

    def rb(self, ids: list[int]) -> list[Any]:
        return [self.r.blocks[i] for i in ids]

    def both(
        self, k_call: Callable[[], Any], r_call: Callable[[], Any]
    ) -> tuple[Any, BaseException | None]:
        """Runs both calls; they must both succeed or both raise a related exception."""
        k_exc: BaseException | None = None
        r_exc: BaseException | None = None
        k_out = r_out = None
        try:
            k_out = k_call()
        except Exception as e:
            k_exc = e
        try:
            r_out = r_call()
        except Exception as e:
            r_exc = e
        if r_exc is None:
            assert k_exc is None, f"kvcore raised {k_exc!r}, the reference did not"
        else:
            assert k_exc is not None, f"the reference raised {r_exc!r}, kvcore did not"
            assert isinstance(k_exc, type(r_exc)), (k_exc, r_exc)
        return (k_out, r_out), k_exc

    def check(self, aliases_before: bool) -> None:
        k, r = self.k, self.r
        k.check_invariants()
        assert k.get_all_free_block_ids() == [
            b.block_id for b in r.free_block_queue.get_all_free_blocks()
        ]
        assert k.get_num_free_blocks() == r.get_num_free_blocks()
        assert k.get_usage() == r.get_usage()
        ids = range(self.n)
        assert k.get_ref_cnts(ids) == [b.ref_cnt for b in r.blocks]
        assert k.get_block_hashes(ids) == [b.block_hash for b in r.blocks]
        assert [k.blocks[i].block_hash_num_tokens for i in ids] == [
            b.block_hash_num_tokens for b in r.blocks
        ]
        index = r.cached_block_hash_to_block
        assert f"cached_keys={len(index)}" in repr(k)
        for key in index._cache:
            one = index.get_one_block(key)
            got = k.get_cached_block(key[:-4], [int.from_bytes(key[-4:], "big")])
            assert got == [one.block_id], key.hex()
        k_events = [event_fields(e) for e in k.take_events()]
        r_events = [event_fields(e) for e in r.take_events()]
        if aliases_before:
            # Alias keys are removed in set order in the reference (unspecified, POOL-6).
            k_events, r_events = sort_removed_runs(k_events), sort_removed_runs(r_events)
        assert k_events == r_events

    def has_aliases(self) -> bool:
        return any(self.r.cached_block_hashes_by_block.values())


class Driver:
    """Random manager-like traffic over a :class:`Pair`."""

    def __init__(
        self,
        seed: int,
        n: int,
        caching: bool,
        hbs: int,
        block_size: int,
        events: bool,
        extras: bool,
    ) -> None:
        self.rng = random.Random(seed)
        self.pair = Pair(n, caching, hbs, events)
        self.hbs = hbs
        self.bs = block_size
        self.extras = extras
        self.caching = caching
        # Prompts share prefixes: a few stems and short random tails.
        self.stems = [
            [self.rng.randrange(50) for _ in range(self.rng.randrange(0, 40))] for _ in range(3)
        ]
        self.running: list[tuple[PoolRequest, list[int], int, int]] = []  # req, blocks, cached, gid

    def make_request(self) -> PoolRequest:
        rng = self.rng
        tokens = list(rng.choice(self.stems)) + [
            rng.randrange(50) for _ in range(rng.randrange(0, 24))
        ]
        kw: dict[str, Any] = {}
        if self.extras and rng.random() < 0.5:
            if rng.random() < 0.5:
                kw["lora_request"] = LoRARequest(
                    rng.choice(["lora-a", "lora-b"]), rng.randrange(1, 3)
                )
            if rng.random() < 0.3:
                kw["cache_salt"] = rng.choice(["s1", "s2"])
            if rng.random() < 0.5 and tokens:
                off = rng.randrange(len(tokens))
                kw["mm_features"] = [
                    MMFeature(
                        f"img-{rng.randrange(3)}", PlaceholderRange(off, rng.randrange(1, 20))
                    )
                ]
        # The hashes of the extras are not what the reference would compute, but the pool
        # treats hashes as opaque: mixing the extras into the chain salt keeps them distinct.
        salt = repr(sorted(kw.items())).encode()
        return PoolRequest(tokens, hash_block_size=self.hbs, salt=salt, **kw)

    def view(self, req: PoolRequest) -> list[bytes]:
        k = self.bs // self.hbs
        fine = req.block_hashes
        return [fine[(i + 1) * k - 1] for i in range(len(fine) // k)]

    # -- steps
    def step_new_request(self) -> None:
        p, rng = self.pair, self.rng
        req = self.make_request()
        gid = rng.randrange(2)
        # Longest cached prefix, capped at num_tokens - 1 (MGR-7), through get_cached_block.
        hits: list[int] = []
        view = self.view(req)
        for h in view[: max(len(req.token_ids) - 1, 0) // self.bs]:
            (kh, rh), _ = p.both(
                lambda h=h: p.k.get_cached_block(h, [gid]),  # type: ignore[misc]
                lambda h=h: p.r.get_cached_block(h, [gid]),  # type: ignore[misc]
            )
            assert kh == (None if rh is None else [b.block_id for b in rh])
            if kh is None:
                break
            hits.append(kh[0])
        # Sometimes skip some hits as a sliding window would: null blocks in their place.
        blocks = list(hits)
        if rng.random() < 0.3:
            blocks = [0 if rng.random() < 0.5 else b for b in blocks]
        need = -(-len(req.token_ids) // self.bs) - len(blocks)
        touched = list(blocks)
        p.both(lambda: p.k.touch(touched), lambda: p.r.touch(p.rb(touched)))
        p.check(False)
        (new_k, new_r), exc = p.both(
            lambda: p.k.get_new_blocks(need), lambda: p.r.get_new_blocks(need)
        )
        if exc is not None:
            p.both(
                lambda: p.k.free_blocks(touched[::-1]), lambda: p.r.free_blocks(p.rb(touched[::-1]))
            )
            return
        assert new_k == [b.block_id for b in new_r]
        blocks += new_k
        self.cache(req, blocks, len(hits), gid)
        self.running.append((req, blocks, len(req.token_ids) // self.bs, gid))

    def cache(self, req: PoolRequest, blocks: list[int], num_cached: int, gid: int) -> None:
        p, rng = self.pair, self.rng
        if not self.caching:
            return  # the managers never cache with caching off (ALLOC-10)
        num_full = len(req.token_ids) // self.bs
        mask = None
        if num_full > num_cached and rng.random() < 0.3:
            mask = [rng.random() < 0.6 for _ in range(num_full - num_cached)]
        aliases = p.has_aliases()
        p.both(
            lambda: p.k.cache_full_blocks(req, blocks, num_cached, num_full, self.bs, gid, mask),
            lambda: p.r.cache_full_blocks(
                req, p.rb(blocks), num_cached, num_full, self.bs, gid, mask
            ),
        )
        p.check(aliases)
        # A partial entry for the tail block (block size above the hash block size).
        tail_tokens = (len(req.token_ids) // self.hbs) * self.hbs
        if self.bs > self.hbs and tail_tokens % self.bs and rng.random() < 0.5:
            blk = blocks[tail_tokens // self.bs]
            aliases = p.has_aliases()
            (kk, rk), _ = p.both(
                lambda: p.k.cache_partial_block(req, blk, tail_tokens, gid, self.bs),
                lambda: p.r.cache_partial_block(req, p.r.blocks[blk], tail_tokens, gid, self.bs),
            )
            assert kk == rk
            p.check(aliases)

    def step_extend(self) -> None:
        p, rng = self.pair, self.rng
        if not self.running:
            return
        i = rng.randrange(len(self.running))
        req, blocks, cached, gid = self.running[i]
        more = [rng.randrange(50) for _ in range(rng.randrange(1, 2 * self.bs))]
        need = -(-(len(req.token_ids) + len(more)) // self.bs) - len(blocks)
        if need > p.k.get_num_free_blocks():
            return
        req.append(more)
        aliases = p.has_aliases()
        (new_k, new_r), _ = p.both(
            lambda: p.k.get_new_blocks(need), lambda: p.r.get_new_blocks(need)
        )
        assert new_k == [b.block_id for b in new_r]
        p.check(aliases)
        blocks += new_k
        self.cache(req, blocks, cached, gid)
        self.running[i] = (req, blocks, len(req.token_ids) // self.bs, gid)

    def step_partial_inside(self) -> None:
        """A prefix boundary inside a block that may already be cached in full: the partial
        key becomes an alias (MAP-6) or a no-op (POOL-31)."""
        p, rng = self.pair, self.rng
        k = self.bs // self.hbs
        if not self.caching or k < 2 or not self.running:
            return
        req, blocks, _, gid = rng.choice(self.running)
        num_hashes = len(req.block_hashes)
        choices = [m * self.hbs for m in range(1, num_hashes + 1) if m % k]
        if not choices:
            return
        num_tokens = rng.choice(choices)
        blk = blocks[num_tokens // self.bs]
        aliases = p.has_aliases()
        (kk, rk), _ = p.both(
            lambda: p.k.cache_partial_block(req, blk, num_tokens, gid, self.bs),
            lambda: p.r.cache_partial_block(req, p.r.blocks[blk], num_tokens, gid, self.bs),
        )
        assert kk == rk
        p.check(aliases)

    def step_free(self) -> None:
        p, rng = self.pair, self.rng
        if not self.running:
            return
        _, blocks, _, _ = self.running.pop(rng.randrange(len(self.running)))
        order = blocks[::-1]
        if rng.random() < 0.2:
            rng.shuffle(order)
        p.both(lambda: p.k.free_blocks(order), lambda: p.r.free_blocks(p.rb(order)))
        p.check(False)

    def step_evict(self) -> None:
        p, rng = self.pair, self.rng
        ids = {rng.randrange(p.n) for _ in range(rng.randrange(1, 4))}
        order = list(ids)  # the set's own iteration order, for both
        aliases = p.has_aliases()
        p.both(lambda: p.k.evict_blocks(order), lambda: p.r.evict_blocks(ids))
        p.check(aliases)

    def step_reset(self) -> None:
        p = self.pair
        (ok_k, ok_r), _ = p.both(p.k.reset_prefix_cache, p.r.reset_prefix_cache)
        assert ok_k == ok_r
        p.check(False)

    def step_over_allocate(self) -> None:
        p = self.pair
        n = p.k.get_num_free_blocks() + 1 + self.rng.randrange(3)
        _, exc = p.both(lambda: p.k.get_new_blocks(n), lambda: p.r.get_new_blocks(n))
        assert isinstance(exc, kvcore.NoFreeBlocksError)
        p.check(False)

    def step_lookup(self) -> None:
        p, rng = self.pair, self.rng
        req = self.make_request()
        gids = rng.choice([[0], [1], [0, 1], []])
        for h in self.view(req):
            (kh, rh), _ = p.both(
                lambda h=h: p.k.get_cached_block(h, gids),  # type: ignore[misc]
                lambda h=h: p.r.get_cached_block(h, gids),  # type: ignore[misc]
            )
            assert kh == (None if rh is None else [b.block_id for b in rh])

    def run(self, steps: int) -> None:
        choices = [
            (self.step_new_request, 5),
            (self.step_extend, 2),
            (self.step_free, 4),
            (self.step_evict, 1),
            (self.step_reset, 1),
            (self.step_over_allocate, 1),
            (self.step_lookup, 1),
            (self.step_partial_inside, 2),
        ]
        fns = [c[0] for c in choices]
        weights = [c[1] for c in choices]
        for _ in range(steps):
            self.rng.choices(fns, weights)[0]()
        # Drain: free everything, then the pool must be resettable.
        while self.running:
            self.step_free()
        self.step_reset()
        assert self.pair.k.get_num_free_blocks() == self.pair.n - 1


CONFIGS = {
    # name: (num_blocks, caching, hash_block_size, block_size, events, extras)
    "plain": (24, True, 4, 4, True, False),
    "hbs-view": (24, True, 4, 8, True, False),
    "partial": (32, True, 2, 8, True, False),
    "extras": (24, True, 4, 4, True, True),
    "extras-partial": (24, True, 4, 12, True, True),
    "tiny": (4, True, 4, 4, True, False),
    "no-events": (16, True, 4, 8, False, False),
    "no-caching": (16, False, 4, 4, False, False),
}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_sequences_match_the_reference(
    config: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_INT_HASHES, raising=False)
    n, caching, hbs, bs, events, extras = CONFIGS[config]
    Driver(seed, n, caching, hbs, bs, events, extras).run(120)


@pytest.mark.parametrize("seed", range(2))
def test_raw_hash_events_match_the_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """EVT-2 with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: raw digests in both."""
    monkeypatch.setenv(ENV_INT_HASHES, "0")
    Driver(100 + seed, 24, True, 4, 8, True, True).run(80)


def test_null_block_drift_matches_the_reference() -> None:
    """BLK-3: touching and freeing the null block moves both counters the same way."""
    p = Pair(6, True, 16, True)
    p.both(lambda: p.k.touch([0, 0, 1]), lambda: p.r.touch(p.rb([0, 0, 1])))
    p.check(False)
    p.both(lambda: p.k.free_blocks([0, 0, 0, 1]), lambda: p.r.free_blocks(p.rb([0, 0, 0, 1])))
    p.check(False)
    assert p.k.get_ref_cnts([0]) == [-1]


def test_scenario_of_the_spec_s3_matches_the_reference() -> None:
    """S3 (duplicates under eviction) step by step against the reference."""
    p = Pair(10, True, 16, True)
    ra, rb = PoolRequest(list(range(1, 33))), PoolRequest(list(range(1, 33)))
    for req in (ra, rb):
        (bk, br), _ = p.both(lambda: p.k.get_new_blocks(2), lambda: p.r.get_new_blocks(2))
        p.both(
            lambda bk=bk, req=req: p.k.cache_full_blocks(req, bk, 0, 2, 16, 0),  # type: ignore[misc]
            lambda br=br, req=req: p.r.cache_full_blocks(req, br, 0, 2, 16, 0),  # type: ignore[misc]
        )
        p.check(False)
    for ids in ([2, 1], [4, 3]):
        p.both(
            lambda ids=ids: p.k.free_blocks(ids),  # type: ignore[misc]
            lambda ids=ids: p.r.free_blocks(p.rb(ids)),  # type: ignore[misc]
        )
        p.check(False)
    (bk, br), _ = p.both(lambda: p.k.get_new_blocks(6), lambda: p.r.get_new_blocks(6))
    assert bk == [b.block_id for b in br] == [5, 6, 7, 8, 9, 2]
    p.check(False)
