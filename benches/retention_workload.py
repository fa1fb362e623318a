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
- the scheduler loop of ``test_bench_manager.py`` (``scheduler_loop.py``: same chat
  workload, same decisions) on a ``KVCacheManager``; with retention on, requests carry
  ``retention_priority`` / ``retention_ttl_s`` (:func:`retention_of`), the manager has
  ``clock=`` a fake clock advanced ``scheduler_loop.STEP_S`` per step, and the two most used
  system prompts are pinned (``pin_prefix`` with a time to live) every
  ``scheduler_loop.PIN_EVERY`` steps.

Run as a script, one workload for ``iters`` iterations (pool cycles, or at most that many
scheduler steps; 0 runs the setup only) and print what it did as JSON:
``python benches/retention_workload.py pool-off/churn_16 1000``.
``compare_instructions.py`` runs it under callgrind.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import scheduler_loop as loop

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
# Scheduler loop (scheduler_loop.py's, with retention)
# --------------------------------------------------------------------------------------------

NUM_PINNED_SYSTEMS = 2
LOOP_SIZE = loop.SIZES[0]
SMALL_LOOP_SIZE = loop.Size(
    "200req-1024blk", 200, 1024, max_num_seqs=24, max_num_batched_tokens=2048
)
"""The size ``compare_instructions.py`` runs under callgrind."""


def retention_of(conv: loop.Conversation, turn: int) -> tuple[int | None, float | None]:
    """The retention a request asks for: keep a conversation's history until its next turn
    (a time to live a little over the think time), drop finished unique prompts first, and
    leave every seventh conversation at the default."""
    if conv.cid % 7 == 0:
        return None, None
    last = turn == len(conv.turns) - 1
    if conv.system_id >= 0:
        return (60, 1.0) if last else (80, 3.0)
    return (10, None) if last else (70, 2.0)


def kvcore_loop_impl(
    size: loop.Size, retention: bool, batch: bool, systems: list[list[int]] | None = None
) -> loop.Impl:
    """kvcore's manager, named ``kvcore-{off,on}[-batch]``; with ``retention`` the requests ask
    :func:`retention_of`, the manager's clock is a :class:`FakeClock` (moved
    ``loop.STEP_S`` per step) and the first :data:`NUM_PINNED_SYSTEMS` of ``systems`` are
    pinned every ``loop.PIN_EVERY`` steps."""
    name = "kvcore" + ("-on" if retention else "-off") + ("-batch" if batch else "")
    if not retention:
        return loop.kvcore_impl(size, batch, name=name)
    return loop.kvcore_impl(
        size,
        batch,
        name=name,
        clock=FakeClock(),
        retention_of=retention_of,
        pins=(systems or [])[:NUM_PINNED_SYSTEMS],
    )


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
    convs, systems = loop.make_workload(SMALL_LOOP_SIZE)
    impl = kvcore_loop_impl(SMALL_LOOP_SIZE, mode.startswith("on"), mode.endswith("batch"), systems)
    res = loop.run_lockstep([impl], SMALL_LOOP_SIZE, convs, max_steps=iters)[0]
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
