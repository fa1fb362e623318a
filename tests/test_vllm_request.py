"""``kvcore.vllm.Request.append_output_token_ids``: vLLM's method run natively, checked against
vLLM's own ``Request`` call by call."""

from __future__ import annotations

import hashlib
import inspect
import random
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm.v1.request")

from vllm.sampling_params import SamplingParams
from vllm.utils import hashing as vllm_hashing
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request as VllmRequest

import kvcore.vllm
from kvcore._native import PlainRequestBase
from kvcore.errors import InvalidArgumentError

pytestmark = pytest.mark.reference

BLOCK = 4


def _hasher(kind: str, calls: list[int]) -> Callable[[Any], list[Any]] | None:
    """A block hasher of one kind; ``counted`` notes each call in ``calls``."""
    fn = vllm_hashing.sha256
    if kind == "none":
        return None
    if kind == "vllm":
        made: Callable[[Any], list[Any]] = kv_cache_utils.get_request_block_hasher(BLOCK, fn)
        return made
    if kind == "kvcore":
        return kvcore.vllm.get_request_block_hasher(BLOCK, fn)
    ref = kv_cache_utils.get_request_block_hasher(BLOCK, fn)

    def counted(request: Any) -> list[Any]:
        calls.append(request.num_tokens)
        hashes: list[Any] = ref(request)
        return hashes

    return counted


def _pair(kind: str) -> tuple[VllmRequest, kvcore.vllm.Request, list[int], list[int]]:
    """vLLM's request and kvcore's, alike, each with its own hasher of ``kind``."""
    calls: tuple[list[int], list[int]] = ([], [])
    made = [
        cls(
            "r",
            list(range(6)),
            SamplingParams(max_tokens=500),
            None,
            block_hasher=_hasher(kind, c),
        )
        for cls, c in zip((VllmRequest, kvcore.vllm.Request), calls, strict=True)
    ]
    ref, ours = made
    assert isinstance(ours, kvcore.vllm.Request)
    return ref, ours, calls[0], calls[1]


def _state(r: VllmRequest) -> tuple[Any, ...]:
    return (
        list(r._all_token_ids),
        list(r._output_token_ids),
        list(r.block_hashes),
        r.num_tokens,
        list(r.all_token_ids),
        list(r.output_token_ids),
    )


def _tokens(rng: random.Random) -> Any:
    """One argument of the kinds a caller may pass."""
    pick = rng.randrange(9)
    if pick < 4:
        return rng.randrange(50_000)
    if pick == 4:
        return [rng.randrange(50_000) for _ in range(rng.randrange(6))]
    if pick == 5:
        return tuple(rng.randrange(50_000) for _ in range(rng.randrange(6)))
    if pick == 6:
        return rng.choice([True, False, 2**70, -3])
    if pick == 7:
        n = rng.randrange(5)

        def gen() -> Iterator[int]:
            yield from range(n)

        return gen
    return []


@pytest.mark.parametrize("kind", ["vllm", "kvcore", "none", "counted"])
@pytest.mark.parametrize("seed", range(4))
def test_append_matches_vllms(kind: str, seed: int) -> None:
    """Every argument kind, with each kind of hasher: the same lists and hashes after every
    call, and a Python hasher called as often, at the same counts."""
    kv_cache_utils.init_none_hash(vllm_hashing.sha256)
    rng = random.Random(seed)
    ref, ours, ref_calls, our_calls = _pair(kind)
    for _ in range(120):
        arg = _tokens(rng)
        for r in (ref, ours):
            r.append_output_token_ids(arg() if callable(arg) else arg)
        assert _state(ours) == _state(ref)
        assert our_calls == ref_calls
    if kind != "none":
        assert len(ref.block_hashes) == ref.num_tokens // BLOCK


@pytest.mark.parametrize(
    ("prompt", "max_tokens"), [(100, 1000), (101, 1000), (100, 30), (16, 500), (7, 500), (0, 9)]
)
def test_token_list_has_room_for_decode(prompt: int, max_tokens: int) -> None:
    """The constructor is vLLM's (same signature, same attributes) and leaves room in
    ``_all_token_ids`` for ``min(max_tokens, prompt - 3)`` appends when the prompt has 16 tokens
    or more: the list's allocation does not grow until then, where vLLM's does, and it holds
    what vLLM's holds all along."""
    assert inspect.signature(kvcore.vllm.Request) == inspect.signature(VllmRequest)
    made = [
        cls("r", list(range(prompt)), SamplingParams(max_tokens=max_tokens), None)
        for cls in (VllmRequest, kvcore.vllm.Request)
    ]
    ref, ours = made
    assert list(ours.all_token_ids) == list(ref.all_token_ids)
    assert ours.max_tokens == ref.max_tokens
    assert ours.all_token_ids._x is ours._all_token_ids  # vLLM's view of the same list
    room = min(max_tokens, prompt - 3) if prompt >= 16 else 0
    size = sys.getsizeof(ours._all_token_ids)
    ref_sizes = {sys.getsizeof(ref._all_token_ids)}
    for i in range(room):
        for r in made:
            r.append_output_token_ids(1000 + i)
        assert sys.getsizeof(ours._all_token_ids) == size
        ref_sizes.add(sys.getsizeof(ref._all_token_ids))
        assert _state(ours) == _state(ref)
    if room > 8:
        assert len(ref_sizes) > 1  # vLLM's list grew meanwhile: the room is kvcore's
    for i in range(20):
        for r in made:
            r.append_output_token_ids(i)
    assert _state(ours) == _state(ref)


def test_append_by_keyword_and_errors_as_vllms() -> None:
    """The keyword form works; a bad argument, a hasher that raises and a replaced list give
    vLLM's exception and vLLM's state."""
    kv_cache_utils.init_none_hash(vllm_hashing.sha256)
    ref, ours, _, _ = _pair("vllm")
    for r in (ref, ours):
        r.append_output_token_ids(token_ids=7)
    assert _state(ours) == _state(ref)
    for bad in (None, 3.5, object()):
        errors = []
        for r in (ref, ours):
            with pytest.raises(TypeError) as info:
                r.append_output_token_ids(bad)
            errors.append(str(info.value))
        assert errors[0] == errors[1]
        assert _state(ours) == _state(ref)

    def failing(request: Any) -> list[Any]:
        raise RuntimeError("hasher down")

    for r in (ref, ours):
        r._block_hasher = failing
        with pytest.raises(RuntimeError, match="hasher down"):
            r.append_output_token_ids(1)
    assert _state(ours) == _state(ref)

    class Recording(list[int]):
        """A list subclass whose appends are seen."""

        seen: list[int]

        def append(self, item: int) -> None:
            self.seen.append(item)
            super().append(item)

    for r in (ref, ours):
        r._block_hasher = None
        rec = Recording(r._output_token_ids)
        rec.seen = []
        r._output_token_ids = rec
        r.append_output_token_ids(9)
        assert rec.seen == [9]
        del r._output_token_ids
        with pytest.raises(AttributeError, match="_output_token_ids"):
            r.append_output_token_ids(9)


def test_append_reads_its_fields_as_attribute_lookup_does() -> None:
    """The append reads ``_output_token_ids``, ``_block_hasher`` and ``block_hashes`` from the
    slots ``kvcore.vllm.Request`` keeps them in: requests whose fields were deleted and set
    again (in rotated orders), or hold other objects, are served as attribute lookup serves
    them, call after call."""
    kv_cache_utils.init_none_hash(vllm_hashing.sha256)
    pairs = [_pair("kvcore")[:2] for _ in range(3)]
    for i, (ref, ours) in enumerate(pairs):
        for r in (ref, ours):
            fields = {n: getattr(r, n) for n in ("_output_token_ids", "_block_hasher")}
            fields["block_hashes"] = r.block_hashes
            names = list(fields)
            for n in names:
                delattr(r, n)
            for n in names[i:] + names[:i]:  # back in a rotated order: other entries
                setattr(r, n, fields[n])
    rng = random.Random(0)
    for step in range(90):
        ref, ours = pairs[rng.randrange(len(pairs))]
        if step % 30 == 29:
            # Other objects under the same names: fresh lists, and the hash list copied.
            for r in (ref, ours):
                r._output_token_ids = list(r._output_token_ids)
                r.block_hashes = list(r.block_hashes)
        token = rng.randrange(50_000)
        for r in (ref, ours):
            r.append_output_token_ids(token)
        assert _state(ours) == _state(ref)
    for _, ours in pairs:
        assert len(ours.block_hashes) == ours.num_tokens // BLOCK


def test_appends_in_changing_orders_with_requests_freed_between() -> None:
    """The native append links each request to the one it served next, for prefetching only:
    requests appended in changing orders (a step's order, then another), some freed mid-step
    (the last one appended among them) and others made, each hold what vLLM's hold, and a
    freed request is gone at once (the link holds no reference)."""
    kv_cache_utils.init_none_hash(vllm_hashing.sha256)
    rng = random.Random(0)
    pairs = [_pair("kvcore")[:2] for _ in range(8)]
    for step in range(60):
        order = list(range(len(pairs)))
        if step % 3:
            rng.shuffle(order)
        for n, i in enumerate(order):
            token = rng.randrange(50_000)
            pairs[i][0].append_output_token_ids(token)
            pairs[i][1].append_output_token_ids(token)
            if n == len(order) // 2 and step % 4 == 1:
                pairs.append(_pair("kvcore")[:2])  # joins mid-step, appended next step
        assert all(_state(ours) == _state(ref) for ref, ours in pairs)
        if step % 2 and len(pairs) > 4:
            _, ours = pairs.pop(order[-1] if step % 4 == 1 else rng.randrange(len(pairs)))
            gone = weakref.ref(ours)
            del ours
            assert gone() is None


def test_a_request_freed_after_its_append_is_not_written_to() -> None:
    """The append that follows a freed request's does not write into the memory it had: here
    bytes objects of its size, made right after it was freed (CPython's allocator hands its
    block to the next object of that size), keep their contents."""
    first, last = (
        kvcore.vllm.Request(f"r{i}", list(range(20)), SamplingParams(max_tokens=9), None)
        for i in range(2)
    )
    first.append_output_token_ids(1)
    last.append_output_token_ids(1)  # the last request the append served
    size = sys.getsizeof(last)
    gone = weakref.ref(last)
    del last
    assert gone() is None
    # Objects of the freed request's size class (its object, managed dict pointers and GC
    # header): one of them takes its block.
    fill = size - sys.getsizeof(b"")
    made = [bytes([0xAB]) * fill for _ in range(512)]
    first.append_output_token_ids(2)
    assert all(b == bytes([0xAB]) * fill for b in made)
    assert first.all_token_ids[-2:] == [1, 2]


def test_a_subclass_gets_vllms_method() -> None:
    """A subclass of kvcore's request is served by vLLM's Python method, so what it overrides
    is called; the native append serves one class only."""
    kv_cache_utils.init_none_hash(vllm_hashing.sha256)
    updates: list[int] = []

    class Sub(kvcore.vllm.Request):
        __slots__ = ()

        def update_block_hashes(self) -> None:
            updates.append(self.num_tokens)
            super().update_block_hashes()

    hasher = kvcore.vllm.get_request_block_hasher(BLOCK, vllm_hashing.sha256)
    sub = Sub("s", [1, 2, 3], SamplingParams(max_tokens=9), None, block_hasher=hasher)
    updates.clear()
    sub.append_output_token_ids(4)
    sub.append_output_token_ids([5, 6])
    assert updates == [4, 6]
    assert sub.num_tokens == 6
    assert len(sub.block_hashes) == 1
    PlainRequestBase._serve_append(kvcore.vllm.Request, VllmRequest.append_output_token_ids)
    with pytest.raises(InvalidArgumentError, match="another class"):
        PlainRequestBase._serve_append(Sub, VllmRequest.append_output_token_ids)


def _edit(rng: random.Random, r: VllmRequest, pick: int, token: int) -> None:
    """One change of the request's token list, as vLLM's own code makes them (the native
    append, an append of several, an item replaced, a truncation and extension as a streaming
    update makes, a ``pop``), or by a caller (an int of another type, a fresh int object of
    the same value)."""
    tokens = r._all_token_ids
    if pick < 5:
        r.append_output_token_ids(token)
    elif pick == 5:
        r.append_output_token_ids([token, token + 1, token + 2])
    elif pick == 6:
        tokens[-1] = token
    elif pick == 7:
        cut = rng.randrange(1, 4)
        del tokens[-cut:]
        tokens.extend(token + i for i in range(cut))
    elif pick == 8:
        tokens.pop()
        tokens.append(token)
    elif pick == 9:
        tokens[-1] = int(str(int(tokens[-1])))  # another object, the same value
    else:
        r.append_output_token_ids(True)


@pytest.mark.parametrize("seed", range(6))
def test_events_follow_in_place_edits_of_the_token_list(seed: int) -> None:
    """The native append keeps the tokens and hashes it appends for the call that stores their
    block (its event takes the tokens instead of slicing the list, the call takes the hash's
    value without reading the ``bytes``); vLLM's code also edits the lists in place. Against
    vLLM's own manager and ``Request``: after every kind of edit of the token list, and with
    the last hash replaced by another or by an equal object, each call's blocks and each
    step's events are the reference's (the event's tokens are the list's at the call)."""
    import vllm_harness as h

    kv_cache_utils.init_none_hash(vllm_hashing.sha256)
    rng = random.Random(seed)
    setup = h.Setup(block_size=BLOCK, num_blocks=400)
    kwargs: dict[str, Any] = {
        "max_model_len": 4096,
        "scheduler_block_size": BLOCK,
        "hash_block_size": BLOCK,
        "enable_kv_cache_events": True,
    }
    ref_mgr, our_mgr = h.manager_pair(setup, **kwargs)
    ref_hasher = kv_cache_utils.get_request_block_hasher(BLOCK, vllm_hashing.sha256)
    our_hasher = kvcore.vllm.get_request_block_hasher(BLOCK, vllm_hashing.sha256)
    pairs: list[tuple[VllmRequest, kvcore.vllm.Request]] = []
    for i in range(4):
        prompt = [rng.randrange(1000, 60_000) for _ in range(rng.randrange(3, 11))]
        pair = (
            VllmRequest(
                f"r{i}", list(prompt), SamplingParams(max_tokens=900), None, block_hasher=ref_hasher
            ),
            kvcore.vllm.Request(
                f"r{i}", list(prompt), SamplingParams(max_tokens=900), None, block_hasher=our_hasher
            ),
        )
        got = [
            m.allocate_slots(r, r.num_tokens) for m, r in zip((ref_mgr, our_mgr), pair, strict=True)
        ]
        assert [g.get_block_ids() for g in got] == [g.get_block_ids() for g in got[:1]] * 2
        pairs.append(pair)
    stored = 0
    for _step in range(150):
        for pair in pairs:
            pick, token = rng.randrange(14), rng.randrange(1000, 60_000)
            hash_pick, later_pick = rng.randrange(8), rng.randrange(6)
            for r in pair:
                _edit(random.Random(token), r, pick, token)
                r.num_computed_tokens = r.num_tokens - 1
                if r.block_hashes and hash_pick == 0:
                    # Another hash in place of the last one the append made.
                    r.block_hashes[-1] = hashlib.sha256(str(token).encode()).digest()
                elif r.block_hashes and hash_pick == 1:
                    r.block_hashes[-1] = bytes(bytearray(r.block_hashes[-1]))  # the same value
                # A token of the block the append just hashed, changed before the call.
                if later_pick == 0:
                    r._all_token_ids[-2] = token + 7
                elif later_pick == 1:
                    r._all_token_ids[-2] = int(str(int(r._all_token_ids[-2])))
            got = [m.allocate_slots(r, 1) for m, r in zip((ref_mgr, our_mgr), pair, strict=True)]
            assert got[1] is not None and got[0] is not None
            assert got[1].get_block_ids() == got[0].get_block_ids()
            assert pair[1]._all_token_ids == pair[0]._all_token_ids
        ref_events, our_events = ref_mgr.take_events(), our_mgr.take_events()
        assert our_events == ref_events
        stored += sum(type(e).__name__ == "BlockStored" for e in ref_events)
    assert stored > 100
