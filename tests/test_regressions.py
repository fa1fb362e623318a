"""Regression tests for the divergences found by the differential API fuzzer (issue "Fuzzing").

Each test names one finding: the reference's behaviour it pins (stated in the docstring, and
checked against the reference by ``tests/test_fuzz_api.py``) and kvcore's answer. They need
no reference: the expected values are the reference's, written out. Calls that used to abort
the process run in a subprocess, so that an abort fails the test instead of killing pytest.
"""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
from pool_helpers import PoolRequest

import kvcore
from kvcore import hashing
from kvcore.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.errors import ArgumentOverflowError, ArgumentTypeError
from kvcore.manager import KVCacheManager
from kvcore.specs import FullAttentionSpec, SlidingWindowSpec

HBS = 4


class Tok(enum.IntEnum):
    """An int subclass used as a token id (pickled by reference, as the reference does)."""

    A = 7


def pool_state(pool: kvcore.BlockPool) -> tuple[Any, ...]:
    """Everything observable about a pool (events drained)."""
    ids = range(pool.num_gpu_blocks)
    return (
        pool.get_all_free_block_ids(),
        pool.get_ref_cnts(ids),
        pool.get_block_hashes(ids),
        repr(pool),
    )


def unchanged(pool: kvcore.BlockPool, call: Callable[[], Any], exc: type[BaseException]) -> Any:
    """Runs ``call``, which must raise ``exc`` (a KvcoreError) and change nothing."""
    pool.take_events()
    before = pool_state(pool)
    with pytest.raises(exc) as info:
        call()
    assert isinstance(info.value, kvcore.KvcoreError), info.value
    pool.check_invariants()
    assert pool_state(pool) == before
    assert pool.take_events() == []
    return info.value


@pytest.fixture
def seeded() -> Iterator[None]:
    """``PYTHONHASHSEED=0`` and an initialised NONE_HASH for sha256."""
    old = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = "0"
    hashing.init_none_hash(hashing.sha256)
    yield
    if old is None:
        del os.environ["PYTHONHASHSEED"]
    else:
        os.environ["PYTHONHASHSEED"] = old


def make_manager(
    num_blocks: int = 10, max_model_len: int = 48, swa: bool = False
) -> KVCacheManager:
    """A manager over full attention (block size 4), plus a sliding window group if ``swa``."""
    specs: list[Any] = [FullAttentionSpec(HBS, num_kv_heads=1, head_size=8, dtype="float16")]
    if swa:
        specs.append(
            SlidingWindowSpec(HBS, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=8)
        )
    cfg = KVCacheConfig(
        num_blocks, [], [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    )
    return KVCacheManager(
        cfg,
        max_model_len=max_model_len,
        scheduler_block_size=HBS,
        hash_block_size=HBS,
        enable_kv_cache_events=True,
    )


def request(rid: str, prompt: list[Any], hashed: bool = True) -> kvcore.Request:
    hasher = hashing.get_request_block_hasher(HBS, hashing.sha256) if hashed else None
    return kvcore.Request(rid, prompt, max_tokens=16, block_hasher=hasher)


def manager_state(m: KVCacheManager, rids: list[str]) -> tuple[Any, ...]:
    """The pool's state plus every listed request's tables and the number of entries."""
    entries = [
        (len(s.req_to_blocks), [s.num_cached_block.get(r) for r in rids])
        for s in m.coordinator.single_type_managers
    ]
    pool: Any = m.block_pool
    return (pool_state(pool), [m.get_block_ids(r) for r in rids], entries)


# --- a Rust panic crossed into Python --------------------------------------------------------


def test_get_new_blocks_of_max_i64_is_no_free_blocks_not_a_panic() -> None:
    """``get_new_blocks(2**63 - 1)`` raised ``PanicException: capacity overflow`` (the core
    reserved room for the result first); the reference raises ValueError."""
    pool = kvcore.BlockPool(10, True, HBS)
    unchanged(pool, lambda: pool.get_new_blocks(2**63 - 1), kvcore.NoFreeBlocksError)
    assert issubclass(kvcore.NoFreeBlocksError, ValueError)


# --- OverflowError on huge ints --------------------------------------------------------------


@pytest.mark.parametrize("n", [2**63, 2**64, 10**30])
def test_get_new_blocks_of_a_huge_count_is_no_free_blocks(n: int) -> None:
    """The reference's ``n > free`` raises ValueError for any size; kvcore raised
    OverflowError beyond 64 bits."""
    pool = kvcore.BlockPool(10, True, HBS)
    unchanged(pool, lambda: pool.get_new_blocks(n), kvcore.NoFreeBlocksError)


@pytest.mark.parametrize("method", ["touch", "free_blocks", "get_ref_cnts", "count_evictable"])
@pytest.mark.parametrize("bad", [2**63, 2**64, 10**30, -(2**64)])
def test_a_huge_block_id_names_no_block(method: str, bad: int) -> None:
    """A huge id is not a block (the reference's ``blocks[i]`` raises IndexError): BlockIdError
    (IndexError), not OverflowError; and nothing is touched or freed before it."""
    pool = kvcore.BlockPool(10, True, HBS)
    held = pool.get_new_blocks(2)
    unchanged(pool, lambda: getattr(pool, method)([held[0], bad]), kvcore.BlockIdError)
    assert issubclass(kvcore.BlockIdError, IndexError)


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 10**30])
def test_blocks_view_of_a_huge_index_is_index_error(bad: int) -> None:
    """``pool.blocks[2**63]`` raises IndexError as the reference's list does."""
    pool = kvcore.BlockPool(4, True, HBS)
    with pytest.raises(IndexError):
        pool.blocks[bad]
    assert [b.block_id for b in pool.blocks[1:3]] == [1, 2]
    assert pool.blocks[-1].block_id == 3


@pytest.mark.parametrize("bad", [10**30, 2**64, 10])
def test_evict_blocks_of_a_huge_id_is_the_reference_assertion(bad: int) -> None:
    """The reference asserts ``block_id < len(blocks)`` (AssertionError): BlockIdError is one,
    and the ids before it are not evicted."""
    pool = kvcore.BlockPool(10, True, HBS)
    req = PoolRequest(list(range(8)), hash_block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, HBS, 0)
    pool.free_blocks(blocks[::-1])
    err = unchanged(pool, lambda: pool.evict_blocks([blocks[0], bad]), kvcore.BlockIdError)
    assert isinstance(err, AssertionError)


def test_evict_blocks_checks_ids_in_order() -> None:
    """``evict_blocks([10, 1.5])``: the reference fails on 10 first (AssertionError)."""
    pool = kvcore.BlockPool(10, True, HBS)
    unchanged(pool, lambda: pool.evict_blocks([10, cast(int, 1.5)]), kvcore.BlockIdError)
    unchanged(pool, lambda: pool.evict_blocks([cast(int, 1.5), 10]), ArgumentTypeError)


@pytest.mark.parametrize("num_cached", [10**30, 2**63, 2**64])
def test_cache_full_blocks_with_a_huge_cached_count_returns(num_cached: int) -> None:
    """``num_cached_blocks >= num_full_blocks`` returns at once in the reference (SPEC
    POOL-13), whatever their size; kvcore raised OverflowError."""
    pool = kvcore.BlockPool(10, True, HBS, True)
    req = PoolRequest(list(range(8)), hash_block_size=HBS)
    blocks = pool.get_new_blocks(2)
    pool.take_events()
    before = pool_state(pool)
    pool.cache_full_blocks(req, blocks, num_cached, 2, HBS, 0)
    assert pool_state(pool) == before and pool.take_events() == []


@pytest.mark.parametrize("num_full", [10**30, 2**64])
def test_cache_full_blocks_with_a_huge_full_count_is_the_hash_assertion(num_full: int) -> None:
    """The reference asserts the view holds ``num_full_blocks`` hashes (AssertionError)."""
    pool = kvcore.BlockPool(10, True, HBS, True)
    req = PoolRequest(list(range(8)), hash_block_size=HBS)
    blocks = pool.get_new_blocks(2)
    err = unchanged(
        pool,
        lambda: pool.cache_full_blocks(req, blocks, 0, num_full, HBS, 0),
        kvcore.InvalidArgumentError,
    )
    assert isinstance(err, AssertionError)


@pytest.mark.parametrize("huge", [2**63, 2**64, 10**30])
def test_allocate_slots_with_a_huge_token_count_is_capped(huge: int, seeded: None) -> None:
    """The reference caps ``num_tokens_need_slot`` at ``max_model_len`` (ALLOC-5) and
    allocates; kvcore raised OverflowError. With a huge lookahead too."""
    m = make_manager(num_blocks=20, max_model_len=32)
    r = request("a", list(range(10)))
    out = m.allocate_slots(r, huge)
    assert out is not None
    assert out.get_block_ids() == ([1, 2, 3, 4, 5, 6, 7, 8],)  # cdiv(32, 4) blocks
    r2 = request("b", list(range(10)))
    assert m.allocate_slots(r2, 2, num_lookahead_tokens=huge) is not None
    assert len(m.get_block_ids("b")[0]) == 8
    # A huge reservation leaves no room: None, as the reference's negative "available".
    r3 = request("c", list(range(10)))
    assert m.allocate_slots(r3, 4, reserved_blocks=huge) is None


@pytest.mark.parametrize("hbs", [2**64, 10**30])
def test_request_block_hasher_of_a_huge_block_size(hbs: int, seeded: None) -> None:
    """``get_request_block_hasher(2**64, fn)`` works in the reference (no window is ever
    full); kvcore raised OverflowError building the native hasher and the request."""
    hasher = hashing.get_request_block_hasher(hbs, hashing.sha256)
    r = kvcore.Request("a", list(range(40)), max_tokens=4, block_hasher=hasher)
    r.append_output_token_ids([1, 2, 3])
    assert list(r.block_hashes) == []


@pytest.mark.parametrize("hbs", [0, -1, -(2**63)])
def test_request_block_hasher_refuses_sizes_the_reference_never_returns_for(hbs: int) -> None:
    """The reference's hasher loops forever for a block size <= 0 (its window never ends);
    kvcore refuses it when the hasher is built."""
    with pytest.raises(kvcore.InvalidArgumentError):
        hashing.get_request_block_hasher(hbs, hashing.sha256)
    with pytest.raises(ArgumentTypeError):
        hashing.get_request_block_hasher(16.0, hashing.sha256)  # type: ignore[arg-type]


# --- lookups, ids, tokens, hashes ------------------------------------------------------------


@pytest.mark.parametrize("length", [33, 100, 0])
def test_get_cached_block_of_an_odd_length_hash(length: int) -> None:
    """``get_cached_block(<100-byte hash>, [0])`` is None in the reference (a miss); kvcore
    raised InvalidArgumentError. Empty group lists give ``[]`` whatever the hash."""
    pool = kvcore.BlockPool(4, True, HBS)
    assert pool.get_cached_block(b"\xab" * length, [0]) is None
    assert pool.get_cached_block(b"\xab" * length, []) == []
    assert pool.get_cached_block(None, []) == []  # type: ignore[arg-type]


def test_get_cached_block_reads_group_ids_lazily() -> None:
    """The reference stops at the first group that misses; later group ids are not read. A
    bad id it reads raises its OverflowError / AttributeError (kvcore: classes deriving from
    both KvcoreError and those)."""
    pool = kvcore.BlockPool(4, True, HBS)
    assert pool.get_cached_block(b"\x01" * 32, [0, cast(int, 1.5)]) is None
    with pytest.raises(ArgumentOverflowError) as info:
        pool.get_cached_block(b"\x01" * 32, [2**32])
    assert isinstance(info.value, OverflowError)
    with pytest.raises(ArgumentTypeError) as info2:
        pool.get_cached_block(b"\x01" * 32, [None])  # type: ignore[list-item]
    assert isinstance(info2.value, AttributeError)


@pytest.mark.parametrize("rid", ["\ud800", "a\udfffb", "\x00", "\x00eda080"])
def test_lone_surrogate_request_ids(rid: str, seeded: None) -> None:
    """A request id with a lone surrogate raised UnicodeEncodeError; the reference keys its
    tables by the str. Ids stay distinct (the surrogate key and a NUL-led id do not collide)."""
    m = make_manager()
    a, b = (
        request(rid, list(range(9))),
        request("\x00eda080" if rid != "\x00eda080" else "\ud800", list(range(9))),
    )
    assert m.allocate_slots(a, 9) is not None
    assert m.allocate_slots(b, 9) is not None
    assert m.get_block_ids(rid) == ([1, 2, 3],)
    assert m.get_num_common_prefix_blocks(rid) == [0]
    m.free(a)
    assert m.get_block_ids(rid) == ([],)
    assert m.get_block_ids(b.request_id) == ([4, 5, 6],)


def test_bool_tokens_hash_as_in_the_reference(seeded: None) -> None:
    """``append_output_token_ids(True)`` stored 1, so later block hashes differed from the
    reference's, which hashes the bool itself (pickle and CBOR write True, not 1)."""
    hasher = hashing.get_request_block_hasher(2, hashing.sha256)
    r = kvcore.Request("a", [1, 2], max_tokens=4, block_hasher=hasher)
    r.append_output_token_ids(True)
    r.append_output_token_ids(5)
    assert list(r.all_token_ids) == [1, 2, True, 5]
    assert type(r.all_token_ids[2]) is bool and type(r.output_token_ids[0]) is bool
    # Computed by the reference (vllm 0.25.1) with PYTHONHASHSEED=0.
    assert r.block_hashes[-1].hex() == (
        "a1a04c8c7821b3f627f8e43994c4b7193f748dd59e54bfb0c25c72612bb3ed8b"
    )
    assert r.block_hashes[-1] == hashing.hash_block_tokens(
        hashing.sha256, r.block_hashes[0], (True, 5)
    )
    assert r.block_hashes[-1] != hashing.hash_block_tokens(
        hashing.sha256, r.block_hashes[0], (1, 5)
    )


def test_int_subclass_tokens_are_kept(seeded: None) -> None:
    """Int subclasses (IntEnum) are stored as given, as bools are, and hash as in the
    reference; tokens beyond int64 or not ints are refused with KvcoreErrors (the reference
    stores anything; kvcore's token ids are int64 ints, a documented deviation), changing
    nothing."""
    hasher = hashing.get_request_block_hasher(2, hashing.sha256)
    r = kvcore.Request("a", [Tok.A, 1], max_tokens=4, block_hasher=hasher)
    assert type(r.all_token_ids[0]) is Tok
    assert list(r.block_hashes) == [hashing.hash_block_tokens(hashing.sha256, None, (Tok.A, 1))]
    with pytest.raises(kvcore.InvalidArgumentError, match="int64"):
        r.append_output_token_ids(2**63)
    with pytest.raises(ArgumentTypeError, match="ints"):
        r.append_output_token_ids([3, "x"])  # type: ignore[list-item]
    assert r.num_tokens == 2 and list(r.all_token_ids) == [Tok.A, 1]


@pytest.mark.parametrize("how", ["assigned", "in place"])
def test_an_empty_parent_hash_means_none_hash(how: str, seeded: None) -> None:
    """With ``block_hashes == [b""]`` the next hash chained from ``b""``; the reference's
    ``if not parent_block_hash`` replaces it by NONE_HASH (SPEC HASH-11). A hash replaced in
    place was also ignored (the native copy was read instead of the list)."""
    hasher = hashing.get_request_block_hasher(2, hashing.sha256)
    r = kvcore.Request("a", [1, 2], max_tokens=4, block_hasher=hasher)
    if how == "assigned":
        r.block_hashes = [b""]
    else:
        r.block_hashes[0] = b""
    r.append_output_token_ids([3, 4])
    expected = hashing.hash_block_tokens(hashing.sha256, None, (3, 4))
    assert r.block_hashes[-1] == expected
    assert expected.hex() == "bcc4c4e57b1d02a068b58047d6e802a12bed3c2e4efebe3dbece2f7bce695c0d"


def test_hash_block_tokens_with_a_non_bytes_parent(seeded: None) -> None:
    """The reference hashes any truthy parent as it is; kvcore raised TypeError."""
    got = hashing.hash_block_tokens(hashing.sha256, "parent", [], None)  # type: ignore[arg-type]
    assert got == hashing.sha256(("parent", (), None))


# --- rejected calls changed state ------------------------------------------------------------


def test_allocate_slots_refused_for_external_tokens_changes_nothing(seeded: None) -> None:
    """External tokens beyond ``max_model_len`` (STM-5 is not capped) take more blocks than
    the capacity check counted: the reference raises ValueError from ``get_new_blocks`` after
    touching its hit blocks and creating the request's entry. kvcore raised NoFreeBlocksError
    after the same changes; now before any."""
    m = make_manager(num_blocks=8, max_model_len=8)
    a = request("a", [7] * 8)
    assert m.allocate_slots(a, 8) is not None
    m.free(a)
    b = request("b", [7] * 8)
    hits, n = m.get_computed_blocks(b)
    assert n == 4 and hits.get_block_ids() == ([1],)
    rids = ["a", "b"]
    m.take_events()
    before = manager_state(m, rids)
    with pytest.raises(kvcore.NoFreeBlocksError):
        m.allocate_slots(b, 4, n, hits, num_external_computed_tokens=40)
    assert manager_state(m, rids) == before
    assert m.take_events() == []
    m.block_pool.check_invariants()


def test_refused_allocation_on_a_finished_request_leaves_no_entry(seeded: None) -> None:
    """A refused allocation for a finished request left an empty table entry behind, so a
    later ``get_num_common_prefix_blocks`` counted one request too many (the reference, after
    the same refusal restored, answers 1; kvcore answered 0)."""
    m = make_manager(num_blocks=8, max_model_len=8)
    shared = [5] * 4
    reqs = [request(rid, shared + [i] * 4) for i, rid in enumerate("xyz")]
    for r in reqs:
        hits, n = m.get_computed_blocks(r)
        assert m.allocate_slots(r, 8 - n, n, hits) is not None
    assert m.get_num_common_prefix_blocks("x") == [1]
    done = request("done", [9] * 3)
    assert m.allocate_slots(done, 3) is not None
    m.free(done)
    with pytest.raises(kvcore.NoFreeBlocksError):
        m.allocate_slots(done, 4, num_external_computed_tokens=20)
    assert m.get_num_common_prefix_blocks("x") == [1]


def test_cache_blocks_on_a_freed_request_leaves_no_entry(seeded: None) -> None:
    """``cache_blocks`` for a request without blocks: the reference fails on the missing
    blocks (IndexError with events on); kvcore refused but left an empty entry."""
    m = make_manager()
    a, b = request("a", list(range(8))), request("b", list(range(8)))
    assert m.allocate_slots(a, 8) is not None
    m.free(a)
    m.take_events()
    before = manager_state(m, ["a", "b"])
    with pytest.raises(kvcore.InvalidArgumentError):
        m.cache_blocks(b, 8)
    with pytest.raises(kvcore.InvalidArgumentError):
        m.cache_blocks(a, 8)
    assert manager_state(m, ["a", "b"]) == before
    assert m.take_events() == []


def test_cache_blocks_with_a_float_count_leaves_no_entry(seeded: None) -> None:
    """The Python path created the entry before the pool refused the float count."""
    m = make_manager()
    a = request("a", list(range(8)))
    before = manager_state(m, ["a"])
    with pytest.raises(ArgumentTypeError):
        m.cache_blocks(a, 1.5)  # type: ignore[arg-type]
    assert manager_state(m, ["a"]) == before


def test_allocate_slots_without_block_hashes_refused_before_allocating(seeded: None) -> None:
    """A request built without a block hasher cannot be cached: the reference asserts (too
    few hashes) after allocating its blocks; kvcore refuses before."""
    m = make_manager()
    r = request("a", list(range(9)), hashed=False)
    before = manager_state(m, ["a"])
    with pytest.raises(kvcore.InvalidArgumentError) as info:
        m.allocate_slots(r, 9)
    assert isinstance(info.value, AssertionError)
    assert manager_state(m, ["a"]) == before
    assert m.take_events() == []
    assert m.allocate_slots(r, 9, delay_cache_blocks=True) is not None


def test_window_undercount_refused_before_allocating(seeded: None) -> None:
    """With a sliding window, computed tokens without hit blocks make STM-2 undercount what
    STM-3 allocates; the reference then fails in a later group after allocating the first."""
    m = make_manager(num_blocks=16, swa=True)
    r = request("a", [1])
    before = manager_state(m, ["a"])
    with pytest.raises(kvcore.InvalidArgumentError):
        m.allocate_slots(r, 6, 2**40)
    assert manager_state(m, ["a"]) == before


def test_window_frees_undone_when_the_allocation_is_refused(seeded: None) -> None:
    """A request that is not running (shorter than a block, so never cached) and claims many
    computed tokens: the window group's STM-2 count skips blocks that STM-3 then allocates.
    The reference frees the block outside the window (ALLOC-6), allocates the full-attention
    group and fails in the window group; kvcore refuses first and takes the freed block
    back, leaving the free queue, the counts and the tables as they were."""
    m = make_manager(num_blocks=19, swa=True)
    r = request("a", [1])
    assert m.allocate_slots(r, 1) is not None
    r.num_computed_tokens = 20
    m.take_events()
    before = manager_state(m, ["a"])
    with pytest.raises(kvcore.NoFreeBlocksError):
        m.allocate_slots(r, 20)
    assert manager_state(m, ["a"]) == before
    assert m.take_events() == []
    m.block_pool.check_invariants()


def test_count_type_errors_are_kvcore_errors(seeded: None) -> None:
    """A float count raised a plain TypeError on the Python path (``|`` of ints)."""
    m = make_manager()
    r = request("a", list(range(8)))
    with pytest.raises(ArgumentTypeError):
        m.allocate_slots(r, 4, num_lookahead_tokens=1.5)  # type: ignore[arg-type]
    with pytest.raises(kvcore.InvalidArgumentError):
        m.allocate_slots(r, -1)


def test_lookup_of_an_empty_request_is_the_reference_value_error(seeded: None) -> None:
    """The reference walks ``islice(hashes, (num_tokens - 1) // bs)``: ValueError for a
    request without tokens; kvcore answered ``(empty, 0)`` (native) or ``(empty, -1)``."""
    m = make_manager(swa=True, num_blocks=16)
    with pytest.raises(kvcore.InvalidArgumentError) as info:
        m.get_computed_blocks(request("a", []))
    assert isinstance(info.value, ValueError)


def test_pool_arguments_read_as_the_reference_reads_them() -> None:
    """Flags by their truth value; the null block answers None before other arguments are
    read; huge block sizes and counts are compared, not overflowed."""
    pool = kvcore.BlockPool(6, 1, 2, 0)  # type: ignore[arg-type]
    assert pool.enable_caching and not pool.enable_kv_cache_events
    req = PoolRequest(list(range(8)), hash_block_size=2)
    assert pool.cache_partial_block(req, 0, None, None, None) is None  # type: ignore[arg-type]
    b = pool.get_new_blocks(1)[0]
    key = pool.cache_partial_block(req, b, 2, 0, 2**64)
    assert key == req.block_hashes[0] + b"\x00\x00\x00\x00"
    unchanged(pool, lambda: pool.get_new_blocks(0.0), ArgumentTypeError)  # type: ignore[arg-type]


# --- calls that killed the process (fixed in the core; run in a subprocess) -------------------


def run_isolated(code: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter (an abort or a signal fails the test, not pytest)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_get_new_blocks_of_2_31_does_not_abort() -> None:
    """``get_new_blocks(2**31)`` on a small pool aborted the process ("memory allocation
    failed") before checking the free count; the reference raises ValueError."""
    out = run_isolated(
        """
        import kvcore
        pool = kvcore.BlockPool(8, True, 16)
        for n in (2**31, 2**32, 2**40):
            try:
                pool.get_new_blocks(n)
            except kvcore.NoFreeBlocksError:
                pass
            else:
                raise SystemExit("no error")
        pool.check_invariants()
        print("ok")
        """
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])


def test_pool_of_2_31_blocks_does_not_abort() -> None:
    """``BlockPool(2**31, True, 16)`` aborted the process. It must now either build the pool
    or raise a KvcoreError (a size whose blocks cannot fit in memory is refused)."""
    out = run_isolated(
        """
        import kvcore
        try:
            pool = kvcore.BlockPool(2**31, True, 16)
        except kvcore.KvcoreError as e:
            print("refused", type(e).__name__)
        else:
            print("built", pool.get_num_free_blocks())
        try:
            kvcore.BlockPool(2**31 + 1, True, 16)
        except kvcore.KvcoreError as e:
            print("refused", type(e).__name__)
        """
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    lines = out.stdout.split("\n")
    assert lines[0] in ("built 2147483647", "refused InvalidArgumentError"), out.stdout
    assert lines[1] == "refused InvalidArgumentError", out.stdout


def test_append_with_a_failing_hasher_takes_the_tokens_back() -> None:
    """A lone-surrogate cache salt cannot be CBOR-encoded: the append is refused whole.

    Found by the API fuzzer: the reference appends the token and then its hasher raises;
    kvcore raised too but had kept the token, so the refused call changed the request.
    """
    from kvcore.hashing import get_request_block_hasher, init_none_hash, sha256_cbor
    from kvcore.request import Request as KvRequest

    init_none_hash(sha256_cbor)
    req = KvRequest(
        "a",
        prompt_token_ids=[0, 0],
        block_hasher=get_request_block_hasher(3, sha256_cbor),
        cache_salt="\ud800",
    )
    with pytest.raises(UnicodeEncodeError):  # the salt's encoding error, as the reference's
        req.append_output_token_ids(0)
    assert list(req.all_token_ids) == [0, 0] and req.num_tokens == 2
    assert list(req.output_token_ids) == [] and list(req.block_hashes) == []
    req.append_output_token_ids([])  # still usable
    assert req.num_tokens == 2
