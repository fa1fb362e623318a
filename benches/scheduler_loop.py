"""The scheduler-loop harness of ``test_bench_manager.py`` and ``test_bench_retention.py``
(through ``retention_workload.py``, which ``compare_instructions.py`` runs as a script).

- :func:`make_workload`: a seeded, chat-like workload (shared and unique system prompts,
  multi-turn conversations whose next prompt extends the previous one, generated tokens
  included, arrivals faster than served).
- :func:`reference_impl` / :func:`kvcore_impl`: a manager of either side with its request
  factory. kvcore's takes the cache-control options of the retention bench (a clock, the
  retention each request asks for, prompts to pin); without them it is the plain manager.
- :func:`simulate_steps` / :func:`run_lockstep`: a minimal scheduler loop (chunked prefill
  under a per-step token budget, decode one token per step, preempt the last admitted request
  first) timing only the KV-manager work, and a checksum over every decision and block id.
  With a clock the loop moves it :data:`STEP_S` per step; with prompts to pin it pins them
  every :data:`PIN_EVERY` steps (timed). Without either it is the loop of
  ``test_bench_manager.py`` unchanged.

One full-attention group, block size 16, sha256_cbor, prefix caching on, events off
(:data:`FULL`); :data:`HYBRID_LAYOUTS` are the hybrid KV cache configurations the manager
bench also runs (several groups, as vLLM builds for hybrid models; same hashing, caching on,
events off), described once by :class:`Layout` and built into either side's config classes
as ``tests/difftrace.py`` builds its trace configurations.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

BLOCK_SIZE = 16
HASH_FN = "sha256_cbor"
VOCAB = 32000
STEP_S = 0.01
"""Seconds a loop clock moves per scheduler step."""
PIN_EVERY = 200
"""Steps between two pins of an implementation's prompts to pin."""
PIN_TTL_S = 3.0
"""Time to live of those pins."""


@dataclass(frozen=True)
class Size:
    """One loop size."""

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


@dataclass(frozen=True)
class Group:
    """One KV cache group of a :class:`Layout` (``tests/difftrace.py``'s ``GroupDesc``)."""

    kind: str
    """``full``, ``swa`` (sliding window), ``chunked`` (chunked local attention) or ``mamba``."""
    block_size: int = BLOCK_SIZE
    window: int = 0
    """Sliding window (swa) or attention chunk (chunked), in tokens."""
    mamba_mode: str = "none"
    """``mamba_cache_mode`` (mamba only)."""


@dataclass(frozen=True)
class Layout:
    """A KV cache configuration: its groups in group-id order and the manager's block sizes."""

    name: str
    groups: tuple[Group, ...]
    scheduler_block_size: int = BLOCK_SIZE
    hash_block_size: int = BLOCK_SIZE

    @property
    def mamba_align(self) -> bool:
        """Whether the scheduler splits prefills at block boundaries (Mamba align mode)."""
        return any(g.kind == "mamba" and g.mamba_mode == "align" for g in self.groups)

    def sized(self, size: Size) -> Size:
        """``size`` with the pool grown to ``size.num_blocks`` per group.

        vLLM sizes a hybrid model's shared pool as memory / (page size x layers per group):
        the same memory split into several groups gives proportionally more (smaller) blocks,
        which all groups draw from. One group: ``size`` itself.
        """
        if len(self.groups) == 1:
            return size
        return replace(size, num_blocks=size.num_blocks * len(self.groups))


FULL = Layout("full", (Group("full"),))
"""The single full-attention configuration (the manager bench's and the retention bench's)."""

MAMBA_BLOCK_SIZE = 256
"""Mamba block size of ``full+mamba``, which is also its scheduler block size."""

HYBRID_LAYOUTS = (
    Layout("full+swa", (Group("full"), Group("swa", window=1024))),
    # Align mode (vLLM's mode for hybrid Mamba with prefix caching): the Mamba state is cached
    # every scheduler block, prefills are split at those boundaries (see simulate_steps);
    # attention blocks stay at 16, hashes at 16.
    Layout(
        "full+mamba",
        (Group("full"), Group("mamba", MAMBA_BLOCK_SIZE, mamba_mode="align")),
        scheduler_block_size=MAMBA_BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
    ),
    Layout("full+chunked", (Group("full"), Group("chunked", window=512))),
    # Full attention at 16, sliding window at 32: the scheduler block is their lcm, hashes at 16.
    Layout(
        "two-sizes",
        (Group("full"), Group("swa", 32, window=1024)),
        scheduler_block_size=32,
        hash_block_size=BLOCK_SIZE,
    ),
)
"""The hybrid configurations of ``test_bench_manager.py`` (pytest ids: their names)."""

SIZES = (
    Size("2000req-8192blk", 2000, 8192, max_num_seqs=128, max_num_batched_tokens=4096),
    Size(
        "10000req-131072blk",
        10000,
        131072,
        max_num_seqs=4096,
        max_num_batched_tokens=32768,
        arrivals_per_step=64,
        unique_frac=0.7,
        unique_max_len=4000,
        max_out=500,
    ),
)
"""The sizes of ``test_bench_manager.py``; the retention bench runs the first."""


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


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
    """Conversations totalling ``size.num_requests`` turns, arriving faster than served, and
    the shared system prompts."""
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


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------


class Clock(Protocol):
    """A manager clock the loop moves by hand (``retention_workload.FakeClock``)."""

    now: float

    def __call__(self) -> float: ...


RetentionOf = Callable[[Conversation, int], tuple[int | None, float | None]]
"""The (retention_priority, retention_ttl_s) the request of a conversation's turn asks for."""


@dataclass
class Impl:
    """One implementation in the loop: its manager, request factory and options."""

    name: str
    manager: Any
    make_request: Callable[[str, list[int], Conversation, int], Any]
    status: Any
    hasher: str
    """Whose block hasher the requests use."""
    batch: bool = False
    """Whether running requests are allocated with ``allocate_slots_batch``."""
    append_batch: Callable[[list[Any], list[int]], None] | None = None
    """Appends one sampled token to each request in one call, or None (one call each)."""
    clock: Clock | None = None
    """The manager's clock, moved :data:`STEP_S` per step, or None (the manager's own)."""
    pins: list[list[int]] = field(default_factory=list)
    """Prompts pinned every :data:`PIN_EVERY` steps."""
    align_split: int = 0
    """Block size of the scheduler's block-aligned prefill split (Mamba align mode), or 0."""


def _config(specs: Any, config: Any, dtype: Any, num_blocks: int, layout: Layout = FULL) -> Any:
    if layout == FULL:
        spec = specs.FullAttentionSpec(BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=dtype)
        return config.KVCacheConfig(num_blocks, [], [config.KVCacheGroupSpec(["attn"], spec)])
    groups = []
    for i, g in enumerate(layout.groups):
        common = {"num_kv_heads": 8, "head_size": 128, "dtype": dtype}
        s: Any
        if g.kind == "full":
            s = specs.FullAttentionSpec(g.block_size, **common)
        elif g.kind == "swa":
            s = specs.SlidingWindowSpec(g.block_size, sliding_window=g.window, **common)
        elif g.kind == "chunked":
            s = specs.ChunkedLocalAttentionSpec(
                g.block_size, attention_chunk_size=g.window, **common
            )
        elif g.kind == "mamba":
            s = specs.MambaSpec(
                g.block_size,
                shapes=((3, 8192), (64, 64, 128)),
                dtypes=(dtype, dtype),
                mamba_cache_mode=g.mamba_mode,
            )
        else:
            raise ValueError(g.kind)
        groups.append(config.KVCacheGroupSpec([f"layer{i}"], s))
    return config.KVCacheConfig(num_blocks, [], groups)


def reference_impl(size: Size, layout: Layout = FULL) -> Impl:
    """The reference manager with sha256_cbor hashing (no retention: plain LRU whatever the
    requests ask), for the KV cache configuration ``layout``."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    fn = get_hash_fn_by_name(HASH_FN)
    init_none_hash(fn)
    hasher = get_request_block_hasher(layout.hash_block_size, fn)
    mgr = KVCacheManager(
        _config(kvi, kvi, torch.float16, size.num_blocks, layout),
        max_model_len=size.max_model_len,
        scheduler_block_size=layout.scheduler_block_size,
        hash_block_size=layout.hash_block_size,
        max_num_batched_tokens=size.max_num_batched_tokens,
    )
    params = SamplingParams(max_tokens=256)

    def make(rid: str, prompt: list[int], conv: Conversation, turn: int) -> Any:
        return Request(rid, prompt, params, None, block_hasher=hasher)

    return Impl(
        "reference",
        mgr,
        make,
        RequestStatus,
        "reference",
        align_split=layout.scheduler_block_size if layout.mamba_align else 0,
    )


def kvcore_impl(
    size: Size,
    batch: bool = False,
    *,
    name: str | None = None,
    clock: Clock | None = None,
    retention_of: RetentionOf | None = None,
    pins: list[list[int]] | None = None,
    layout: Layout = FULL,
) -> Impl:
    """kvcore's manager for the KV cache configuration ``layout``; hashing by
    ``kvcore.hashing`` or, where it is missing, the
    reference's. ``clock`` is the manager's (``clock=``, with ``hash_fn=`` for the pins),
    ``retention_of`` gives each request its ``retention_priority`` / ``retention_ttl_s``,
    ``pins`` are pinned every :data:`PIN_EVERY` steps; without them the manager and its
    requests are the plain ones (any kvcore, the one before cache control included).
    ``name`` defaults to ``kvcore`` / ``kvcore-batch``."""
    from kvcore import config as kconfig
    from kvcore import specs as kspecs
    from kvcore.manager import KVCacheManager
    from kvcore.request import Request, RequestStatus, append_output_token_ids_batch

    fn: Any
    try:
        from kvcore import hashing

        fn = hashing.get_hash_fn_by_name(HASH_FN)
        hashing.init_none_hash(fn)
        hasher: Any = hashing.get_request_block_hasher(layout.hash_block_size, fn)
        origin = "kvcore"
    except ImportError:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name(HASH_FN)
        init_none_hash(fn)
        hasher = get_request_block_hasher(layout.hash_block_size, fn)
        origin = "reference (kvcore.hashing unavailable)"
    extra: dict[str, Any] = {} if clock is None else {"hash_fn": fn, "clock": clock}
    mgr = KVCacheManager(
        _config(kspecs, kconfig, "float16", size.num_blocks, layout),
        max_model_len=size.max_model_len,
        scheduler_block_size=layout.scheduler_block_size,
        hash_block_size=layout.hash_block_size,
        max_num_batched_tokens=size.max_num_batched_tokens,
        **extra,
    )
    if retention_of is not None:
        ask = retention_of

        def make(rid: str, prompt: list[int], conv: Conversation, turn: int) -> Any:
            p, t = ask(conv, turn)
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

    return Impl(
        name or ("kvcore-batch" if batch else "kvcore"),
        mgr,
        make,
        RequestStatus,
        origin,
        batch=batch,
        append_batch=append_output_token_ids_batch if batch else None,
        clock=clock,
        pins=list(pins or []),
        align_split=layout.scheduler_block_size if layout.mamba_align else 0,
    )


# --------------------------------------------------------------------------------------------
# Scheduler loop
# --------------------------------------------------------------------------------------------


def _token_seed(request_id: str) -> int:
    """Seed of a request's generated tokens: ``1 + (seed + k * 40503) % (VOCAB - 1)``.

    A closed form rather than a ``random.Random`` per request: thousands of generator states
    (2.5 KiB each) would evict the managers' own state between the timed calls.
    """
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")


def _aligned_split(bs: int, r: Any, n: int, computed: int, uncached_prefix: int = 0) -> int:
    """The reference scheduler's block-aligned prefill split for Mamba align mode
    (``Scheduler._mamba_block_aligned_split``, no EAGLE): ``n`` tokens after ``computed``,
    cut to a multiple of the scheduler block ``bs``, or to the last block boundary of the
    request, or (Marconi admission) to the ``uncached_prefix`` a lookup reported; 0 when
    nothing aligned fits (the request waits)."""
    if computed < max(r.num_prompt_tokens, r.num_tokens - 1):
        last = r.num_tokens - r.num_tokens % bs
        after = computed + n
        if after < last:
            n = n // bs * bs
        elif computed < last < after:
            n = last - computed
        if uncached_prefix >= bs and n > uncached_prefix:
            n = uncached_prefix // bs * bs
    return n


@dataclass
class _Live:
    conv: Conversation
    turn: int
    req: Any
    seed: int
    out: int = 0


@dataclass
class RunResult:
    """What one run measured."""

    step_us: list[float] = field(default_factory=list)
    checksum: str = ""
    steps: int = 0
    preemptions: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    wall_s: float = 0.0
    pin_calls: int = 0
    max_pinned: int = 0


def simulate_steps(
    impl: Impl,
    size: Size,
    convs: list[Conversation],
    res: RunResult,
    max_steps: int | None = None,
) -> Iterator[None]:
    """Runs the workload on ``impl`` into ``res`` (at most ``max_steps`` steps), yielding after
    every scheduler step.

    Only the KV-manager work is timed (pins included). The caller handles the garbage
    collector. With ``impl.align_split`` (Mamba align mode) prefill chunks are split at
    block boundaries as the reference's scheduler splits them: a running request left
    with nothing aligned to compute is skipped this step, a waiting one stops admission.
    """
    mgr = impl.manager
    align = impl.align_split
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
    t_wall = time.perf_counter()
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
                    if align:
                        n = _aligned_split(align, r, n, r.num_computed_tokens)
                        if n <= 0:
                            break  # skipped: the batch ends before it
                    reqs.append(r)
                    ns.append(n)
                    left -= n
                if not reqs:  # running[i] has nothing aligned to compute: skip it
                    i += 1
                    continue
                t0 = clock()
                got = mgr.allocate_slots_batch(reqs, ns, allow_none=True)
                spent += clock() - t0
            else:
                r = running[i].req
                ns = [min(r.num_tokens - r.num_computed_tokens, budget)]
                if align:
                    ns[0] = _aligned_split(align, r, ns[0], r.num_computed_tokens)
                    if ns[0] <= 0:
                        i += 1
                        continue
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
            # running[i] did not fit: preempt the last running request, then retry.
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
            if align:
                uncached = getattr(mgr.coordinator, "num_uncached_common_prefix_tokens", 0)
                n = _aligned_split(align, r, n, hits, uncached)
                digest.update(f"u{uncached}".encode())
                if n <= 0:
                    break
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
    res.wall_s = time.perf_counter() - t_wall
    digest.update(f"{mgr.block_pool.get_num_free_blocks()}".encode())
    res.checksum = digest.hexdigest()


def run_lockstep(
    impls: list[Impl],
    size: Size,
    convs: list[Conversation],
    chunk: int = 25,
    max_steps: int | None = None,
) -> list[RunResult]:
    """Runs the implementations on the same workload, ``chunk`` scheduler steps each in turn
    (each at most ``max_steps`` steps), with the garbage collector off.

    The machine's speed drifts over seconds (the reference's time per step moved by 60%
    between separate runs); taking turns every few steps makes every implementation see the
    same drift, so the ratios are stable, while each still runs mostly on its own warm caches
    (taking turns every step would hand each one the caches the previous one left). Each
    ``wall_s`` then spans the whole run.
    """
    results = [RunResult() for _ in impls]
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


def step_stats(us: list[float]) -> tuple[float, float]:
    """Mean and p99 of microseconds per step."""
    s = sorted(us)
    return sum(s) / len(s), s[min(len(s) - 1, int(0.99 * len(s)))]


def size_fields(size: Size, scale: float) -> dict[str, Any]:
    """The fields of a results row that say which size ran (and at what scale)."""
    return {
        "requests": size.num_requests,
        "num_blocks": size.num_blocks,
        "max_num_seqs": size.max_num_seqs,
        "max_num_batched_tokens": size.max_num_batched_tokens,
        "scale": scale,
    }


def merge_results(path: Path, size: Size, row: dict[str, Any], **top: Any) -> None:
    """Writes ``row`` as ``sizes[size.name]`` of the JSON file ``path`` (keeping the other
    sizes' rows, an unreadable file starts over), and the ``top`` keys beside it."""
    data: dict[str, Any] = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except ValueError:
            data = {}
    data.setdefault("sizes", {})[size.name] = row
    data.update(top)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
