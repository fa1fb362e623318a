"""Scheduler-loop benchmark: kvcore's ``KVCacheManager`` against the reference's.

Both managers run the same seeded, chat-like workload through a minimal scheduler loop:

- long system prompts shared by most conversations, plus conversations with unique prompts;
- multi-turn conversations whose next prompt extends the previous one, generated tokens
  included (the generated tokens are a deterministic function of the request, so both runs see
  the same tokens as long as their decisions agree);
- enough concurrent load to fill the pool and preempt (last-admitted request first);
- chunked prefill under a per-step token budget, decode one token per step.

Only KV-manager work is timed: request construction (which hashes the prompt), appending
output tokens (which hashes new full blocks), ``get_computed_blocks``, ``allocate_slots`` with
``get_block_ids()`` of its result (``get_block_ids(allow_none=True)`` for running requests, as
the reference's scheduler calls it), ``free``, ``new_step_starts`` and ``take_new_block_ids``.
The benchmark reports mean and p99 microseconds per scheduler step for each implementation,
their ratio, and a checksum over every decision and block id, which must be equal.

kvcore runs twice: ``kvcore`` with the reference's per-request calls, and ``kvcore-batch``,
whose scheduler allocates each step's running requests with one ``allocate_slots_batch`` call
(preempting and calling again from the request that did not fit: the same decisions, which the
checksum proves) and appends the step's sampled tokens with one
``append_output_token_ids_batch`` call. Admissions and frees are per request in both.

The three run in lockstep, 25 scheduler steps each in turn (``run_lockstep``): this machine's
speed drifts by tens of percent over seconds, and taking turns makes every implementation see
the same drift.

Sizes (one full-attention group, block size 16, sha256_cbor, prefix caching on, events off):

- 2000 requests / 8192 blocks: 128 sequences, 4096 tokens per step, 30% unique prompts;
- 10000 requests / 131072 blocks: 4096 sequences, 32768 tokens per step, 70% unique prompts of
  up to 4000 tokens and outputs of up to 500 tokens, so that the large pool fills and preempts.

``KVCORE_BENCH_SCALE`` (default 1.0) shrinks the request count, the pool and the sequence cap
for quick runs.  Results are printed as a table and merged into
``benches/results/manager.json``.  Use a release build (``maturin develop --release``).
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager")

pytestmark = pytest.mark.reference

SCALE = float(os.environ.get("KVCORE_BENCH_SCALE", "1.0"))
RESULTS = Path(__file__).parent / "results" / "manager.json"
BLOCK_SIZE = 16
HASH_FN = "sha256_cbor"
VOCAB = 32000


@dataclass(frozen=True)
class Size:
    """One benchmark size."""

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
        """The size with requests and blocks multiplied by ``scale``."""
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
    """A conversation: an optional shared system prompt and its turns."""

    cid: int
    system: list[int]
    turns: list[Turn]
    arrival: int
    think: list[int]


def make_workload(size: Size, seed: int = 0) -> list[Conversation]:
    """Conversations totalling ``size.num_requests`` turns, arriving faster than served."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(512, 2048))] for _ in range(8)]
    convs: list[Conversation] = []
    total = 0
    while total < size.num_requests:
        n = min(rng.randrange(1, 7), size.num_requests - total)
        if rng.random() >= size.unique_frac:
            system = systems[min(int(rng.expovariate(0.6)), len(systems) - 1)]
        else:
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
                turns,
                arrival=1 + len(convs) // size.arrivals_per_step,
                think=think,
            )
        )
        total += n
    return convs


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------


@dataclass
class Impl:
    """One implementation: its manager, a request factory and its status enum."""

    name: str
    manager: Any
    make_request: Callable[[str, list[int]], Any]
    status: Any
    hasher: str
    batch: bool = False
    """Whether running requests are allocated with ``allocate_slots_batch``."""
    append_batch: Callable[[list[Any], list[int]], None] | None = None
    """Appends one sampled token to each request in one call, or None (one call each)."""


def _config(specs: Any, config: Any, dtype: Any, num_blocks: int) -> Any:
    spec = specs.FullAttentionSpec(BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=dtype)
    return config.KVCacheConfig(num_blocks, [], [config.KVCacheGroupSpec(["attn"], spec)])


def reference_impl(size: Size) -> Impl:
    """The reference manager with sha256_cbor hashing."""
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

    def make(rid: str, prompt: list[int]) -> Any:
        return Request(rid, prompt, params, None, block_hasher=hasher)

    return Impl("reference", mgr, make, RequestStatus, "reference")


def kvcore_impl(size: Size, batch: bool = False) -> Impl:
    """kvcore's manager; hashing by ``kvcore.hashing`` or, until it lands, the reference's."""
    from kvcore import config as kconfig
    from kvcore import specs as kspecs
    from kvcore.manager import KVCacheManager
    from kvcore.request import Request, RequestStatus

    try:
        from kvcore import hashing

        fn = hashing.get_hash_fn_by_name(HASH_FN)
        hashing.init_none_hash(fn)
        hasher: Any = hashing.get_request_block_hasher(BLOCK_SIZE, fn)
        origin = "kvcore"
    except ImportError:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        rfn = get_hash_fn_by_name(HASH_FN)
        init_none_hash(rfn)
        hasher = get_request_block_hasher(BLOCK_SIZE, rfn)
        origin = "reference (kvcore.hashing unavailable)"
    mgr = KVCacheManager(
        _config(kspecs, kconfig, "float16", size.num_blocks),
        max_model_len=size.max_model_len,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        max_num_batched_tokens=size.max_num_batched_tokens,
    )

    def make(rid: str, prompt: list[int]) -> Any:
        return Request(rid, prompt, max_tokens=256, block_hasher=hasher)

    from kvcore.request import append_output_token_ids_batch

    name = "kvcore-batch" if batch else "kvcore"
    appender = append_output_token_ids_batch if batch else None
    return Impl(name, mgr, make, RequestStatus, origin, batch, appender)


# --------------------------------------------------------------------------------------------
# Scheduler loop
# --------------------------------------------------------------------------------------------


def _token_seed(request_id: str) -> int:
    """Seed of a request's generated tokens: ``1 + (seed + k * 40503) % (VOCAB - 1)``.

    A closed form rather than a ``random.Random`` per request: thousands of generator states
    (2.5 KiB each) would evict the managers' own state between the timed calls.
    """
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")


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


def simulate_steps(
    impl: Impl, size: Size, convs: list[Conversation], res: RunResult
) -> Iterator[None]:
    """Runs the workload on ``impl`` into ``res``, yielding after every scheduler step.

    Only the KV-manager work is timed. The caller handles the garbage collector.
    """
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
    t_wall = time.perf_counter()
    while pending:
        step += 1
        spent = 0
        for conv, k in arrivals.pop(step, ()):
            prompt = history.get(conv.cid, conv.system) + conv.turns[k].user
            rid = f"c{conv.cid}t{k}"
            t0 = clock()
            req = impl.make_request(rid, prompt)
            spent += clock() - t0
            res.requests += 1
            res.prompt_tokens += len(prompt)
            waiting.append(_Live(conv, k, req, _token_seed(rid)))

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
    impls: list[Impl], size: Size, convs: list[Conversation], chunk: int = 25
) -> list[RunResult]:
    """Runs the implementations on the same workload, ``chunk`` scheduler steps each in turn.

    The machine's speed drifts over seconds (the reference's time per step moved by 60%
    between separate runs); taking turns every few steps makes every implementation see the
    same drift, so the ratios are stable, while each still runs mostly on its own warm caches
    (taking turns every step would hand each one the caches the previous one left). Each
    ``wall_s`` then spans the whole run.
    """
    results = [RunResult() for _ in impls]
    live = [simulate_steps(i, size, convs, r) for i, r in zip(impls, results, strict=True)]
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


def simulate(impl: Impl, size: Size, convs: list[Conversation]) -> RunResult:
    """Runs the workload on ``impl`` alone."""
    return run_lockstep([impl], size, convs)[0]


def _stats(us: list[float]) -> tuple[float, float]:
    s = sorted(us)
    p99 = s[min(len(s) - 1, int(0.99 * len(s)))]
    return sum(s) / len(s), p99


def _record(
    size: Size, ref: RunResult, kv: RunResult, kvb: RunResult, hasher: str
) -> dict[str, Any]:
    rm, rp = _stats(ref.step_us)
    km, kp = _stats(kv.step_us)
    bm, bp = _stats(kvb.step_us)
    row = {
        "requests": size.num_requests,
        "num_blocks": size.num_blocks,
        "max_num_seqs": size.max_num_seqs,
        "max_num_batched_tokens": size.max_num_batched_tokens,
        "scale": SCALE,
        "steps": ref.steps,
        "preemptions": ref.preemptions,
        "prompt_tokens": ref.prompt_tokens,
        "prefix_hit_tokens": ref.hit_tokens,
        "reference_mean_us": round(rm, 2),
        "reference_p99_us": round(rp, 2),
        "kvcore_mean_us": round(km, 2),
        "kvcore_p99_us": round(kp, 2),
        "kvcore_batch_mean_us": round(bm, 2),
        "kvcore_batch_p99_us": round(bp, 2),
        "speedup_mean": round(rm / km, 3) if km else None,
        "speedup_p99": round(rp / kp, 3) if kp else None,
        "speedup_batch_mean": round(rm / bm, 3) if bm else None,
        "speedup_batch_p99": round(rp / bp, 3) if bp else None,
        "reference_total_s": round(sum(ref.step_us) / 1e6, 3),
        "kvcore_total_s": round(sum(kv.step_us) / 1e6, 3),
        "kvcore_batch_total_s": round(sum(kvb.step_us) / 1e6, 3),
        "checksum": kv.checksum,
        "checksums_match": ref.checksum == kv.checksum == kvb.checksum,
        "kvcore_hasher": hasher,
    }
    data: dict[str, Any] = {}
    if RESULTS.exists():
        try:
            data = json.loads(RESULTS.read_text())
        except ValueError:
            data = {}
    data.setdefault("sizes", {})[size.name] = row
    data["block_size"] = BLOCK_SIZE
    data["hash_fn"] = HASH_FN
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return row


def _table(name: str, row: dict[str, Any]) -> str:
    lines = [
        f"\n{name}: {row['requests']} requests, {row['num_blocks']} blocks, {row['steps']} "
        f"steps, {row['preemptions']} preemptions, {row['prefix_hit_tokens']}/"
        f"{row['prompt_tokens']} prompt tokens hit",
        f"  {'impl':13s} {'mean us/step':>14s} {'p99 us/step':>14s} {'total s':>9s} "
        f"{'ratio mean':>11s} {'ratio p99':>10s}",
    ]
    for label, key, ratio in (
        ("reference", "reference", None),
        ("kvcore", "kvcore", "speedup"),
        ("kvcore-batch", "kvcore_batch", "speedup_batch"),
    ):
        tail = f" {row[ratio + '_mean']:10.2f}x {row[ratio + '_p99']:9.2f}x" if ratio else ""
        lines.append(
            f"  {label:13s} {row[key + '_mean_us']:14.1f} {row[key + '_p99_us']:14.1f} "
            f"{row[key + '_total_s']:9.2f}{tail}"
        )
    lines.append(
        f"  checksums match: {row['checksums_match']} ({row['checksum']}); "
        f"kvcore hasher: {row['kvcore_hasher']}"
    )
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("size", [s.scaled(SCALE) for s in SIZES], ids=lambda s: s.name)
def test_bench_manager(
    size: Size,
    benchmark: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same workload on both managers: equal decisions, and the per-step cost of each."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # both NONE_HASHes from the same seed
    convs = make_workload(size)
    impls = [reference_impl(size), kvcore_impl(size), kvcore_impl(size, batch=True)]
    holder: list[list[RunResult]] = []
    benchmark.pedantic(
        lambda: holder.append(run_lockstep(impls, size, convs)), rounds=1, iterations=1
    )
    ref, kv, kvb = holder[0]
    row = _record(size, ref, kv, kvb, impls[1].hasher)
    benchmark.extra_info.update(row)
    with capsys.disabled():
        print(_table(size.name, row))
    assert kv.steps == ref.steps == kvb.steps
    assert kv.checksum == ref.checksum, "kvcore and the reference made different decisions"
    assert kvb.checksum == ref.checksum, "allocate_slots_batch changed a decision"
