"""Differential fuzzing of ``kvcore.KVCacheManager`` against the reference's.

:class:`ManagerFuzzer` builds both managers from one :class:`difftrace.TraceConfig` (one full
group with and without caching, and a hybrid full + sliding-window one) and applies a drawn
sequence of manager calls with awkward arguments: counts from :func:`fuzz_values.counts`
(negative, huge, bools, floats, None), request ids that collide, are unknown, non-ASCII or lone
surrogates, hits from an earlier lookup, from another request or of the wrong shape, calls on
freed and finished requests, appends, status and ``num_computed_tokens`` changes.

After every call the outcomes are judged (:mod:`fuzz_harness`). When both return, the results
are compared, then the events, the free queue, every ref count and key, every table of every
request id the sequence has named (blocks per group, cached-block counts, the number of
entries), ``take_new_block_ids`` and the usage. When kvcore raises, its state must be what it
was before the call (events included) and the reference is restored from a deep copy.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from difftrace import GroupDesc, KvcoreSide, ReferenceSide, ReqSpec, TraceConfig
from fuzz_harness import Divergence, Outcome, attempt, judge
from fuzz_values import counts, id_lists, request_ids, token_values, wrap

import kvcore

__all__ = ["MANAGER_CONFIGS", "ManagerFuzzer", "manager_programs"]

_F4 = GroupDesc("full", 4)


def _config(name: str, groups: tuple[GroupDesc, ...], **kw: Any) -> TraceConfig:
    """A small configuration of 4-token blocks without hash extras."""
    kw.setdefault("num_blocks", 10)
    kw.setdefault("max_model_len", 48)
    return TraceConfig(name, groups, scheduler_block_size=4, hash_block_size=4, salt=False, **kw)


MANAGER_CONFIGS: dict[str, TraceConfig] = {
    "full": _config("full", (_F4,)),
    "full-wm": _config(
        "full-wm", (_F4,), num_blocks=12, max_model_len=40, watermark=0.2, use_eagle=True
    ),
    "nocache": _config("nocache", (_F4,), num_blocks=8, enable_caching=False, events=False),
    "hybrid": _config("hybrid", (_F4, GroupDesc("swa", 4, window=8)), num_blocks=16),
}


STATUSES = ("WAITING", "RUNNING", "PREEMPTED", "FINISHED_STOPPED")


def manager_programs() -> st.SearchStrategy[list[tuple[Any, ...]]]:
    """A sequence of manager calls (request indices resolve modulo the requests made)."""
    k = st.integers(0, 7)
    prompt = st.lists(st.integers(0, 2), max_size=20)
    small = st.integers(0, 20)
    count = st.one_of(small, small, counts(24))
    hits = st.sampled_from(("none", "none", "last", "last", "empty", "new-empty", "other", "bad"))
    new = st.tuples(st.just("new"), st.sampled_from(("a", "b", "c", "d")), prompt)
    op = st.one_of(
        st.tuples(st.just("new"), request_ids(), prompt),
        new,
        new,
        st.tuples(st.just("computed"), k),
        st.tuples(st.just("new_nohash"), st.sampled_from(("a", "e")), prompt),
        st.tuples(
            st.just("allocate"),
            k,
            count,
            st.one_of(st.just("hits"), st.just("hits"), count),
            hits,
            st.one_of(st.just(0), st.just(0), count),
            st.one_of(st.just(0), st.just(0), st.just(0), count),
            st.booleans(),
            st.one_of(st.just(0), count),
            st.booleans(),
            st.one_of(st.just(0), st.just(0), count),
            st.sampled_from((True, True, False, 1, None)),
        ),
        st.tuples(st.just("schedule"), k),
        st.tuples(st.just("schedule"), k),
        st.tuples(
            st.just("append"), k, st.one_of(token_values(), st.lists(token_values(), max_size=6))
        ),
        st.tuples(
            st.just("computed_tokens"), k, st.one_of(st.sampled_from(("all", "all-1")), small)
        ),
        st.tuples(st.just("status"), k, st.sampled_from(STATUSES)),
        st.tuples(
            st.just("batch"),
            st.lists(k, max_size=4),
            st.lists(st.one_of(st.integers(1, 6), count), max_size=5),
            st.one_of(st.just(0), count),
            st.booleans(),
        ),
        st.tuples(st.just("free"), k),
        st.tuples(st.just("pop_free"), k, st.booleans()),
        st.tuples(st.just("cache_blocks"), k, count),
        st.tuples(st.just("common"), st.one_of(k, request_ids())),
        st.tuples(st.just("block_ids"), st.one_of(k, request_ids(), st.sampled_from((5, None)))),
        st.tuples(st.just("ids_for_computed"), st.one_of(k, request_ids()), count),
        st.tuples(
            st.just("evict"),
            st.sampled_from(("list", "list", "tuple", "iter", "none")),
            id_lists(16),
        ),
        st.tuples(st.just("reset")),
        st.tuples(st.just("new_step")),
        st.tuples(st.just("remove_skipped"), st.one_of(k, request_ids()), count),
    )
    return st.lists(op, min_size=8, max_size=40)


class _Pair:
    """One request on both sides."""

    def __init__(self, rid: str, ref: Any, kv: Any) -> None:
        self.rid = rid
        self.ref = ref
        self.kv = kv
        self.hits: list[list[int]] | None = None  # ids per group of the last lookup
        self.num_hits = 0


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and v >= 0


class ManagerFuzzer:
    """Runs manager programs on kvcore and the reference; see the module docs."""

    def __init__(self, name: str) -> None:
        cfg = MANAGER_CONFIGS[name]
        self.cfg = cfg
        self.ref = ReferenceSide(cfg)
        self.kv = KvcoreSide(cfg)
        self.groups = len(cfg.groups)
        self.reqs: list[_Pair] = []
        self.rids: list[Any] = []
        self.log: list[str] = []
        self.counts: dict[tuple[str, str], int] = {}

    # -- helpers -------------------------------------------------------------------------------

    @property
    def rm(self) -> Any:
        return self.ref.manager

    @property
    def km(self) -> Any:
        return self.kv.manager

    def req(self, k: int) -> _Pair | None:
        return self.reqs[k % len(self.reqs)] if self.reqs else None

    def rid_of(self, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            pair = self.req(v)
            return pair.rid if pair is not None else "a"
        return v

    def note_rid(self, rid: Any) -> None:
        if isinstance(rid, str) and rid not in self.rids:
            self.rids.append(rid)

    def history(self) -> str:
        return "  calls:\n    " + "\n    ".join(self.log[-15:])

    def ref_blocks(self, ids: list[list[int]]) -> Any:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        blocks = self.rm.block_pool.blocks
        return KVCacheBlocks(tuple([blocks[i] for i in g] for g in ids))

    # -- state ----------------------------------------------------------------------------------

    def _ref_tables(self) -> Any:
        out = []
        for m in self.rm.coordinator.single_type_managers:
            # Non-empty tables only: the native tables say how many entries they hold, not
            # which ids have an empty one.
            tables = {
                rid: [b.block_id for b in m.req_to_blocks[rid]]
                for rid in self.rids
                if m.req_to_blocks.get(rid)
            }
            cached = {
                rid: m.num_cached_block[rid] for rid in self.rids if rid in m.num_cached_block
            }
            out.append((len(m.req_to_blocks), tables, cached))
        return out

    def _kv_tables(self) -> Any:
        out = []
        for m in self.km.coordinator.single_type_managers:
            tables = {
                rid: list(m.req_to_blocks[rid]) for rid in self.rids if m.req_to_blocks.get(rid)
            }
            cached = {
                rid: m.num_cached_block[rid] for rid in self.rids if rid in m.num_cached_block
            }
            out.append((len(m.req_to_blocks), tables, cached))
        return out

    def kv_state(self) -> Any:
        return (
            self.kv.free_ids(),
            self.kv.ref_cnts(),
            self.kv.block_keys(),
            self._kv_tables(),
        )

    def compare(self, what: str) -> None:
        self.km.block_pool.check_invariants()
        k_events = self.kv.events()
        r_events = self.ref.events()
        checks = [
            ("events", k_events, r_events),
            ("free queue", self.kv.free_ids(), self.ref.free_ids()),
            ("ref counts", self.kv.ref_cnts(), self.ref.ref_cnts()),
            ("block keys", self.kv.block_keys(), self.ref.block_keys()),
            ("usage", self.km.usage, self.rm.usage),
        ]
        checks.append(("tables", self._kv_tables(), self._ref_tables()))
        checks.append(
            (
                "take_new_block_ids",
                list(self.km.take_new_block_ids()),
                list(self.rm.take_new_block_ids()),
            )
        )
        for name, kv, ref in checks:
            if kv != ref:
                raise Divergence(
                    f"after {what}: {name} differ\n  kvcore:    {kv!r}\n  reference: {ref!r}\n"
                    + self.history()
                )

    # -- one call -------------------------------------------------------------------------------

    def call(
        self,
        what: str,
        k_call: Callable[[], Any],
        r_call: Callable[[], Any],
        convert_k: Callable[[Any], Any] = lambda v: v,
        convert_r: Callable[[Any], Any] = lambda v: v,
        deviation: str | None = None,
        skip_ref: bool = False,
    ) -> Outcome:
        """Runs one call on both sides and checks the outcome and the state after it.

        ``skip_ref``: the input would make the reference build a huge structure; it is not
        run, and kvcore must refuse (``deviation`` says why)."""
        self.log.append(what)
        before = self.kv_state()
        ko = attempt(k_call)
        # The reference is copied only when kvcore refused (its copy is then restored); when
        # kvcore returned, a refusal by the reference alone is a divergence anyway.
        saved = copy.deepcopy(self.ref.manager) if ko.exc is not None else None
        ro = Outcome() if skip_ref else attempt(r_call)
        if skip_ref and ko.exc is None:
            raise Divergence(f"{what}: kvcore {ko}; it must refuse ({deviation})\n{self.history()}")
        try:
            verdict = judge(what, ko, ro, deviation, False)
        except Divergence as e:
            raise Divergence(f"{e}\n{self.history()}") from None
        key = (what.split("(")[0], verdict)
        self.counts[key] = self.counts.get(key, 0) + 1
        if verdict == "ok":
            kv, ref = convert_k(ko.value), convert_r(ro.value)
            if kv != ref:
                raise Divergence(
                    f"{what}: results differ\n  kvcore:    {kv!r}\n  reference: {ref!r}\n"
                    + self.history()
                )
            self.compare(what)
            return ko
        self.km.block_pool.check_invariants()
        after = self.kv_state()
        events = self.km.take_events()
        if after != before or events:
            raise Divergence(
                f"{what}: kvcore raised {ko.exc!r} but changed its state\n"
                f"  before: {before!r}\n  after:  {after!r}\n  events: {events!r}\n"
                + self.history()
            )
        self.ref.manager = saved
        return ko

    def blocks_result(self, side: Any) -> Callable[[Any], Any]:
        def convert(res: Any) -> Any:
            if res is None:
                return None
            return (res.get_block_ids(), res is side.manager.empty_kv_cache_blocks)

        return convert

    # -- programs -------------------------------------------------------------------------------

    def run(self, program: list[tuple[Any, ...]]) -> None:
        for op in program:
            getattr(self, "op_" + op[0])(*op[1:])
        self.compare("end of program")

    def op_new(self, rid: str, prompt: list[int]) -> None:
        spec = ReqSpec(rid, list(prompt), 16)
        self.log.append(f"new request {rid!r} prompt={prompt!r}")
        r = attempt(lambda: self.ref.make_request(spec))
        k = attempt(lambda: self.kv.make_request(spec))
        judge(f"Request({rid!r}, {prompt!r})", k, r, None, False)
        if r.exc is None and k.exc is None:
            if list(k.value.block_hashes) != list(r.value.block_hashes):
                raise Divergence(f"request {rid!r}: block hashes differ\n{self.history()}")
            self.reqs.append(_Pair(rid, r.value, k.value))
            self.note_rid(rid)

    def op_new_nohash(self, rid: str, prompt: list[int]) -> None:
        """A request built without a block hasher (its ``block_hashes`` stay empty)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request as RefRequest

        self.log.append(f"new request {rid!r} prompt={prompt!r} without a block hasher")
        ref = RefRequest(rid, list(prompt), SamplingParams(max_tokens=16), None)
        kv = kvcore.Request(rid, list(prompt), max_tokens=16)
        self.reqs.append(_Pair(rid, ref, kv))
        self.note_rid(rid)

    def _hashes_short(self, p: _Pair) -> bool:
        bs = min(g.block_size for g in self.cfg.groups)
        short: bool = len(p.ref.block_hashes) < p.ref.num_tokens // bs
        return short

    def op_computed(self, k: int) -> None:
        p = self.req(k)
        if p is None:
            return

        def conv(side: Any) -> Callable[[Any], Any]:
            def f(v: Any) -> Any:
                blocks, n = v
                ids = blocks.get_block_ids()
                return (ids, n, blocks is side.manager.empty_kv_cache_blocks)

            return f

        out = self.call(
            f"get_computed_blocks({p.rid!r})",
            lambda: self.km.get_computed_blocks(p.kv),
            lambda: self.rm.get_computed_blocks(p.ref),
            conv(self.kv),
            conv(self.ref),
        )
        if out.exc is None:
            blocks, n = out.value
            p.hits = [list(g) for g in blocks.get_block_ids()]
            p.num_hits = n

    def _hits(self, p: _Pair, choice: str) -> tuple[Any, Any, str | None]:
        """(kvcore hits, reference hits, deviation) for a hits choice."""
        groups = self.groups
        if choice == "none":
            return None, None, None
        if choice == "empty":
            return self.km.empty_kv_cache_blocks, self.rm.empty_kv_cache_blocks, None
        if choice == "new-empty":
            return (
                self.km.empty_kv_cache_blocks.new_empty(),
                self.rm.empty_kv_cache_blocks.new_empty(),
                None,
            )
        if choice == "bad":
            ids = [[1, 1]] * (groups + 1)
            return (
                kvcore.KVCacheBlocks(tuple(ids), self.km.block_pool),
                self.ref_blocks(ids),
                "hits for the wrong number of groups",
            )
        source = p
        if choice == "other":
            others = [q for q in self.reqs if q is not p and q.hits]
            if not others:
                return None, None, None
            source = others[0]
        if source.hits is None:
            return None, None, None
        ids = source.hits
        if not any(ids):
            return self.km.empty_kv_cache_blocks, self.rm.empty_kv_cache_blocks, None
        return (
            kvcore.KVCacheBlocks(tuple(list(g) for g in ids), self.km.block_pool),
            self.ref_blocks(ids),
            None,
        )

    def _holds_blocks_not_running(self, rid: str) -> bool:
        ms = self.rm.coordinator.single_type_managers
        return not any(rid in m.num_cached_block for m in ms) and any(
            m.req_to_blocks.get(rid) for m in ms
        )

    def op_allocate(
        self,
        k: int,
        num_new: Any,
        num_computed: Any,
        hits_choice: str,
        lookahead: Any,
        ext: Any,
        delay: bool,
        enc: Any,
        must_fit: bool,
        reserved: Any,
        has_sched: Any,
    ) -> None:
        p = self.req(k)
        if p is None:
            return
        k_hits, r_hits, deviation = self._hits(p, hits_choice)
        nc = (
            (p.num_hits if hits_choice in ("last", "other") else 0)
            if num_computed == "hits"
            else num_computed
        )
        args = (num_new, nc, lookahead, ext, enc, reserved)
        if deviation is None and not all(_is_count(a) for a in args):
            deviation = "a count that is not a non-negative int"
        if (
            deviation is None
            and nc
            and k_hits in (None, self.km.empty_kv_cache_blocks)
            and self.groups > 1
        ):
            deviation = "computed tokens without the hit blocks they count (window groups)"
        skip_ref = False
        if deviation is None and any(a >= 2**62 for a in args):
            # The reference's window arithmetic then builds lists of that many entries
            # (MemoryError) or allocates group by group before failing.
            deviation = "a count no sequence reaches (2**62 or more)"
        if (
            deviation is None
            and self.groups > 1
            and p.ref.num_computed_tokens + nc + ext > self.cfg.max_model_len
        ):
            # The reference would build a list of that many null blocks (STM-4): not run.
            deviation = "computed tokens beyond max_model_len with window groups"
            skip_ref = True
        if (
            deviation is None
            and (k_hits is not None or (_is_count(ext) and ext > 0))
            and self._holds_blocks_not_running(p.rid)
        ):
            deviation = "hits or external tokens for a request that holds blocks"
        if (
            deviation is None
            and self.rm.enable_caching is False
            and hits_choice in ("last", "other", "bad")
        ):
            deviation = "prefix hits with caching off"
        if deviation is None and self.rm.enable_caching and self._hashes_short(p):
            deviation = "a request without the block hashes of its full blocks"
        what = (
            f"allocate_slots({p.rid!r}, {num_new!r}, {nc!r}, {hits_choice}, L={lookahead!r}, "
            f"ext={ext!r}, delay={delay}, enc={enc!r}, fit={must_fit}, res={reserved!r}, "
            f"sched={has_sched!r})"
        )

        def run(m: Any, r: Any, hits: Any) -> Any:
            return m.allocate_slots(
                r, num_new, nc, hits, lookahead, ext, delay, enc, must_fit, reserved, has_sched
            )

        self.call(
            what,
            lambda: run(self.km, p.kv, k_hits),
            lambda: run(self.rm, p.ref, r_hits),
            self.blocks_result(self.kv),
            self.blocks_result(self.ref),
            deviation,
            skip_ref,
        )

    def op_schedule(self, k: int) -> None:
        """A well-formed scheduler step for one request: lookup, allocate, advance."""
        p = self.req(k)
        if p is None:
            return
        r = p.ref
        if r.num_computed_tokens == 0:
            self.op_computed(k)
            hits = "last"
        else:
            hits = "none"
        n = max(r.num_tokens - r.num_computed_tokens - (p.num_hits if hits == "last" else 0), 1)
        self.op_allocate(k, n, "hits", hits, 0, 0, False, 0, False, 0, True)
        new = r.num_computed_tokens + (p.num_hits if hits == "last" else 0) + n
        self.op_computed_tokens(k, min(new, r.num_tokens))
        self.op_status(k, "RUNNING")

    def op_batch(self, ks: list[int], counts: list[Any], lookahead: Any, allow_none: bool) -> None:
        """``allocate_slots_batch`` (a kvcore extension) against the reference's loop of
        ``allocate_slots`` calls, stopping at the first None."""
        pairs = [self.req(k) for k in ks]
        reqs = [p for p in pairs if p is not None]
        n = counts[: len(reqs)]
        deviation = None
        if len(n) != len(reqs):
            deviation = "sequences of different lengths"
        elif not all(_is_count(a) for a in [*n, lookahead]):
            deviation = "a count that is not a non-negative int"
        elif any(a >= 2**62 for a in [*n, lookahead]):
            deviation = "a count no sequence reaches (2**62 or more)"
        elif 0 in n:
            deviation = "a zero count, refused for the whole batch before any allocation"
        if self.rm.enable_caching and any(self._hashes_short(p) for p in reqs):
            # Refused at that request, after the ones before it were allocated: the batch has
            # the loop's semantics (documented), which the state check here does not model.
            return

        def loop() -> Any:
            out = []
            for p, c in zip(reqs, n, strict=True):
                got = self.rm.allocate_slots(p.ref, c, num_lookahead_tokens=lookahead)
                if got is None:
                    break
                out.append(got.get_block_ids(allow_none=allow_none))
            return out

        self.call(
            f"allocate_slots_batch({[p.rid for p in reqs]!r}, {n!r}, {lookahead!r}, {allow_none})",
            lambda: self.km.allocate_slots_batch(
                [p.kv for p in reqs], n, lookahead, allow_none=allow_none
            ),
            loop,
            lambda v: [None if x is None else tuple(list(g) for g in x) for x in v],
            lambda v: [None if x is None else tuple(list(g) for g in x) for x in v],
            deviation,
        )

    def op_append(self, k: int, tokens: Any) -> None:
        p = self.req(k)
        if p is None:
            return
        self.log.append(f"{p.rid!r}.append_output_token_ids({tokens!r})")
        for r in (p.ref, p.kv):
            r.append_output_token_ids(list(tokens) if isinstance(tokens, list) else tokens)
        if list(p.kv.block_hashes) != list(p.ref.block_hashes):
            raise Divergence(f"{p.rid!r}: block hashes differ after an append\n{self.history()}")

    def op_computed_tokens(self, k: int, n: Any) -> None:
        p = self.req(k)
        if p is None:
            return
        if n == "all":
            n = p.ref.num_tokens
        elif n == "all-1":
            n = max(p.ref.num_tokens - 1, 0)
        self.log.append(f"{p.rid!r}.num_computed_tokens = {n}")
        p.ref.num_computed_tokens = n
        p.kv.num_computed_tokens = n

    def op_status(self, k: int, name: str) -> None:
        p = self.req(k)
        if p is None:
            return
        self.log.append(f"{p.rid!r}.status = {name}")
        p.ref.status = getattr(self.ref.status, name)
        p.kv.status = getattr(self.kv.status, name)

    def op_free(self, k: int) -> None:
        p = self.req(k)
        if p is None:
            return
        self.call(f"free({p.rid!r})", lambda: self.km.free(p.kv), lambda: self.rm.free(p.ref))

    def op_pop_free(self, k: int, give_back: bool) -> None:
        p = self.req(k)
        if p is None:
            return
        out = self.call(
            f"pop_blocks_for_free({p.rid!r})",
            lambda: self.km.pop_blocks_for_free(p.kv),
            lambda: self.rm.pop_blocks_for_free(p.ref),
            lambda v: list(v),
            lambda v: [b.block_id for b in v],
        )
        if out.exc is None and give_back:
            ids = list(out.value)[::-1]
            self.call(
                "block_pool.free_blocks(reversed popped)",
                lambda: self.km.block_pool.free_blocks(ids),
                lambda: self.rm.block_pool.free_blocks([self.rm.block_pool.blocks[i] for i in ids]),
            )

    def op_cache_blocks(self, k: int, n: Any) -> None:
        p = self.req(k)
        if p is None:
            return
        deviation = None
        if not _is_count(n):
            deviation = "a count that is not a non-negative int"
        elif self.rm.enable_caching:
            bs = self.cfg.groups[0].block_size
            held = min(
                len(m.req_to_blocks.get(p.rid, ()))
                for m in self.rm.coordinator.single_type_managers
            )
            if n // bs > held or n // bs > len(p.ref.block_hashes):
                deviation = "caching more full blocks than the request holds or has hashes for"
        self.call(
            f"cache_blocks({p.rid!r}, {n!r})",
            lambda: self.km.cache_blocks(p.kv, n),
            lambda: self.rm.cache_blocks(p.ref, n),
            deviation=deviation,
        )

    def op_common(self, v: Any) -> None:
        rid = self.rid_of(v)
        self.note_rid(rid)
        self.call(
            f"get_num_common_prefix_blocks({rid!r})",
            lambda: list(self.km.get_num_common_prefix_blocks(rid)),
            lambda: list(self.rm.get_num_common_prefix_blocks(rid)),
        )

    def op_block_ids(self, v: Any) -> None:
        rid = self.rid_of(v)
        self.note_rid(rid)
        deviation = None if isinstance(rid, str) else "a request id that is not a str"
        self.call(
            f"get_block_ids({rid!r})",
            lambda: tuple(list(g) for g in self.km.get_block_ids(rid)),
            lambda: tuple(list(g) for g in self.rm.get_block_ids(rid)),
            deviation=deviation,
        )
        self.call(
            f"get_blocks({rid!r})",
            lambda: self.km.get_blocks(rid).get_block_ids(),
            lambda: self.rm.get_blocks(rid).get_block_ids(),
            deviation=deviation,
        )

    def op_ids_for_computed(self, v: Any, n: Any) -> None:
        rid = self.rid_of(v)
        self.note_rid(rid)
        deviation = None if _is_count(n) else "a count that is not a non-negative int"
        self.call(
            f"get_block_ids_for_computed_tokens({rid!r}, {n!r})",
            lambda: tuple(list(g) for g in self.km.get_block_ids_for_computed_tokens(rid, n)),
            lambda: tuple(list(g) for g in self.rm.get_block_ids_for_computed_tokens(rid, n)),
            deviation=deviation,
        )

    def op_evict(self, kind: str, ids: list[Any]) -> None:
        ids = [i if not hasattr(i, "k") else i.k for i in ids]
        n = self.cfg.num_blocks
        deviation = None
        if kind != "none" and any(not isinstance(i, int) or -n <= i < 0 for i in ids):
            deviation = "a block id that is negative or not an int (SPEC POOL-20)"
        self.call(
            f"evict_blocks({kind}:{ids!r})",
            lambda: self.km.evict_blocks(wrap(kind, ids)),
            lambda: self.rm.evict_blocks(wrap(kind, ids)),
            deviation=deviation,
        )

    def op_reset(self) -> None:
        self.call("reset_prefix_cache()", self.km.reset_prefix_cache, self.rm.reset_prefix_cache)

    def op_new_step(self) -> None:
        self.call("new_step_starts()", self.km.new_step_starts, self.rm.new_step_starts)

    def op_remove_skipped(self, v: Any, n: Any) -> None:
        rid = self.rid_of(v)
        self.note_rid(rid)
        deviation = None if _is_count(n) else "a count that is not a non-negative int"
        self.call(
            f"remove_skipped_blocks({rid!r}, {n!r})",
            lambda: self.km.remove_skipped_blocks(rid, n),
            lambda: self.rm.remove_skipped_blocks(rid, n),
            deviation=deviation,
        )


_ = dataclasses  # kept for callers that derive configurations
