"""``kvcore bench``: a few timings of kvcore against the reference, in well under a minute.

Three kinds of measurement, each run on kvcore and, when it is importable, on the reference:

* pool operations (the block pool alone): allocate and free 64 blocks; allocate 64 blocks,
  cache them under a request's hashes, look every hash up and free them (evicting the blocks
  cached by an earlier round);
* hashing: building a request of 2,048 prompt tokens, which hashes its 128 full blocks, with
  ``sha256`` and ``sha256_cbor``;
* one replay: the synthetic chat workload through the manager (manager µs per step).

Each figure is the best of several rounds, in microseconds per operation.
"""

from __future__ import annotations

import gc
import importlib
import random
import time
from collections.abc import Callable
from typing import Any

from kvcore.simulate.backends import (
    REFERENCE_INSTALL,
    Backend,
    BackendUnavailable,
    ManagerSettings,
    make_backend,
    model_preset,
)
from kvcore.simulate.scheduler import SchedulerSettings, Simulator
from kvcore.simulate.workload import ChatWorkloadParams, synthetic_chat

_BS = 16


def _best_us(fn: Callable[[], None], number: int, rounds: int) -> float:
    """Best mean time of ``number`` calls over ``rounds`` rounds, in microseconds."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / number / 1e3)
    return best


def _pool_ops(name: str, backend: Backend, number: int, rounds: int) -> dict[str, float]:
    """Times the pool operations of one backend."""
    settings = ManagerSettings(num_blocks=1024, max_model_len=4096, max_num_batched_tokens=2048)
    manager = backend.build_manager(model_preset("full", _BS), settings)
    pool: Any
    if name == "kvcore":
        pool = importlib.import_module("kvcore._native").BlockPool(1024, True, _BS)
    else:
        ref_pool = importlib.import_module("vllm.v1.core.block_pool")
        pool = ref_pool.BlockPool(1024, True, _BS)
    del manager  # built only to initialise hashing (NONE_HASH, hasher) for the request below
    rng = random.Random(0)
    req = backend.request_factory("bench", [rng.randrange(32000) for _ in range(64 * _BS)], 1)()
    n = 64

    def alloc_free() -> None:
        blocks = pool.get_new_blocks(n)
        pool.free_blocks(blocks)

    def cache_cycle() -> None:
        blocks = pool.get_new_blocks(n)
        pool.cache_full_blocks(req, blocks, 0, n, _BS, 0)
        for h in req.block_hashes:
            pool.get_cached_block(h, [0])
        pool.free_blocks(reversed(blocks))

    return {
        "pool: allocate + free 64 blocks": _best_us(alloc_free, number, rounds),
        "pool: allocate, cache, look up, free 64 blocks": _best_us(cache_cycle, number, rounds),
    }


def _hashing(backend: Backend, number: int, rounds: int) -> dict[str, float]:
    """Times request construction (hashing 128 full blocks) with two hash functions."""
    rng = random.Random(1)
    prompt = [rng.randrange(32000) for _ in range(2048)]
    out: dict[str, float] = {}
    for fn in ("sha256", "sha256_cbor"):
        settings = ManagerSettings(
            num_blocks=256, max_model_len=4096, max_num_batched_tokens=2048, hash_name=fn
        )
        backend.build_manager(model_preset("full", _BS), settings)

        def build(fn_name: str = fn) -> None:
            backend.request_factory(f"h-{fn_name}", prompt, 1)()

        out[f"hashing: request of 2048 tokens, {fn}"] = _best_us(build, number, rounds)
    return out


def _replay(backend: Backend, requests: int) -> tuple[dict[str, float], str]:
    """One replay of the synthetic workload; returns µs per step and the checksum."""
    workload = synthetic_chat(ChatWorkloadParams(num_requests=requests, seed=0))
    settings = ManagerSettings(num_blocks=2000, max_model_len=8192, max_num_batched_tokens=2048)
    sim = Simulator(backend, model_preset("full", _BS), settings, SchedulerSettings(), workload)
    stats = sim.run()
    mean = sum(stats.kv_ns) / len(stats.kv_ns) / 1e3 if stats.kv_ns else 0.0
    return {f"replay: {requests} chat requests, µs per step": mean}, sim.decisions_checksum


def run_bench(quick: bool = False) -> dict[str, Any]:
    """Runs every measurement.

    Args:
        quick: Fewer repetitions and a smaller replay.

    Returns:
        ``{"results": [{"name", "kvcore_us", "reference_us", "ratio"}...],
        "reference": bool, "replay_decisions_match": bool | None}``; ``reference_us`` and
        ``ratio`` (reference over kvcore) are None without the reference.
    """
    number, rounds, requests = (20, 3, 60) if quick else (100, 5, 150)
    figures: dict[str, dict[str, float]] = {}
    checksums: dict[str, str] = {}
    names = ["kvcore"]
    try:
        make_backend("reference")
        names.append("reference")
    except BackendUnavailable:
        pass
    gc.collect()
    gc.freeze()  # as a serving engine does after start-up: imports are not rescanned
    try:
        for name in names:
            backend = make_backend(name)
            figs: dict[str, float] = {}
            figs.update(_pool_ops(name, backend, number, rounds))
            figs.update(_hashing(backend, max(1, number // 4), rounds))
            replay, checksums[name] = _replay(backend, requests)
            figs.update(replay)
            figures[name] = figs
    finally:
        gc.unfreeze()
    results = []
    for key, ours in figures["kvcore"].items():
        theirs = figures.get("reference", {}).get(key)
        results.append(
            {
                "name": key,
                "kvcore_us": ours,
                "reference_us": theirs,
                "ratio": theirs / ours if theirs is not None and ours > 0 else None,
            }
        )
    match = checksums["kvcore"] == checksums["reference"] if "reference" in checksums else None
    return {
        "results": results,
        "reference": "reference" in figures,
        "replay_decisions_match": match,
    }


def format_bench(report: dict[str, Any]) -> str:
    """Renders :func:`run_bench`'s result as a table."""
    rows = report["results"]
    width = max(len(r["name"]) for r in rows) + 2
    lines = [f"{'benchmark':<{width}}{'kvcore µs':>12}{'reference µs':>14}{'ratio':>9}"]
    for r in rows:
        ref = "n/a" if r["reference_us"] is None else f"{r['reference_us']:,.1f}"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        lines.append(f"{r['name']:<{width}}{r['kvcore_us']:>12,.1f}{ref:>14}{ratio:>9}")
    if not report["reference"]:
        lines.append(
            "(the reference (vLLM 0.25.1) is not installed, so there are no ratios; "
            f"{REFERENCE_INSTALL})"
        )
    elif report["replay_decisions_match"] is not None:
        match = "yes" if report["replay_decisions_match"] else "NO"
        lines.append(f"replay decisions identical to the reference: {match}")
    return "\n".join(lines)
