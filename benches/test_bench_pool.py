"""Benchmarks of ``kvcore.BlockPool`` against the reference ``BlockPool``, per block.

Every case runs on both sides in the same session and the ratio table (reference time /
kvcore time, see ``conftest.py``) is printed at the end and written to
``benches/results/pool.json``. Targets (from the issue): at least 20x faster per block on pool
operations, at least 50x on construction, and at most 1/5 of the reference's memory per block.

Memory per block is the resident-set growth (``/proc/self/statm``) across the construction, in a
fresh subprocess per side, so the Rust allocations count (``tracemalloc`` sees none of them);
the reference's ``tracemalloc`` figure is recorded as a cross-check.

Run on a release build: ``maturin develop --release`` then
``python -m pytest benches/test_bench_pool.py --benchmark-only``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest

import kvcore

IMPLS = ["kvcore", "reference"]
POOL_OPS_TARGET = 20.0
CONSTRUCTION_TARGET = 50.0
MEMORY_TARGET = 5.0
HBS = 16


def _reference_cls() -> Any:
    mod = pytest.importorskip("vllm.v1.core.block_pool")
    return mod.BlockPool


class Req:
    """The request fields the pool reads (SPEC §17)."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.all_token_ids = list(range(seed, seed + num_blocks * HBS))
        self.block_hashes = [
            (seed * 1_000_003 + i).to_bytes(8, "big") * 4 for i in range(num_blocks)
        ]
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = None
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict[Any, bytes] = {}


class Side:
    """One pool with the same int-id API whichever side it is."""

    def __init__(self, impl: str, num_blocks: int, events: bool = False) -> None:
        self.impl = impl
        if impl == "kvcore":
            self.pool: Any = kvcore.BlockPool(num_blocks, True, HBS, events)
            self.wrap: Callable[[list[int]], Any] = lambda ids: ids
            self.ids: Callable[[Any], list[int]] = lambda blocks: blocks
        else:
            self.pool = _reference_cls()(num_blocks, True, HBS, events)
            blocks = self.pool.blocks
            self.wrap = lambda ids: [blocks[i] for i in ids]
            self.ids = lambda bs: [b.block_id for b in bs]

    def allocate(self, n: int) -> list[int]:
        return self.ids(self.pool.get_new_blocks(n))

    def cache(self, req: Req, ids: list[int]) -> None:
        self.pool.cache_full_blocks(req, self.wrap(ids), 0, len(ids), HBS, 0)


@pytest.mark.parametrize("n", [1, 16, 256])
@pytest.mark.parametrize("impl", IMPLS)
def test_get_new_blocks_and_free(paired: Callable[..., Any], impl: str, n: int) -> None:
    side = Side(impl, 4096)
    pool = side.pool

    def op() -> None:
        pool.free_blocks(pool.get_new_blocks(n))

    paired(f"get_new_blocks+free_blocks {n}", impl, op, per=n, target=POOL_OPS_TARGET)


@pytest.mark.parametrize("n", [1, 256])
@pytest.mark.parametrize("impl", IMPLS)
def test_touch_cached_blocks(paired: Callable[..., Any], impl: str, n: int) -> None:
    """Touching prefix hits: cached blocks in the free queue (POOL-9)."""
    side = Side(impl, 4096)
    ids = side.allocate(n)
    side.cache(Req(n), ids)
    side.pool.free_blocks(side.wrap(ids[::-1]))
    blocks = side.wrap(ids)
    pool = side.pool
    touched = [False]

    def setup() -> None:
        if touched[0]:
            pool.free_blocks(blocks[::-1])
        touched[0] = True

    paired(
        f"touch {n} (cached, free)",
        impl,
        lambda: pool.touch(blocks),
        per=n,
        target=POOL_OPS_TARGET,
        setup=setup,
        rounds=2000,
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_cache_full_blocks(paired: Callable[..., Any], impl: str) -> None:
    n = 256
    side = Side(impl, 4096)
    ids = side.allocate(n)
    req = Req(n)
    pool = side.pool
    blocks = side.wrap(ids)
    evict = ids if impl == "kvcore" else set(ids)
    cached = [False]

    def setup() -> None:
        if cached[0]:
            pool.evict_blocks(evict)
        cached[0] = True

    paired(
        f"cache_full_blocks {n}",
        impl,
        lambda: pool.cache_full_blocks(req, blocks, 0, n, HBS, 0),
        per=n,
        target=POOL_OPS_TARGET,
        setup=setup,
        rounds=500,
    )


def _cached_side(impl: str, n: int) -> tuple[Side, Req]:
    side = Side(impl, 4096)
    req = Req(n)
    ids = side.allocate(n)
    side.cache(req, ids)
    return side, req


@pytest.mark.parametrize("impl", IMPLS)
def test_get_cached_block(paired: Callable[..., Any], impl: str) -> None:
    side, req = _cached_side(impl, 256)
    pool, h = side.pool, req.block_hashes[128]
    paired(
        "get_cached_block 1 hit",
        impl,
        lambda: pool.get_cached_block(h, [0]),
        per=1,
        unit="lookup",
        target=POOL_OPS_TARGET,
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_longest_prefix_batch_vs_loop(paired: Callable[..., Any], impl: str) -> None:
    """kvcore's one-call ``longest_cached_prefix`` vs the reference's per-hash loop."""
    side, req = _cached_side(impl, 256)
    pool, hashes = side.pool, req.block_hashes
    if impl == "kvcore":

        def op() -> Any:
            return pool.longest_cached_prefix(hashes, len(hashes), [0])
    else:

        def op() -> Any:
            out = []
            for h in hashes:
                hit = pool.get_cached_block(h, [0])
                if hit is None:
                    break
                out.append(hit[0])
            return out

    paired(
        "prefix lookup 256 (batch vs loop)",
        impl,
        op,
        per=256,
        unit="lookup",
        target=POOL_OPS_TARGET,
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_get_cached_block_loop(paired: Callable[..., Any], impl: str) -> None:
    """The same 256-hash walk with one ``get_cached_block`` call per hash on both sides."""
    side, req = _cached_side(impl, 256)
    pool, hashes = side.pool, req.block_hashes

    def op() -> None:
        for h in hashes:
            pool.get_cached_block(h, [0])

    paired("get_cached_block loop 256", impl, op, per=256, unit="lookup")


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys
    impl, sizes = sys.argv[1], [int(x) for x in sys.argv[2:]]
    page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    if impl == "kvcore":
        from kvcore import BlockPool
    else:
        from vllm.v1.core.block_pool import BlockPool
    out = {}
    keep = []
    for n in sizes:
        gc.collect()
        before = rss()
        pool = BlockPool(n, True, 16, False)
        out[f"rss:{n}"] = (rss() - before) / n
        # Touch and free every block once so that lazily committed (zeroed) pages count too.
        if impl == "kvcore":
            pool.touch(range(1, n))
            pool.free_blocks(range(n - 1, 0, -1))
        else:
            pool.touch(pool.blocks[1:])
            pool.free_blocks(pool.blocks[:0:-1])
        gc.collect()
        out[f"rss_used:{n}"] = (rss() - before) / n
        keep.append(pool)
    if impl == "reference":
        import tracemalloc
        keep.clear()
        gc.collect()
        for n in sizes:
            tracemalloc.start()
            pool = BlockPool(n, True, 16, False)
            out[f"tracemalloc:{n}"] = tracemalloc.get_traced_memory()[0] / n
            tracemalloc.stop()
            del pool
            gc.collect()
    print("RESULT " + json.dumps(out))
    """
)

SIZES = [131072, 1048576]


@cache
def _memory(impl: str) -> dict[str, float]:
    if impl == "reference":
        _reference_cls()
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, impl, *map(str, SIZES)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=True,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, float] = json.loads(line.removeprefix("RESULT "))
    return result


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("impl", IMPLS)
def test_construction(
    paired: Callable[..., Any], record_metric: Callable[..., None], impl: str, n: int
) -> None:
    cls = kvcore.BlockPool if impl == "kvcore" else _reference_cls()
    rounds = None if impl == "kvcore" else (3 if n < 1_000_000 else 2)
    paired(
        f"construction {n}",
        impl,
        lambda: cls(n, True, HBS, False),
        per=n,
        target=CONSTRUCTION_TARGET,
        rounds=rounds,
    )
    mem = _memory(impl)
    record_metric(f"memory {n} (RSS)", impl, mem[f"rss:{n}"], "B/block", target=MEMORY_TARGET)
    record_metric(
        f"memory {n} (RSS, every block used once)",
        impl,
        mem[f"rss_used:{n}"],
        "B/block",
        target=MEMORY_TARGET,
    )
    if impl == "reference":
        record_metric(f"memory {n} (ref tracemalloc)", impl, mem[f"tracemalloc:{n}"], "B/block")
