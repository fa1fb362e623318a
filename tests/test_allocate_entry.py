"""``allocate_slots``'s native entry: the scheduler's per-request shape and every other one.

``KVCacheManagerCore.allocate_slots`` is a fastcall method that takes the scheduler's decode
call ``allocate_slots(request, n)`` / ``allocate_slots(request, n, num_lookahead_tokens=k)``
(exact ints) straight to the manager, and hands every other call shape to pyo3's generated
method, which parses it. These tests drive the same workload through both shapes and require
the same results, events and errors; bad arguments in the short shape raise what the general
parser raises, and leave the state as it was.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any

import pytest

from kvcore import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    SlidingWindowSpec,
)
from kvcore._native import KVCacheManagerCore
from kvcore.hashing import get_request_block_hasher, init_none_hash, sha256
from kvcore.request import Request, RequestStatus

ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
BLOCK = 4

Call = Callable[[KVCacheManager, Request, int, int], Any]

init_none_hash(sha256)  # once: every run below chains from the same root hash
hasher = get_request_block_hasher(BLOCK, sha256)


def short(mgr: KVCacheManager, req: Request, n: int, k: int) -> Any:
    """The shape the native entry takes itself."""
    if k == 0:
        return mgr.allocate_slots(req, n)
    return mgr.allocate_slots(req, n, num_lookahead_tokens=k)


def positional(mgr: KVCacheManager, req: Request, n: int, k: int) -> Any:
    """Every argument up to the lookahead by position: pyo3's parser."""
    return mgr.allocate_slots(req, n, 0, None, k)


def by_keyword(mgr: KVCacheManager, req: Request, n: int, k: int) -> Any:
    """Every argument by keyword, the keyword name built at run time (not interned)."""
    name = "".join(["num_lookahead", "_tokens"])
    kwargs: dict[str, Any] = {name: k}
    return mgr.allocate_slots(request=req, num_new_tokens=n, **kwargs)


def manager(hybrid: bool, caching: bool = True) -> KVCacheManager:
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=BLOCK, **ATTN))]
    if hybrid:
        groups.append(
            KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=BLOCK, sliding_window=8, **ATTN))
        )
    cfg = KVCacheConfig(num_blocks=40, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(
        cfg,
        max_model_len=256,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=caching,
        enable_kv_cache_events=True,
    )


def outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The call's block ids (None when refused), or its exception's class and message."""
    try:
        result = fn(*args, **kwargs)
    except Exception as e:
        return ("raised", type(e), str(e))
    return None if result is None else result.get_block_ids()


def play(call: Call, hybrid: bool, seed: int) -> list[Any]:
    """Admissions, decode steps through ``call`` (refusals free the request), frees."""
    mgr = manager(hybrid)
    rng = random.Random(seed)
    prefix = [rng.randrange(40) for _ in range(9)]
    log: list[Any] = []
    running: list[Request] = []
    for step in range(50):
        if rng.random() < 0.35:
            prompt = prefix[: rng.randrange(10)] + [rng.randrange(40) for _ in range(5)]
            req = Request(f"r{step}", prompt, block_hasher=hasher)
            hits, n = mgr.get_computed_blocks(req)
            got = outcome(mgr.allocate_slots, req, req.num_tokens - n, n, hits)
            log.append(got)
            if got is not None:
                req.num_computed_tokens = req.num_tokens
                req.status = RequestStatus.RUNNING
                req.append_output_token_ids(rng.randrange(40))
                running.append(req)
        for req in list(running):
            k = rng.choice((0, 0, 1, 3))
            got = outcome(call, mgr, req, 1, k)
            log.append(got)
            if got is None:
                mgr.free(req)
                running.remove(req)
                continue
            req.num_computed_tokens += 1
            req.append_output_token_ids(rng.randrange(40))
        if running and rng.random() < 0.15:
            mgr.free(running.pop(rng.randrange(len(running))))
        log.append(mgr.take_events())
        log.append(mgr.block_pool.get_num_free_blocks())
    return log


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_both_shapes_allocate_the_same(hybrid: bool, seed: int) -> None:
    expected = play(positional, hybrid, seed)
    assert any(x is None for x in expected), "the workload should refuse some steps"
    assert play(short, hybrid, seed) == expected
    assert play(by_keyword, hybrid, seed) == expected


class Index:
    """An int-like count: not an exact int, so the general parser reads it (``__index__``)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


BAD_CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("negative count", (-1,), {}),
    ("negative lookahead", (1,), {"num_lookahead_tokens": -2}),
    ("count not an int", ("2",), {}),
    ("lookahead not an int", (1,), {"num_lookahead_tokens": 1.5}),
    ("zero tokens", (0,), {}),
    ("unknown keyword", (1,), {"num_lookahead": 1}),
    ("count twice", (1,), {"num_new_tokens": 1}),
    ("missing count", (), {}),
]


@pytest.mark.parametrize(("what", "args", "kwargs"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_raise_as_the_general_parser(
    what: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    mgr = manager(hybrid=True)
    req = Request("r", list(range(10)), block_hasher=hasher)
    assert mgr.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    req.status = RequestStatus.RUNNING
    req.append_output_token_ids(3)
    before = (mgr.get_block_ids("r"), mgr.block_pool.get_num_free_blocks())
    fast = outcome(mgr.allocate_slots, req, *args, **kwargs)
    # The same call through pyo3's parser: one more keyword (the default it names anyway).
    general = outcome(mgr.allocate_slots, req, *args, **kwargs, has_scheduled_reqs=True)
    assert fast[0] == "raised", (what, fast)
    assert fast == general, what
    assert (mgr.get_block_ids("r"), mgr.block_pool.get_num_free_blocks()) == before


def test_int_like_counts_go_through_the_general_parser() -> None:
    a, b = manager(hybrid=False), manager(hybrid=False)
    ra = Request("r", list(range(7)), block_hasher=hasher)
    rb = Request("r", list(range(7)), block_hasher=hasher)
    got_a = a.allocate_slots(ra, Index(7), num_lookahead_tokens=Index(2))  # type: ignore[arg-type]
    got_b = b.allocate_slots(rb, 7, num_lookahead_tokens=2)
    assert got_a is not None and got_b is not None
    assert got_a.get_block_ids() == got_b.get_block_ids()
    assert a.allocate_slots(ra, True) is not None  # a bool is an int subclass: counted as 1


def test_the_entry_keeps_the_methods_name_signature_and_doc() -> None:
    method = KVCacheManagerCore.allocate_slots
    assert method.__name__ == "allocate_slots"
    assert method.__qualname__ == "KVCacheManagerCore.allocate_slots"
    assert method.__doc__ and "ALLOC-1..13" in method.__doc__
    params = list(inspect.signature(method).parameters)
    assert params[:3] == ["self", "request", "num_new_tokens"]
    assert params[-1] == "has_scheduled_reqs"
    assert inspect.signature(KVCacheManager.allocate_slots) == inspect.signature(method)


def test_a_request_whose_attributes_call_the_manager_is_served() -> None:
    """Re-entrancy through the short shape: a property that calls the manager."""
    mgr = manager(hybrid=False, caching=False)
    other = Request("other", list(range(5)))
    assert mgr.allocate_slots(other, 5) is not None

    class Reentrant:
        request_id = "re"
        num_prompt_tokens = 6
        num_computed_tokens = 0
        status = RequestStatus.RUNNING
        block_hashes = ()
        skip_reading_prefix_cache = False
        lora_request = None
        cache_salt = None
        mm_features = ()
        prompt_embeds = None
        all_token_ids = tuple(range(6))

        @property
        def num_tokens(self) -> int:
            assert mgr.get_block_ids("other") == ([1, 2],)
            return 6

    got = mgr.allocate_slots(Reentrant(), 6)
    assert got is not None and got.get_block_ids() == ([3, 4],)
