"""Rule-by-rule tests of ``kvcore.BlockPool`` (SPEC §1–4, the events it emits (§6) and the
pool-level parts of the scenarios S1–S3 (§19)).

Test names cite the SPEC rule they check (``test_pool_5_...`` is POOL-5). Every rejected call is
checked three ways: the kvcore exception class, the built-in class the reference raises for the
same misuse, and that the pool is left exactly as it was (free list order, every ref count,
every key and token count, lookups, the queued events, ``check_invariants``), by comparing it
with a twin pool that never saw the call.

Not reachable through the public API, so not tested here: touching a block with ``ref_cnt == 0``
that is not in the free queue (POOL-9's RuntimeError; the core's model tests cover it), an
index entry that does not list a block holding its key (MAP-4's None case), and a popped block
with a non-zero count (POOL-5's AssertionError).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from pool_helpers import (
    NULL,
    LoRARequest,
    MMFeature,
    PlaceholderRange,
    PoolRequest,
    assert_same_state,
    event_fields,
    ext,
    key,
    lookups,
    snapshot,
)

import kvcore
from kvcore import (
    BlockIdError,
    BlockPool,
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    KvcoreError,
    NoFreeBlocksError,
)
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored

ENV_INT_HASHES = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


@pytest.fixture(autouse=True)
def _default_event_hash_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with the default (int) event hash form (SPEC EVT-2)."""
    monkeypatch.delenv(ENV_INT_HASHES, raising=False)


def new_pool(n: int = 10, caching: bool = True, hbs: int = 16, events: bool = True) -> BlockPool:
    return BlockPool(n, caching, hbs, events)


def stored(
    hashes: list[Any],
    parent: Any,
    tokens: list[int],
    block_size: int = 16,
    *,
    group: int = 0,
    extra_keys: list[Any] | str | None = "default",
    lora_id: int | None = None,
    lora_name: str | None = None,
) -> BlockStored:
    keys: Any = extra_keys
    if extra_keys == "default":
        # The reference builds one entry (None without extra-key sources) per stored block;
        # an empty list becomes None (POOL-17).
        keys = [None] * len(hashes) or None
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=lora_id,
        medium="GPU",
        lora_name=lora_name,
        extra_keys=keys,
        group_idx=group,
    )


def removed(h: bytes, group: int = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=[ext(h)], medium="GPU", group_idx=group)


def take(pool: BlockPool) -> list[Any]:
    """The drained events, typed loosely so tests can read any field."""
    return list(pool.take_events())


# --------------------------------------------------------------------------- exceptions


def test_exception_tree() -> None:
    """Each class subclasses the built-ins a caller of the reference would catch."""
    assert issubclass(KvcoreError, Exception)
    expected: dict[type[Exception], tuple[type[Exception], ...]] = {
        BlockIdError: (IndexError, AssertionError),
        NoFreeBlocksError: (ValueError,),
        DoubleFreeError: (ValueError,),
        BlockStateError: (RuntimeError,),
        InvalidArgumentError: (ValueError, AssertionError),
    }
    for cls, builtins in expected.items():
        assert issubclass(cls, KvcoreError)
        for b in builtins:
            assert issubclass(cls, b), (cls, b)
        assert cls.__module__ == "kvcore._native"
    assert kvcore.KVCacheBlockView is not None


# --------------------------------------------------------------------------- BLK / POOL-1..3


def test_pool_1_construction_queue_and_null_block() -> None:
    pool = new_pool(10)
    assert pool.num_gpu_blocks == 10 == len(pool) == len(pool.blocks)
    assert pool.enable_caching is True
    assert pool.hash_block_size == 16
    assert pool.enable_kv_cache_events is True
    assert pool.null_block == NULL == 0
    assert pool.get_all_free_block_ids() == list(range(1, 10))
    null = pool.blocks[0]
    assert null.is_null and null.block_id == 0 and null.ref_cnt == 0
    assert not any(pool.blocks[i].is_null for i in range(1, 10))
    pool.check_invariants()


@pytest.mark.parametrize("n", [0, -1, -(2**40)])
def test_pool_1_non_positive_size_rejected(n: int) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        BlockPool(n, True, 16)
    assert isinstance(info.value, AssertionError)


@pytest.mark.parametrize("n", [1.0, 2.5, "3", None, [3]])
def test_pool_1_non_int_size_rejected(n: Any) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        BlockPool(n, True, 16)
    assert isinstance(info.value, AssertionError)


def test_pool_1_bool_size_is_an_int() -> None:
    """``isinstance(True, int)`` holds, so the reference builds a 1-block pool; so does kvcore."""
    pool = BlockPool(True, True, 16)
    assert pool.num_gpu_blocks == 1


@pytest.mark.parametrize("hbs", [0, -16])
def test_pool_1_non_positive_hash_block_size_rejected(hbs: int) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockPool(10, True, hbs)


def test_pool_1_metrics_collector_rejected() -> None:
    BlockPool(10, True, 16, False, None)
    with pytest.raises(InvalidArgumentError):
        BlockPool(10, True, 16, False, object())  # type: ignore[arg-type]


def test_pool_1_single_block_pool() -> None:
    pool = new_pool(1)
    assert pool.get_all_free_block_ids() == []
    assert pool.get_num_free_blocks() == 0
    assert pool.get_new_blocks(0) == []
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    pool.check_invariants()


def test_pool_2_free_count_is_queue_length() -> None:
    pool = new_pool(10)
    assert pool.get_num_free_blocks() == 9
    got = pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 5 == len(pool.get_all_free_block_ids())
    pool.free_blocks(got)
    assert pool.get_num_free_blocks() == 9


def test_pool_3_usage() -> None:
    pool = new_pool(10)
    assert pool.get_usage() == 0.0
    pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(1.0 - 6 / 9)
    pool.get_new_blocks(6)
    assert pool.get_usage() == 1.0


def test_pool_3_usage_of_single_block_pool_is_int_zero() -> None:
    u = new_pool(1).get_usage()
    assert u == 0 and type(u) is int


def test_blk_1_fields_of_the_view() -> None:
    pool = new_pool(10, hbs=16)
    req = PoolRequest(list(range(32)))
    b = pool.get_new_blocks(2)
    v = pool.blocks[b[0]]
    assert (v.block_id, v.ref_cnt, v.block_hash, v.block_hash_num_tokens, v.is_null) == (
        1,
        1,
        None,
        None,
        False,
    )
    pool.cache_full_blocks(req, b, 0, 2, 16, 3)
    v0, v1 = pool.blocks[b[0]], pool.blocks[b[1]]
    assert v0.block_hash == key(req.block_hashes[0], 3)
    assert v0.block_hash_num_tokens == 16
    assert v1.block_hash == key(req.block_hashes[1], 3)
    assert v1.block_hash_num_tokens == 32
    # A view is a snapshot: it does not follow later changes.
    pool.touch([b[0]])
    assert v0.ref_cnt == 1 and pool.blocks[b[0]].ref_cnt == 2


def test_blk_1_blocks_indexing() -> None:
    pool = new_pool(10)
    assert pool.blocks[-1].block_id == 9
    assert pool.blocks[-10].block_id == 0
    for bad in (10, -11, 2**40):
        with pytest.raises(IndexError):
            pool.blocks[bad]
    with pytest.raises(TypeError):
        pool.blocks["1"]  # type: ignore[call-overload]


def test_blk_2_setting_a_key_twice_is_not_a_promotion() -> None:
    """BLK-2 through the API: a block with a key cannot take another full key for as many
    tokens (POOL-16's assertion); an eviction clears both fields."""
    pool = new_pool(10)
    req = PoolRequest(list(range(16)))
    [b] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b], 0, 1, 16, 0)
    with pytest.raises(InvalidArgumentError) as info:
        pool.cache_full_blocks(req, [b], 0, 1, 16, 0)
    assert isinstance(info.value, AssertionError)
    pool.evict_blocks([b])
    v = pool.blocks[b]
    assert v.block_hash is None and v.block_hash_num_tokens is None
    pool.cache_full_blocks(req, [b], 0, 1, 16, 0)
    assert pool.blocks[b].block_hash == key(req.block_hashes[0])


def test_blk_3_null_block_ref_count_drifts() -> None:
    pool = new_pool(5)
    pool.touch([NULL, NULL])
    assert pool.blocks[NULL].ref_cnt == 2
    pool.free_blocks([NULL, NULL, NULL])
    assert pool.blocks[NULL].ref_cnt == -1
    assert pool.get_all_free_block_ids() == [1, 2, 3, 4]
    pool.free_blocks([NULL])
    assert pool.get_ref_cnts([NULL]) == [-2]
    pool.touch([NULL])
    assert pool.get_ref_cnts([NULL]) == [-1]
    assert pool.get_all_free_block_ids() == [1, 2, 3, 4]
    pool.check_invariants()


# --------------------------------------------------------------------------- FQ


def test_fq_1_initial_order() -> None:
    assert new_pool(6).get_all_free_block_ids() == [1, 2, 3, 4, 5]


def test_fq_2_pop_from_empty_queue_raises_value_error() -> None:
    pool = new_pool(3)
    pool.get_new_blocks(2)
    with pytest.raises(NoFreeBlocksError) as info:
        pool.get_new_blocks(1)
    assert isinstance(info.value, ValueError)


def test_fq_3_popleft_n_zero_and_all() -> None:
    pool = new_pool(6)
    assert pool.get_new_blocks(0) == []
    assert pool.get_new_blocks(5) == [1, 2, 3, 4, 5]
    assert pool.get_all_free_block_ids() == []


def test_fq_4_remove_from_the_middle() -> None:
    pool = new_pool(6)
    pool.touch([3])
    assert pool.get_all_free_block_ids() == [1, 2, 4, 5]
    pool.touch([5, 1])
    assert pool.get_all_free_block_ids() == [2, 4]
    assert pool.get_num_free_blocks() == 2
    pool.check_invariants()


def test_fq_5_prepend_and_append_keep_list_order() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(48)))
    blocks = pool.get_new_blocks(6)  # [1..6], queue [7,8,9]
    pool.cache_full_blocks(req, blocks[:3], 0, 3, 16, 0)  # 1,2,3 hashed
    # U = [4, 6, 5] prepended as a unit; H = [2, 3, 1] appended in list order.
    pool.free_blocks([4, 2, 6, 3, 5, 1])
    assert pool.get_all_free_block_ids() == [4, 6, 5, 7, 8, 9, 2, 3, 1]
    assert pool.get_num_free_blocks() == 9


def test_fq_6_free_list_front_to_back() -> None:
    pool = new_pool(5)
    got = pool.get_new_blocks(4)
    pool.free_blocks(got)
    assert pool.get_all_free_block_ids() == [1, 2, 3, 4]


# --------------------------------------------------------------------------- KEY / MAP


def test_key_1_layout_sha256_and_xxhash_sizes() -> None:
    pool = new_pool(10)
    r32 = PoolRequest(list(range(16)))
    r16 = PoolRequest(list(range(16)), digest_size=16, salt=b"x")
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(r32, [a], 0, 1, 16, 7)
    pool.cache_full_blocks(r16, [b], 0, 1, 16, 2**32 - 1)
    ka, kb = pool.get_block_hashes([a, b])
    assert ka is not None and kb is not None
    assert len(ka) == 36 and ka[:-4] == r32.block_hashes[0] and ka[-4:] == b"\x00\x00\x00\x07"
    assert len(kb) == 20 and kb[:-4] == r16.block_hashes[0] and kb[-4:] == b"\xff" * 4
    assert pool.get_cached_block(r32.block_hashes[0], [7]) == [a]
    assert pool.get_cached_block(r16.block_hashes[0], [2**32 - 1]) == [b]
    assert pool.get_cached_block(r32.block_hashes[0], [0]) is None


def test_key_1_group_id_out_of_u32_range() -> None:
    """``group_id.to_bytes(4, "big")`` raises OverflowError in the reference."""
    pool = new_pool(10)
    h = PoolRequest(list(range(16))).block_hashes[0]
    for gid in (-1, 2**32):
        with pytest.raises(OverflowError):
            pool.get_cached_block(h, [gid])


def test_key_1_hash_prefix_is_not_a_hit() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(16)))
    [b] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b], 0, 1, 16, 0)
    h = req.block_hashes[0]
    assert pool.get_cached_block(h, [0]) == [b]
    assert pool.get_cached_block(h[:16], [0]) is None
    assert pool.get_cached_block(h[:31], [0]) is None
    assert pool.get_cached_block(h[1:], [0]) is None


def test_map_1_duplicates_are_never_merged() -> None:
    pool = new_pool(10)
    ra, rb = PoolRequest(list(range(32))), PoolRequest(list(range(32)))
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(ra, a, 0, 2, 16, 0)
    pool.cache_full_blocks(rb, b, 0, 2, 16, 0)
    assert pool.get_block_hashes(a) == pool.get_block_hashes(b)
    assert pool.get_cached_block(ra.block_hashes[1], [0]) == [a[1]]
    pool.check_invariants()


def test_map_2_earliest_insertion_wins_and_map_4_reinsert_goes_last() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(16)))
    h = req.block_hashes[0]
    x, y, z = pool.get_new_blocks(3)
    for b in (x, y, z):
        pool.cache_full_blocks(req, [b], 0, 1, 16, 0)
    assert pool.get_cached_block(h, [0]) == [x]
    pool.evict_blocks([x])
    assert pool.get_cached_block(h, [0]) == [y]
    pool.cache_full_blocks(req, [x], 0, 1, 16, 0)  # x re-inserted: order y, z, x
    pool.evict_blocks([y])
    assert pool.get_cached_block(h, [0]) == [z]
    pool.evict_blocks([z])
    assert pool.get_cached_block(h, [0]) == [x]
    pool.evict_blocks([x])
    assert pool.get_cached_block(h, [0]) is None
    pool.check_invariants()


def test_map_5_number_of_keys() -> None:
    """``len(index)`` is the number of keys, not blocks (reported by ``repr``)."""
    pool = new_pool(10)
    req = PoolRequest(list(range(32)))
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, a, 0, 2, 16, 0)
    pool.cache_full_blocks(req, b, 0, 2, 16, 0)
    assert "cached_keys=2" in repr(pool)
    pool.cache_full_blocks(req, pool.get_new_blocks(1), 0, 1, 16, 1)
    assert "cached_keys=3" in repr(pool)


def test_map_6_alias_keys_are_evicted_with_the_block() -> None:
    """A partial key on a block that already has a primary key becomes an alias; evicting the
    block removes the primary key first, then every alias (POOL-6)."""
    pool = new_pool(10, hbs=4)
    req = PoolRequest(list(range(1, 17)), hash_block_size=4)  # 4 fine hashes
    [b] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b], 0, 1, 8, 0)  # primary: fine[1], 8 tokens
    pool.take_events()
    # num_tokens 4 < 8: alias (the primary already covers more).
    assert pool.cache_partial_block(req, b, 4, 0, 8) == key(req.block_hashes[0])
    # Another group: another alias.
    pool.cache_partial_block(req, b, 4, 5, 8)
    assert pool.blocks[b].block_hash == key(req.block_hashes[1])
    assert pool.blocks[b].block_hash_num_tokens == 8
    assert pool.get_cached_block(req.block_hashes[0], [0, 5]) == [b, b]
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [b]
    pool.take_events()
    pool.evict_blocks([b])
    events = take(pool)
    assert events[0] == removed(req.block_hashes[1], 0)
    assert {(e.block_hashes[0], e.group_idx) for e in events[1:]} == {
        (ext(req.block_hashes[0]), 0),
        (ext(req.block_hashes[0]), 5),
    }
    assert len(events) == 3
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert pool.get_cached_block(req.block_hashes[0], [5]) is None
    pool.check_invariants()


def test_map_7_and_pool_31_inserting_a_held_key_is_a_no_op() -> None:
    pool = new_pool(10, hbs=4)
    req = PoolRequest(list(range(1, 17)), hash_block_size=4)
    [b] = pool.get_new_blocks(1)
    k = pool.cache_partial_block(req, b, 4, 0, 8)
    assert pool.take_events() != []
    # Already the primary key: same key back, no event, no change.
    before = snapshot(pool)
    assert pool.cache_partial_block(req, b, 4, 0, 8) == k
    assert pool.take_events() == []
    assert snapshot(pool) == before
    # Already an alias (listed by the index under this block): also a no-op.
    pool.cache_full_blocks(req, [b], 0, 1, 8, 0)  # promotion: primary fine[1]
    pool.cache_partial_block(req, b, 4, 0, 8)  # alias fine[0]
    pool.take_events()
    before = snapshot(pool)
    pool.cache_partial_block(req, b, 4, 0, 8)
    assert pool.take_events() == []
    assert snapshot(pool) == before
    pool.check_invariants()


# --------------------------------------------------------------------------- POOL-4


def test_pool_4_lookup_per_group() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(16)))
    h = req.block_hashes[0]
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [a], 0, 1, 16, 0)
    pool.cache_full_blocks(req, [b], 0, 1, 16, 1)
    assert pool.get_cached_block(h, [0, 1]) == [a, b]
    assert pool.get_cached_block(h, [1, 0, 1]) == [b, a, b]
    assert pool.get_cached_block(h, [0, 2]) is None
    assert pool.get_cached_block(h, []) == []
    assert pool.get_cached_block(PoolRequest([7] * 16).block_hashes[0], [0]) is None


def test_pool_4_lookups_change_nothing() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(32)))
    got = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, got, 0, 2, 16, 0)
    pool.free_blocks(got)
    before = snapshot(pool)
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [got[0]]
    assert pool.longest_cached_prefix(req.block_hashes, 10, [0]) == [got]
    assert snapshot(pool) == before


def test_longest_cached_prefix_matches_a_get_cached_block_loop() -> None:
    pool = new_pool(20, hbs=4)
    req = PoolRequest(list(range(40)), hash_block_size=4)  # 10 fine hashes
    a = pool.get_new_blocks(5)
    pool.cache_full_blocks(req, a, 0, 5, 4, 0)
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, b, 0, 3, 4, 1)
    assert pool.longest_cached_prefix(req.block_hashes, 100, [0]) == [a]
    assert pool.longest_cached_prefix(req.block_hashes, 100, [0, 1]) == [a[:3], b]
    assert pool.longest_cached_prefix(req.block_hashes, 2, [0, 1]) == [a[:2], b[:2]]
    assert pool.longest_cached_prefix(req.block_hashes, 0, [0]) == [[]]
    assert pool.longest_cached_prefix(req.block_hashes, 10, []) == []
    # stride k reads fine[(i+1)*k - 1] (the HBS view, RH-3).
    c = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, c, 0, 2, 8, 2)
    assert pool.longest_cached_prefix(req.block_hashes, 10, [2], stride=2) == [c]
    for gids in ([0], [1], [0, 1]):
        loop: list[list[int]] = [[] for _ in gids]
        for h in req.block_hashes:
            hit = pool.get_cached_block(h, gids)
            if hit is None:
                break
            for out, blk in zip(loop, hit, strict=True):
                out.append(blk)
        assert pool.longest_cached_prefix(req.block_hashes, 100, gids) == loop


def test_longest_cached_prefix_bad_input() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(32)))
    with pytest.raises(InvalidArgumentError):
        pool.longest_cached_prefix(req.block_hashes, 4, [0], stride=0)
    with pytest.raises(InvalidArgumentError):
        pool.longest_cached_prefix(req.block_hashes, -1, [0])
    with pytest.raises(TypeError):
        pool.longest_cached_prefix(["x", "y"], 4, [0])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        pool.longest_cached_prefix(None, 4, [0])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- POOL-5, POOL-6


def test_pool_5_pops_front_in_queue_order_with_ref_cnt_1() -> None:
    pool = new_pool(10)
    assert pool.get_new_blocks(3) == [1, 2, 3]
    assert pool.get_ref_cnts([1, 2, 3, 4]) == [1, 1, 1, 0]
    pool.free_blocks([2, 1])
    assert pool.get_all_free_block_ids() == [2, 1, 4, 5, 6, 7, 8, 9]
    assert pool.get_new_blocks(3) == [2, 1, 4]
    assert pool.get_new_blocks(0) == []


def test_pool_6_eviction_on_pop() -> None:
    pool = new_pool(6)
    req = PoolRequest(list(range(48)))
    got = pool.get_new_blocks(3)  # [1,2,3], queue [4,5]
    pool.cache_full_blocks(req, got, 0, 3, 16, 0)
    pool.take_events()
    pool.free_blocks(reversed(got))  # queue [4,5,3,2,1]
    assert pool.get_all_free_block_ids() == [4, 5, 3, 2, 1]
    assert pool.get_new_blocks(4) == [4, 5, 3, 2]
    assert pool.take_events() == [removed(req.block_hashes[2]), removed(req.block_hashes[1])]
    assert pool.get_block_hashes([1, 2, 3]) == [key(req.block_hashes[0]), None, None]
    assert pool.blocks[3].block_hash_num_tokens is None
    assert pool.get_cached_block(req.block_hashes[2], [0]) is None
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [1]
    pool.check_invariants()


def test_pool_6_eviction_keeps_other_copies() -> None:
    """EVT-3: evicting one copy of a duplicated hash emits BlockRemoved although another block
    still holds it, and the lookup falls through to that block."""
    pool = new_pool(6)
    req = PoolRequest(list(range(16)))
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [a], 0, 1, 16, 0)
    pool.cache_full_blocks(req, [b], 0, 1, 16, 0)
    assert pool.take_events() == [stored([ext(req.block_hashes[0])], None, list(range(16)))] * 2
    pool.free_blocks([a])  # queue [3,4,5,a]
    pool.get_new_blocks(4)
    assert pool.take_events() == [removed(req.block_hashes[0])]
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [b]


def test_pool_6_without_caching_popped_blocks_keep_their_keys() -> None:
    """With caching off ``get_new_blocks`` does not evict (the reference only evicts on pop
    when caching is on), and events stay off."""
    pool = new_pool(4, caching=False, events=False)
    req = PoolRequest(list(range(16)))
    [b] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b], 0, 1, 16, 0)
    pool.free_blocks([b])
    assert pool.get_all_free_block_ids() == [2, 3, 1]
    assert pool.get_new_blocks(3) == [2, 3, 1]
    assert pool.blocks[1].block_hash == key(req.block_hashes[0])
    assert pool.take_events() == []
    pool.check_invariants()


# --------------------------------------------------------------------------- POOL-9, 10, 12


def test_pool_9_touch_dequeues_free_blocks_and_counts() -> None:
    pool = new_pool(6)
    pool.touch([2])
    assert pool.get_ref_cnts([2]) == [1]
    assert pool.get_all_free_block_ids() == [1, 3, 4, 5]
    pool.touch([2, 3, 3])  # 2 is referenced: stays out; 3 dequeued once, counted twice
    assert pool.get_ref_cnts([2, 3]) == [2, 2]
    assert pool.get_all_free_block_ids() == [1, 4, 5]
    pool.touch(x for x in [4])  # any iterable
    assert pool.get_all_free_block_ids() == [1, 5]
    pool.touch([])
    pool.check_invariants()


def test_pool_9_touch_a_cached_free_block_makes_it_a_hit() -> None:
    pool = new_pool(6)
    req = PoolRequest(list(range(32)))
    got = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, got, 0, 2, 16, 0)
    pool.free_blocks(reversed(got))
    hit = pool.longest_cached_prefix(req.block_hashes, 2, [0])[0]
    assert hit == got
    pool.touch(hit)
    assert pool.get_ref_cnts(hit) == [1, 1]
    assert pool.get_all_free_block_ids() == [3, 4, 5]
    assert pool.take_events() == [stored([ext(h) for h in req.block_hashes], None, list(range(32)))]


def test_pool_10_free_order_unhashed_front_hashed_back() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(32)))
    got = pool.get_new_blocks(4)  # [1,2,3,4]; queue [5..9]
    pool.cache_full_blocks(req, got, 0, 2, 16, 0)  # 1, 2 hashed
    pool.touch([2])
    pool.free_blocks([4, 2, 1, 3])  # 2 stays at 1
    assert pool.get_all_free_block_ids() == [4, 3, 5, 6, 7, 8, 9, 1]
    assert pool.get_ref_cnts([1, 2, 3, 4]) == [0, 1, 0, 0]
    pool.free_blocks([2])
    assert pool.get_all_free_block_ids() == [4, 3, 5, 6, 7, 8, 9, 1, 2]
    pool.check_invariants()


def test_pool_10_free_the_same_block_twice_in_one_call() -> None:
    pool = new_pool(5)
    [b] = pool.get_new_blocks(1)
    pool.touch([b])
    pool.free_blocks([b, b])
    assert pool.get_ref_cnts([b]) == [0]
    assert pool.get_all_free_block_ids() == [b, 2, 3, 4]
    pool.check_invariants()


def test_pool_10_free_accepts_iterables_and_null_changes_only_its_counter() -> None:
    pool = new_pool(5)
    got = pool.get_new_blocks(2)
    pool.free_blocks(iter([NULL, *got]))
    assert pool.get_all_free_block_ids() == [1, 2, 3, 4]
    assert pool.get_ref_cnts([NULL]) == [-1]
    pool.free_blocks(())


def test_pool_12_reverse_free_evicts_tail_first_and_lru() -> None:
    pool = new_pool(10)
    r1, r2 = PoolRequest(list(range(48))), PoolRequest(list(range(100, 148)))
    b1 = pool.get_new_blocks(3)
    b2 = pool.get_new_blocks(3)
    pool.cache_full_blocks(r1, b1, 0, 3, 16, 0)
    pool.cache_full_blocks(r2, b2, 0, 3, 16, 0)
    pool.free_blocks(reversed(b1))  # freed earlier: evicted earlier
    pool.free_blocks(reversed(b2))
    assert pool.get_all_free_block_ids() == [7, 8, 9, 3, 2, 1, 6, 5, 4]
    assert pool.get_new_blocks(4) == [7, 8, 9, 3]


# --------------------------------------------------------------------------- POOL-13..17


def test_pool_13_nothing_new_to_cache_is_a_no_op() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(32)))
    got = pool.get_new_blocks(2)
    before = snapshot(pool)
    # Returns before any check: a wrong mask, a short view or a bad block size pass silently.
    pool.cache_full_blocks(req, got, 2, 2, 16, 0, [True, True, True])
    pool.cache_full_blocks(req, got, 3, 1, 16, 0)
    pool.cache_full_blocks(PoolRequest([], hash_block_size=None), got, 1, 1, 7, 0)
    assert snapshot(pool) == before
    assert pool.take_events() == []


@pytest.mark.parametrize("mask_len", [0, 1, 3])
def test_pool_14_mask_of_the_wrong_length(mask_len: int) -> None:
    def setup() -> tuple[BlockPool, Any]:
        pool = new_pool(10)
        return pool, pool.get_new_blocks(4)

    a, got = setup()
    b, _ = setup()
    with pytest.raises(InvalidArgumentError) as info:
        a.cache_full_blocks(PoolRequest(list(range(64))), got, 1, 3, 16, 0, [True] * mask_len)
    assert isinstance(info.value, AssertionError)
    assert_same_state(a, b)


def test_pool_15_hbs_view_reads_the_last_fine_hash_of_each_block() -> None:
    pool = new_pool(10, hbs=4)
    req = PoolRequest(list(range(1, 27)), hash_block_size=4)  # 6 fine hashes
    got = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, got, 0, 2, 12, 0)  # k = 3: view = [fine[2], fine[5]]
    fine = req.block_hashes
    assert pool.get_block_hashes(got) == [key(fine[2]), key(fine[5]), None]
    assert [pool.blocks[b].block_hash_num_tokens for b in got[:2]] == [12, 24]
    assert pool.take_events() == [
        stored([ext(fine[2]), ext(fine[5])], None, list(range(1, 25)), 12)
    ]
    # Parent at num_cached=1 is view[0] = fine[2].
    got2 = pool.get_new_blocks(2)
    req2 = PoolRequest(list(range(1, 27)), hash_block_size=4)
    pool.cache_full_blocks(req2, [NULL, got2[0]], 1, 2, 12, 1)
    assert pool.take_events() == [
        stored([ext(fine[5])], ext(fine[2]), list(range(13, 25)), 12, group=1)
    ]


def test_pool_15_view_too_short() -> None:
    def setup() -> tuple[BlockPool, list[int]]:
        pool = new_pool(10, hbs=4)
        return pool, pool.get_new_blocks(3)

    a, got = setup()
    b, _ = setup()
    req = PoolRequest(list(range(1, 27)), hash_block_size=4)  # 6 fine hashes
    for args in ((0, 4, 8), (0, 7, 4), (2, 4, 12)):
        with pytest.raises(InvalidArgumentError) as info:
            a.cache_full_blocks(req, [*got, 4, 5, 6, 7], *args, 0)
        assert isinstance(info.value, AssertionError)
    assert_same_state(a, b)


@pytest.mark.parametrize("bs", [6, 2, 0, -4])
def test_pool_15_block_size_not_a_multiple(bs: int) -> None:
    def setup() -> tuple[BlockPool, list[int]]:
        pool = new_pool(10, hbs=4)
        return pool, pool.get_new_blocks(2)

    a, got = setup()
    b, _ = setup()
    with pytest.raises(InvalidArgumentError) as info:
        a.cache_full_blocks(PoolRequest(list(range(64)), hash_block_size=4), got, 0, 2, bs, 0)
    assert isinstance(info.value, AssertionError)
    assert_same_state(a, b)


def test_pool_16_null_and_masked_blocks_are_skipped() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(64)))
    got = pool.get_new_blocks(3)
    blocks = [got[0], NULL, got[1], got[2]]
    pool.cache_full_blocks(req, blocks, 0, 4, 16, 0, [True, True, False, True])
    hs = req.block_hashes
    assert pool.get_block_hashes(got) == [key(hs[0]), None, key(hs[3])]
    assert pool.get_ref_cnts([NULL]) == [0]
    assert pool.get_block_hashes([NULL]) == [None]
    # Token ids include the skipped blocks'; extra_keys follow the stored blocks only.
    assert pool.take_events() == [stored([ext(hs[0]), ext(hs[3])], None, list(range(64)))]


def test_pool_16_partial_to_full_promotion() -> None:
    pool = new_pool(10, hbs=4)
    req = PoolRequest(list(range(1, 15)), hash_block_size=4)  # 3 fine hashes, 14 tokens
    b = pool.get_new_blocks(2)
    fine = req.block_hashes
    assert pool.cache_partial_block(req, b[1], 12, 0, 8) == key(fine[2])
    pool.cache_full_blocks(req, b, 0, 1, 8, 0)
    assert pool.blocks[b[1]].block_hash_num_tokens == 12
    pool.take_events()
    req.append([15, 16])  # 4 fine hashes
    pool.cache_full_blocks(req, b, 1, 2, 8, 0)
    assert pool.blocks[b[1]].block_hash == key(req.block_hashes[3])
    assert pool.blocks[b[1]].block_hash_num_tokens == 16
    assert pool.get_cached_block(fine[2], [0]) is None
    # The promotion's BlockRemoved comes before the call's BlockStored (POOL-17).
    assert pool.take_events() == [
        removed(fine[2]),
        stored([ext(req.block_hashes[3])], ext(fine[1]), list(range(9, 17)), 8),
    ]
    pool.check_invariants()


def test_pool_16_promotion_removes_aliases_too() -> None:
    pool = new_pool(10, hbs=4)
    req = PoolRequest(list(range(1, 25)), hash_block_size=4)  # 6 fine hashes
    fine = req.block_hashes
    [b] = pool.get_new_blocks(1)
    pool.cache_partial_block(req, b, 20, 0, 16)  # primary fine[4] (20 tokens) ... as block 1
    pool.cache_partial_block(req, b, 4, 0, 16)  # alias fine[0] (primary covers more)
    pool.take_events()
    # Full key at 24 tokens for block index 0 with block_size 24 (k = 6).
    pool.cache_full_blocks(req, [b], 0, 1, 24, 0)
    events = take(pool)
    assert events[:2] == [removed(fine[4]), removed(fine[0])]
    assert events[2] == stored([ext(fine[5])], None, list(range(1, 25)), 24)
    assert pool.get_cached_block(fine[0], [0]) is None
    pool.check_invariants()


def test_pool_16_not_a_promotion_rejected_and_nothing_changes() -> None:
    """The second block fails the promotion check: the first must not have been cached."""

    def setup() -> tuple[BlockPool, PoolRequest, list[int]]:
        pool = new_pool(10)
        req = PoolRequest(list(range(64)))
        got = pool.get_new_blocks(4)
        pool.cache_full_blocks(req, got, 1, 2, 16, 0)  # got[1] holds hs[1], 32 tokens
        return pool, req, got

    a, req, got = setup()
    b, _, _ = setup()
    keys = [key(h) for h in req.block_hashes]
    with pytest.raises(InvalidArgumentError) as info:
        a.cache_full_blocks(req, got, 0, 3, 16, 0)
    assert isinstance(info.value, AssertionError)
    assert_same_state(a, b, keys)
    # The same key at a smaller count on another position is also not a promotion.
    with pytest.raises(InvalidArgumentError):
        a.cache_full_blocks(req, [got[1]], 0, 1, 16, 0)
    assert_same_state(a, b, keys)


def test_pool_17_one_stored_event_even_when_everything_is_skipped() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(48)))
    got = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [NULL, got[0], got[1]], 1, 3, 16, 0, [False, False])
    hs = req.block_hashes
    # Parent is view[0] although block 0 is null; no block stored; extra_keys None.
    assert pool.take_events() == [stored([], ext(hs[0]), list(range(16, 48)))]
    assert pool.get_block_hashes(got) == [None, None]


def test_pool_17_event_with_lora_salt_and_multimodal_extra_keys() -> None:
    """TV-R's extra keys: LoRA "lora-a", salt "salt-1" and an image at offset 3, length 20."""
    lora = LoRARequest("lora-a", 7)
    req = PoolRequest(
        list(range(1, 49)),
        lora_request=lora,
        cache_salt="salt-1",
        mm_features=[MMFeature("img-abc", PlaceholderRange(3, 20))],
    )
    pool = new_pool(10)
    got = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, got, 0, 3, 16, 0)
    hs = req.block_hashes
    [ev] = take(pool)
    assert ev == BlockStored(
        block_hashes=[ext(h) for h in hs],
        parent_block_hash=None,
        token_ids=list(range(1, 49)),
        block_size=16,
        lora_id=7,
        medium="GPU",
        lora_name="lora-a",
        extra_keys=[
            ("lora-a", ("img-abc", 3), "salt-1"),
            ("lora-a", ("img-abc", -13)),
            ("lora-a",),
        ],
        group_idx=0,
    )
    # num_cached = 1: the multimodal scan restarts at index 0; the salt only goes to block 0.
    pool2 = new_pool(10)
    got2 = pool2.get_new_blocks(3)
    pool2.cache_full_blocks(req, got2, 1, 2, 16, 2)
    [ev2] = take(pool2)
    assert ev2.extra_keys == [("lora-a", ("img-abc", -13))]
    assert ev2.parent_block_hash == ext(hs[0])
    assert (ev2.lora_id, ev2.lora_name, ev2.group_idx) == (7, "lora-a", 2)


def test_pool_17_multimodal_index_carries_over_stored_blocks_only() -> None:
    req = PoolRequest(
        list(range(48)),
        mm_features=[
            MMFeature("img-a", PlaceholderRange(2, 4)),
            MMFeature("img-b", PlaceholderRange(20, 4)),
        ],
    )
    pool = new_pool(10)
    got = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, got, 0, 3, 16, 0, [False, True, True])
    [ev] = take(pool)
    assert ev.extra_keys == [(("img-b", 4),), None]
    assert ev.token_ids == list(range(48))
    assert ev.lora_id is None and ev.lora_name is None


def test_pool_17_prompt_embeds_extra_key() -> None:
    """TV-R: embeddings ``float32 arange(64).reshape(16, 4)`` give key ``21b9ca0f…``."""
    torch = pytest.importorskip("torch")
    req = PoolRequest([0] * 16, prompt_embeds=torch.arange(64, dtype=torch.float32).reshape(16, 4))
    pool = new_pool(4)
    got = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, got, 0, 1, 16, 0)
    [ev] = take(pool)
    assert ev.extra_keys == [
        (bytes.fromhex("21b9ca0f94efa26b229b2d90151c5d0296c3944dc3053a8a28e871d289d50519"),)
    ]


def test_pool_17_no_extra_key_sources_gives_none_entries() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(32)))
    got = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, got, 0, 2, 16, 0)
    [ev] = take(pool)
    # The reference builds one (None) entry per stored block: a list, not None.
    assert ev.extra_keys is None or ev.extra_keys == [None, None]
    assert ev.extra_keys == [None, None]


def test_pool_17_events_off_needs_no_token_ids() -> None:
    """With events off the pool reads only ``block_hashes``."""

    class HashesOnly:
        def __init__(self, hashes: list[bytes]) -> None:
            self.block_hashes = hashes

    pool = new_pool(10, events=False)
    got = pool.get_new_blocks(2)
    hs = PoolRequest(list(range(32))).block_hashes
    pool.cache_full_blocks(HashesOnly(hs), got, 0, 2, 16, 0)
    assert pool.get_block_hashes(got) == [key(h) for h in hs]
    assert pool.take_events() == []


# --------------------------------------------------------------------------- POOL-20..22


def test_pool_20_evict_blocks_keeps_ref_cnts_and_queue() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(48)))
    got = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, got, 0, 3, 16, 0)
    pool.free_blocks([got[2]])
    pool.take_events()
    queue, refs = pool.get_all_free_block_ids(), pool.get_ref_cnts(range(10))
    pool.evict_blocks({got[0], got[2], 9})  # 9 has no key: nothing
    assert pool.get_all_free_block_ids() == queue
    assert pool.get_ref_cnts(range(10)) == refs
    hs = req.block_hashes
    assert pool.get_block_hashes(got) == [None, key(hs[1]), None]
    assert sorted(e.block_hashes[0] for e in take(pool)) == sorted([ext(hs[0]), ext(hs[2])])
    pool.evict_blocks([got[1], got[1], NULL])  # the second time: no key left
    assert pool.take_events() == [removed(hs[1])]
    pool.check_invariants()


def test_pool_20_evict_blocks_out_of_range() -> None:
    def setup() -> tuple[BlockPool, list[bytes]]:
        pool = new_pool(10)
        req = PoolRequest(list(range(32)))
        got = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, got, 0, 2, 16, 0)
        return pool, [key(h) for h in req.block_hashes]

    a, keys = setup()
    b, _ = setup()
    for ids in ([10], [1, 10], [2**40]):
        with pytest.raises(BlockIdError) as info:
            a.evict_blocks(ids)
        assert isinstance(info.value, AssertionError)
    # Negative ids: the reference indexes from the end; kvcore rejects them (documented).
    with pytest.raises(BlockIdError):
        a.evict_blocks([1, -1])
    with pytest.raises(TypeError):
        a.evict_blocks([1, "2"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        a.evict_blocks(3)  # type: ignore[arg-type]
    assert_same_state(a, b, keys)


def test_pool_21_reset_refused_while_blocks_are_in_use(caplog: pytest.LogCaptureFixture) -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(32)))
    got = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, got, 0, 2, 16, 0)
    pool.free_blocks(got[1:])
    twin = new_pool(10)
    got2 = twin.get_new_blocks(2)
    twin.cache_full_blocks(req, got2, 0, 2, 16, 0)
    twin.free_blocks(got2[1:])
    with caplog.at_level(logging.WARNING):
        assert pool.reset_prefix_cache() is False
    assert any("not freed" in r.getMessage() for r in caplog.records)
    assert_same_state(pool, twin, [key(h) for h in req.block_hashes])


def test_pool_21_reset_clears_keys_keeps_order() -> None:
    pool = new_pool(10, hbs=4)
    req = PoolRequest(list(range(1, 33)), hash_block_size=4)
    got = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, got, 0, 4, 8, 0)
    pool.cache_partial_block(req, got[0], 4, 0, 8)  # an alias
    pool.free_blocks(reversed(got))
    pool.touch([NULL])  # the null block's count does not matter
    order = pool.get_all_free_block_ids()
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert pool.get_all_free_block_ids() == order
    assert pool.get_block_hashes(range(10)) == [None] * 10
    assert all(pool.blocks[i].block_hash_num_tokens is None for i in range(10))
    assert pool.longest_cached_prefix(req.block_hashes, 8, [0]) == [[]]
    assert pool.take_events() == [AllBlocksCleared()]
    assert "cached_keys=0" in repr(pool)
    pool.check_invariants()
    # Keys can be stored again afterwards.
    again = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, again, 0, 1, 8, 0)
    assert pool.get_cached_block(req.block_hashes[1], [0]) == again


def test_pool_21_reset_without_events_emits_nothing() -> None:
    pool = new_pool(3, events=False)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == []


def test_pool_22_take_events_drains_in_order() -> None:
    pool = new_pool(5)
    req = PoolRequest(list(range(16)))
    [b] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b], 0, 1, 16, 0)
    pool.evict_blocks([b])
    events = take(pool)
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    assert pool.take_events() == []


def test_pool_22_events_off_always_empty() -> None:
    pool = new_pool(5, events=False)
    req = PoolRequest(list(range(32)))
    got = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, got, 0, 2, 16, 0)
    pool.free_blocks(got)
    pool.get_new_blocks(4)
    pool.free_blocks([1, 2, 3, 4])
    pool.reset_prefix_cache()
    assert pool.take_events() == []


# --------------------------------------------------------------------------- POOL-30, 31


def test_pool_30_partial_entry_event_and_key() -> None:
    pool = new_pool(10, hbs=4)
    req = PoolRequest(list(range(1, 15)), hash_block_size=4)  # 3 fine hashes
    fine = req.block_hashes
    [b] = pool.get_new_blocks(1)
    assert pool.cache_partial_block(req, b, 12, 3, 8) == key(fine[2], 3)
    assert pool.blocks[b].block_hash == key(fine[2], 3)
    assert pool.blocks[b].block_hash_num_tokens == 12
    assert pool.get_cached_block(fine[2], [3]) == [b]
    assert pool.take_events() == [
        stored([ext(fine[2])], ext(fine[1]), [9, 10, 11, 12], 4, group=3, extra_keys=[None])
    ]
    pool.check_invariants()


def test_pool_30_first_window_has_no_parent_and_gets_the_salt() -> None:
    pool = new_pool(10, hbs=4)
    req = PoolRequest(
        list(range(1, 15)), hash_block_size=4, cache_salt="s", lora_request=LoRARequest("l", 2)
    )
    fine = req.block_hashes
    a, b = pool.get_new_blocks(2)
    pool.cache_partial_block(req, a, 4, 0, 8)
    pool.cache_partial_block(req, b, 12, 0, 8)
    assert pool.take_events() == [
        stored(
            [ext(fine[0])],
            None,
            [1, 2, 3, 4],
            4,
            extra_keys=[("l", "s")],
            lora_id=2,
            lora_name="l",
        ),
        stored(
            [ext(fine[2])],
            ext(fine[1]),
            [9, 10, 11, 12],
            4,
            extra_keys=[("l",)],
            lora_id=2,
            lora_name="l",
        ),
    ]


def test_pool_30_partial_multimodal_scan_starts_at_the_last_item() -> None:
    """``mm start = -1`` when the window does not start at 0 (POOL-30)."""
    pool = new_pool(10, hbs=4)
    req = PoolRequest(
        list(range(1, 15)),
        hash_block_size=4,
        mm_features=[
            MMFeature("a", PlaceholderRange(1, 2)),
            MMFeature("b", PlaceholderRange(6, 4)),
        ],
    )
    [b] = pool.get_new_blocks(1)
    pool.cache_partial_block(req, b, 12, 0, 8)  # window [8, 12): only "b" is considered
    [ev] = take(pool)
    assert ev.extra_keys == [(("b", -2),)]


def test_pool_30_longer_partial_replaces_shorter_key() -> None:
    pool = new_pool(10, hbs=4)
    req = PoolRequest(list(range(1, 15)), hash_block_size=4)
    fine = req.block_hashes
    [b] = pool.get_new_blocks(1)
    pool.cache_partial_block(req, b, 4, 0, 8)
    pool.take_events()
    pool.cache_partial_block(req, b, 12, 0, 8)
    assert pool.blocks[b].block_hash == key(fine[2])
    assert pool.get_cached_block(fine[0], [0]) is None
    events = take(pool)
    assert events[0] == removed(fine[0])
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]


def test_pool_30_null_block_returns_none() -> None:
    pool = new_pool(10, hbs=4)
    req = PoolRequest(list(range(1, 15)), hash_block_size=4)
    before = snapshot(pool)
    # The null check comes first: even invalid arguments return None.
    assert pool.cache_partial_block(req, NULL, 12, 0, 8) is None
    assert pool.cache_partial_block(req, NULL, 16, 0, 8) is None
    assert snapshot(pool) == before
    assert pool.take_events() == []


@pytest.mark.parametrize(
    ("num_tokens", "block_size"),
    [
        (4, 4),  # block_size must exceed hbs
        (4, 2),
        (6, 6),  # block_size % hbs
        (8, 8),  # num_tokens % block_size == 0: not partial
        (16, 8),
        (0, 8),
        (6, 8),  # num_tokens % hbs != 0
        (20, 8),  # m = 5 > 3 hashes
        (-4, 8),
    ],
)
def test_pool_30_preconditions(num_tokens: int, block_size: int) -> None:
    def setup() -> tuple[BlockPool, list[int]]:
        pool = new_pool(10, hbs=4)
        req = PoolRequest(list(range(1, 17)), hash_block_size=4)
        got = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, got, 0, 1, 8, 0)
        return pool, got

    a, got = setup()
    b, _ = setup()
    req = PoolRequest(list(range(1, 15)), hash_block_size=4)  # 3 fine hashes
    with pytest.raises(InvalidArgumentError) as info:
        a.cache_partial_block(req, got[1], num_tokens, 0, block_size)
    assert isinstance(info.value, AssertionError)
    assert_same_state(a, b, [key(h) for h in req.block_hashes])


def test_pool_30_bad_block_id() -> None:
    pool = new_pool(10, hbs=4)
    req = PoolRequest(list(range(1, 15)), hash_block_size=4)
    for bad in (10, -1):
        with pytest.raises(BlockIdError) as info:
            pool.cache_partial_block(req, bad, 12, 0, 8)
        assert isinstance(info.value, IndexError)
    with pytest.raises(TypeError):
        pool.cache_partial_block(req, "1", 12, 0, 8)  # type: ignore[arg-type]
    pool.check_invariants()


# --------------------------------------------------------------------------- EVT


def test_evt_1_event_classes_and_field_order() -> None:
    names = [n for n, _ in [event_fields(stored([], None, []))]]
    assert names == ["BlockStored"]
    assert list(event_fields(stored([], None, []))[1]) == [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ]
    assert list(event_fields(removed(b"\x01" * 32))[1]) == ["block_hashes", "medium", "group_idx"]
    assert event_fields(AllBlocksCleared()) == ("AllBlocksCleared", {})


def test_evt_2_int_form_is_last_8_bytes_big_endian() -> None:
    pool = new_pool(5)
    h = bytes(range(32))
    req = PoolRequest(list(range(16)), block_hashes=[h])
    [b] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b], 0, 1, 16, 9)
    [ev] = take(pool)
    assert ev.block_hashes == [int.from_bytes(h[-8:], "big")]
    assert ev.group_idx == 9
    pool.evict_blocks([b])
    assert pool.take_events() == [BlockRemoved([int.from_bytes(h[-8:], "big")], "GPU", 9)]


@pytest.mark.parametrize("value", ["0", "00", " 0 "])
def test_evt_2_raw_bytes_when_disabled(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    pool = new_pool(5)
    req = PoolRequest(list(range(32)), digest_size=16)
    got = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, got, 1, 2, 16, 4)
    pool.evict_blocks([got[1]])
    monkeypatch.setenv(ENV_INT_HASHES, value)
    hs = req.block_hashes
    assert pool.take_events() == [
        stored([hs[1]], hs[0], list(range(16, 32)), group=4),
        BlockRemoved([hs[1]], "GPU", 4),
    ]


@pytest.mark.parametrize("value", ["1", "2", "-1"])
def test_evt_2_int_for_non_zero_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_INT_HASHES, value)
    pool = new_pool(5)
    req = PoolRequest(list(range(16)))
    got = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, got, 0, 1, 16, 0)
    [ev] = take(pool)
    assert ev.block_hashes == [ext(req.block_hashes[0])]


@pytest.mark.parametrize("value", ["true", "", "yes"])
def test_evt_2_non_integer_value_raises(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    pool = new_pool(5)
    req = PoolRequest(list(range(16)))
    got = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, got, 0, 1, 16, 0)
    monkeypatch.setenv(ENV_INT_HASHES, value)
    with pytest.raises(ValueError):
        pool.take_events()
    assert pool.get_block_hashes(got) == [key(req.block_hashes[0])]
    pool.check_invariants()


def test_evt_2_failed_conversion_keeps_the_events(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = new_pool(5)
    req = PoolRequest(list(range(16)))
    got = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, got, 0, 1, 16, 0)
    monkeypatch.setenv(ENV_INT_HASHES, "true")
    with pytest.raises(ValueError):
        pool.take_events()
    monkeypatch.setenv(ENV_INT_HASHES, "1")
    assert len(pool.take_events()) == 1


def test_evt_2_read_at_conversion_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable is read when events are taken, not when they are emitted."""
    pool = new_pool(5)
    req = PoolRequest(list(range(16)))
    got = pool.get_new_blocks(1)
    monkeypatch.setenv(ENV_INT_HASHES, "true")
    pool.cache_full_blocks(req, got, 0, 1, 16, 0)
    monkeypatch.setenv(ENV_INT_HASHES, "0")
    [ev] = take(pool)
    assert ev.block_hashes == [req.block_hashes[0]]


def test_evt_3_duplicates_show_up_in_events() -> None:
    pool = new_pool(10)
    req = PoolRequest(list(range(32)))
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, a, 0, 2, 16, 0)
    pool.cache_full_blocks(req, b, 0, 2, 16, 0)
    e1, e2 = pool.take_events()
    assert e1 == e2
    pool.evict_blocks([a[0]])
    assert pool.take_events() == [removed(req.block_hashes[0])]
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [b[0]]


# --------------------------------------------------------------------------- bad input


@dataclass
class Busy:
    """A pool in a busy state: held blocks, cached blocks in the queue, duplicates, an alias,
    two groups and undrained events."""

    pool: Any  # Any: the bad-input calls pass wrong types on purpose
    req: PoolRequest
    held: list[int]
    keys: list[bytes] = field(default_factory=list)


def busy(events: bool = True) -> Busy:
    pool = BlockPool(16, True, 4, events)
    req = PoolRequest(list(range(1, 40)), hash_block_size=4)  # 9 fine hashes, 39 tokens
    held = pool.get_new_blocks(5)  # [1..5]
    pool.cache_full_blocks(req, held, 0, 4, 8, 0)  # 4 blocks x 8 tokens
    pool.cache_partial_block(req, held[4], 36, 0, 8)  # partial primary key
    pool.cache_partial_block(req, held[3], 28, 0, 8)  # alias on a full block
    dup = pool.get_new_blocks(3)  # [6, 7, 8]
    pool.cache_full_blocks(req, dup, 0, 2, 8, 0)  # duplicates of 1, 2
    pool.cache_full_blocks(req, dup[2:], 0, 1, 4, 1)  # group 1
    pool.touch([held[0]])
    pool.free_blocks(reversed(dup))  # all hashed: 8, 7, 6 at the back
    keys = [key(h, g) for h in req.block_hashes for g in (0, 1)]
    return Busy(pool, req, held, keys)


BadCall = Callable[[Busy], object]

BAD_CALLS: list[tuple[str, BadCall, tuple[type[BaseException], ...]]] = [
    # POOL-5 / FQ-3
    (
        "get_new_blocks_too_many",
        lambda s: s.pool.get_new_blocks(100),
        (NoFreeBlocksError, ValueError),
    ),
    (
        "get_new_blocks_free_plus_one",
        lambda s: s.pool.get_new_blocks(s.pool.get_num_free_blocks() + 1),
        (NoFreeBlocksError, ValueError),
    ),
    (
        "get_new_blocks_negative",
        lambda s: s.pool.get_new_blocks(-1),
        (InvalidArgumentError, ValueError),
    ),
    ("get_new_blocks_str", lambda s: s.pool.get_new_blocks("1"), (TypeError,)),
    ("get_new_blocks_float", lambda s: s.pool.get_new_blocks(1.0), (TypeError,)),
    ("get_new_blocks_none", lambda s: s.pool.get_new_blocks(None), (TypeError,)),
    # POOL-9
    ("touch_out_of_range", lambda s: s.pool.touch([16]), (BlockIdError, IndexError)),
    ("touch_negative", lambda s: s.pool.touch([-1]), (BlockIdError, IndexError)),
    (
        "touch_valid_then_out_of_range",
        lambda s: s.pool.touch([9, 1, 10**12]),
        (BlockIdError, IndexError),
    ),
    ("touch_str_id", lambda s: s.pool.touch([9, "1"]), (TypeError,)),
    ("touch_float_id", lambda s: s.pool.touch([9.0]), (TypeError,)),
    ("touch_not_iterable", lambda s: s.pool.touch(9), (TypeError,)),
    ("touch_none", lambda s: s.pool.touch(None), (TypeError,)),
    # POOL-10
    ("free_a_free_block", lambda s: s.pool.free_blocks([9]), (DoubleFreeError, ValueError)),
    ("free_a_cached_free_block", lambda s: s.pool.free_blocks([6]), (DoubleFreeError, ValueError)),
    ("free_more_than_held", lambda s: s.pool.free_blocks([2, 3, 2]), (DoubleFreeError, ValueError)),
    (
        "free_held_twice_after_touch",
        lambda s: s.pool.free_blocks([1, 1, 1]),
        (DoubleFreeError, ValueError),
    ),
    ("free_out_of_range", lambda s: s.pool.free_blocks([2, 16]), (BlockIdError, IndexError)),
    ("free_negative", lambda s: s.pool.free_blocks([-3]), (BlockIdError, IndexError)),
    ("free_str", lambda s: s.pool.free_blocks([2, "3"]), (TypeError,)),
    ("free_none", lambda s: s.pool.free_blocks(None), (TypeError,)),
    # POOL-14..16
    (
        "cache_mask_too_long",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 10], 0, 2, 4, 2, [True] * 3),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "cache_mask_too_short",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 10], 0, 2, 4, 2, [True]),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "cache_mask_not_bools",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 10], 0, 2, 4, 2, ["x", 1]),
        (TypeError,),
    ),
    (
        "cache_view_too_short",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 10, 11, 12, 13], 0, 5, 8, 2),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "cache_fine_view_too_short",
        lambda s: s.pool.cache_full_blocks(s.req, list(range(1, 11)), 8, 10, 4, 2),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "cache_bs_not_multiple",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 10], 0, 2, 6, 2),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "cache_bs_zero",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 10], 0, 2, 0, 2),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "cache_not_a_promotion",
        lambda s: s.pool.cache_full_blocks(s.req, s.held, 0, 4, 8, 0),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "cache_not_a_promotion_second",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 2], 0, 2, 8, 0),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "cache_partial_then_shorter_full",
        lambda s: s.pool.cache_full_blocks(s.req, [5], 0, 1, 8, 0),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "cache_block_out_of_range",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 16], 0, 2, 4, 2),
        (BlockIdError, IndexError),
    ),
    (
        "cache_block_negative",
        lambda s: s.pool.cache_full_blocks(s.req, [9, -1], 0, 2, 4, 2),
        (BlockIdError, IndexError),
    ),
    (
        "cache_blocks_too_few",
        lambda s: s.pool.cache_full_blocks(s.req, [9], 0, 2, 4, 2),
        (InvalidArgumentError,),
    ),
    (
        "cache_negative_num_cached",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 10], -1, 2, 4, 2),
        (InvalidArgumentError,),
    ),
    (
        "cache_group_negative",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 10], 0, 2, 4, -1),
        (OverflowError,),
    ),
    (
        "cache_group_too_big",
        lambda s: s.pool.cache_full_blocks(s.req, [9, 10], 0, 2, 4, 2**32),
        (OverflowError,),
    ),
    (
        "cache_hash_not_bytes",
        lambda s: s.pool.cache_full_blocks(
            PoolRequest(
                [1] * 8,
                block_hashes=[b"\x01" * 32, "x"],  # type: ignore[list-item]
                hash_block_size=4,
            ),
            [9, 10],
            0,
            2,
            4,
            2,
        ),
        (TypeError,),
    ),
    (
        "cache_hash_too_long",
        lambda s: s.pool.cache_full_blocks(
            PoolRequest([1] * 8, block_hashes=[b"\x01" * 32, b"\x02" * 33], hash_block_size=4),
            [9, 10],
            0,
            2,
            4,
            2,
        ),
        (InvalidArgumentError,),
    ),
    (
        "cache_no_block_hashes",
        lambda s: s.pool.cache_full_blocks(object(), [9, 10], 0, 2, 4, 2),
        (AttributeError,),
    ),
    (
        "cache_no_token_ids",
        lambda s: s.pool.cache_full_blocks(
            type("R", (), {"block_hashes": s.req.block_hashes})(), [9, 10], 0, 2, 4, 2
        ),
        (AttributeError,),
    ),
    (
        "cache_blocks_not_ints",
        lambda s: s.pool.cache_full_blocks(s.req, [9, "10"], 0, 2, 4, 2),
        (TypeError,),
    ),
    # POOL-30
    (
        "partial_block_out_of_range",
        lambda s: s.pool.cache_partial_block(s.req, 16, 12, 0, 8),
        (BlockIdError, IndexError),
    ),
    (
        "partial_not_partial",
        lambda s: s.pool.cache_partial_block(s.req, 9, 16, 0, 8),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "partial_too_many_tokens",
        lambda s: s.pool.cache_partial_block(s.req, 9, 44, 0, 8),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "partial_bs_equals_hbs",
        lambda s: s.pool.cache_partial_block(s.req, 9, 6, 0, 4),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "partial_misaligned",
        lambda s: s.pool.cache_partial_block(s.req, 9, 13, 0, 8),
        (InvalidArgumentError, AssertionError),
    ),
    (
        "partial_group_negative",
        lambda s: s.pool.cache_partial_block(s.req, 9, 12, -1, 8),
        (OverflowError,),
    ),
    # POOL-20
    ("evict_out_of_range", lambda s: s.pool.evict_blocks([1, 16]), (BlockIdError, AssertionError)),
    ("evict_negative", lambda s: s.pool.evict_blocks([1, -16]), (BlockIdError, IndexError)),
    ("evict_str", lambda s: s.pool.evict_blocks([1, "x"]), (TypeError,)),
    # POOL-4 and batch helpers
    ("lookup_str", lambda s: s.pool.get_cached_block("x", [0]), (TypeError,)),
    (
        "lookup_group_negative",
        lambda s: s.pool.get_cached_block(s.req.block_hashes[0], [-1]),
        (OverflowError,),
    ),
    ("ref_cnts_out_of_range", lambda s: s.pool.get_ref_cnts([1, 16]), (BlockIdError, IndexError)),
    ("block_hashes_negative", lambda s: s.pool.get_block_hashes([-1]), (BlockIdError, IndexError)),
    (
        "count_evictable_out_of_range",
        lambda s: s.pool.count_evictable([16]),
        (BlockIdError, IndexError),
    ),
]


EVENTS_ONLY = {"cache_no_token_ids"}  # with events off the pool never reads the tokens


@pytest.mark.parametrize(
    ("name", "call", "classes", "events"),
    [
        pytest.param(*c, ev, id=f"{c[0]}-{'events' if ev else 'quiet'}")
        for c in BAD_CALLS
        for ev in (True, False)
        if ev or c[0] not in EVENTS_ONLY
    ],
)
def test_bad_input_raises_and_changes_nothing(
    name: str,
    call: BadCall,
    classes: tuple[type[BaseException], ...],
    events: bool,
) -> None:
    a, b = busy(events), busy(events)
    a.pool.check_invariants()
    with pytest.raises(classes[0]) as info:
        call(a)
    for cls in classes:
        assert isinstance(info.value, cls), (name, type(info.value).__mro__, cls)
    if issubclass(classes[0], KvcoreError):
        assert str(info.value)
    assert_same_state(a.pool, b.pool, a.keys)


def test_busy_state_is_what_the_bad_input_tests_assume() -> None:
    s = busy()
    pool = s.pool
    assert pool.get_ref_cnts(range(1, 9)) == [2, 1, 1, 1, 1, 0, 0, 0]
    assert pool.get_all_free_block_ids() == [9, 10, 11, 12, 13, 14, 15, 8, 7, 6]
    fine = s.req.block_hashes
    assert pool.get_cached_block(fine[1], [0]) == [1]
    assert pool.get_cached_block(fine[6], [0]) == [4]  # alias on block 4
    assert pool.get_cached_block(fine[8], [0]) == [5]  # partial primary
    assert pool.get_cached_block(fine[0], [1]) == [8]
    assert pool.count_evictable([1, 6, 7, 8, NULL, 9]) == 4
    assert len(pool.take_events()) == 5
    pool.check_invariants()


def test_count_evictable() -> None:
    pool = new_pool(6)
    got = pool.get_new_blocks(2)
    assert pool.count_evictable([*got, 3, 3, NULL]) == 2
    assert pool.count_evictable([]) == 0


# --------------------------------------------------------------------------- S1..S3 (pool level)

NONE_HASH_SHA256_CBOR_SEED0 = bytes.fromhex(
    "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
)


def sha256_cbor_request(tokens: list[int], monkeypatch: pytest.MonkeyPatch) -> PoolRequest:
    """A request hashed like the scenarios (sha256_cbor, seed 0, hbs 16)."""
    from kvcore import hashing

    monkeypatch.setattr(hashing, "NONE_HASH", NONE_HASH_SHA256_CBOR_SEED0, raising=False)
    hashes: list[bytes] = []
    parent: bytes | None = None
    for s in range(0, len(tokens) - 15, 16):
        parent = hashing.hash_block_tokens(hashing.sha256_cbor, parent, tokens[s : s + 16])
        hashes.append(parent)
    return PoolRequest(tokens, block_hashes=hashes)


B1_INT = 3236607068019569386
B2_INT = 2758186210834249151


def test_s1_prefix_reuse_and_free_order(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = new_pool(10)
    assert pool.get_all_free_block_ids() == list(range(1, 10)) and pool.get_usage() == 0.0
    r1 = sha256_cbor_request(list(range(1, 41)), monkeypatch)
    assert [ext(h) for h in r1.block_hashes] == [B1_INT, B2_INT]
    assert pool.longest_cached_prefix(r1.block_hashes, 2, [0]) == [[]]
    b1 = pool.get_new_blocks(3)
    pool.cache_full_blocks(r1, b1, 0, 2, 16, 0)
    assert b1 == [1, 2, 3] and pool.get_all_free_block_ids() == [4, 5, 6, 7, 8, 9]
    assert round(pool.get_usage(), 4) == 0.3333
    assert pool.take_events() == [
        stored([B1_INT, B2_INT], None, list(range(1, 33)), extra_keys=[None, None])
    ]
    pool.free_blocks(reversed(b1))
    assert pool.get_all_free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    # r2 hits [1, 2] and gets block 3.
    r2 = sha256_cbor_request([*range(1, 33), *range(100, 108)], monkeypatch)
    hit = pool.longest_cached_prefix(r2.block_hashes, 2, [0])[0]
    assert hit == [1, 2]
    pool.touch(hit)
    b2 = hit + pool.get_new_blocks(1)
    pool.cache_full_blocks(r2, b2, 2, 2, 16, 0)
    assert b2 == [1, 2, 3] and pool.get_all_free_block_ids() == [4, 5, 6, 7, 8, 9]
    assert pool.take_events() == []
    # r3 hits only [1] (MGR-7 caps at num_tokens - 1); block 4 duplicates block 2.
    r3 = sha256_cbor_request(list(range(1, 33)), monkeypatch)
    hit3 = pool.longest_cached_prefix(r3.block_hashes, (32 - 1) // 16, [0])[0]
    assert hit3 == [1]
    pool.touch(hit3)
    b3 = hit3 + pool.get_new_blocks(1)
    pool.cache_full_blocks(r3, b3, 1, 2, 16, 0)
    assert b3 == [1, 4]
    assert pool.take_events() == [stored([B2_INT], B1_INT, list(range(17, 33)), extra_keys=[None])]
    assert pool.get_ref_cnts([1, 2, 3, 4]) == [2, 1, 1, 1]
    pool.free_blocks(reversed(b2))
    pool.free_blocks(reversed(b3))
    assert pool.get_all_free_block_ids() == [3, 5, 6, 7, 8, 9, 2, 4, 1]
    assert pool.reset_prefix_cache() is True
    assert pool.get_all_free_block_ids() == [3, 5, 6, 7, 8, 9, 2, 4, 1]
    assert pool.take_events() == [AllBlocksCleared()]
    pool.check_invariants()


def test_s2_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = new_pool(5)
    r1 = sha256_cbor_request(list(range(1, 34)), monkeypatch)
    b1 = pool.get_new_blocks(3)
    pool.cache_full_blocks(r1, b1, 0, 2, 16, 0)
    assert b1 == [1, 2, 3] and pool.get_all_free_block_ids() == [4]
    pool.take_events()
    pool.free_blocks(reversed(b1))
    assert pool.get_all_free_block_ids() == [3, 4, 2, 1]
    r2 = sha256_cbor_request(list(range(1001, 1065)), monkeypatch)
    assert pool.longest_cached_prefix(r2.block_hashes, 3, [0]) == [[]]
    b2 = pool.get_new_blocks(4)
    pool.cache_full_blocks(r2, b2, 0, 4, 16, 0)
    assert b2 == [3, 4, 2, 1]
    r2_ints = [13873306188318471009, 6954383379811354547, 4887838800748829271, 17326173464932708408]
    assert pool.take_events() == [
        BlockRemoved([B2_INT], "GPU", 0),
        BlockRemoved([B1_INT], "GPU", 0),
        stored(r2_ints, None, list(range(1001, 1065)), extra_keys=[None] * 4),
    ]
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_usage() == 1.0
    pool.check_invariants()


def test_s3_duplicates_under_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = new_pool(10)
    ra = sha256_cbor_request(list(range(1, 33)), monkeypatch)
    rb = sha256_cbor_request(list(range(1, 33)), monkeypatch)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(ra, a, 0, 2, 16, 0)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(rb, b, 0, 2, 16, 0)
    assert (a, b) == ([1, 2], [3, 4])
    e1, e2 = pool.take_events()
    assert e1 == e2 == stored([B1_INT, B2_INT], None, list(range(1, 33)), extra_keys=[None] * 2)
    probe = sha256_cbor_request(list(range(1, 34)), monkeypatch)
    assert pool.longest_cached_prefix(probe.block_hashes, 2, [0]) == [[1, 2]]
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert pool.get_all_free_block_ids() == [5, 6, 7, 8, 9, 2, 1, 4, 3]
    assert pool.get_new_blocks(6) == [5, 6, 7, 8, 9, 2]
    assert pool.take_events() == [BlockRemoved([B2_INT], "GPU", 0)]
    assert pool.longest_cached_prefix(probe.block_hashes, 2, [0]) == [[1, 4]]
    pool.check_invariants()


def test_lookups_helper_reads_every_key() -> None:
    s = busy()
    found = lookups(s.pool, s.keys)
    assert sum(v is not None for v in found.values()) == 7


def test_pool_size_limit_is_a_clear_error() -> None:
    """POOL-1: a pool above 2**31 blocks is refused with a ValueError naming the limit."""
    with pytest.raises(ValueError, match="2\\*\\*31"):
        BlockPool(2**31 + 1, True, 16, False)
