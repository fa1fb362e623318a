"""Workloads of the retention benchmarks, shared by ``test_bench_retention.py`` and
``compare_instructions.py`` (docs/behaviour.md §21, CC-1..CC-6).

Two kinds, each with retention off (the reference's plain LRU; runs on any kvcore, the one
before cache control included) and on:

- pool cycles over a cached 4096-block pool (block size 16, caching on, events off):
  ``alloc_free_<n>`` (``get_new_blocks(n)`` + ``free_blocks``), ``touch_<n>`` (free the
  request's cached blocks, then ``touch`` them, as a prefix hit does) and ``churn_<n>``
  (``get_new_blocks(n)``, which evicts cached blocks, + ``cache_full_blocks`` with new hashes
  + ``free_blocks``, the steady state of a full prefix cache). With retention on, every free
  carries a ``kvcore._native.Retention`` from :data:`RETENTION_MIX` (mixed priorities, some
  with a time to live), 64 blocks are pinned, and the churn cycle advances a fake clock by
  :data:`TICK_PER_BLOCK` per block and calls ``expire()`` (what ``allocate_slots`` does), so
  deadlines run out during the run. ``pin_<n>`` (on only) pins and unpins ``n`` cached blocks.
- the scheduler loop of ``test_bench_manager.py`` (same chat workload, same decisions) on a
  ``KVCacheManager``; with retention on, requests carry ``retention_priority`` /
  ``retention_ttl_s`` (:func:`retention_of`), the manager has ``clock=`` a fake clock advanced
  :data:`STEP_S` per step, and the two most used system prompts are pinned (``pin_prefix``
  with a time to live) every :data:`PIN_EVERY` steps.

Run as a script, one workload for ``iters`` iterations (pool cycles, or at most that many
scheduler steps; 0 runs the setup only) and print what it did as JSON:
``python benches/retention_workload.py pool-off/churn_16 1000``.
``compare_instructions.py`` runs it under callgrind.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

HBS = 16
POOL_BLOCKS = 4096
RING = 65536
"""Distinct block hashes the churn cycles go through; more than any block stays cached."""
TICK_PER_BLOCK = 0.000625
"""Fake seconds per block cycled (0.01 s per 16-block cycle), so times to live are in blocks."""
RETENTION_MIX: tuple[tuple[int, float | None], ...] = (
    (10, None),
    (30, None),
    (50, 0.5),
    (70, 2.0),
    (90, 5.0),
    (20, 0.2),
    (80, None),
    (60, 1.0),
)
"""The (priority, ttl_s) the pool workloads' frees cycle through."""
NUM_PINNED = 64


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Req:
    """The request fields the pool reads (SPEC §17)."""

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes
        self.all_token_ids: list[int] = []
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = None
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict[Any, bytes] = {}


def _hashes(seed: int, n: int) -> list[bytes]:
    return [(seed * 1_000_003 + i).to_bytes(8, "big") * 4 for i in range(n)]


# --------------------------------------------------------------------------------------------
# Pool cycles
# --------------------------------------------------------------------------------------------


@dataclass
class PoolCase:
    """One pool cycle ready to run: ``fn`` is one iteration, ``per`` blocks of it."""

    impl: str
    retention: bool
    pool: Any
    fn: Callable[[], None]
    per: int
    setup: Callable[[], None] | None = None
    """Untimed preparation before each ``fn`` (``touch``: free the blocks again)."""
    cost_s: float = 0.0
    """Seconds one ``fn`` takes, once measured (for choosing iteration counts)."""


class PoolSide:
    """A cached pool of either side with the int-id API of ``test_bench_pool.Side``."""

    def __init__(self, impl: str, retention: bool) -> None:
        assert impl == "kvcore" or not retention, "the reference has no retention"
        self.impl = impl
        self.retention = retention
        self.clock = FakeClock()
        if impl == "kvcore":
            import kvcore

            self.pool: Any = kvcore.BlockPool(POOL_BLOCKS, True, HBS, False)
            self.wrap: Callable[[list[int]], Any] = lambda ids: ids
        else:
            from vllm.v1.core.block_pool import BlockPool

            self.pool = BlockPool(POOL_BLOCKS, True, HBS, False)
            blocks = self.pool.blocks
            self.wrap = lambda ids: [blocks[i] for i in ids]
        self.rets: Iterator[Any] = iter(())
        if retention:
            from kvcore._native import Retention

            self.pool.clock = self.clock
            self.rets = itertools.cycle([Retention(p, t) for p, t in RETENTION_MIX])
        self.chunks = self._fill()

    def free(self, blocks: Any) -> None:
        """Frees ``blocks`` (in order), with the next retention of the mix when on."""
        if self.retention:
            self.pool.free_blocks(blocks, next(self.rets))
        else:
            self.pool.free_blocks(blocks)

    def _fill(self) -> list[tuple[Req, Any]]:
        """Caches every block in chunks of 256 (one request each), frees them tail first."""
        chunks = []
        left = self.pool.get_num_free_blocks()
        k = 0
        while left:
            n = min(256, left)
            blocks = self.pool.get_new_blocks(n)
            req = Req(_hashes(1_000_000 + k, n))
            self.pool.cache_full_blocks(req, blocks, 0, n, HBS, 0)
            chunks.append((req, blocks))
            left -= n
            k += 1
        for _, blocks in chunks:
            self.free(blocks[::-1])
        if self.retention:
            pinned = self.pool.pin_prefix(
                [(0, chunks[0][0].block_hashes[:NUM_PINNED])], None, POOL_BLOCKS
            )
            assert pinned == [NUM_PINNED] and self.pool.num_pinned_blocks == NUM_PINNED
        return chunks


def pool_case(impl: str, retention: bool, op: str) -> PoolCase:
    """The pool cycle ``op`` (``alloc_free_<n>``, ``touch_<n>``, ``churn_<n>``, ``pin_<n>``)."""
    kind, _, size = op.rpartition("_")
    n = int(size)
    side = PoolSide(impl, retention)
    pool = side.pool
    get, cache, free, clock = pool.get_new_blocks, pool.cache_full_blocks, side.free, side.clock
    if kind == "alloc_free":

        def alloc_free() -> None:
            free(get(n))

        return PoolCase(impl, retention, pool, alloc_free, n)
    if kind == "touch":
        # A cached request's blocks, free and findable: a prefix hit touches them.
        chunk = side.chunks[3][1]
        blocks = chunk[:n]
        back = blocks[::-1]
        touch = pool.touch
        touched = [False]

        def refree() -> None:
            if touched[0]:
                free(back)
            touched[0] = True

        return PoolCase(impl, retention, pool, lambda: touch(blocks), n, setup=refree)
    if kind == "churn":
        ring_hashes = _hashes(7, RING)
        reqs = [Req(ring_hashes[i : i + n]) for i in range(0, RING, n)]
        ring = itertools.cycle(reqs)
        tick = TICK_PER_BLOCK * n
        expire = pool.expire if retention else None

        def churn() -> None:
            blocks = get(n)
            cache(next(ring), blocks, 0, n, HBS, 0)
            blocks.reverse()
            free(blocks)
            if expire is not None:
                clock.now += tick
                expire()

        return PoolCase(impl, retention, pool, churn, n)
    if kind == "pin":
        assert impl == "kvcore" and retention, "pins are a kvcore extension"
        groups = [(0, side.chunks[5][0].block_hashes[:n])]
        pin, unpin = pool.pin_prefix, pool.unpin_prefix

        def pin_unpin() -> None:
            pin(groups, None, POOL_BLOCKS)
            unpin(groups)

        return PoolCase(impl, retention, pool, pin_unpin, n)
    raise ValueError(f"unknown pool cycle {op!r}")


POOL_OPS = ("alloc_free_1", "alloc_free_16", "alloc_free_256", "touch_256", "churn_16", "churn_256")


# --------------------------------------------------------------------------------------------
# Scheduler loop (the workload and loop of test_bench_manager.py, with retention)
# --------------------------------------------------------------------------------------------

BLOCK_SIZE = 16
HASH_FN = "sha256_cbor"
VOCAB = 32000
STEP_S = 0.01
"""Fake seconds per scheduler step."""
PIN_EVERY = 200
PIN_TTL_S = 3.0
NUM_PINNED_SYSTEMS = 2


@dataclass(frozen=True)
class Size:
    """One loop size (as ``test_bench_manager.Size``)."""

    name: str
    num_requests: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    arrivals_per_step: int = 4
    unique_frac: float = 0.3
    unique_max_len: int = 2000
    max_out: int = 200
    max_model_len: int = 16384

    def scaled(self, scale: float) -> Size:
        """The size with requests, blocks and sequences multiplied by ``scale`` (< 1)."""
        if scale >= 1.0:
            return self
        return Size(
            self.name,
            max(20, round(self.num_requests * scale)),
            max(256, round(self.num_blocks * scale)),
            max(8, round(self.max_num_seqs * scale)),
            self.max_num_batched_tokens,
            self.arrivals_per_step,
            self.unique_frac,
            self.unique_max_len,
            self.max_out,
            self.max_model_len,
        )


LOOP_SIZE = Size("2000req-8192blk", 2000, 8192, max_num_seqs=128, max_num_batched_tokens=4096)
SMALL_LOOP_SIZE = Size("200req-1024blk", 200, 1024, max_num_seqs=24, max_num_batched_tokens=2048)
"""The size ``compare_instructions.py`` runs under callgrind."""


@dataclass
class Turn:
    """One request of a conversation."""

    user: list[int]
    max_out: int


@dataclass
class Conversation:
    """A conversation: a system prompt (``system_id`` >= 0 when shared) and its turns."""

    cid: int
    system: list[int]
    system_id: int
    turns: list[Turn]
    arrival: int
    think: list[int]


def make_workload(size: Size, seed: int = 0) -> tuple[list[Conversation], list[list[int]]]:
    """``test_bench_manager.make_workload``'s conversations (same draws), and the shared
    system prompts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(512, 2048))] for _ in range(8)]
    convs: list[Conversation] = []
    total = 0
    while total < size.num_requests:
        n = min(rng.randrange(1, 7), size.num_requests - total)
        if rng.random() >= size.unique_frac:
            sid = min(int(rng.expovariate(0.6)), len(systems) - 1)
            system = systems[sid]
        else:
            sid = -1
            system = [
                rng.randrange(1, VOCAB) for _ in range(rng.randrange(200, size.unique_max_len))
            ]
        turns = [
            Turn(
                [rng.randrange(1, VOCAB) for _ in range(rng.randrange(30, 300))],
                rng.randrange(16, size.max_out),
            )
            for _ in range(n)
        ]
        think = [rng.randrange(0, 20) for _ in range(n)]
        convs.append(
            Conversation(
                len(convs),
                system,
                sid,
                turns,
                arrival=1 + len(convs) // size.arrivals_per_step,
                think=think,
            )
        )
        total += n
    return convs, systems


def retention_of(conv: Conversation, turn: int) -> tuple[int | None, float | None]:
    """The retention a request asks for: keep a conversation's history until its next turn
    (a time to live a little over the think time), drop finished unique prompts first, and
    leave every seventh conversation at the default."""
    if conv.cid % 7 == 0:
        return None, None
    last = turn == len(conv.turns) - 1
    if conv.system_id >= 0:
        return (60, 1.0) if last else (80, 3.0)
    return (10, None) if last else (70, 2.0)


@dataclass
class LoopImpl:
    """One implementation in the loop: its manager, request factory and options."""

    name: str
    manager: Any
    make_request: Callable[[str, list[int], Conversation, int], Any]
    status: Any
    batch: bool = False
    append_batch: Callable[[list[Any], list[int]], None] | None = None
    clock: FakeClock | None = None
    """The manager's clock when retention is on (moved :data:`STEP_S` per step)."""
    pins: list[list[int]] = field(default_factory=list)
    """Prompts pinned every :data:`PIN_EVERY` steps."""


def _config(specs: Any, config: Any, dtype: Any, num_blocks: int) -> Any:
    spec = specs.FullAttentionSpec(BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=dtype)
    return config.KVCacheConfig(num_blocks, [], [config.KVCacheGroupSpec(["attn"], spec)])


def reference_loop_impl(size: Size) -> LoopImpl:
    """The reference manager (it has no retention: plain LRU whatever the requests ask)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    fn = get_hash_fn_by_name(HASH_FN)
    init_none_hash(fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, fn)
    mgr = KVCacheManager(
        _config(kvi, kvi, torch.float16, size.num_blocks),
        max_model_len=size.max_model_len,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        max_num_batched_tokens=size.max_num_batched_tokens,
    )
    params = SamplingParams(max_tokens=256)

    def make(rid: str, prompt: list[int], conv: Conversation, turn: int) -> Any:
        return Request(rid, prompt, params, None, block_hasher=hasher)

    return LoopImpl("reference", mgr, make, RequestStatus)


def kvcore_loop_impl(
    size: Size, retention: bool, batch: bool, systems: list[list[int]] | None = None
) -> LoopImpl:
    """kvcore's manager; with ``retention`` the requests, clock and pins described above."""
    from kvcore import config, hashing, specs
    from kvcore.manager import KVCacheManager
    from kvcore.request import Request, RequestStatus, append_output_token_ids_batch

    fn = hashing.get_hash_fn_by_name(HASH_FN)
    hashing.init_none_hash(fn)
    hasher: Any = hashing.get_request_block_hasher(BLOCK_SIZE, fn)
    extra: dict[str, Any] = {}
    clock = None
    if retention:
        clock = FakeClock()
        extra = {"hash_fn": fn, "clock": clock}
    mgr = KVCacheManager(
        _config(specs, config, "float16", size.num_blocks),
        max_model_len=size.max_model_len,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        max_num_batched_tokens=size.max_num_batched_tokens,
        **extra,
    )
    if retention:

        def make(rid: str, prompt: list[int], conv: Conversation, turn: int) -> Any:
            p, t = retention_of(conv, turn)
            return Request(
                rid,
                prompt,
                max_tokens=256,
                block_hasher=hasher,
                retention_priority=p,
                retention_ttl_s=t,
            )
    else:

        def make(rid: str, prompt: list[int], conv: Conversation, turn: int) -> Any:
            return Request(rid, prompt, max_tokens=256, block_hasher=hasher)

    name = "kvcore" + ("-on" if retention else "-off") + ("-batch" if batch else "")
    return LoopImpl(
        name,
        mgr,
        make,
        RequestStatus,
        batch=batch,
        append_batch=append_output_token_ids_batch if batch else None,
        clock=clock,
        pins=list((systems or [])[:NUM_PINNED_SYSTEMS]) if retention else [],
    )


def _token_seed(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")


@dataclass
class _Live:
    conv: Conversation
    turn: int
    req: Any
    seed: int
    out: int = 0


@dataclass
class LoopResult:
    """What one run measured."""

    step_us: list[float] = field(default_factory=list)
    checksum: str = ""
    steps: int = 0
    preemptions: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    pin_calls: int = 0
    max_pinned: int = 0


def simulate_steps(
    impl: LoopImpl,
    size: Size,
    convs: list[Conversation],
    res: LoopResult,
    max_steps: int | None = None,
) -> Iterator[None]:
    """``test_bench_manager.simulate_steps`` with retention, pins and a fake clock; yields
    after every step. Only KV-manager work is timed (pins included)."""
    mgr = impl.manager
    st = impl.status
    clock = time.perf_counter_ns
    digest = hashlib.blake2b(digest_size=16)
    arrivals: dict[int, list[tuple[Conversation, int]]] = {}
    for c in convs:
        arrivals.setdefault(c.arrival, []).append((c, 0))
    history: dict[int, list[int]] = {}
    waiting: deque[_Live] = deque()
    running: list[_Live] = []
    pending = sum(len(c.turns) for c in convs)
    step = 0
    while pending and (max_steps is None or step < max_steps):
        step += 1
        spent = 0
        if impl.clock is not None:
            impl.clock.now += STEP_S
        for conv, k in arrivals.pop(step, ()):
            prompt = history.get(conv.cid, conv.system) + conv.turns[k].user
            rid = f"c{conv.cid}t{k}"
            t0 = clock()
            req = impl.make_request(rid, prompt, conv, k)
            spent += clock() - t0
            res.requests += 1
            res.prompt_tokens += len(prompt)
            waiting.append(_Live(conv, k, req, _token_seed(rid)))

        if impl.pins and step % PIN_EVERY == 0:
            t0 = clock()
            for prompt in impl.pins:
                mgr.pin_prefix(prompt, ttl_s=PIN_TTL_S)
            res.max_pinned = max(res.max_pinned, mgr.num_pinned_blocks)
            spent += clock() - t0
            res.pin_calls += len(impl.pins)

        t0 = clock()
        mgr.new_step_starts()
        spent += clock() - t0
        budget = size.max_num_batched_tokens
        scheduled: list[tuple[_Live, int]] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            if impl.batch:
                reqs: list[Any] = []
                ns: list[int] = []
                left = budget
                for lv in itertools.islice(running, i, None):
                    if left <= 0:
                        break
                    r = lv.req
                    n = min(r.num_tokens - r.num_computed_tokens, left)
                    reqs.append(r)
                    ns.append(n)
                    left -= n
                t0 = clock()
                got = mgr.allocate_slots_batch(reqs, ns, allow_none=True)
                spent += clock() - t0
            else:
                r = running[i].req
                ns = [min(r.num_tokens - r.num_computed_tokens, budget)]
                t0 = clock()
                blocks = mgr.allocate_slots(r, ns[0])
                got = [] if blocks is None else [blocks.get_block_ids(allow_none=True)]
                spent += clock() - t0
            for ids, n in zip(got, ns, strict=False):
                lv = running[i]
                digest.update(f"a{lv.req.request_id}:{n}:{ids}".encode())
                scheduled.append((lv, n))
                budget -= n
                i += 1
            if len(got) == len(ns):
                continue
            lv = running[i]
            digest.update(f"a{lv.req.request_id}:{ns[len(got)]}:None".encode())
            victim = running.pop()
            preempted = True
            for j, (q, m) in enumerate(scheduled):
                if q is victim:
                    budget += m
                    del scheduled[j]
                    break
            t0 = clock()
            mgr.free(victim.req)
            spent += clock() - t0
            res.preemptions += 1
            victim.req.status = st.PREEMPTED
            victim.req.num_computed_tokens = 0
            victim.req.num_preemptions += 1
            waiting.appendleft(victim)

        while waiting and budget > 0 and not preempted and len(running) < size.max_num_seqs:
            lv = waiting[0]
            r = lv.req
            t0 = clock()
            hit_blocks, hits = mgr.get_computed_blocks(r)
            spent += clock() - t0
            n = min(r.num_tokens - hits, budget)
            t0 = clock()
            blocks = mgr.allocate_slots(r, n, hits, hit_blocks)
            ids = None if blocks is None else blocks.get_block_ids()
            spent += clock() - t0
            digest.update(f"w{r.request_id}:{hits}:{n}:{ids}".encode())
            if blocks is None:
                break
            waiting.popleft()
            res.hit_tokens += hits
            r.num_computed_tokens = hits
            r.status = st.RUNNING
            running.append(lv)
            scheduled.append((lv, n))
            budget -= n

        t0 = clock()
        new_ids = mgr.take_new_block_ids()
        spent += clock() - t0
        digest.update(f"n{len(new_ids)}".encode())

        sampled: list[_Live] = []
        for lv, n in scheduled:
            r = lv.req
            r.num_computed_tokens += n
            if r.num_computed_tokens >= r.num_tokens:
                sampled.append(lv)
        toks = [1 + (lv.seed + lv.out * 40503) % (VOCAB - 1) for lv in sampled]
        if impl.append_batch is not None:
            reqs = [lv.req for lv in sampled]
            t0 = clock()
            impl.append_batch(reqs, toks)
            spent += clock() - t0
        else:
            for lv, tok in zip(sampled, toks, strict=True):
                r = lv.req
                t0 = clock()
                r.append_output_token_ids(tok)
                spent += clock() - t0
        for lv in sampled:
            r = lv.req
            lv.out += 1
            conv = lv.conv
            if lv.out >= conv.turns[lv.turn].max_out or r.num_tokens >= size.max_model_len - 1:
                running.remove(lv)
                t0 = clock()
                mgr.free(r)
                spent += clock() - t0
                r.status = st.FINISHED_STOPPED
                pending -= 1
                digest.update(f"f{r.request_id}".encode())
                nxt = lv.turn + 1
                if nxt < len(conv.turns):
                    context = list(r.all_token_ids)
                    if len(context) + 300 + 200 < size.max_model_len:
                        history[conv.cid] = context
                        arrivals.setdefault(step + 1 + conv.think[nxt], []).append((conv, nxt))
                    else:
                        pending -= len(conv.turns) - nxt
        res.step_us.append(spent / 1000.0)
        yield
    res.steps = step
    digest.update(f"{mgr.block_pool.get_num_free_blocks()}".encode())
    res.checksum = digest.hexdigest()


def run_lockstep(
    impls: list[LoopImpl],
    size: Size,
    convs: list[Conversation],
    chunk: int = 25,
    max_steps: int | None = None,
) -> list[LoopResult]:
    """Runs the implementations ``chunk`` steps each in turn (``test_bench_manager``'s
    lockstep: the machine's drift hits all alike), with the garbage collector off."""
    import gc

    results = [LoopResult() for _ in impls]
    live = [
        simulate_steps(i, size, convs, r, max_steps) for i, r in zip(impls, results, strict=True)
    ]
    gc_was = gc.isenabled()
    gc.disable()
    try:
        while live:
            for g in list(live):
                for _ in range(chunk):
                    if next(g, StopIteration) is StopIteration:
                        live.remove(g)
                        break
    finally:
        if gc_was:
            gc.enable()
    return results


# --------------------------------------------------------------------------------------------
# Script entry: one workload, for compare_instructions.py
# --------------------------------------------------------------------------------------------

WORKLOADS: dict[str, tuple[int, int]] = {
    **{f"pool-off/{op}": (1000, 3000) for op in POOL_OPS},
    **{f"pool-on/{op}": (1000, 3000) for op in (*POOL_OPS, "pin_64")},
    "manager-off": (0, 10**9),
    "manager-off-batch": (0, 10**9),
    "manager-on": (0, 10**9),
    "manager-on-batch": (0, 10**9),
}
"""Every workload the script runs, with the two iteration counts ``compare_instructions.py``
subtracts (pool cycles; scheduler steps, where 0 is the setup alone and 10**9 the whole run)."""


def run_workload(name: str, iters: int) -> dict[str, Any]:
    """Runs workload ``name`` for ``iters`` iterations; returns what it did."""
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; one of: {', '.join(WORKLOADS)}")
    if name.startswith("pool-"):
        mode, op = name.removeprefix("pool-").split("/")
        case = pool_case("kvcore", mode == "on", op)
        fn, setup = case.fn, case.setup
        for _ in range(iters):
            if setup is not None:
                setup()
            fn()
        return {"workload": name, "iters": iters, "free": case.pool.get_num_free_blocks()}
    mode = name.removeprefix("manager-")
    convs, systems = make_workload(SMALL_LOOP_SIZE)
    impl = kvcore_loop_impl(SMALL_LOOP_SIZE, mode.startswith("on"), mode.endswith("batch"), systems)
    res = run_lockstep([impl], SMALL_LOOP_SIZE, convs, max_steps=iters)[0]
    return {
        "workload": name,
        "iters": iters,
        "steps": res.steps,
        "checksum": res.checksum,
        "preemptions": res.preemptions,
        "hit_tokens": res.hit_tokens,
        "prompt_tokens": res.prompt_tokens,
    }


def main(argv: list[str]) -> None:
    """``retention_workload.py WORKLOAD ITERS``: prints the result as one JSON line."""
    if len(argv) != 2:
        raise SystemExit(f"usage: retention_workload.py WORKLOAD ITERS ({', '.join(WORKLOADS)})")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    print("RESULT " + json.dumps(run_workload(argv[0], int(argv[1]))))


if __name__ == "__main__":
    main(sys.argv[1:])
