"""``KVCacheManager.allocate_slots_batch``: the per-request loop's decisions in one call.

Two managers run the same seeded trace: one allocates its running requests with
``allocate_slots_batch`` (preempting and retrying when the result comes back short), the other
with a loop of ``allocate_slots`` calls. After every step both must agree on every result, the
free-block order and the events. One full-attention group and a hybrid configuration (full
attention + sliding window) are each covered.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvcore import hashing
from kvcore.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.errors import InvalidArgumentError
from kvcore.manager import KVCacheManager
from kvcore.request import Request, RequestStatus
from kvcore.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 64, "dtype": "float16"}
BS = 16


def _manager(kind: str, num_blocks: int) -> KVCacheManager:
    specs: list[KVCacheSpec] = [FullAttentionSpec(BS, **ATTN)]
    if kind == "hybrid":
        specs.append(SlidingWindowSpec(BS, sliding_window=48, **ATTN))
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    return KVCacheManager(
        KVCacheConfig(num_blocks, [], groups),
        max_model_len=4096,
        scheduler_block_size=BS,
        hash_block_size=BS,
        enable_kv_cache_events=True,
    )


def _hasher() -> Any:
    fn = hashing.get_hash_fn_by_name("sha256")
    hashing.init_none_hash(fn)
    return hashing.get_request_block_hasher(BS, fn)


def _pool(m: KVCacheManager) -> Any:
    return m.block_pool


def _state(m: KVCacheManager) -> tuple[Any, ...]:
    return (_pool(m).get_all_free_block_ids(), m.take_events())


@pytest.mark.parametrize("kind", ["single", "hybrid"])
@pytest.mark.parametrize("seed", range(6))
def test_batch_matches_loop(kind: str, seed: int) -> None:
    """Batch and loop make the same decisions, step after step, under preemption."""
    rng = random.Random(seed)
    allow_none = seed % 2 == 1  # odd seeds ask for None instead of empty id lists
    hasher = _hasher()
    batch_mgr, loop_mgr = _manager(kind, 60), _manager(kind, 60)
    shared = [rng.randrange(1, 500) for _ in range(40)]
    running: list[tuple[Request, Request]] = []
    waiting: list[tuple[Request, Request]] = []
    n_req = 0
    for step in range(120):
        for _ in range(rng.randrange(0, 3)):
            prompt = shared[: rng.randrange(0, 40)] + [
                rng.randrange(1, 500) for _ in range(rng.randrange(1, 60))
            ]
            rid = f"r{n_req}"
            n_req += 1
            waiting.append(
                (
                    Request(rid, prompt, max_tokens=99, block_hasher=hasher),
                    Request(rid, prompt, max_tokens=99, block_hasher=hasher),
                )
            )
        # Running requests: batch on one side, loop on the other; preempt the last on failure.
        i = 0
        while i < len(running):
            pairs = running[i:]
            counts = [max(1, p[0].num_tokens - p[0].num_computed_tokens) for p in pairs]
            got = batch_mgr.allocate_slots_batch(
                [p[0] for p in pairs], counts, allow_none=allow_none
            )
            for k, (pair, n) in enumerate(zip(pairs, counts, strict=True)):
                want = loop_mgr.allocate_slots(pair[1], n)
                if k < len(got):
                    assert want is not None
                    assert want.get_block_ids(allow_none=allow_none) == got[k]
                else:
                    assert want is None, "batch stopped before a request the loop allocated"
                    break
            i += len(got)
            if i < len(running):
                victim = running.pop()
                for mgr, req in zip((batch_mgr, loop_mgr), victim, strict=True):
                    mgr.free(req)
                    req.status = RequestStatus.PREEMPTED
                    req.num_computed_tokens = 0
                waiting.insert(0, victim)
        for pair in running:
            tok = rng.randrange(1, 500)
            for req in pair:
                req.num_computed_tokens = req.num_tokens
                req.append_output_token_ids(tok)
        # Admissions through the per-request API on both sides.
        while waiting:
            a, b = waiting[0]
            hits_a, na = batch_mgr.get_computed_blocks(a)
            hits_b, nb = loop_mgr.get_computed_blocks(b)
            assert na == nb
            ra = batch_mgr.allocate_slots(a, a.num_tokens - na, na, hits_a)
            rb = loop_mgr.allocate_slots(b, b.num_tokens - nb, nb, hits_b)
            assert (ra is None) == (rb is None)
            if ra is None or rb is None:
                break
            assert ra.get_block_ids() == rb.get_block_ids()
            waiting.pop(0)
            for req, n in ((a, na), (b, nb)):
                req.num_computed_tokens = n
                req.status = RequestStatus.RUNNING
            running.append((a, b))
        # Finish some.
        for pair in list(running):
            if rng.random() < 0.08:
                running.remove(pair)
                batch_mgr.free(pair[0])
                loop_mgr.free(pair[1])
        assert _state(batch_mgr) == _state(loop_mgr), f"step {step}"
    _pool(batch_mgr).check_invariants()


def test_batch_stops_at_first_failure() -> None:
    """Requests after the one that does not fit are not tried: their tables are unchanged."""
    m = _manager("single", 6)  # 5 usable blocks
    reqs = [
        Request(f"r{i}", list(range(1, 17)), max_tokens=9, block_hasher=_hasher()) for i in range(3)
    ]
    for r in reqs[:2]:
        assert m.allocate_slots(r, 16) is not None
        r.num_computed_tokens = 16
        r.status = RequestStatus.RUNNING
    assert m.allocate_slots(reqs[2], 16) is not None
    reqs[2].num_computed_tokens = 16
    reqs[2].status = RequestStatus.RUNNING
    before = [m.get_block_ids(r.request_id) for r in reqs]
    got = m.allocate_slots_batch(reqs, [20, 40, 1])  # r0 takes 2, r1 needs 3: only 0 left
    assert len(got) == 1 and len(got[0][0]) == 2
    assert m.get_block_ids("r1") == before[1] and m.get_block_ids("r2") == before[2]
    assert m.allocate_slots_batch([], []) == []
    reqs[2].num_computed_tokens = 8  # the 9th token still fits in its one block
    got_none = m.allocate_slots_batch(reqs[2:], [1], allow_none=True)
    assert got_none == [None], "a request that needs no new block gets None with allow_none"


@pytest.mark.parametrize("kind", ["single", "hybrid"])
def test_batch_bad_input_changes_nothing(kind: str) -> None:
    """Mismatched lengths and negative counts raise before any allocation."""
    m = _manager(kind, 20)
    r = Request("r", list(range(1, 17)), max_tokens=9, block_hasher=_hasher())
    assert m.allocate_slots(r, 16) is not None
    r.num_computed_tokens = 16
    r.status = RequestStatus.RUNNING
    free = _pool(m).get_all_free_block_ids()
    held = m.get_block_ids("r")
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots_batch([r], [1, 1])
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots_batch([r, r], [40, -1])
    with pytest.raises(ValueError):
        m.allocate_slots_batch([r], [1], num_lookahead_tokens=-2)
    assert _pool(m).get_all_free_block_ids() == free
    assert m.get_block_ids("r") == held


def test_one_request_object_across_managers_frees_and_renames() -> None:
    """The native manager's per-request slot hint never points at another table or request."""
    m1, m2 = _manager("single", 40), _manager("single", 40)
    other = Request("o", list(range(100, 140)), max_tokens=9, block_hasher=_hasher())
    assert m2.allocate_slots(other, 40) is not None  # m2's ids now differ from m1's
    r = Request("r", list(range(1, 33)), max_tokens=9, block_hasher=_hasher())
    assert m1.allocate_slots(r, 32) is not None and m2.allocate_slots(r, 32) is not None
    r.num_computed_tokens = 32
    r.status = RequestStatus.RUNNING
    for _ in range(20):  # alternate managers: each must grow its own table
        for m in (m1, m2):
            assert m.allocate_slots(r, 1) is not None
        r.append_output_token_ids(7)
        r.num_computed_tokens += 1
    t1, t2 = m1.get_block_ids("r")[0], m2.get_block_ids("r")[0]
    assert len(t1) == len(t2) == 4 and t1 != t2
    m1.free(r)  # r's entry in m1 is gone; a new request takes its slot
    x = Request("x", list(range(50, 66)), max_tokens=9, block_hasher=_hasher())
    assert m1.allocate_slots(x, 16) is not None
    x_table = m1.get_block_ids("x")
    r.status = RequestStatus.PREEMPTED
    r.num_computed_tokens = 0
    hits, n = m1.get_computed_blocks(r)
    assert m1.allocate_slots(r, r.num_tokens - n, n, hits) is not None
    assert m1.get_block_ids("x") == x_table
    r.request_id = "renamed"  # the same object under a new id is a new request
    r.status = RequestStatus.WAITING
    assert m1.allocate_slots(r, r.num_tokens) is not None
    assert m1.get_block_ids("x") == x_table and m1.get_block_ids("renamed")[0]
    _pool(m1).check_invariants()
    _pool(m2).check_invariants()


class _Tagged(Request):
    """A Python subclass of Request: still read natively."""


def test_batch_mixes_request_classes() -> None:
    """Requests of two classes in one batch, the subclass first (the manager remembers the
    first class it recognises): the same blocks as per-request calls, step after step."""
    hasher = _hasher()
    batch_mgr, loop_mgr = _manager("native", 200), _manager("native", 200)
    pairs: list[tuple[Request, Request]] = []
    for i in range(8):
        cls = _Tagged if i % 2 == 0 else Request
        prompt = [i + 1] * (5 + 9 * i)
        pair = (
            cls(f"r{i}", prompt, block_hasher=hasher),
            cls(f"r{i}", prompt, block_hasher=hasher),
        )
        for mgr, req in zip((batch_mgr, loop_mgr), pair, strict=True):
            assert mgr.allocate_slots(req, req.num_tokens) is not None
            req.num_computed_tokens = req.num_tokens
            req.status = RequestStatus.RUNNING
        pairs.append(pair)
    for step in range(40):
        for pair in pairs:
            for req in pair:
                req.append_output_token_ids(step + 1)
        got = batch_mgr.allocate_slots_batch([p[0] for p in pairs], [1] * len(pairs))
        want = [loop_mgr.allocate_slots(p[1], 1) for p in pairs]
        assert got == [w.get_block_ids() for w in want if w is not None]
        for pair in pairs:
            for req in pair:
                req.num_computed_tokens += 1
        assert _state(batch_mgr) == _state(loop_mgr), f"step {step}"
    _pool(batch_mgr).check_invariants()
