"""The native parts of a request and of a result: ``RequestCore``, ``RequestBlockHasher`` and
``KVCacheBlocksBase`` behave as the Python objects they replaced (SPEC §7, §17, RH-1/RH-2)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import cbor2
import pytest

from kvcore import hashing
from kvcore.blocks import KVCacheBlocks
from kvcore.request import Request, RequestStatus, append_output_token_ids_batch

NONE_HASH = hashlib.sha256(cbor2.dumps("0")).digest()


def _python_hasher(hbs: int) -> Any:
    """RH-1 with sha256_cbor written out in Python (no extras)."""

    def hasher(req: Any) -> list[bytes]:
        out: list[bytes] = []
        parent = req.block_hashes[-1] if req.block_hashes else NONE_HASH
        start = len(req.block_hashes) * hbs
        while start + hbs <= req.num_tokens:
            block = tuple(req.all_token_ids[start : start + hbs])
            parent = hashlib.sha256(cbor2.dumps((parent, block, None))).digest()
            out.append(parent)
            start += hbs
        return out

    return hasher


@pytest.fixture
def native_hasher(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    fn = hashing.get_hash_fn_by_name("sha256_cbor")
    hashing.init_none_hash(fn)
    h: Any = hashing.get_request_block_hasher(4, fn)
    assert type(h).__name__ == "RequestBlockHasher" and h.hash_block_size == 4
    return h


def test_native_hasher_matches_python(native_hasher: Any) -> None:
    """RH-1/RH-2: prompt and appended tokens hash as the Python hasher does, block by block."""
    a = Request("a", list(range(1, 11)), block_hasher=native_hasher)
    b = Request("b", list(range(1, 11)), block_hasher=_python_hasher(4))
    assert len(a.block_hashes) == 2 and a.block_hashes == b.block_hashes
    for tok in range(100, 120):
        a.append_output_token_ids(tok)
        b.append_output_token_ids(tok)
        assert a.block_hashes == b.block_hashes
        assert a.num_tokens == b.num_tokens == len(a.all_token_ids)
    a.append_output_token_ids([7, 8, 9, 10, 11])
    b.append_output_token_ids([7, 8, 9, 10, 11])
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 8


def test_native_hasher_falls_back_for_extra_keys(native_hasher: Any) -> None:
    """A salted request goes through the Python path: its first hash differs, the rest chain."""
    plain = Request("p", list(range(1, 9)), block_hasher=native_hasher)
    salted = Request("s", list(range(1, 9)), cache_salt="salt", block_hasher=native_hasher)
    assert len(salted.block_hashes) == 2 and salted.block_hashes[0] != plain.block_hashes[0]


def test_append_forms_and_counts() -> None:
    """REQ-1: int, int subclass and iterables append to both lists; num_tokens follows.

    An int subclass such as ``bool`` is kept as given, as the reference keeps it (its block
    hashes serialise ``True``, not ``1``).
    """
    r = Request("r", [1, 2, 3])
    r.append_output_token_ids(True)
    assert r.output_token_ids == [1] and type(r.output_token_ids[0]) is bool
    r.append_output_token_ids((5, 6))
    assert r.all_token_ids == [1, 2, 3, 1, 5, 6] and r.num_tokens == 6
    assert r.num_output_tokens == 3 and r.num_tokens_with_spec == 6
    with pytest.raises(TypeError):
        r.append_output_token_ids(None)  # type: ignore[arg-type]
    assert r.num_tokens == 6


def test_fields_and_bad_assignments() -> None:
    """The native fields read and write like attributes; wrong types raise and change nothing."""
    r = Request("r", [1, 2, 3])
    assert r.request_id == "r" and r.status is RequestStatus.WAITING and not r.is_finished()
    r.num_computed_tokens = 2
    r.status = RequestStatus.FINISHED_STOPPED
    assert r.num_computed_tokens == 2 and r.is_finished()
    with pytest.raises(TypeError):
        r.request_id = 5  # type: ignore[assignment]
    with pytest.raises(TypeError):
        r.num_computed_tokens = "x"  # type: ignore[assignment]
    with pytest.raises((AttributeError, TypeError)):
        del r.num_tokens
    assert r.request_id == "r" and r.num_computed_tokens == 2 and r.num_tokens == 3
    assert "request_id='r'" in repr(r)


def test_no_hasher_stops_trying() -> None:
    """Without a hasher the request never hashes and appends skip the check."""
    r = Request("r", list(range(40)))
    r.append_output_token_ids(list(range(40)))
    assert r.block_hashes == [] and r._next_hash_at > 10**9


def test_kv_cache_blocks_native_base() -> None:
    """KVB-1/KVB-2: fresh lists per call, equality on blocks and class, unhashable, repr."""
    a = KVCacheBlocks(([1, 2], (3,)))
    ids = a.get_block_ids()
    assert ids == ([1, 2], [3]) and ids[0] is not a.blocks[0]
    ids[0].append(99)
    assert a.get_block_ids() == ([1, 2], [3])
    assert KVCacheBlocks([[1], [2]]).blocks == ([1], [2])  # any iterable of groups
    assert a == KVCacheBlocks(([1, 2], (3,)), block_pool=object())
    assert a != KVCacheBlocks(([1], (3,)))
    with pytest.raises(TypeError):
        hash(a)
    assert repr(KVCacheBlocks(((),))) == "KVCacheBlocks(blocks=((),))"
    assert KVCacheBlocks(((), ())).get_block_ids(allow_none=True) is None
    with pytest.raises(TypeError):
        KVCacheBlocks(5)  # type: ignore[arg-type]


class _Counting(Request):
    """A subclass that overrides the append: the batch call must call the override."""

    __slots__ = ("calls",)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        self.calls = getattr(self, "calls", 0) + 1
        super().append_output_token_ids(token_ids)


class _Duck:
    """A duck-typed request with only the method."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def append_output_token_ids(self, token_ids: Any) -> None:
        self.seen.append(token_ids)


def test_append_batch_matches_per_request(native_hasher: Any) -> None:
    """append_output_token_ids_batch == one append_output_token_ids per request."""
    one = [Request(f"a{i}", list(range(i, i + 7)), block_hasher=native_hasher) for i in range(5)]
    two = [Request(f"a{i}", list(range(i, i + 7)), block_hasher=native_hasher) for i in range(5)]
    for step in range(12):
        toks: list[Any] = [step * 10 + i for i in range(5)]
        toks[2] = [step, step + 1]
        append_output_token_ids_batch(one, toks)
        for r, t in zip(two, toks, strict=True):
            r.append_output_token_ids(t)
    for a, b in zip(one, two, strict=True):
        assert a.all_token_ids == b.all_token_ids and a.num_tokens == b.num_tokens
        assert a.block_hashes == b.block_hashes and a.block_hashes


def test_append_batch_calls_overrides_and_duck_types() -> None:
    """Objects that are not plain kvcore Requests get their own method called."""
    plain, counting, duck = Request("p", [1]), _Counting("c", [1]), _Duck()
    append_output_token_ids_batch([plain, counting, duck, counting], [2, 3, [4, 5], 6])
    assert plain.output_token_ids == [2] and counting.output_token_ids == [3, 6]
    assert counting.calls == 2 and duck.seen == [[4, 5]]


def test_append_batch_length_mismatch_appends_nothing() -> None:
    r = Request("r", [1, 2])
    with pytest.raises(ValueError):
        append_output_token_ids_batch([r, r], [3])
    assert r.num_tokens == 2 and r.output_token_ids == []
    append_output_token_ids_batch([], [])


def test_manager_reads_the_list_when_it_differs_from_the_native_copy(native_hasher: Any) -> None:
    """The Rust manager's native copy of the hashes never hides a change to the list."""
    from kvcore.config import KVCacheConfig, KVCacheGroupSpec
    from kvcore.manager import KVCacheManager
    from kvcore.specs import FullAttentionSpec

    spec = FullAttentionSpec(4, num_kv_heads=1, head_size=8, dtype="float16")
    m = KVCacheManager(
        KVCacheConfig(30, [], [KVCacheGroupSpec(["a"], spec)]),
        max_model_len=256,
        scheduler_block_size=4,
        hash_block_size=4,
    )
    a = Request("a", list(range(1, 17)), block_hasher=native_hasher)
    assert m.allocate_slots(a, 16) is not None
    m.free(a)  # a's 4 blocks are cached
    b = Request("b", list(range(101, 117)), block_hasher=native_hasher)
    assert m.get_computed_blocks(b)[1] == 0
    b.block_hashes = list(a.block_hashes)  # reassigned: b now claims a's prefix
    assert m.get_computed_blocks(b)[1] == 12
    c = Request("c", list(range(101, 117)), block_hasher=native_hasher)
    c.block_hashes.clear()
    c.block_hashes.extend(a.block_hashes[:2])  # edited in place: lengths differ from the copy
    assert m.get_computed_blocks(c)[1] == 8


def test_request_cycles_are_collected() -> None:
    """A hasher that refers back to its request does not keep the request alive."""
    import gc
    import weakref

    class Holder:
        req: Any = None

        def __call__(self, req: Any) -> list[bytes]:
            return []

    h = Holder()
    r = Request("cyc", [1, 2, 3], block_hasher=h)
    h.req = r  # r -> hasher -> r
    ref = weakref.ref(r)
    del r, h
    gc.collect()
    assert ref() is None


def test_output_token_ids_is_a_live_read_only_view() -> None:
    """REQ-1: output_token_ids follows later appends and behaves as a read-only list."""
    r = Request("v", [9, 9, 9])
    out = r.output_token_ids
    assert out == [] and len(out) == 0 and not out and r.num_output_tokens == 0
    r.append_output_token_ids([4, 5, 4])
    assert out == [4, 5, 4] and r.output_token_ids == out and list(out) == [4, 5, 4]
    assert out[0] == 4 and out[-1] == 4 and out[1:] == [5, 4] and 5 in out and 9 not in out
    assert out.index(4, 1) == 2 and out.count(4) == 2 and repr(out) == "[4, 5, 4]"
    assert r.num_output_tokens == 3 and r.all_token_ids == [9, 9, 9, 4, 5, 4]
    with pytest.raises(IndexError):
        out[3]
    with pytest.raises(ValueError):
        out.index(7)
    with pytest.raises(TypeError):
        out[0] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        hash(out)
    assert out != [4, 5] and (out == (4, 5, 4)) is False
    r._output_token_ids = [1]  # the tail of the token list is replaced
    assert r.all_token_ids == [9, 9, 9, 1] and out == [1]


def test_append_batch_bad_entry_stops_there() -> None:
    """A bad entry raises; requests before it keep their token, the ones after are untouched."""
    a, b, c = Request("a", [1]), Request("b", [1]), Request("c", [1])
    with pytest.raises(TypeError):
        append_output_token_ids_batch([a, b, c], [2, None, 3])  # type: ignore[list-item]
    assert a.output_token_ids == [2] and b.num_tokens == 1 and c.num_tokens == 1


def test_token_ids_are_a_native_buffer_with_live_views() -> None:
    """REQ-1: all_token_ids follows appends; bad token ids raise and change nothing."""
    prompt = [3, 1, 4, 1, 5]
    r = Request("t", prompt)
    view = r.all_token_ids
    prompt.append(9)  # the prompt was copied
    assert view == [3, 1, 4, 1, 5] and len(view) == r.num_tokens == 5
    r.append_output_token_ids([9, 2])
    assert view == [3, 1, 4, 1, 5, 9, 2] and view[-1] == 2 and view[5:] == [9, 2]
    assert list(view) == [3, 1, 4, 1, 5, 9, 2] and type(view[0]) is int
    with pytest.raises(ValueError, match="int64"):
        r.append_output_token_ids(2**63)
    with pytest.raises(ValueError, match="int64"):
        r.append_output_token_ids([6, -(2**64)])
    with pytest.raises(TypeError, match="ints"):
        r.append_output_token_ids([6, "7"])  # type: ignore[list-item]
    assert r.num_tokens == 7 and r.output_token_ids == [9, 2], "a bad append changed nothing"
    with pytest.raises(ValueError):
        Request("big", [1, 2**70])
    big = Request("ok", [2**63 - 1, -(2**63)])
    assert big.all_token_ids == [2**63 - 1, -(2**63)]


def test_native_hashes_match_for_any_sequence_prompt(native_hasher: Any) -> None:
    """RH-1: a tuple or any other sequence prompt is read into the buffer, hashed as a list."""
    a = Request("a", list(range(1, 40)), block_hasher=native_hasher)
    b = Request("b", tuple(range(1, 40)), block_hasher=native_hasher)
    c = Request("c", range(1, 40), block_hasher=native_hasher)
    assert a.block_hashes == b.block_hashes == c.block_hashes and len(a.block_hashes) == 9


def test_token_view_slices_like_a_list() -> None:
    """REQ-1: slicing a token view gives what slicing the same list gives."""
    tokens = [7, 3, 9, 1, 4, 4, 8, 2, 6]
    r = Request("s", tokens[:5])
    r.append_output_token_ids(tokens[5:])
    views = ((r.all_token_ids, tokens), (r.output_token_ids, tokens[5:]))
    for view, want in views:
        for sl in (
            slice(None),
            slice(2, 5),
            slice(-3, None),
            slice(4, 100),
            slice(6, 2),
            slice(None, None, 2),
            slice(None, None, -1),
            slice(7, 1, -3),
            slice(50, 60),
        ):
            assert view[sl] == want[sl], sl
