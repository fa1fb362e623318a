"""Requests of a registered *plain* class are read from their instance dict.

``KVCacheManager._plain_request_classes`` names a class whose fields the core reads from the
instance dict (``kvcore.vllm`` names vLLM's ``Request``). These tests run the same workload
through a manager that reads a plain class that way and one that reads a subclass of it (which
the core reads by attribute lookup, since only the exact class is plain): every result, every
event and every error must be the same. The registration refuses classes where a dict read
could differ from ``getattr``.
"""

from __future__ import annotations

import gc
import random
import weakref
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from kvcore import (
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    RSWASpec,
    SlidingWindowSpec,
)
from kvcore._native import PlainRequestBase
from kvcore.events import BlockStored
from kvcore.hashing import get_request_block_hasher, init_none_hash, sha256

ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
BLOCK = 4
RUNNING = 2  # RequestStatus.RUNNING


class PlainRequest:
    """vLLM's layout: plain attributes, ``num_tokens`` a property over a token list."""

    def __init__(self, request_id: str, prompt: list[int], hasher: Any) -> None:
        self.request_id = request_id
        self._all_token_ids = list(prompt)
        self.all_token_ids = self._all_token_ids
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.status = 1  # WAITING
        self.skip_reading_prefix_cache = False
        self.lora_request = None
        self.cache_salt: str | None = None
        self.mm_features: list[Any] = []
        self.prompt_embeds = None
        self.block_hashes: list[bytes] = []
        self._hasher = hasher
        self.block_hashes.extend(hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def append(self, token: int) -> None:
        self._all_token_ids.append(token)
        self.block_hashes.extend(self._hasher(self))


class DuckRequest(PlainRequest):
    """The same request, read by attribute lookup (a subclass is not the plain class)."""


class PlainManager(KVCacheManager):
    _plain_request_classes: ClassVar[tuple[tuple[type, str], ...]] = (
        (PlainRequest, "_all_token_ids"),
    )


class WidePlainRequest(PlainRequest):
    """A request with as many attributes as vLLM's: CPython gives its instances dicts with keys
    of their own (a small class's instances share theirs)."""

    def __init__(self, request_id: str, prompt: list[int], hasher: Any) -> None:
        super().__init__(request_id, prompt, hasher)
        for i in range(40):
            setattr(self, f"extra_{i}", i)


class WideDuckRequest(WidePlainRequest):
    """The wide request, read by attribute lookup."""


class WidePlainManager(KVCacheManager):
    _plain_request_classes: ClassVar[tuple[tuple[type, str], ...]] = (
        (WidePlainRequest, "_all_token_ids"),
    )


class SlottedPlainRequest(PlainRequest, PlainRequestBase):
    """The request with its decode fields in slots of its own and its key and hints in its
    native base (as ``kvcore.vllm.Request``)."""

    __slots__ = ("_all_token_ids", "num_computed_tokens", "num_prompt_tokens", "request_id")


class SlottedDuckRequest(SlottedPlainRequest):
    """The slotted request, read by attribute lookup."""


class SlottedPlainManager(KVCacheManager):
    _plain_request_classes: ClassVar[tuple[tuple[type, str], ...]] = (
        (SlottedPlainRequest, "_all_token_ids"),
    )


class HalfSlottedPlainRequest(PlainRequest):
    """Two decode fields in slots, the other two in the dict."""

    __slots__ = ("_all_token_ids", "num_computed_tokens")


class HalfSlottedDuckRequest(HalfSlottedPlainRequest):
    """The half-slotted request, read by attribute lookup."""


class HalfSlottedPlainManager(KVCacheManager):
    _plain_request_classes: ClassVar[tuple[tuple[type, str], ...]] = (
        (HalfSlottedPlainRequest, "_all_token_ids"),
    )


CALL_SLOTS = (
    "_all_token_ids",
    "block_hashes",
    "cache_salt",
    "lora_request",
    "mm_features",
    "num_computed_tokens",
    "num_prompt_tokens",
    "prompt_embeds",
    "request_id",
)
"""Every field a manager call reads, up to one that fills a block (``Slots::whole``)."""


class CallSlottedPlainRequest(WidePlainRequest, PlainRequestBase):
    """Every field a call that fills a block reads in slots, the rest (``status``,
    ``skip_reading_prefix_cache``) in a wide dict, read only when asked for (the layout of
    ``kvcore.vllm.Request``)."""

    __slots__ = CALL_SLOTS


class CallSlottedDuckRequest(CallSlottedPlainRequest):
    """The call-slotted request, read by attribute lookup."""


class CallSlottedPlainManager(KVCacheManager):
    _plain_request_classes: ClassVar[tuple[tuple[type, str], ...]] = (
        (CallSlottedPlainRequest, "_all_token_ids"),
    )


class AllSlottedPlainRequest(PlainRequest):
    """Every field the manager reads in a slot, with no native base."""

    __slots__ = (*CALL_SLOTS, "skip_reading_prefix_cache", "status")


class AllSlottedDuckRequest(AllSlottedPlainRequest):
    """The all-slotted request, read by attribute lookup."""


class AllSlottedPlainManager(KVCacheManager):
    _plain_request_classes: ClassVar[tuple[tuple[type, str], ...]] = (
        (AllSlottedPlainRequest, "_all_token_ids"),
    )


LAYOUTS: dict[str, tuple[type[PlainRequest], type[PlainRequest], type[KVCacheManager]]] = {
    "shared-keys": (PlainRequest, DuckRequest, PlainManager),
    "own-keys": (WidePlainRequest, WideDuckRequest, WidePlainManager),
    "slots": (SlottedPlainRequest, SlottedDuckRequest, SlottedPlainManager),
    "some-slots": (HalfSlottedPlainRequest, HalfSlottedDuckRequest, HalfSlottedPlainManager),
    "call-slots": (CallSlottedPlainRequest, CallSlottedDuckRequest, CallSlottedPlainManager),
    "all-slots": (AllSlottedPlainRequest, AllSlottedDuckRequest, AllSlottedPlainManager),
}
"""Plain request layouts: the plain class, a subclass read by attribute lookup, a manager."""


def config(hybrid: bool | str) -> KVCacheConfig:
    """Full attention, with a sliding-window group when `hybrid`; ``"rswa"`` adds a
    reference sliding-window group instead, whose calls read the prompt length (RSWA-1)."""
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=BLOCK, **ATTN))]
    if hybrid == "rswa":
        groups.append(KVCacheGroupSpec(["rswa"], RSWASpec(block_size=BLOCK, rswa_window=8, **ATTN)))
    elif hybrid:
        groups.append(
            KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=BLOCK, sliding_window=8, **ATTN))
        )
    return KVCacheConfig(num_blocks=48, kv_cache_tensors=[], kv_cache_groups=groups)


def events_manager(hybrid: bool | str, cls: type[KVCacheManager] = PlainManager) -> KVCacheManager:
    """A plain-class manager of `config(hybrid)` with KV events on."""
    return plain_manager(hybrid, cls, enable_kv_cache_events=True)


def plain_manager(
    hybrid: bool | str, cls: type[KVCacheManager] = PlainManager, **kwargs: Any
) -> KVCacheManager:
    """A manager of class `cls` (a plain class's) over `config(hybrid)`."""
    return cls(
        config(hybrid),
        max_model_len=256,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        **kwargs,
    )


def as_plain(log: list[Any], duck_cls: type, plain_cls: type) -> list[Any]:
    """`log` with the duck class's name in error messages read as the plain class's."""
    return [
        (x[0], x[1], x[2].replace(duck_cls.__name__, plain_cls.__name__))
        if isinstance(x, tuple) and x and x[0] == "raised"
        else x
        for x in log
    ]


def outcome(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The call's result, or its exception's class and message."""
    try:
        result = fn(*args, **kwargs)
    except Exception as e:
        return ("raised", type(e), str(e))
    if hasattr(result, "get_block_ids"):
        return result.get_block_ids()
    if isinstance(result, tuple) and result and hasattr(result[0], "get_block_ids"):
        return (result[0].get_block_ids(), *result[1:])
    return result


def play(mgr: KVCacheManager, cls: type[PlainRequest], seed: int) -> list[Any]:
    """A seeded workload of admissions, decode steps, frees and a few bad requests."""
    hasher = get_request_block_hasher(BLOCK, sha256)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    log: list[Any] = []
    running: list[PlainRequest] = []
    for step in range(60):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            req: Any = cls(f"r{step}", prompt, hasher)
            if rng.random() < 0.2:
                req.mm_features = []
            if rng.random() < 0.15:
                # The event of its first block (a prompt of its own: not a hit) carries the
                # salt as an extra key, read from the dict on both paths.
                own = [50 + rng.randrange(50) for _ in range(rng.randrange(4, 13))]
                req = cls(f"r{step}", own, hasher)
                req.cache_salt = "salt"
            if rng.random() < 0.1:
                # A LoRA: its events carry the adapter, read with the request's other fields.
                req.lora_request = SimpleNamespace(lora_name="ad", adapter_id=5, name="ad")
            hits = outcome(mgr.get_computed_blocks, req)
            log.append(hits)
            blocks, n = mgr.get_computed_blocks(req)
            got = outcome(mgr.allocate_slots, req, req.num_tokens - n, n, blocks)
            log.append(got)
            if got is not None and got[0] != "raised":
                req.num_computed_tokens = req.num_tokens
                req.status = RUNNING
                running.append(req)
        for req in list(running):
            got = outcome(mgr.allocate_slots, req, 1, num_lookahead_tokens=rng.randrange(2))
            log.append(got)
            if got is None:
                mgr.free(req)
                running.remove(req)
                continue
            req.num_computed_tokens += 1
            req.append(rng.randrange(50))
        if running and rng.random() < 0.2:
            done = running.pop(rng.randrange(len(running)))
            log.append(outcome(mgr.free, done))
        log.append(mgr.take_events())
        log.append(mgr.usage)
    # Misuse: a negative count and a missing attribute raise the same on both paths.
    bad = cls("bad", [1, 2, 3], hasher)
    bad.num_computed_tokens = -1
    log.append(outcome(mgr.allocate_slots, bad, 1))
    missing = cls("missing", [1, 2, 3], hasher)
    del missing.num_computed_tokens
    log.append(outcome(mgr.allocate_slots, missing, 1))
    # A request_id that is not a str: refused as on the attribute path, on first use and
    # after a str id of the same request was seen (the kept entry is found by address only).
    for rid in (7, b"bytes-id"):
        odd = cls("odd", [1, 2, 3], hasher)
        log.append(outcome(mgr.allocate_slots, odd, 1))
        odd.request_id = rid  # type: ignore[assignment]
        log.append(outcome(mgr.allocate_slots, odd, 1))
        odd.request_id = "odd"
        log.append(outcome(mgr.free, odd))
    not_a_list = cls("tuple-tokens", [1, 2, 3, 4, 5], hasher)
    not_a_list._all_token_ids = tuple(not_a_list._all_token_ids)  # type: ignore[assignment]
    log.append(outcome(mgr.get_computed_blocks, not_a_list))
    log.append(outcome(mgr.allocate_slots, not_a_list, 5))
    for req in running:
        mgr.free(req)
    log.append(mgr.take_events())
    mgr.check_invariants()
    return log


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hybrid", [False, True, "rswa"])
@pytest.mark.parametrize("seed", range(4))
def test_a_plain_request_reads_as_by_attribute(layout: str, hybrid: bool | str, seed: int) -> None:
    plain_cls, duck_cls, manager_cls = LAYOUTS[layout]

    def manager() -> KVCacheManager:
        return events_manager(hybrid, manager_cls)

    init_none_hash(sha256)
    plain = play(manager(), plain_cls, seed)
    duck = as_plain(play(manager(), duck_cls, seed), duck_cls, plain_cls)
    assert plain == duck
    assert any(isinstance(x, list) and x for x in plain)  # events were compared


def test_the_plain_reader_is_the_one_used() -> None:
    """A plain request whose ``num_tokens`` property lies is read by its token list."""

    class Lying(PlainRequest):
        pass

    class LyingManager(KVCacheManager):
        _plain_request_classes = ((Lying, "_all_token_ids"),)

    Lying.num_tokens = property(lambda self: 10**6)  # type: ignore[assignment]
    mgr = LyingManager(
        config(False), max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK
    )
    hasher = get_request_block_hasher(BLOCK, sha256)
    first: Any = Lying("a", list(range(8)), hasher)
    assert mgr.allocate_slots(first, 8) is not None
    mgr.free(first)
    # The hit stops before the last of the 8 tokens (MGR-7): one block. Read through the
    # property (10**6 tokens) it would be both.
    second: Any = Lying("b", list(range(8)), hasher)
    assert mgr.get_computed_blocks(second)[1] == BLOCK
    third: Any = DuckLying("c", list(range(8)), hasher)
    assert mgr.get_computed_blocks(third)[1] == 2 * BLOCK


class DuckLying(PlainRequest):
    num_tokens = property(lambda self: 10**6)


class Slotted:
    __slots__ = ("request_id",)


class WithProperty:
    @property
    def num_computed_tokens(self) -> int:
        return 0


class WithGetattr:
    def __getattr__(self, name: str) -> Any:
        return 0


class WithClassDefault:
    status = 0


class TokensOnClass:
    _all_token_ids: ClassVar[list[int]] = []


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (Slotted, "no __dict__"),
        (WithProperty, "defines num_computed_tokens"),
        (WithGetattr, "customises attribute lookup"),
        (WithClassDefault, "defines status"),
        (TokensOnClass, "defines _all_token_ids"),
    ],
)
def test_a_class_that_is_not_plain_is_refused(cls: type, message: str) -> None:
    class Manager(KVCacheManager):
        _plain_request_classes = ((cls, "_all_token_ids"),)

    with pytest.raises(InvalidArgumentError, match=message):
        Manager(config(False), max_model_len=64, scheduler_block_size=BLOCK, hash_block_size=BLOCK)


class HashList(list[bytes]):
    """A list subclass: its methods could run Python code while the core reads it."""


def test_a_plain_requests_hash_list_is_read_only_when_plain() -> None:
    """A plain request's ``block_hashes`` is read when the core needs it, without running
    Python code: a tuple reads as the list does, anything else is refused before any change."""
    hasher = get_request_block_hasher(BLOCK, sha256)

    def manager() -> KVCacheManager:
        return PlainManager(
            config(False), max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK
        )

    as_list, as_tuple = manager(), manager()
    a: Any = PlainRequest("a", list(range(10)), hasher)
    b: Any = PlainRequest("a", list(range(10)), hasher)
    b.block_hashes = tuple(b.block_hashes)
    got_a = as_list.allocate_slots(a, 10)
    got_b = as_tuple.allocate_slots(b, 10)
    assert got_a is not None and got_b is not None
    assert got_a.get_block_ids() == got_b.get_block_ids()
    assert as_list.block_pool.get_num_free_blocks() == as_tuple.block_pool.get_num_free_blocks()

    mgr = manager()
    free = mgr.block_pool.get_num_free_blocks()
    c: Any = PlainRequest("c", list(range(10)), hasher)
    c.block_hashes = HashList(c.block_hashes)
    with pytest.raises(InvalidArgumentError, match="block_hashes must be a list or a tuple"):
        mgr.allocate_slots(c, 10)
    assert mgr.block_pool.get_num_free_blocks() == free
    assert mgr.get_block_ids("c") == ([],)
    # Running, in a decode step that fills no block, the list is not read at all.
    d: Any = PlainRequest("d", list(range(10)), hasher)
    assert mgr.allocate_slots(d, 10) is not None
    d.num_computed_tokens = 10
    d.status = RUNNING
    d.block_hashes = HashList(d.block_hashes)
    assert mgr.allocate_slots(d, 1) is not None
    mgr.check_invariants()


def hint_scenario(managers: list[KVCacheManager], cls: type[Any], hasher: Any) -> list[Any]:
    """Requests of `cls` admitted and decoded by `managers` in turn: an id replaced by an
    equal str, an id reused after a free; what each call answered."""
    log: list[Any] = []
    a: Any = cls("".join(["a", "1"]), list(range(6)), hasher)
    b: Any = cls("b", list(range(10, 19)), hasher)
    for mgr in managers:
        for req in (a, b):
            log.append(outcome(mgr.allocate_slots, req, req.num_tokens))
    for req in (a, b):
        req.num_computed_tokens = req.num_tokens
        req.status = RUNNING
        req.append(5)
    a.request_id = "".join(["a", "1"])  # equal, another str object
    for _ in range(6):
        for mgr in managers:
            for req in (a, b):
                log.append(outcome(mgr.allocate_slots, req, 1, num_lookahead_tokens=1))
        for req in (a, b):
            req.num_computed_tokens += 1
            req.append(6)
    for mgr in managers:
        log.append((mgr.get_block_ids("a1"), mgr.get_block_ids("b")))
        mgr.free(a)
        again: Any = cls("a1", list(range(30, 37)), hasher)  # the id reused
        log.append(outcome(mgr.allocate_slots, again, again.num_tokens))
        log.append(outcome(mgr.allocate_slots, b, 1))
        log.append((mgr.get_block_ids("a1"), mgr.get_block_ids("b")))
        mgr.free(b)
        mgr.free(again)
        log.append(mgr.block_pool.get_num_free_blocks())
    return log


def test_plain_request_hints_follow_their_ids() -> None:
    """The manager finds a plain request's tables by the address of its id str (an entry that
    keeps the str alive, with the request's slot hints). An id replaced by an equal str, an id
    reused after a free, and frees in any order give what attribute reads give; freed
    requests leave no entry (but one freed under another str: swept later)."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def manager() -> KVCacheManager:
        return plain_manager(True)

    plain_mgr = manager()
    assert hint_scenario([plain_mgr], PlainRequest, hasher) == hint_scenario(
        [manager()], DuckRequest, hasher
    )
    # Every request was freed; only a1's first id str, replaced before its free, keeps its
    # entry until a sweep (test_plain_request_hints_stay_bounded).
    assert plain_mgr._num_plain_hints == 1


def test_a_native_based_request_keeps_its_key_and_hints_in_itself() -> None:
    """A request of a class derived from ``PlainRequestBase`` keeps its key and hints in its
    native base, not in the manager's hint map: an id replaced by an equal str or reused after a
    free, and one request object served by two managers in turn, give what attribute reads
    give."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def managers() -> list[KVCacheManager]:
        return [plain_manager(True, SlottedPlainManager), plain_manager(False, SlottedPlainManager)]

    ours = managers()
    assert hint_scenario(ours, SlottedPlainRequest, hasher) == hint_scenario(
        managers(), SlottedDuckRequest, hasher
    )
    assert [m._num_plain_hints for m in ours] == [0, 0]


def test_a_native_based_requests_token_list_is_read_as_by_attribute_when_replaced() -> None:
    """A native-based request's base holds its token list once a call has checked it, and its
    decode calls then read the list only when the answer needs its length: a list replaced by
    another (longer, shorter, the same), by a tuple, a list subclass whose length lies, an int
    or nothing gives what attribute reads give, on the calls right after and later."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    class LyingList(list[int]):
        def __len__(self) -> int:
            return 3

    def scenario(mgr: KVCacheManager, cls: type[PlainRequest]) -> list[Any]:
        log: list[Any] = []
        req: Any = cls("a", list(range(10)), hasher)
        log.append(outcome(mgr.allocate_slots, req, 10))
        req.num_computed_tokens = 10
        req.status = RUNNING

        def decode(n: int) -> None:
            for _ in range(n):
                log.append(outcome(mgr.allocate_slots, req, 1))
                log.append(mgr.get_block_ids("a"))
                if log[-2] is not None and log[-2][0] != "raised":
                    req.num_computed_tokens += 1
                    req.append(7)

        decode(6)
        tokens = req._all_token_ids
        for replacement in (
            list(tokens),
            [*tokens, 1, 2, 3, 4, 5],
            list(tokens[:4]),
            tuple(tokens),
            LyingList(tokens),
            17,
            None,
            list(tokens),
        ):
            if replacement is None:
                del req._all_token_ids
                log.append(outcome(mgr.allocate_slots, req, 1))
                req._all_token_ids = list(tokens)
                continue
            req._all_token_ids = replacement
            log.append(outcome(mgr.allocate_slots, req, 1))
            if isinstance(replacement, list):
                decode(5)
            req._all_token_ids = list(tokens)
            decode(2)
        log.append(outcome(mgr.free, req))
        log.append(mgr.take_events())
        mgr.check_invariants()
        return log

    ours = scenario(
        plain_manager(False, SlottedPlainManager, enable_kv_cache_events=True), SlottedPlainRequest
    )
    theirs = scenario(
        plain_manager(False, SlottedPlainManager, enable_kv_cache_events=True), SlottedDuckRequest
    )
    assert ours == as_plain(theirs, SlottedDuckRequest, SlottedPlainRequest)
    assert any(isinstance(x, tuple) and x and x[0] == "raised" for x in ours)


def test_a_token_list_the_base_holds_does_not_keep_a_cycle_alive() -> None:
    """The list a native base holds is seen by the cycle collector: a request in a cycle
    through its token list is freed."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    mgr = plain_manager(False, SlottedPlainManager)
    req: Any = SlottedPlainRequest("a", list(range(6)), hasher)
    assert mgr.allocate_slots(req, 6) is not None
    req.num_computed_tokens = 6
    req.status = RUNNING
    req.append(1)
    for _ in range(3):  # decode calls: the base now holds the list
        assert mgr.allocate_slots(req, 1) is not None
    mgr.free(req)
    req._all_token_ids.append(req)
    gone = weakref.ref(req)
    del req
    gc.collect()
    assert gone() is None


def test_the_slotted_reader_is_the_one_used() -> None:
    """A native-based request whose ``num_tokens`` property lies is read by its token list, on
    the no-op path too (its decode calls reach it once its key is kept)."""

    class Lying(SlottedPlainRequest):
        __slots__ = ()

    class LyingManager(KVCacheManager):
        _plain_request_classes = ((Lying, "_all_token_ids"),)

    Lying.num_tokens = property(lambda self: 10**6)  # type: ignore[assignment]
    mgr = LyingManager(
        config(False), max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK
    )
    hasher = get_request_block_hasher(BLOCK, sha256)
    req: Any = Lying("a", list(range(6)), hasher)
    assert mgr.allocate_slots(req, 6) is not None
    req.num_computed_tokens = 6
    req.append(1)
    # 7 tokens in 2 blocks: a decode call needs no block. Read through the property it would
    # need far more than the pool has.
    for _ in range(3):
        got = mgr.allocate_slots(req, 1)
        assert got is not None and got.get_block_ids() == ([],)
    assert len(mgr.get_block_ids("a")[0]) == 2


def test_plain_request_entries_follow_any_call_order() -> None:
    """Each entry notes the entry found after it, which the next call checks before the index:
    a steady order, then a reversed, rotated and shuffled one, a request freed from the middle
    (its slab slot reused by a new request) and a request called twice in a row all give what
    attribute reads give."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def scenario(mgr: KVCacheManager, cls: type[PlainRequest]) -> list[Any]:
        rng = random.Random(3)
        log: list[Any] = []
        reqs: list[Any] = []

        def admit(name: str) -> None:
            req: Any = cls(name, [rng.randrange(50) for _ in range(rng.randrange(1, 9))], hasher)
            log.append(outcome(mgr.allocate_slots, req, req.num_tokens))
            req.num_computed_tokens = req.num_tokens
            req.status = RUNNING
            req.append(1)
            reqs.append(req)

        def step(order: list[Any]) -> None:
            for req in order:
                log.append(outcome(mgr.allocate_slots, req, 1))
                req.num_computed_tokens += 1
                req.append(rng.randrange(50))
            log.append([mgr.get_block_ids(r.request_id) for r in reqs])

        for i in range(6):
            admit(f"s{i}")
        for _ in range(5):
            step(reqs)
        step(reqs[::-1])
        step(reqs[2:] + reqs[:2])
        mgr.free(reqs.pop(3))
        admit("late")
        step(reqs)
        step(rng.sample(reqs, len(reqs)))
        step([reqs[0], reqs[0], *reqs[1:]])
        for req in reqs:
            mgr.free(req)
        log.append(mgr.block_pool.get_num_free_blocks())
        return log

    def manager() -> KVCacheManager:
        return plain_manager(True)

    log = scenario(manager(), PlainRequest)
    assert None not in log  # every allocation fitted
    assert log == scenario(manager(), DuckRequest)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("wide", [False, True], ids=["shared-keys", "own-keys"])
def test_a_plain_request_whose_dict_changes_layout_reads_as_by_attribute(
    wide: bool, hybrid: bool
) -> None:
    """The decode fields are read at the dict entry where the last request had them (as
    CPython's attribute cache reads them); a dict whose entries moved (a field deleted and set
    again goes to the end), lost a field, or grew is read by lookup, as attribute reads read it."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    plain_cls, duck_cls = (
        (WidePlainRequest, WideDuckRequest) if wide else (PlainRequest, DuckRequest)
    )
    manager_cls = WidePlainManager if wide else PlainManager

    def scenario(cls: type[PlainRequest]) -> list[Any]:
        mgr = plain_manager(hybrid, manager_cls)
        log: list[Any] = []
        reqs: list[Any] = [cls(f"w{i}", list(range(i, i + 5)), hasher) for i in range(4)]
        for req in reqs:
            log.append(outcome(mgr.allocate_slots, req, req.num_tokens))
            req.num_computed_tokens = req.num_tokens
            req.status = RUNNING
            req.append(1)
        for step in range(12):
            if step == 3:  # fields move to the end of one dict, then of another
                for name in ("num_computed_tokens", "request_id", "_all_token_ids"):
                    value = getattr(reqs[1], name)
                    delattr(reqs[1], name)
                    setattr(reqs[1], name, value)
            if step == 5:
                reqs[2].extra_field = step  # the dict grows
            if step == 7:
                del reqs[3].num_computed_tokens  # a field missing: the error of attribute reads
            for req in reqs:
                log.append(outcome(mgr.allocate_slots, req, 1))
                if hasattr(req, "num_computed_tokens"):
                    req.num_computed_tokens += 1
                req.append(step)
            if step == 8:
                reqs[3].num_computed_tokens = reqs[3].num_tokens - 1
        log.append([mgr.get_block_ids(r.request_id) for r in reqs])
        return as_plain(log, duck_cls, plain_cls)

    plain = scenario(plain_cls)
    assert plain == scenario(duck_cls)
    assert any(isinstance(x, tuple) and x and x[0] == "raised" for x in plain)


class Clash:
    """A dict key with a field name's hash whose comparison raises once armed."""

    def __init__(self, name: str) -> None:
        self.h = hash(name)
        self.armed = False

    def __hash__(self) -> int:
        return self.h

    def __eq__(self, other: object) -> bool:
        if self.armed:
            raise RuntimeError("comparison refused")
        return False


@pytest.mark.parametrize(
    "field", ["num_computed_tokens", "request_id", "_all_token_ids", "block_hashes", "cache_salt"]
)
def test_a_dict_key_whose_comparison_raises_reads_as_by_attribute(field: str) -> None:
    """An instance dict with a non-str key (no table to read by index) met before a field's own
    entry: a call that reads the field raises what an attribute read raises, changing
    nothing (the hash list and the event fields are read, as by the reference, only by a
    call that caches a block); once the key is gone the request is served again."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def scenario(cls: type[PlainRequest]) -> list[Any]:
        mgr = events_manager(False)
        req: Any = cls("c", [1, 2, 3, 4, 5, 6, 7], hasher)
        log: list[Any] = [outcome(mgr.allocate_slots, req, req.num_tokens)]
        req.num_computed_tokens = req.num_tokens
        req.status = RUNNING
        clash = Clash(field)
        value = req.__dict__.pop(field)
        req.__dict__[clash] = 0
        req.__dict__[field] = value  # probed after the clashing key
        clash.armed = True
        log.append(outcome(mgr.allocate_slots, req, 1))  # fills no block
        clash.armed = False
        req.append(8)  # the call below caches the second block
        clash.armed = True
        for _ in range(2):
            log.append(outcome(mgr.allocate_slots, req, 1))
            log.append(mgr.take_events())
            log.append(mgr.usage)
        del req.__dict__[clash]
        log.append(outcome(mgr.allocate_slots, req, 1))
        log.append(mgr.take_events())
        mgr.check_invariants()
        return as_plain(log, DuckRequest, PlainRequest)

    plain = scenario(PlainRequest)
    assert plain == scenario(DuckRequest)
    raised = [x[:2] == ("raised", RuntimeError) for x in plain if isinstance(x, tuple)]
    every_call = field in ("num_computed_tokens", "request_id", "_all_token_ids")
    assert raised == [False, every_call, True, True, False]


def test_plain_request_hints_stay_bounded() -> None:
    """Entries whose request is gone without its own id str being freed (freed under an equal
    str) are swept as the map grows: the map stays within a small multiple of the live ones."""
    mgr = PlainManager(
        config(False),
        max_model_len=64,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=False,
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    for i in range(3000):
        req: Any = PlainRequest(f"q{i}", [1, 2, 3], hasher)
        assert mgr.allocate_slots(req, 3) is not None
        req.request_id = "".join(["q", str(i)])  # the free names an equal str: no entry goes
        mgr.free(req)
    assert 0 < mgr._num_plain_hints <= 2048
    assert mgr.block_pool.get_num_free_blocks() == 47


def test_a_call_made_while_the_hint_map_is_held_reads_the_id() -> None:
    """A plain request's call holds its entry in the manager's hint map for the call. A call
    made meanwhile (here a garbage-collector callback, run while a salted request's event
    fields are copied) finds the map held, reads its request's id instead, and gets what it
    would have got before the other call: the same blocks, tables and events."""
    import gc

    from kvcore import InvariantViolationError

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def admitted(mgr: KVCacheManager) -> tuple[Any, Any]:
        a: Any = PlainRequest("a", list(range(7)), hasher)
        a.cache_salt = "salt"  # its event fields are copied: Python objects made mid-call
        b: Any = PlainRequest("b", list(range(20, 26)), hasher)
        for req in (a, b):
            assert mgr.allocate_slots(req, req.num_tokens) is not None
            req.num_computed_tokens = req.num_tokens
            req.status = RUNNING
            req.append(9)
        return a, b

    def manager() -> KVCacheManager:
        return events_manager(False)

    def step(mgr: KVCacheManager, req: Any) -> Any:
        got = mgr.allocate_slots(req, 1)
        assert got is not None
        req.num_computed_tokens += 1
        req.append(9)
        return got.get_block_ids()

    def state(mgr: KVCacheManager) -> Any:
        events = [(type(e).__name__, getattr(e, "block_hashes", None)) for e in mgr.take_events()]
        return mgr.get_block_ids("a"), mgr.get_block_ids("b"), events

    mgr = manager()
    a, b = admitted(mgr)
    inner: list[Any] = []  # (a's step during which b's call ran, b's new blocks)
    at = [0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase != "start" or inner:
            return
        try:
            _ = mgr._num_plain_hints  # raises while this thread's call holds the map
        except InvariantViolationError:  # inside a plain request's call: the map is held
            inner.append((at[0], step(mgr, b)))

    threshold = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1)
    try:
        outer = []
        for i in range(8):
            at[0] = i
            outer.append(step(mgr, a))
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)
    assert len(inner) == 1, "no collection ran inside a plain request's call"
    during, b_blocks = inner[0]

    # The same calls in the order they took effect: b's before the a step it ran inside.
    ref = manager()
    a2, b2 = admitted(ref)
    ref_outer = []
    for i in range(8):
        if i == during:
            assert step(ref, b2) == b_blocks
        ref_outer.append(step(ref, a2))
    assert outer == ref_outer
    assert state(mgr) == state(ref)
    mgr.check_invariants()


@pytest.mark.parametrize("cls", [PlainRequest, DuckRequest])
def test_token_ints_of_every_width_read_as_their_value(cls: type[PlainRequest]) -> None:
    """Token ids of one, two and three 30-bit digits, either sign, up to int64's ends (the
    native reader takes small ints from their digits, bigger ones through CPython): the
    events carry exactly the list's values."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    mgr = events_manager(False)
    widths = [0, 1, -1, 2**30 - 1, 2**30, -(2**30), 2**31 + 5, 2**60 - 1, -(2**60) + 1]
    widths += [2**60, -(2**61), 2**62 + 3, 2**63 - 1, -(2**63), 123_456_789_012]
    tokens = widths + [7] * (-len(widths) % BLOCK)
    req = cls("w", tokens, hasher)
    assert mgr.allocate_slots(req, len(tokens)) is not None
    events = mgr.take_events()
    assert all(isinstance(e, BlockStored) for e in events)
    assert [t for e in events if isinstance(e, BlockStored) for t in e.token_ids] == tokens
    mgr.check_invariants()


@pytest.mark.parametrize("cls", [PlainRequest, DuckRequest])
def test_an_event_has_the_tokens_the_fill_saw(cls: type[PlainRequest]) -> None:
    """A plain request's `BlockStored` carries a slice of its token list taken when the block
    filled (the reference's slice): a later change of the list is not in it. A token that is
    an int of another type (a bool) reads as its value, and one that is no int64 raises as on
    the attribute path, nothing cached, its blocks freed with the request."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    mgr = events_manager(False)
    req = cls("a", [5, 6, 7, 8, 9], hasher)
    assert mgr.allocate_slots(req, 5) is not None
    req._all_token_ids[0] = 40
    (event,) = mgr.take_events()
    assert isinstance(event, BlockStored)
    assert event.token_ids == [5, 6, 7, 8]
    assert event.token_ids is not req._all_token_ids
    flag = cls("flag", [1, 2, 3, 4], hasher)
    flag._all_token_ids[3] = True
    assert mgr.allocate_slots(flag, 4) is not None
    (event,) = mgr.take_events()
    assert isinstance(event, BlockStored)
    assert event.token_ids == [1, 2, 3, 1]
    odd: list[tuple[str, Any, type[Exception]]] = [
        ("bad", "x", TypeError),
        ("big", 2**70, OverflowError),
    ]
    for rid, token, error in odd:
        bad = cls(rid, [11, 12, 13, 14], hasher)
        bad._all_token_ids[2] = token
        usage = mgr.usage
        with pytest.raises(error):
            mgr.allocate_slots(bad, 4)
        assert mgr.take_events() == []
        mgr.check_invariants()
        mgr.free(bad)
        assert mgr.usage == usage
        mgr.check_invariants()


class DictOfItsOwn(dict[str, Any]):
    """A dict subclass: a plain request whose instance dict is one is read by attribute lookup."""


def test_a_call_slotted_requests_dict_is_read_only_for_its_other_fields() -> None:
    """A request that keeps every field a call reads in slots is read without its instance
    dict. Its other fields (``skip_reading_prefix_cache``) are read from the dict when asked
    for: by attribute lookup when the dict is not an exact dict, and a missing one raises as
    attribute reads raise."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def scenario(cls: type[PlainRequest]) -> list[Any]:
        mgr = events_manager(False, CallSlottedPlainManager)
        log: list[Any] = []
        reqs: list[Any] = [cls(f"d{i}", list(range(i, i + 9)), hasher) for i in range(3)]
        reqs[1].__dict__ = DictOfItsOwn(reqs[1].__dict__)
        reqs[1].skip_reading_prefix_cache = True
        del reqs[2].skip_reading_prefix_cache
        for req in reqs:
            log.append(outcome(mgr.get_computed_blocks, req))
            log.append(outcome(mgr.allocate_slots, req, req.num_tokens))
            req.num_computed_tokens = req.num_tokens
            req.status = RUNNING
        for step in range(2 * BLOCK):
            for req in reqs:
                req.append(step)
                log.append(outcome(mgr.allocate_slots, req, 1))
                req.num_computed_tokens += 1
        log.append(mgr.take_events())
        log.append([mgr.get_block_ids(r.request_id) for r in reqs])
        return as_plain(log, CallSlottedDuckRequest, CallSlottedPlainRequest)

    plain = scenario(CallSlottedPlainRequest)
    assert plain == scenario(CallSlottedDuckRequest)
    assert ("raised", AttributeError) in [x[:2] for x in plain if isinstance(x, tuple)]
    assert any(isinstance(x, list) and x and isinstance(x[0], BlockStored) for x in plain)
