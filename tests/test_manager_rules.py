"""KVCacheManager, coordinators and single-type managers, rule by rule (SPEC §7–15, TV-S).

Every test names the rules it checks. The scenarios S1–S4 follow SPEC §19 TV-S exactly:
sha256_cbor hashing with ``PYTHONHASHSEED=0`` (NONE_HASH = sha256(cbor("0"))), events on.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import pytest

from kvcore.blocks import KVCacheBlocks
from kvcore.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
)
from kvcore.errors import InvalidArgumentError, KvcoreError
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcore.manager import KVCacheManager, PrefixCacheStats
from kvcore.request import Request, RequestStatus
from kvcore.single_type import (
    FullAttentionManager,
    MambaManager,
)
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

# --------------------------------------------------------------------------------------------
# Helpers: a sha256_cbor request hasher (SPEC §5) with the PYTHONHASHSEED=0 NONE_HASH.

NONE_HASH = hashlib.sha256(cbor2.dumps("0")).digest()
ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 64, "dtype": "float16"}


def ext(h: bytes) -> int:
    """EVT-2 int form of a hash."""
    return int.from_bytes(h[-8:], "big")


def make_hasher(hbs: int) -> Callable[[Any], list[bytes]]:
    """RH-1 with sha256_cbor, LoRA and salt extras."""

    def hasher(req: Any) -> list[bytes]:
        start = len(req.block_hashes) * hbs
        parent = req.block_hashes[-1] if req.block_hashes else NONE_HASH
        out: list[bytes] = []
        tokens = req.all_token_ids
        while start + hbs <= req.num_tokens:
            extra: list[Any] = []
            if req.lora_request is not None:
                extra.append(req.lora_request.lora_name)
            if start == 0 and req.cache_salt:
                extra.append(req.cache_salt)
            payload = (parent, tuple(tokens[start : start + hbs]), tuple(extra) if extra else None)
            parent = hashlib.sha256(cbor2.dumps(payload)).digest()
            out.append(parent)
            start += hbs
        return out

    return hasher


def full(bs: int = 16, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, **ATTN, **kw)


def swa(bs: int = 16, w: int = 32) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, sliding_window=w, **ATTN)


def make_manager(
    num_blocks: int,
    specs: Sequence[KVCacheSpec] | None = None,
    *,
    max_model_len: int = 1024,
    sbs: int | None = None,
    hbs: int | None = None,
    eagle_groups: Sequence[int] = (),
    **kw: Any,
) -> KVCacheManager:
    specs = list(specs) if specs is not None else [full()]
    groups = [
        KVCacheGroupSpec([f"layer.{i}"], s, is_eagle_group=i in eagle_groups)
        for i, s in enumerate(specs)
    ]
    bs = specs[0].block_size if specs else 16
    kw.setdefault("enable_kv_cache_events", True)
    return KVCacheManager(
        KVCacheConfig(num_blocks, [], groups),
        max_model_len=max_model_len,
        scheduler_block_size=sbs if sbs is not None else bs,
        hash_block_size=hbs if hbs is not None else bs,
        **kw,
    )


def req(rid: str, tokens: Sequence[int], hbs: int = 16, **kw: Any) -> Request:
    return Request(rid, list(tokens), block_hasher=make_hasher(hbs), **kw)


def queue(m: KVCacheManager) -> list[int]:
    return list(m.block_pool.get_all_free_block_ids())


def refs(m: KVCacheManager, ids: Sequence[int]) -> list[int]:
    return list(m.block_pool.get_ref_cnts(list(ids)))


def num_cached(m: KVCacheManager, rid: str) -> int | None:
    """STM-1's num_cached_block entry of a single-group manager."""
    return m.coordinator.single_type_managers[0].num_cached_block.get(rid)


def r1to(n: int) -> list[int]:
    return list(range(1, n + 1))


B1 = ext(hashlib.sha256(cbor2.dumps((NONE_HASH, tuple(r1to(16)), None))).digest())


# --------------------------------------------------------------------------------------------
# TV-S scenarios


def test_tv_s1_prefix_reuse_and_free_order() -> None:
    """TV-S1 (MGR-7, ALLOC-12, POOL-10/12, EVT-3, FA-2, POOL-21)."""
    m = make_manager(10)
    assert queue(m) == r1to(9) and m.usage == 0.0
    r1 = req("r1", r1to(40))
    hit, n = m.get_computed_blocks(r1)
    assert hit.blocks == ((),) and n == 0
    out = m.allocate_slots(r1, 40)
    assert out is not None and out.get_block_ids() == ([1, 2, 3],)
    assert queue(m) == [4, 5, 6, 7, 8, 9]
    assert m.usage == pytest.approx(0.3333, abs=1e-4)
    events = m.take_events()
    assert events == [
        BlockStored(
            block_hashes=[3236607068019569386, 2758186210834249151],
            parent_block_hash=None,
            token_ids=r1to(32),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None, None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            kv_cache_spec_sliding_window=None,
        )
    ]
    m.free(r1)
    assert queue(m) == [3, 4, 5, 6, 7, 8, 9, 2, 1]

    r2 = req("r2", r1to(32) + list(range(100, 108)))
    hit, n = m.get_computed_blocks(r2)
    assert hit.get_block_ids() == ([1, 2],) and n == 32
    out = m.allocate_slots(r2, 8, 32, hit)
    assert out is not None and out.get_block_ids() == ([3],)
    assert m.get_block_ids("r2") == ([1, 2, 3],)
    assert queue(m) == [4, 5, 6, 7, 8, 9]
    assert m.take_events() == []

    r3 = req("r3", r1to(32))
    hit, n = m.get_computed_blocks(r3)
    assert hit.get_block_ids() == ([1],) and n == 16
    out = m.allocate_slots(r3, 16, 16, hit)
    assert out is not None and out.get_block_ids() == ([4],)
    (stored,) = m.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [2758186210834249151]
    assert stored.parent_block_hash == 3236607068019569386
    assert stored.token_ids == list(range(17, 33))
    assert refs(m, [1, 2, 3, 4]) == [2, 1, 1, 1]
    assert m.get_num_common_prefix_blocks("r2") == [1]

    m.free(r2)
    m.free(r3)
    assert queue(m) == [3, 5, 6, 7, 8, 9, 2, 4, 1]
    assert m.reset_prefix_cache() is True
    assert queue(m) == [3, 5, 6, 7, 8, 9, 2, 4, 1]
    assert m.take_events() == [AllBlocksCleared()]


def test_tv_s2_eviction() -> None:
    """TV-S2 (POOL-6 eviction events, ALLOC-13 order, POOL-21 failure, POOL-3)."""
    m = make_manager(5)
    r1 = req("r1", r1to(33))
    out = m.allocate_slots(r1, 33)
    assert out is not None and out.get_block_ids() == ([1, 2, 3],)
    assert queue(m) == [4]
    m.free(r1)
    assert queue(m) == [3, 4, 2, 1]
    m.take_events()
    r2 = req("r2", range(1001, 1065))
    assert m.get_computed_blocks(r2)[1] == 0
    out = m.allocate_slots(r2, 64)
    assert out is not None and out.get_block_ids() == ([3, 4, 2, 1],)
    events = m.take_events()
    assert events[:2] == [
        BlockRemoved(block_hashes=[2758186210834249151], medium="GPU", group_idx=0),
        BlockRemoved(block_hashes=[3236607068019569386], medium="GPU", group_idx=0),
    ]
    stored = events[2]
    assert len(events) == 3 and isinstance(stored, BlockStored)
    assert stored.block_hashes == [
        13873306188318471009,
        6954383379811354547,
        4887838800748829271,
        17326173464932708408,
    ]
    assert stored.parent_block_hash is None and len(stored.token_ids) == 64
    r3 = req("r3", r1to(19))
    assert m.allocate_slots(r3, 19) is None
    assert m.reset_prefix_cache() is False
    assert m.usage == 1.0


def test_tv_s3_duplicates_under_eviction() -> None:
    """TV-S3 (MAP-1 duplicates, EVT-3, MAP-2 earliest block)."""
    m = make_manager(10)
    ra, rb = req("ra", r1to(32)), req("rb", r1to(32))
    a = m.allocate_slots(ra, 32)
    b = m.allocate_slots(rb, 32)
    assert a is not None and b is not None
    assert a.get_block_ids() == ([1, 2],) and b.get_block_ids() == ([3, 4],)
    e1, e2 = m.take_events()
    assert e1 == e2 and isinstance(e1, BlockStored) and len(e1.block_hashes) == 2
    assert m.get_computed_blocks(req("q", r1to(33)))[0].get_block_ids() == ([1, 2],)
    m.free(ra)
    m.free(rb)
    assert queue(m) == [5, 6, 7, 8, 9, 2, 1, 4, 3]
    out = m.allocate_slots(req("big", range(500, 596)), 96)
    assert out is not None and out.get_block_ids() == ([5, 6, 7, 8, 9, 2],)
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(block_hashes=[2758186210834249151], medium="GPU", group_idx=0)]
    assert m.get_computed_blocks(req("q2", r1to(33)))[0].get_block_ids() == ([1, 4],)


def test_tv_s4_hybrid_full_plus_sliding_window() -> None:
    """TV-S4 (COORD-9/11, SWA-1 cap 7, SWA-2/STM-7 frees, MGR-20 order, SWA-3 hit)."""
    m = make_manager(30, [full(), swa()], max_num_batched_tokens=64)
    swa_mgr = m.coordinator.single_type_managers[1]
    assert swa_mgr.admission_cap == 7
    assert isinstance(m.coordinator, HybridKVCacheCoordinator)
    r1 = req("r1", r1to(100))
    out = m.allocate_slots(r1, 100)
    assert out is not None
    assert out.get_block_ids() == (r1to(7), list(range(8, 15)))
    events = m.take_events()
    assert len(events) == 2
    e0, e1 = events
    assert isinstance(e0, BlockStored) and isinstance(e1, BlockStored)
    assert e0.block_hashes == e1.block_hashes and len(e0.block_hashes) == 6
    assert (e0.group_idx, e0.kv_cache_spec_kind, e0.kv_cache_spec_sliding_window) == (
        0,
        "full_attention",
        None,
    )
    assert (e1.group_idx, e1.kv_cache_spec_kind, e1.kv_cache_spec_sliding_window) == (
        1,
        "sliding_window",
        32,
    )
    r1.num_computed_tokens = 100
    r1.append_output_token_ids(101)
    before = queue(m)
    out = m.allocate_slots(r1, 1)
    assert out is not None and out.get_block_ids() == ([], [])
    assert out is m.empty_kv_cache_blocks
    assert m.get_block_ids("r1")[1] == [0, 0, 0, 0, 12, 13, 14]
    assert queue(m) == [*before, 11, 10, 9, 8]
    m.free(r1)
    assert queue(m) == [14, 7, *range(15, 30), 11, 10, 9, 8, 6, 5, 4, 3, 2, 1, 13, 12]
    r2 = req("r2", r1to(100))
    hit, n = m.get_computed_blocks(r2)
    assert n == 96
    assert hit.get_block_ids() == (r1to(6), [0, 0, 0, 0, 12, 13])
    out = m.allocate_slots(r2, 4, 96, hit)
    assert out is not None and out.get_block_ids() == ([14], [7])


# --------------------------------------------------------------------------------------------
# §8 KVCacheManager


def test_mgr_1_watermark_and_defaults() -> None:
    """MGR-1: watermark_blocks truncates; negative watermark raises AssertionError."""
    m = make_manager(10, watermark=0.25)
    assert m.watermark_blocks == 2
    with pytest.raises(AssertionError):
        make_manager(10, watermark=-0.1)
    # Construction errors of the coordinator come first (COORD-2 before MGR-1).
    with pytest.raises(AssertionError, match="scheduler_block_size"):
        make_manager(10, sbs=24, watermark=-1.0)


def test_mgr_2_mgr_3_mgr_4_construction() -> None:
    """MGR-2 pool/groups, MGR-3 shared empty instance, MGR-4 metadata and stats."""
    m = make_manager(10, log_stats=True)
    assert m.block_pool is m.coordinator.block_pool and m.num_kv_cache_groups == 1
    assert m.empty_kv_cache_blocks.blocks == ((),)
    assert m.create_kv_cache_blocks(([],)) is m.empty_kv_cache_blocks
    assert m.create_kv_cache_blocks(([1],)).get_block_ids() == ([1],)
    assert m.kv_cache_event_metadata == (("full_attention", None),)
    assert isinstance(m.prefix_cache_stats, PrefixCacheStats)
    assert make_manager(10).prefix_cache_stats is None


def test_mgr_6_no_lookup_when_caching_off_or_skip() -> None:
    """MGR-6: caching off or skip_reading_prefix_cache → (empty, 0), no stats."""
    m = make_manager(10, log_stats=True)
    r = req("a", r1to(40))
    m.allocate_slots(r, 40)
    skip = req("b", r1to(40), skip_reading_prefix_cache=True)
    blocks, n = m.get_computed_blocks(skip)
    assert blocks is m.empty_kv_cache_blocks and n == 0
    assert m.prefix_cache_stats == PrefixCacheStats()
    off = make_manager(10, enable_caching=False)
    assert isinstance(off.coordinator, KVCacheCoordinatorNoPrefixCache)
    off.allocate_slots(req("a", r1to(40)), 40)
    assert off.get_computed_blocks(req("b", r1to(40)))[1] == 0
    assert off.take_events() == []


def test_mgr_7_last_token_recomputed_and_lookup_is_pure() -> None:
    """MGR-7: a fully cached 32-token prompt hits 16; lookups change no ref count; STAT-1."""
    m = make_manager(10, log_stats=True)
    r = req("a", r1to(32))
    m.allocate_slots(r, 32)
    m.free(r)
    q_before = queue(m)
    hit, n = m.get_computed_blocks(req("b", r1to(32)))
    assert n == 16 and hit.get_block_ids() == ([1],)
    assert queue(m) == q_before and refs(m, [1, 2]) == [0, 0]
    m.get_computed_blocks(req("c", [9] * 20))  # a miss is recorded too
    pre = req("d", r1to(40))
    pre.num_preemptions = 1
    m.get_computed_blocks(pre)
    stats = m.make_prefix_cache_stats()
    assert stats == PrefixCacheStats(
        requests=2, queries=52, hits=16, preempted_requests=1, preempted_queries=40,
        preempted_hits=32,
    )  # fmt: skip
    assert m.prefix_cache_stats == PrefixCacheStats()
    assert make_manager(4).make_prefix_cache_stats() is None


def test_alloc_1_zero_tokens_and_negative_counts_raise_value_error() -> None:
    """ALLOC-1: zero new tokens without external tokens → ValueError; negatives too."""
    m = make_manager(10)
    r = req("a", r1to(20))
    with pytest.raises(ValueError):
        m.allocate_slots(r, 0)
    bad: tuple[dict[str, Any], ...] = (
        {"num_new_tokens": -1},
        {"num_new_tokens": 4, "num_lookahead_tokens": -1},
        {"num_new_tokens": 4, "num_external_computed_tokens": -16},
        {"num_new_tokens": 4, "reserved_blocks": -1},
        {"num_new_tokens": 4, "num_new_computed_tokens": -16},
    )
    for kwargs in bad:
        with pytest.raises(InvalidArgumentError):
            m.allocate_slots(r, **kwargs)
    assert queue(m) == r1to(9) and m.get_block_ids("a") == ([],)
    # External tokens alone are fine (async KV load).
    out = m.allocate_slots(r, 0, num_external_computed_tokens=16)
    assert out is not None and m.get_block_ids("a") == ([1],)


def test_alloc_3_watermark_applies_to_waiting_and_preempted_only() -> None:
    """ALLOC-3: the watermark applies to WAITING/PREEMPTED with has_scheduled_reqs."""
    m = make_manager(10, watermark=0.5)  # 5 blocks of watermark, 9 free
    r = req("a", r1to(80))
    assert m.allocate_slots(r, 80) is None  # 5 + 5 > 9
    assert m.allocate_slots(r, 80, has_scheduled_reqs=False) is not None
    r2 = req("b", r1to(64))
    r2.status = RequestStatus.RUNNING
    assert m.allocate_slots(r2, 16) is not None  # no watermark for a running request
    r3 = req("c", r1to(16))
    r3.status = RequestStatus.PREEMPTED
    assert m.allocate_slots(r3, 16) is None  # 1 + 5 > 3
    assert m.allocate_slots(r3, 16, has_scheduled_reqs=False) is not None


def test_alloc_4_full_sequence_gate_ignores_reserved_blocks() -> None:
    """ALLOC-4: the gate uses min(num_tokens, max_model_len), ignores reserved_blocks."""
    m = make_manager(10)
    r = req("a", r1to(150))
    assert m.allocate_slots(r, 16, full_sequence_must_fit=True) is None  # 10 blocks > 9
    assert m.get_block_ids("a") == ([],) and queue(m) == r1to(9)
    m2 = make_manager(10, max_model_len=128)
    r = req("a", r1to(150))
    out = m2.allocate_slots(r, 16, full_sequence_must_fit=True, reserved_blocks=0)
    assert out is not None and out.get_block_ids() == ([1],)
    # reserved_blocks is checked only by ALLOC-7: 1 + 0 <= 8 - 7.
    r2 = req("b", r1to(100))
    assert m2.allocate_slots(r2, 16, full_sequence_must_fit=True, reserved_blocks=7) is not None
    r3 = req("c", r1to(16))
    assert m2.allocate_slots(r3, 16, full_sequence_must_fit=True, reserved_blocks=7) is None


def test_alloc_5_lookahead_slots_capped_by_max_model_len() -> None:
    """ALLOC-5: need_slot = min(main + lookahead, max_model_len); ALLOC-11 caches real tokens."""
    m = make_manager(20, max_model_len=64)
    r = req("a", r1to(16))
    out = m.allocate_slots(r, 16, num_lookahead_tokens=40)
    assert out is not None and out.get_block_ids() == ([1, 2, 3, 4],)
    assert num_cached(m, "a") == 1


def test_alloc_6_skipped_blocks_freed_even_when_allocation_fails() -> None:
    """ALLOC-6: remove_skipped_blocks runs before the capacity check and is kept."""
    m = make_manager(8, [swa(16, 32)])
    r = req("a", r1to(80))
    out = m.allocate_slots(r, 80)
    assert out is not None and out.get_block_ids() == ([1, 2, 3, 4, 5],)
    r.num_computed_tokens = 80
    assert m.allocate_slots(r, 200) is None  # needs 13 more, has only 6
    assert m.get_block_ids("a") == ([0, 0, 0, 4, 5],)
    assert queue(m) == [6, 7, 3, 2, 1]


def test_alloc_7_reserved_blocks_and_capacity() -> None:
    """ALLOC-7: need + watermark > free - reserved → None, nothing allocated."""
    m = make_manager(10)
    r = req("a", r1to(64))
    assert m.allocate_slots(r, 64, reserved_blocks=6) is None
    assert m.get_block_ids("a") == ([],)
    assert m.allocate_slots(r, 64, reserved_blocks=5) is not None


def test_alloc_8_identity_test_on_empty_hits() -> None:
    """ALLOC-8: a fresh empty KVCacheBlocks still registers the request (0 cached)."""
    m = make_manager(10)
    m.allocate_slots(req("a", r1to(10)), 10)
    assert num_cached(m, "a") is None  # STM-6: shorter than a block
    m.allocate_slots(req("b", r1to(10)), 10, 0, KVCacheBlocks(((),)))
    assert num_cached(m, "b") == 0
    m.allocate_slots(req("c", r1to(10)), 10, 0, m.empty_kv_cache_blocks)
    assert num_cached(m, "c") is None


def test_alloc_9_alloc_12_result_excludes_hits() -> None:
    """ALLOC-9/12: the result holds only new blocks; empty instance when none."""
    m = make_manager(10)
    m.allocate_slots(req("a", r1to(48)), 48)
    r = req("b", r1to(48))
    hit, n = m.get_computed_blocks(r)
    assert n == 32
    out = m.allocate_slots(r, 16, n, hit)
    assert out is not None and out.get_block_ids() == ([4],)
    assert m.get_block_ids("b") == ([1, 2, 4],)
    r.num_computed_tokens = 48
    r.append_output_token_ids(5)
    out = m.allocate_slots(r, 1)
    assert out is not None and out.get_block_ids() == ([5],)
    r.num_computed_tokens = 49
    r.append_output_token_ids(6)
    assert m.allocate_slots(r, 1) is m.empty_kv_cache_blocks


def test_alloc_10_alloc_11_caching_cap_and_delay() -> None:
    """ALLOC-10: delay_cache_blocks skips caching; ALLOC-11 caps at r.num_tokens."""
    m = make_manager(10)
    r = req("a", r1to(20))
    out = m.allocate_slots(r, 20 + 28)  # 28 unverified draft tokens
    assert out is not None and len(out.get_block_ids()[0]) == 3
    stored = m.take_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert len(stored[0].block_hashes) == 1
    d = req("d", r1to(40))
    m.allocate_slots(d, 40, delay_cache_blocks=True)
    assert m.take_events() == []
    assert num_cached(m, "d") is None
    m.cache_blocks(d, 40)
    assert len(m.take_events()) == 1


def test_alloc_13_event_order_external_then_new_then_stored() -> None:
    """ALLOC-13: evictions by external allocation, then by new blocks, then BlockStored."""
    m = make_manager(5)
    m.allocate_slots(req("x", r1to(64)), 64)
    m.free(req("x", []))
    m.take_events()
    r = req("y", range(1000, 1064))
    out = m.allocate_slots(r, 32, 0, None, num_external_computed_tokens=32)
    assert out is not None and out.get_block_ids() == ([2, 1],)
    assert m.get_block_ids("y") == ([4, 3, 2, 1],)
    kinds = [type(e).__name__ for e in m.take_events()]
    assert kinds == ["BlockRemoved"] * 4 + ["BlockStored"]


def test_coord_5_running_request_with_hits_raises_and_state_unchanged() -> None:
    """COORD-5: hits for a running request raise AssertionError before any change."""
    m = make_manager(10)
    m.allocate_slots(req("a", r1to(40)), 40)
    r = req("b", r1to(40))
    m.allocate_slots(r, 16)
    q = queue(m)
    with pytest.raises(AssertionError):
        m.allocate_slots(r, 16, 16, KVCacheBlocks(([1],)))
    with pytest.raises(KvcoreError):
        m.allocate_slots(r, 16, 16, KVCacheBlocks(([1],)))
    assert queue(m) == q and m.get_block_ids("b") == ([4],)
    with pytest.raises(ValueError):
        m.allocate_slots(req("c", r1to(40)), 16, 16, KVCacheBlocks(([1], [2])))


def test_mgr_20_free_reverse_order_and_unknown_noop() -> None:
    """MGR-20: free pops and frees in reverse; an unknown id is a no-op."""
    m = make_manager(10, enable_caching=False)
    m.allocate_slots(req("a", r1to(40)), 40)
    m.free(req("zzz", []))
    m.free(req("a", []))
    assert queue(m) == [3, 2, 1, 4, 5, 6, 7, 8, 9]
    m.free(req("a", []))
    assert queue(m) == [3, 2, 1, 4, 5, 6, 7, 8, 9]


def test_mgr_21_pop_blocks_for_free() -> None:
    """MGR-21: pops state, returns blocks group by group; the caller frees them later."""
    m = make_manager(30, [full(), swa()], max_num_batched_tokens=64)
    m.allocate_slots(req("a", r1to(40)), 40)
    blocks = m.pop_blocks_for_free(req("a", []))
    assert blocks == [1, 2, 3, 4, 5, 6]
    assert m.get_block_ids("a") == ([], []) and m.get_blocks("a") is m.empty_kv_cache_blocks
    assert refs(m, blocks) == [1] * 6
    m.block_pool.free_blocks(blocks[::-1])
    assert refs(m, blocks) == [0] * 6


def test_mgr_22_fa_2_common_prefix_blocks() -> None:
    """MGR-22 / FA-2 / STM-12: leading blocks held by every tracked request."""
    m = make_manager(20, [full(), swa()], max_num_batched_tokens=64)
    m.allocate_slots(req("a", r1to(64)), 64)
    for rid in ("b", "c"):
        r = req(rid, r1to(48) + [7] * 16)
        hit, n = m.get_computed_blocks(r)
        m.allocate_slots(r, 64 - n, n, hit)
    assert m.get_num_common_prefix_blocks("a") == [3, 0]
    m.remove_skipped_blocks("a", 64)
    assert m.get_block_ids("a") == ([1, 2, 3, 4], [0, 0, 7, 8])


def test_mgr_24_take_events_annotation_and_bad_group(caplog: pytest.LogCaptureFixture) -> None:
    """MGR-24: BlockStored gets kind/window by group; a group without metadata is logged."""
    m = make_manager(10, [full(), swa()], max_num_batched_tokens=64, enable_kv_cache_events=True)
    m.allocate_slots(req("a", r1to(40)), 40)
    m.kv_cache_event_metadata = m.kv_cache_event_metadata[:1]  # group 1 unknown
    with caplog.at_level(logging.WARNING, logger="kvcore.manager"):
        events = m.take_events()
    stored = {e.group_idx: e for e in events if isinstance(e, BlockStored)}
    assert set(stored) == {0, 1}
    assert (stored[0].kv_cache_spec_kind, stored[0].kv_cache_spec_sliding_window) == (
        "full_attention",
        None,
    )
    assert stored[1].kv_cache_spec_kind is None
    assert stored[1].kv_cache_spec_sliding_window is None
    assert "Group index 1 not in KV cache metadata" in caplog.text
    m2 = make_manager(10, [full(), swa()], max_num_batched_tokens=64, enable_kv_cache_events=True)
    m2.allocate_slots(req("a", r1to(40)), 40)
    windows = {
        e.group_idx: e.kv_cache_spec_sliding_window
        for e in m2.take_events()
        if isinstance(e, BlockStored)
    }
    assert windows == {0: None, 1: 32}


def test_mgr_25_mgr_26_block_ids() -> None:
    """MGR-25 get_blocks/get_block_ids; MGR-26 truncation per attention group."""
    m = make_manager(20, [full(), MambaSpec(16, mamba_cache_mode="all")], enable_caching=False)
    m.allocate_slots(req("a", r1to(40)), 40)
    assert m.get_blocks("zzz") is m.empty_kv_cache_blocks
    ids = m.get_block_ids("a")
    assert ids == ([1, 2, 3], [4, 5, 6])
    assert m.get_block_ids_for_computed_tokens("a", 17) == ([1, 2], [4, 5, 6])
    assert m.get_block_ids_for_computed_tokens("a", 0) == ([], [4, 5, 6])


def test_mgr_27_evict_and_reset_stats() -> None:
    """MGR-27: evict_blocks drops keys; a successful reset sets stats.reset."""
    m = make_manager(10, log_stats=True)
    r = req("a", r1to(40))
    m.allocate_slots(r, 40)
    m.take_events()
    m.evict_blocks({1})
    assert m.take_events() == [BlockRemoved([B1], "GPU", group_idx=0)]
    assert m.get_computed_blocks(req("b", r1to(40)))[1] == 0
    assert m.reset_prefix_cache() is False
    m.free(r)
    assert m.reset_prefix_cache() is True
    stats = m.make_prefix_cache_stats()
    assert stats is not None and stats.reset is True


def test_mgr_29_take_new_block_ids() -> None:
    """MGR-29: ids recorded for exact Full-type specs only; hits never; caching off too."""
    m = make_manager(
        40,
        [full(), swa(), RSWASpec(block_size=16, rswa_window=32, **ATTN)],
        max_num_batched_tokens=64,
    )
    m.allocate_slots(req("a", r1to(32)), 32)
    assert m.take_new_block_ids() == [1, 2]
    assert m.take_new_block_ids() == []
    r = req("b", r1to(48))
    hit, n = m.get_computed_blocks(r)
    m.allocate_slots(r, 48 - n, n, hit)
    assert m.take_new_block_ids() == [7]
    assert m.get_block_ids("b") == ([1, 2, 7], [3, 4, 8], [5, 6, 9])
    off = make_manager(10, enable_caching=False)
    off.allocate_slots(req("a", r1to(20)), 20)
    assert off.take_new_block_ids() == [1, 2]


def test_mgr_30_new_step_starts_clears_mamba_step_cache() -> None:
    """MGR-30 / MAMBA-6: new_step_starts clears the Mamba per-step cache."""
    m = make_manager(40, [full(), MambaSpec(16, mamba_cache_mode="all")], max_num_batched_tokens=64)
    m.allocate_slots(req("a", r1to(33)), 33)
    assert isinstance(m.coordinator.single_type_managers[1], MambaManager)
    r = req("b", r1to(40))
    hit, n = m.get_computed_blocks(r)
    assert n == 32
    assert m.allocate_slots(r, 40 - n, n, hit) is None  # MAMBA-4: delayed one step
    m.new_step_starts()
    assert m.allocate_slots(r, 40 - n, n, hit) is not None


# --------------------------------------------------------------------------------------------
# §9 coordinators


def test_coord_1_selection() -> None:
    """COORD-1: caching off → NoPrefixCache (any groups); one group → Unitary; else Hybrid."""
    assert isinstance(make_manager(8).coordinator, UnitaryKVCacheCoordinator)
    assert isinstance(make_manager(8, [full(), swa()]).coordinator, HybridKVCacheCoordinator)
    for specs in ([], [full()], [full(), swa()]):
        m = make_manager(8, specs, enable_caching=False, sbs=16, hbs=16)
        assert isinstance(m.coordinator, KVCacheCoordinatorNoPrefixCache)
        if specs:
            assert m.allocate_slots(req("x", r1to(20)), 20) is not None
        assert m.get_num_common_prefix_blocks("x") == [0] * len(specs)  # COORD-8


def test_coord_2_divisibility_pool_and_eagle_groups() -> None:
    """COORD-2: sbs divisible by hbs and every group size; eagle group selection; POOL-1."""
    with pytest.raises(AssertionError):
        make_manager(8, [full(16), swa(32)], sbs=16, hbs=16)
    with pytest.raises(AssertionError):
        make_manager(8, sbs=16, hbs=32)
    with pytest.raises(AssertionError):
        make_manager(0)
    m = make_manager(8, [full(), swa()], use_eagle=True)
    assert m.coordinator.eagle_group_ids == {0, 1}
    m = make_manager(8, [full(), swa()], use_eagle=True, eagle_groups=[1])
    assert m.coordinator.eagle_group_ids == {1}
    assert [s.use_eagle for s in m.coordinator.single_type_managers] == [False, True]


def test_coord_2_retention_interval_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """COORD-2 / RET-1: the retention env var is validated (ValueError)."""
    monkeypatch.setenv("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "32")
    with pytest.raises(ValueError):
        make_manager(8)  # no SWA or Mamba group
    with pytest.raises(ValueError):
        make_manager(8, enable_caching=False)  # checked with caching off too
    m = make_manager(8, [full(), swa()])
    assert m.coordinator.retention_interval == 32
    for bad in ("-16", "24", "x"):
        monkeypatch.setenv("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", bad)
        with pytest.raises(ValueError):
            make_manager(8, [full(), swa()])


def test_coord_7_unitary_hash_block_size_must_match() -> None:
    """COORD-7: with caching on a single group needs hbs == bs*dcp*pcp."""
    with pytest.raises(AssertionError):
        make_manager(8, [full(32)], sbs=32, hbs=16)
    m = make_manager(8, [full(32)], sbs=32, hbs=16, enable_caching=False)
    assert m.coordinator.block_pool is not None
    m = make_manager(8, [full(16)], sbs=32, hbs=32, dcp_world_size=2)
    assert m.coordinator.single_type_managers[0].block_size == 32


def test_coord_9_hybrid_construction_checks() -> None:
    """COORD-9: equal specs merge; <2 attention groups and dcp raise; full first."""
    with pytest.raises(AssertionError):
        make_manager(8, [full(), full()])
    with pytest.raises(AssertionError):
        make_manager(8, [full(), swa()], dcp_world_size=2, sbs=32, hbs=32)
    m = make_manager(8, [swa(), full(), full(), swa(w=64)])
    coord = m.coordinator
    assert isinstance(coord, HybridKVCacheCoordinator)
    assert [ag.group_ids for ag in coord.attention_groups] == [[1, 2], [0], [3]]
    assert coord.attention_groups[0].manager_cls is FullAttentionManager


def test_coord_10_coord_11_mixed_block_sizes() -> None:
    """COORD-10: caching aligned to sbs; COORD-11 lookup with an HBS view (RH-3)."""
    m = make_manager(40, [full(32), swa(16, 32)], sbs=32, hbs=16, max_num_batched_tokens=128)
    r = req("a", r1to(100), hbs=16)
    m.allocate_slots(r, 100)
    stms = m.coordinator.single_type_managers
    assert stms[0].num_cached_block["a"] == 3 and stms[1].num_cached_block["a"] == 6
    r2 = req("b", r1to(100), hbs=16)
    hit, n = m.get_computed_blocks(r2)
    assert n == 96
    assert hit.get_block_ids() == ([1, 2, 3], [0, 0, 0, 0, 9, 10])
    coord = m.coordinator
    assert isinstance(coord, HybridKVCacheCoordinator)
    assert coord.num_uncached_common_prefix_tokens == 0
    per_group, lengths = coord.find_longest_cache_hit_per_group(r2.block_hashes, 99)
    assert lengths == (96, 96) and len(per_group[0]) == 3


def test_fa_1_eagle_drops_last_block() -> None:
    """FA-1 / EAGLE-1 / COORD-7: with eagle the last matched block is dropped."""
    m = make_manager(10, use_eagle=True)
    m.allocate_slots(req("a", r1to(64)), 64)
    hit, n = m.get_computed_blocks(req("b", r1to(64)))
    assert n == 32 and hit.get_block_ids() == ([1, 2],)


def _cached_pool(n_tokens: int) -> tuple[KVCacheManager, Request]:
    m = make_manager(20)
    r = req("a", r1to(n_tokens))
    m.allocate_slots(r, n_tokens)
    return m, r


def test_cla_1_chunked_local_admission_cap() -> None:
    """CLA-1's cap (CLA-2's skipping and CLA-3's lookup examples are Rust tests:
    ``rust/kvcore-core/src/single_type_tests.rs``)."""
    spec = ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=32, **ATTN)
    cm = make_manager(20, [spec], max_num_batched_tokens=64)
    assert cm.coordinator.single_type_managers[0].admission_cap == 6


def test_mamba_4_5_align_mode() -> None:
    """MAMBA-4/5 align mode: prefill takes 1 + ns blocks; later steps reuse spec blocks."""
    spec = MambaSpec(16, mamba_cache_mode="align", num_speculative_blocks=1)
    m = make_manager(30, [full(), spec], max_num_batched_tokens=64)
    r = req("a", r1to(40))
    out = m.allocate_slots(r, 40)
    assert out is not None
    ids = out.get_block_ids()
    assert ids[0] == [1, 2, 3] and ids[1] == [0, 0, 4, 5]
    r.num_computed_tokens = 40
    r.append_output_token_ids([41] * 8)
    out = m.allocate_slots(r, 8)
    assert out is not None and out.get_block_ids() == ([], [])
    r.num_computed_tokens = 48
    r.append_output_token_ids([42])
    out = m.allocate_slots(r, 1)
    assert out is not None and out.get_block_ids() == ([6], [7])
    assert isinstance(m.coordinator.single_type_managers[1], MambaManager)
    assert m.get_block_ids("a") == ([1, 2, 3, 6], [0, 0, 4, 5, 7])
    # MAMBA-4: the count can be negative in align mode (the full group needs 0).
    assert m.coordinator.get_num_blocks_to_allocate("a", 16, ([], []), 0, 16, 16) == -3
    m.free(r)
    assert m.get_block_ids("a") == ([], [])


def test_rswa_1_gap_blocks_freed() -> None:
    """RSWA-1: blocks between the prompt and the decode window are freed."""
    spec = RSWASpec(block_size=16, rswa_window=32, **ATTN)
    m = make_manager(20, [spec])
    r = req("a", r1to(20))
    m.allocate_slots(r, 20)
    r.num_computed_tokens = 20
    r.append_output_token_ids(list(range(100, 180)))
    m.allocate_slots(r, 80)
    r.num_computed_tokens = 100
    m.remove_skipped_blocks("a", 100, 20)
    assert m.get_block_ids("a") == ([1, 2, 0, 0, 5, 6, 7],)
    m.remove_skipped_blocks("a", 200)  # without P nothing is skipped
    assert m.get_block_ids("a") == ([1, 2, 0, 0, 5, 6, 7],)


def test_sink_1_intended_behaviour() -> None:
    """SINK-1: sink blocks leave the queue for good; reset always fails; bad sink_len raises."""
    spec = SinkFullAttentionSpec(block_size=16, sink_len=32, **ATTN)
    m = make_manager(10, [spec])
    assert m.block_pool.get_num_free_blocks() == 7
    assert 1 not in queue(m) and 2 not in queue(m)
    assert m.reset_prefix_cache() is False
    for bad in (None, 0, 24):
        with pytest.raises(AssertionError):
            make_manager(10, [SinkFullAttentionSpec(block_size=16, sink_len=bad, **ATTN)])


def test_xattn_1_cross_attention() -> None:
    """XATTN-1 / COORD-3: allocated once from num_encoder_tokens; caching raises."""
    spec = CrossAttentionSpec(block_size=16, **ATTN)
    m = make_manager(20, [full(), spec], enable_caching=False)
    r = req("a", r1to(20))
    out = m.allocate_slots(r, 20, num_encoder_tokens=40)
    assert out is not None and out.get_block_ids() == ([1, 2], [3, 4, 5])
    r.num_computed_tokens = 20
    r.append_output_token_ids(list(range(13)))
    out = m.allocate_slots(r, 13, num_encoder_tokens=40)
    assert out is not None and out.get_block_ids() == ([6], [])
    with pytest.raises(ValueError):
        m.coordinator.cache_blocks(r, 32)
    on = make_manager(20, [full(), spec])
    with pytest.raises(ValueError):
        on.allocate_slots(req("b", r1to(20)), 20, num_encoder_tokens=40)


def test_stm_2_evictable_hits_count_against_capacity() -> None:
    """STM-2: hits sitting in the free queue count as allocations."""
    m = make_manager(6)
    m.allocate_slots(req("a", r1to(64)), 64)
    m.free(req("a", []))
    r = req("b", r1to(64) + [0] * 16)
    hit, n = m.get_computed_blocks(r)
    assert n == 64
    assert m.coordinator.get_num_blocks_to_allocate("b", 80, hit.blocks, 0, 64, 80) == 1 + 4
    assert m.allocate_slots(r, 16, n, hit) is not None
    assert m.block_pool.get_num_free_blocks() == 0


def test_stm_4_stm_7_stm_8_swa_null_padding_and_range_removal() -> None:
    """STM-4 null padding of skipped hits; STM-7/8 back-to-front removal stops at null."""
    m = make_manager(30, [full(), swa()], max_num_batched_tokens=64)
    m.allocate_slots(req("a", r1to(100)), 100)
    r = req("b", r1to(100))
    hit, n = m.get_computed_blocks(r)
    m.allocate_slots(r, 100 - n, n, hit)
    assert m.get_block_ids("b") == ([1, 2, 3, 4, 5, 6, 15], [0, 0, 0, 0, 12, 13, 16])
    m.remove_skipped_blocks("b", 100)  # the last skipped block is null already: nothing to do
    assert m.get_block_ids("b")[1] == [0, 0, 0, 0, 12, 13, 16]
    m.remove_skipped_blocks("b", 112)  # freed back to front, stopping at the first null
    assert m.get_block_ids("b")[1] == [0, 0, 0, 0, 0, 13, 16]


def test_kvb_3_on_manager_results() -> None:
    """KVB-3 on real results: the partial tail block is unhashed; nulls are dropped per group."""
    m = make_manager(10)
    out = m.allocate_slots(req("a", r1to(40)), 40)
    assert out is not None and out.get_unhashed_block_ids() == [3]
    h = make_manager(30, [full(), swa()], max_num_batched_tokens=64)
    h.allocate_slots(req("a", r1to(100)), 100)
    hit, _ = h.get_computed_blocks(req("b", r1to(100)))
    assert hit.get_unhashed_block_ids_all_groups() == [[], []]
    assert h.get_blocks("a").get_unhashed_block_ids_all_groups() == [[7], [14]]


def test_mgr_1_max_num_batched_tokens_defaults_to_max_model_len() -> None:
    """MGR-1 / SWA-1: without max_num_batched_tokens the cap uses max_model_len."""
    m = make_manager(8, [full(), swa()], max_model_len=256)
    assert m.coordinator.single_type_managers[1].admission_cap == 17


def test_spec_1_groups_without_manager_fail_construction() -> None:
    """SPEC-1 through COORD-2: an encoder-only group has no manager (AssertionError)."""
    from kvcore.specs import EncoderOnlyAttentionSpec, UniformTypeKVCacheSpecs

    with pytest.raises(AssertionError):
        make_manager(8, [EncoderOnlyAttentionSpec(block_size=16, **ATTN)])
    with pytest.raises(AssertionError):
        make_manager(8, [full(), UniformTypeKVCacheSpecs(16, {"a": full()})])


def test_pool_22_no_events_when_disabled() -> None:
    """POOL-22 via MGR-24: with events off take_events is always empty."""
    m = make_manager(8, enable_kv_cache_events=False)
    m.allocate_slots(req("a", r1to(40)), 40)
    m.free(req("a", []))
    assert m.reset_prefix_cache() is True
    assert m.take_events() == []
