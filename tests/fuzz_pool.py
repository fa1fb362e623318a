"""Differential fuzzing of ``kvcore.BlockPool`` against the reference ``BlockPool``.

:class:`PoolFuzzer` applies a drawn sequence of pool calls, with the awkward arguments of
:mod:`fuzz_values`, to a kvcore pool and a reference pool of the same configuration. kvcore
names a block by its int id, the reference by its ``KVCacheBlock``: an id list is translated
for the reference block by block, an id that names no block of the reference raising the
``IndexError`` (or, for a value that is not an int, the ``TypeError``) the reference would raise
on ``blocks[id]``. After every call the outcomes are judged (:mod:`fuzz_harness`); then either
both pools are compared in full (free queue front to back, every ref count, every primary key
and its token count, every index key's first block, the number of keys, the events) or, when
kvcore raised, kvcore's state must equal its state before the call and the reference is
restored from its copy.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
from fuzz_harness import Divergence, Outcome, attempt, judge, sort_removed_runs
from fuzz_values import (
    NON_INTS,
    Free,
    Held,
    KnownHash,
    containers,
    counts,
    group_ids,
    hash_bytes,
    id_lists,
    id_values,
    special_ints,
    token_values,
    wrap,
)
from pool_helpers import LoRARequest, MMFeature, PlaceholderRange, PoolRequest, event_fields

import kvcore

__all__ = ["PoolConfig", "PoolFuzzer", "pool_configs", "pool_programs"]


@dataclass(frozen=True)
class PoolConfig:
    """A pool configuration."""

    n: int
    caching: bool
    hbs: int
    events: bool


def pool_configs() -> st.SearchStrategy[PoolConfig]:
    """Small pools (so that calls collide), caching and events on or off."""
    return st.builds(
        PoolConfig,
        st.sampled_from((1, 2, 3, 6, 10)),
        st.booleans(),
        st.sampled_from((1, 2, 4)),
        st.booleans(),
    )


@dataclass(frozen=True)
class Len:
    """Resolved to the length of the block list of the call plus ``delta``."""

    delta: int


def _num_blocks_arg() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(Len, st.integers(-2, 1)),
        st.builds(Len, st.integers(-2, 1)),
        st.integers(0, 6),
        special_ints(),
        st.sampled_from((None, 1.5, True)),
    )


def _request_specs() -> st.SearchStrategy[tuple[Any, ...]]:
    """(tokens, hash tampering, extras) of one request."""
    return st.tuples(
        st.lists(token_values(), max_size=24),
        st.sampled_from(
            ("plain", "plain", "plain", "empty-first", "long", "none-item", "str-item", "short")
        ),
        st.sampled_from(("none", "none", "lora", "salt", "mm")),
    )


def pool_programs(n: int) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    """A sequence of pool calls over a pool of ``n`` blocks."""
    ids = id_lists(n)
    cache_natural = st.tuples(
        st.just("cache_natural"),
        st.integers(0, 2),
        st.integers(0, 7),
        st.sampled_from((1, 1, 2, 3)),
        st.integers(0, 1),
        st.integers(0, 2),
    )
    op = st.one_of(
        st.tuples(
            st.just("get_new_blocks"), st.one_of(counts(n + 2), st.builds(Free, st.integers(-1, 1)))
        ),
        st.tuples(st.just("get_new_blocks"), st.builds(Free, st.integers(-1, 1))),
        st.tuples(st.just("touch"), containers(), ids),
        st.tuples(st.just("free_blocks"), containers(), ids),
        st.tuples(
            st.just("free_blocks"),
            st.just("list"),
            st.lists(st.builds(Held, st.integers(0, 7)), max_size=6),
        ),
        st.tuples(
            st.just("cache_full_blocks"),
            st.integers(0, 2),
            st.one_of(st.just(None), st.lists(id_values(n), max_size=8)),
            _num_blocks_arg(),
            _num_blocks_arg(),
            st.one_of(
                st.sampled_from((1, 1, 1, 2, 3)), special_ints(), st.sampled_from((0, 1.0, None))
            ),
            group_ids(),
            st.one_of(
                st.just(None),
                st.just(None),
                st.lists(st.booleans(), max_size=8),
                st.lists(st.sampled_from((0, 1, None, "x")), max_size=4),
            ),
        ),
        cache_natural,
        cache_natural,  # twice: drawn twice as often
        st.tuples(
            st.just("cache_partial_block"),
            st.integers(0, 2),
            id_values(n),
            st.one_of(st.integers(0, 24), special_ints(), st.sampled_from((None, 2.0))),
            group_ids(),
            st.one_of(st.sampled_from((2, 2, 3, 4)), special_ints(), st.sampled_from((None, 2.0))),
        ),
        st.tuples(
            st.just("get_cached_block"),
            hash_bytes(),
            st.one_of(st.lists(group_ids(), max_size=3), st.sampled_from((None, 0))),
        ),
        st.tuples(st.just("evict_blocks"), containers(), ids),
        st.tuples(st.just("reset_prefix_cache")),
        st.tuples(
            st.just("blocks_getitem"),
            st.one_of(
                id_values(n), st.sampled_from((slice(None), slice(1, None, 2), slice(-2, None)))
            ),
        ),
        st.tuples(st.just("get_ref_cnts"), containers(), ids),
        st.tuples(st.just("get_block_hashes"), containers(), ids),
        st.tuples(st.just("count_evictable"), containers(), ids),
        st.tuples(
            st.just("append_tokens"), st.integers(0, 2), st.lists(token_values(), max_size=8)
        ),
    )
    return st.lists(op, min_size=8, max_size=40)


def _make_request(spec: tuple[Any, ...], hbs: int) -> PoolRequest:
    tokens, tamper, extras = spec
    kw: dict[str, Any] = {}
    if extras == "lora":
        kw["lora_request"] = LoRARequest("lora-a", 1)
    elif extras == "salt":
        kw["cache_salt"] = "salt"
    elif extras == "mm" and tokens:
        kw["mm_features"] = [MMFeature("img", PlaceholderRange(0, max(len(tokens) // 2, 1)))]
    req = PoolRequest(list(tokens), hash_block_size=hbs, salt=extras.encode(), **kw)
    hashes: list[Any] = req.block_hashes
    if hashes:
        if tamper == "empty-first":
            hashes[0] = b""
        elif tamper == "long":
            hashes[-1] = hashes[-1] * 4
        elif tamper == "none-item":
            hashes[len(hashes) // 2] = None
        elif tamper == "str-item":
            hashes[0] = "not bytes"
        elif tamper == "short":
            hashes[-1] = hashes[-1][:3]
    return req


def _int(v: Any) -> bool:
    return isinstance(v, int)


class NoBlock:
    """A reference-side stand-in for an id that names no block (see ``PoolFuzzer.rblock``)."""

    def __init__(self, v: Any) -> None:
        object.__setattr__(self, "_v", v)

    def _fail(self) -> Exception:
        v = object.__getattribute__(self, "_v")
        if isinstance(v, int):
            return IndexError("list index out of range")
        return TypeError(f"list indices must be integers or slices, not {type(v).__name__}")

    def __getattr__(self, name: str) -> Any:
        raise self._fail()

    def __setattr__(self, name: str, value: Any) -> None:
        raise self._fail()

    def __eq__(self, other: object) -> bool:
        raise self._fail()

    def __hash__(self) -> int:
        raise self._fail()

    def __repr__(self) -> str:
        return f"NoBlock({object.__getattribute__(self, '_v')!r})"


class PoolFuzzer:
    """Runs pool programs on kvcore and the reference; see the module docs."""

    def __init__(self, cfg: PoolConfig, reference: Any, requests: list[tuple[Any, ...]]) -> None:
        self.cfg = cfg
        self.ref_module = reference
        self.k = kvcore.BlockPool(cfg.n, cfg.caching, cfg.hbs, cfg.events)
        self.r = reference.BlockPool(cfg.n, cfg.caching, cfg.hbs, cfg.events)
        self.requests = [_make_request(s, cfg.hbs) for s in requests]
        self.hashes: list[bytes] = []
        for req in self.requests:
            self._note_hashes(req)
        self.log: list[str] = []
        self.counts: dict[tuple[str, str], int] = {}
        self.allocations: list[list[int]] = []

    # -- helpers -------------------------------------------------------------------------------

    def _note_hashes(self, req: PoolRequest) -> None:
        for h in req.block_hashes:
            if isinstance(h, bytes) and h not in self.hashes:
                self.hashes.append(h)

    def _held(self) -> list[int]:
        return [b.block_id for b in self.r.blocks if b.ref_cnt > 0 and not b.is_null]

    def resolve(self, v: Any) -> Any:
        """Replaces the sequence-dependent tokens of :mod:`fuzz_values` by values."""
        if isinstance(v, Held):
            held = self._held()
            return held[v.k % len(held)] if held else v.k % self.cfg.n
        if isinstance(v, Free):
            return self.r.get_num_free_blocks() + v.delta
        if isinstance(v, KnownHash):
            return self.hashes[v.k % len(self.hashes)] if self.hashes else b"\x00" * 32
        if isinstance(v, list):
            return [self.resolve(x) for x in v]
        return v

    def rblock(self, v: Any) -> Any:
        """The reference block for id ``v``; for an id that names no block, a stand-in that
        raises, on first use, what ``blocks[v]`` would (the reference then fails where it
        first looks at that block, as it would on ``blocks[v]`` at that point)."""
        if isinstance(v, int) and 0 <= v < self.cfg.n:
            return self.r.blocks[v]
        return NoBlock(v)

    def rblocks(self, kind: str, ids: Any) -> Any:
        """The reference's form of an id container (same container kind)."""
        if kind in ("none", "int"):
            return wrap(kind, [])
        return wrap(kind, [self.rblock(i) for i in ids])

    def corrupt(self) -> bool:
        """Whether the reference pool broke its own invariants (SPEC POOL-2, BLK-3)."""
        r = self.r
        queue = r.free_block_queue.get_all_free_blocks()
        if len(queue) != r.free_block_queue.num_free_blocks:
            return True
        if any(b.ref_cnt != 0 or b.is_null for b in queue):
            return True
        queued = {b.block_id for b in queue}
        return any(
            (b.ref_cnt < 0 or (b.ref_cnt == 0 and b.block_id not in queued))
            for b in r.blocks
            if not b.is_null
        )

    def has_aliases(self) -> bool:
        return any(self.r.cached_block_hashes_by_block.values())

    # -- state ----------------------------------------------------------------------------------

    def state_keys(self) -> list[bytes]:
        """Every key either pool's index holds now."""
        return sorted(set(self.r.cached_block_hash_to_block._cache) | set(self._kv_primary_keys()))

    def kv_state(self, keys: list[bytes]) -> tuple[Any, ...]:
        """kvcore's whole observable state (events are drained after every call), with the
        lookups of ``keys``."""
        k = self.k
        ids = list(range(self.cfg.n))
        return (
            k.get_all_free_block_ids(),
            k.get_num_free_blocks(),
            k.get_usage(),
            k.get_ref_cnts(ids),
            k.get_block_hashes(ids),
            [k.blocks[i].block_hash_num_tokens for i in ids],
            [
                (key, k.get_cached_block(key[:-4], [int.from_bytes(key[-4:], "big")]))
                for key in keys
            ],
            repr(k),
        )

    def _kv_primary_keys(self) -> list[bytes]:
        return [h for h in self.k.get_block_hashes(range(self.cfg.n)) if h is not None]

    def compare(self, what: str, aliases_before: bool) -> None:
        """Both pools must be indistinguishable (and their events equal)."""
        k, r = self.k, self.r
        k.check_invariants()
        n = self.cfg.n
        ids = list(range(n))
        checks = [
            (
                "free queue",
                k.get_all_free_block_ids(),
                [b.block_id for b in r.free_block_queue.get_all_free_blocks()],
            ),
            ("num free", k.get_num_free_blocks(), r.get_num_free_blocks()),
            ("usage", k.get_usage(), r.get_usage()),
            ("ref counts", k.get_ref_cnts(ids), [b.ref_cnt for b in r.blocks]),
            ("primary keys", k.get_block_hashes(ids), [b.block_hash for b in r.blocks]),
            (
                "key token counts",
                [k.blocks[i].block_hash_num_tokens for i in ids],
                [b.block_hash_num_tokens for b in r.blocks],
            ),
        ]
        index = r.cached_block_hash_to_block
        checks.append(
            ("number of keys", repr(k).split("cached_keys=")[1].split(",")[0], str(len(index)))
        )
        for key in index._cache:
            one = index.get_one_block(key)
            got = k.get_cached_block(key[:-4], [int.from_bytes(key[-4:], "big")])
            checks.append((f"lookup {key.hex()}", got, [one.block_id]))
        k_events = [event_fields(e) for e in k.take_events()]
        r_events = [event_fields(e) for e in r.take_events()]
        if aliases_before or self.has_aliases():
            k_events, r_events = sort_removed_runs(k_events), sort_removed_runs(r_events)
        checks.append(("events", k_events, r_events))
        for name, kv, ref in checks:
            if kv != ref:
                raise Divergence(
                    f"after {what}: {name} differ\n  kvcore:    {kv!r}\n  reference: {ref!r}\n"
                    + self.history()
                )

    def history(self) -> str:
        return "  calls:\n    " + "\n    ".join(self.log[-15:])

    # -- one call -------------------------------------------------------------------------------

    def call(
        self,
        what: str,
        k_call: Callable[[], Any],
        r_call: Callable[[], Any],
        convert: Callable[[Any], Any] = lambda v: v,
        deviation: str | None = None,
    ) -> Outcome:
        """Runs one call on both sides and checks the outcome and the state after it."""
        self.log.append(what)
        keys = self.state_keys()
        before = self.kv_state(keys)
        aliases = self.has_aliases()
        ko = attempt(k_call)
        # The reference is copied only when kvcore refused (its copy is then restored); when
        # kvcore returned, a refusal by the reference alone is a divergence anyway.
        saved = copy.deepcopy(self.r) if ko.exc is not None else None
        ro = attempt(r_call)
        try:
            verdict = judge(what, ko, ro, deviation, ro.exc is None and self.corrupt())
        except Divergence as e:
            raise Divergence(f"{e}\n{self.history()}") from None
        key = (what.split("(")[0], verdict)
        self.counts[key] = self.counts.get(key, 0) + 1
        if verdict == "ok":
            kv, ref = ko.value, convert(ro.value)
            if kv != ref:
                raise Divergence(
                    f"{what}: results differ\n  kvcore:    {kv!r}\n  reference: {ref!r}\n{self.history()}"
                )
            self.compare(what, aliases)
            return ko
        # kvcore raised: it must be unchanged; the reference goes back to its copy.
        self.k.check_invariants()
        after = self.kv_state(keys)
        events = self.k.take_events()
        if after != before or events:
            raise Divergence(
                f"{what}: kvcore raised {ko.exc!r} but changed its state\n"
                f"  before: {before!r}\n  after:  {after!r}\n  events: {events!r}\n{self.history()}"
            )
        self.r = saved
        return ko

    # -- programs -------------------------------------------------------------------------------

    def run(self, program: list[tuple[Any, ...]]) -> None:
        for op in program:
            getattr(self, "op_" + op[0])(*op[1:])
        self.compare("end of program", True)

    def op_get_new_blocks(self, count: Any) -> None:
        n = self.resolve(count)
        deviation = None
        if not _int(n):
            deviation = "a count that is not an int"
        elif n < 0:
            deviation = "a negative count (the reference pops nothing and raises its free count)"
        out = self.call(
            f"get_new_blocks({n!r})",
            lambda: self.k.get_new_blocks(n),
            lambda: self.r.get_new_blocks(n),
            lambda blocks: [b.block_id for b in blocks],
            deviation,
        )
        if out.exc is None and out.value:
            self.allocations.append(list(out.value))

    def op_touch(self, kind: str, ids: list[Any]) -> None:
        ids = self.resolve(ids)
        self.call(
            f"touch({kind}:{ids!r})",
            lambda: self.k.touch(wrap(kind, ids)),
            lambda: self.r.touch(self.rblocks(kind, ids)),
        )

    def op_free_blocks(self, kind: str, ids: list[Any]) -> None:
        ids = self.resolve(ids)
        self.call(
            f"free_blocks({kind}:{ids!r})",
            lambda: self.k.free_blocks(wrap(kind, ids)),
            lambda: self.r.free_blocks(self.rblocks(kind, ids)),
        )

    def op_evict_blocks(self, kind: str, ids: list[Any]) -> None:
        ids = self.resolve(ids)
        deviation = None
        if kind in ("list", "tuple", "iter"):
            if any(not _int(i) for i in ids):
                deviation = "a block id that is not an int"
            elif any(-self.cfg.n <= i < 0 for i in ids):
                deviation = "a negative block id (SPEC POOL-20)"
        self.call(
            f"evict_blocks({kind}:{ids!r})",
            lambda: self.k.evict_blocks(wrap(kind, ids)),
            lambda: self.r.evict_blocks(wrap(kind, ids)),
            deviation=deviation,
        )

    def op_reset_prefix_cache(self) -> None:
        self.call("reset_prefix_cache()", self.k.reset_prefix_cache, self.r.reset_prefix_cache)

    def op_blocks_getitem(self, index: Any) -> None:
        index = self.resolve(index)

        def view(b: Any) -> tuple[Any, ...]:
            return (b.block_id, b.ref_cnt, b.block_hash, b.block_hash_num_tokens, b.is_null)

        def k_call() -> Any:
            got = self.k.blocks[index]
            return [view(b) for b in got] if isinstance(got, list) else view(got)

        def r_call() -> Any:
            got = self.r.blocks[index]
            return [view(b) for b in got] if isinstance(got, list) else view(got)

        self.call(f"blocks[{index!r}]", k_call, r_call)

    def _read_ids(self, name: str, kind: str, ids: list[Any], read: Callable[[Any], Any]) -> None:
        ids = self.resolve(ids)

        def r_call() -> Any:
            blocks = self.rblocks(kind, ids)
            return read(list(blocks))

        self.call(f"{name}({kind}:{ids!r})", lambda: getattr(self.k, name)(wrap(kind, ids)), r_call)

    def op_get_ref_cnts(self, kind: str, ids: list[Any]) -> None:
        self._read_ids("get_ref_cnts", kind, ids, lambda bs: [b.ref_cnt for b in bs])

    def op_get_block_hashes(self, kind: str, ids: list[Any]) -> None:
        self._read_ids("get_block_hashes", kind, ids, lambda bs: [b.block_hash for b in bs])

    def op_count_evictable(self, kind: str, ids: list[Any]) -> None:
        self._read_ids(
            "count_evictable",
            kind,
            ids,
            lambda bs: sum(b.ref_cnt == 0 and not b.is_null for b in bs),
        )

    def op_get_cached_block(self, block_hash: Any, gids: Any) -> None:
        h = self.resolve(block_hash)
        self.call(
            f"get_cached_block({h!r}, {gids!r})",
            lambda: self.k.get_cached_block(h, gids),
            lambda: self.r.get_cached_block(h, gids),
            lambda found: None if found is None else [b.block_id for b in found],
        )

    def op_append_tokens(self, req_k: int, tokens: list[Any]) -> None:
        req = self.requests[req_k % len(self.requests)]
        # A tampered hash list cannot be chained from: no new hashes then.
        with contextlib.suppress(TypeError):
            req.append(tokens)
        self._note_hashes(req)
        self.log.append(f"request {req_k}: append {tokens!r}")

    def op_cache_full_blocks(
        self,
        req_k: int,
        blocks: list[Any] | None,
        num_cached: Any,
        num_full: Any,
        bs_mult: Any,
        gid: Any,
        mask: list[Any] | None,
    ) -> None:
        req = self.requests[req_k % len(self.requests)]
        ids = self._held() if blocks is None else self.resolve(blocks)
        nc = num_cached.delta + len(ids) if isinstance(num_cached, Len) else num_cached
        nf = num_full.delta + len(ids) if isinstance(num_full, Len) else num_full
        bs = bs_mult * self.cfg.hbs if type(bs_mult) is int and 0 < bs_mult < 8 else bs_mult
        deviation = self._cache_full_deviation(req, ids, nc, nf, bs, mask)
        if deviation is None and not (type(gid) is int and 0 <= gid < 2**32):
            deviation = "a group id that is not an int in 0..2**32"

        def r_call() -> Any:
            rb = [self.rblock(i) for i in ids]
            return self.r.cache_full_blocks(req, rb, nc, nf, bs, gid, mask)

        self.call(
            f"cache_full_blocks(req{req_k}, {ids!r}, {nc!r}, {nf!r}, {bs!r}, {gid!r}, {mask!r})",
            lambda: self.k.cache_full_blocks(req, ids, nc, nf, bs, gid, mask),
            r_call,
            deviation=deviation,
        )

    def op_cache_natural(self, req_k: int, alloc_k: int, bs_mult: int, gid: int, skip: int) -> None:
        """A well-formed ``cache_full_blocks`` of an allocation, as a manager makes it."""
        req = self.requests[req_k % len(self.requests)]
        if not self.allocations:
            return
        ids = self.allocations[alloc_k % len(self.allocations)]
        view = len(req.block_hashes) // bs_mult
        nf = min(len(ids), view)
        nc = min(skip, nf)
        self.op_cache_full_blocks(req_k, ids, nc, nf, bs_mult, gid, None)

    def _cache_full_deviation(
        self, req: PoolRequest, ids: list[Any], nc: Any, nf: Any, bs: Any, mask: Any
    ) -> str | None:
        """Why kvcore may refuse a ``cache_full_blocks`` call the reference accepts."""
        if not (_int(nc) and _int(nf)) or nc >= nf:
            return None
        if nc < 0 or nf < 0:
            return "a negative block count"
        if not _int(bs) or bs <= 0:
            return "a non-positive block size"
        if nf > len(ids):
            return "fewer blocks than num_full_blocks"
        if mask is not None and any(type(m) is not bool for m in mask):
            return "block_mask entries that are not bools"
        if any(not isinstance(h, bytes) or len(h) > 32 for h in req.block_hashes):
            return "block hashes that are not digests (bytes of at most 32 bytes)"
        return None

    def op_cache_partial_block(
        self, req_k: int, block: Any, num_tokens: Any, gid: Any, bs: Any
    ) -> None:
        req = self.requests[req_k % len(self.requests)]
        b = self.resolve(block)
        deviation = None
        if not (type(gid) is int and 0 <= gid < 2**32):
            deviation = "a group id that is not an int in 0..2**32"
        elif not (_int(num_tokens) and _int(bs)):
            deviation = "a token count or block size that is not an int"
        elif num_tokens < 0:
            deviation = "a negative token count"
        elif any(not isinstance(h, bytes) or len(h) > 32 for h in req.block_hashes):
            deviation = "block hashes that are not digests (bytes of at most 32 bytes)"
        self.call(
            f"cache_partial_block(req{req_k}, {b!r}, {num_tokens!r}, {gid!r}, {bs!r})",
            lambda: self.k.cache_partial_block(req, b, num_tokens, gid, bs),
            lambda: self.r.cache_partial_block(req, self.rblock(b), num_tokens, gid, bs),
            lambda key: key,
            deviation,
        )


_ = NON_INTS  # re-exported for the tests' convenience
