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

The workload, the managers and the loop are in ``scheduler_loop.py`` (shared with
``test_bench_retention.py``, which runs the loop with retention off and on).

Sizes (one full-attention group, block size 16, sha256_cbor, prefix caching on, events off):

- 2000 requests / 8192 blocks: 128 sequences, 4096 tokens per step, 30% unique prompts;
- 10000 requests / 131072 blocks: 4096 sequences, 32768 tokens per step, 70% unique prompts of
  up to 4000 tokens and outputs of up to 500 tokens, so that the large pool fills and preempts.

``KVCORE_BENCH_SCALE`` (default 1.0) shrinks the request count, the pool and the sequence cap
for quick runs.  Results are printed as a table and merged into
``benches/results/manager.json``.  Use a release build (``maturin develop --release``).

Hybrid configurations (``test_bench_manager_hybrid``): the same loop, sizes and lockstep on KV
cache configurations of several groups, as vLLM builds for hybrid models
(``scheduler_loop.HYBRID_LAYOUTS``; the pool has ``num_blocks`` per group: the same memory in
smaller pages), with the reference, ``kvcore`` and ``kvcore-batch`` side by side and the same
checksum, which must be equal:

- ``full+swa``: full attention + sliding window 1024, block size 16;
- ``full+mamba``: full attention at 16 + Mamba in ``align`` mode (prefix caching of the state
  every scheduler block) at 256, the scheduler block 256, hashes at 16; prefills are split at
  those boundaries as vLLM's scheduler splits them;
- ``full+chunked``: full attention + chunked local attention (chunk 512), block size 16;
- ``two-sizes``: full attention at 16 + sliding window 1024 at 32, the scheduler block 32,
  hashes at 16.

Their rows go to ``benches/results/manager_hybrid.json`` (key ``<config>/<size>``). The
single full-attention configuration (``full``) is ``test_bench_manager``. Select with the
pytest id, e.g. ``-k full+swa`` or
``"benches/test_bench_manager.py::test_bench_manager_hybrid[two-sizes-2000req-8192blk]"``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from scheduler_loop import (
    BLOCK_SIZE,
    HASH_FN,
    HYBRID_LAYOUTS,
    SIZES,
    Layout,
    RunResult,
    Size,
    kvcore_impl,
    make_workload,
    merge_results,
    reference_impl,
    run_lockstep,
    size_fields,
    step_stats,
)

pytest.importorskip("vllm.v1.core.kv_cache_manager")

pytestmark = pytest.mark.reference

SCALE = float(os.environ.get("KVCORE_BENCH_SCALE", "1.0"))
RESULTS = Path(__file__).parent / "results" / "manager.json"
HYBRID_RESULTS = Path(__file__).parent / "results" / "manager_hybrid.json"


def _record(
    size: Size, ref: RunResult, kv: RunResult, kvb: RunResult, hasher: str
) -> dict[str, Any]:
    row = _row(size, ref, kv, kvb, hasher)
    merge_results(RESULTS, size, row, block_size=BLOCK_SIZE, hash_fn=HASH_FN)
    return row


def _row(size: Size, ref: RunResult, kv: RunResult, kvb: RunResult, hasher: str) -> dict[str, Any]:
    rm, rp = step_stats(ref.step_us)
    km, kp = step_stats(kv.step_us)
    bm, bp = step_stats(kvb.step_us)
    row = {
        **size_fields(size, SCALE),
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
    convs, _ = make_workload(size)
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


def _run(
    size: Size, layout: Layout, monkeypatch: pytest.MonkeyPatch, benchmark: Any
) -> tuple[list[RunResult], str]:
    """The three implementations in lockstep on ``size``'s workload, configured as ``layout``."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # both NONE_HASHes from the same seed
    convs, _ = make_workload(size)
    impls = [
        reference_impl(size, layout),
        kvcore_impl(size, layout=layout),
        kvcore_impl(size, batch=True, layout=layout),
    ]
    holder: list[list[RunResult]] = []
    benchmark.pedantic(
        lambda: holder.append(run_lockstep(impls, size, convs)), rounds=1, iterations=1
    )
    return holder[0], impls[1].hasher


def _layout_fields(layout: Layout) -> dict[str, Any]:
    return {
        "config": layout.name,
        "groups": [
            {"kind": g.kind, "block_size": g.block_size, "window": g.window}
            | ({"mamba_cache_mode": g.mamba_mode} if g.kind == "mamba" else {})
            for g in layout.groups
        ],
        "scheduler_block_size": layout.scheduler_block_size,
        "hash_block_size": layout.hash_block_size,
    }


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("size", [s.scaled(SCALE) for s in SIZES], ids=lambda s: s.name)
@pytest.mark.parametrize("layout", HYBRID_LAYOUTS, ids=lambda c: c.name)
def test_bench_manager_hybrid(
    layout: Layout,
    size: Size,
    benchmark: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hybrid KV cache configuration on both managers: equal decisions, per-step costs."""
    pooled = layout.sized(size)
    (ref, kv, kvb), hasher = _run(pooled, layout, monkeypatch, benchmark)
    row = {**_layout_fields(layout), **_row(pooled, ref, kv, kvb, hasher)}
    key = Size(f"{layout.name}/{size.name}", 0, 0, 0, 0)
    merge_results(HYBRID_RESULTS, key, row, hash_fn=HASH_FN)
    benchmark.extra_info.update(row)
    with capsys.disabled():
        print(_table(f"{layout.name} {size.name}", row))
    assert kv.steps == ref.steps == kvb.steps
    assert kv.checksum == ref.checksum, (
        f"{layout.name}: kvcore and the reference made different decisions"
    )
    assert kvb.checksum == ref.checksum, f"{layout.name}: allocate_slots_batch changed a decision"
